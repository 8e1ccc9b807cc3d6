"""The on-disk protocol of a checkpoint directory: a save lands whole or not at all.

    DIR/
      step_00000020/         one complete checkpoint: DCP's files (.metadata, __<rank>_0.distcp) + fsdp_lab.json
      step_00000040/
      latest                 one line naming the newest complete step directory, e.g. "step_00000040"
      .tmp-step_00000060/    a save in progress, or one that was interrupted: never read, removed by the next save

[Note: atomic save] Every rank writes into `.tmp-step_N` beside the final name. Only after all ranks have written
and DCP's coordinator has written `.metadata` does rank 0 record the checksums, fsync the directory, rename it to
`step_N` (one rename(2), atomic within a file system) and then replace `latest` (written to `latest.tmp`,
fsynced, then os.replace'd). A crash at any moment therefore leaves every published `step_N` whole, and its
files are never opened for writing again. A crash or a full disk between the rename and the pointer leaves a
complete step that `latest` does not name yet: resume finds it anyway (fsdp_lab/checkpoint/trust.py,
[Note: `latest` is a hint]). The directory must be on a file system every rank can see (one machine, or
NFS/Lustre across nodes).

No torch.distributed here: these helpers are called by rank 0 only (see fsdp_lab.checkpoint).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

LATEST = "latest"
META_FILE = "fsdp_lab.json"
DCP_METADATA = ".metadata"
FORMAT = "fsdp_lab.checkpoint/1"
_STEP_DIR = re.compile(r"step_(\d{8,})")
LATEST_MAX_BYTES = 64  # "step_" and the digits: anything longer is not a pointer this fsdp_lab wrote


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or loaded; the message names the path and the problem.
    `every_rank`: every rank raised this same error (one rank reporting it is enough)."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def disk_full(errors, where: Path, needed: int) -> str:
    """"No space left on device: ..." when a failed write was a full disk, which torch's writer hides (a short
    write surfaces as "unexpected pos 704 vs 598", not as ENOSPC): an OSError with ENOSPC among `errors` or their
    causes, or a file system with less room than the `needed` bytes. Otherwise ''."""
    def chain(exc):
        while exc is not None:
            yield exc
            exc = exc.__cause__ or exc.__context__

    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for exc in errors for e in chain(exc))
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if not enospc and (free is None or free >= needed):
        return ""
    room = "" if free is None else f": {where} has {free:,} bytes free and this rank's part needs {needed:,}"
    return f"No space left on device{room}. "


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """N for a name `step_N` (8 or more digits), else None."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".tmp-{step_dirname(step)}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_tmp(root: str | os.PathLike, step: int) -> Path:
    """Create an empty `.tmp-step_N` (removing what an interrupted save left there) and return it."""
    root = Path(root)
    final = root / step_dirname(step)
    if os.path.lexists(final):
        what = "a link" if final.is_symlink() else ("a complete checkpoint" if (final / DCP_METADATA).is_file()
                                                     else "not a checkpoint this save can replace")
        raise CheckpointError(f"{final} already exists ({what}), so step {step} cannot be saved there; fsdp_lab "
                              f"never overwrites it. Move it away, or use another --checkpoint-dir")
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_latest(root: str | os.PathLike, name: str) -> None:
    """Point `latest` at `name` atomically: readers see the old name or the new one, never a torn file. A
    failed write (a full disk) removes its staging file and leaves `latest` as it was."""
    root = Path(root)
    staging = root / f"{LATEST}.tmp"
    try:
        with open(staging, "w", encoding="utf-8") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(staging, root / LATEST)
    except OSError:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise
    _fsync_dir(root)


def publish(root: str | os.PathLike, step: int) -> Path:
    """Turn a fully written `.tmp-step_N` into `step_N` and point `latest` at it."""
    root = Path(root)
    tmp, final = tmp_dir(root, step), root / step_dirname(step)
    if not (tmp / DCP_METADATA).is_file():
        raise CheckpointError(f"{tmp} has no {DCP_METADATA}: the save did not complete, so it is not published")
    _fsync_dir(tmp)
    os.rename(tmp, final)  # refuses to replace a non-empty directory: prepare_tmp checked it did not exist
    _fsync_dir(root)
    try:
        write_latest(root, final.name)
    except OSError as err:
        raise CheckpointError(f"step {step} is saved, complete, as {final}, but '{LATEST}' could not be updated "
                              f"({err.strerror or err}); --resume finds {final.name} anyway") from None
    return final


def read_latest(root: str | os.PathLike, check_target: bool = True) -> Path | None:
    """The step directory `latest` names, or None if there is no `latest`. Only a hint of the newest checkpoint
    (see trust.find); CheckpointError in one line when it is not a pointer this fsdp_lab wrote."""
    root = Path(root)
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return None
    if pointer.is_symlink() or not pointer.is_file():
        raise CheckpointError(f"{pointer} should be a file naming a step directory, but it is "
                              f"{'a link' if pointer.is_symlink() else 'a directory or special file'}")
    try:
        with open(pointer, "rb") as fh:
            raw = fh.read(LATEST_MAX_BYTES + 1)
        name = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer} cannot be read as a step name ({type(err).__name__})") from None
    if len(raw) > LATEST_MAX_BYTES or step_of(name) is None:
        raise CheckpointError(f"{pointer} should name a step directory like 'step_00000020', found "
                              f"{name[:40]!r}{'...' if len(name) > 40 else ''}")
    target = root / name
    if check_target and not (target / DCP_METADATA).is_file():
        raise CheckpointError(f"{pointer} names {name}, but {target} is not a complete checkpoint "
                              f"(no {DCP_METADATA}); was the directory moved or partly deleted?")
    return target
