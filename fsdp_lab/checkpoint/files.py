"""The on-disk protocol of a checkpoint directory: a save lands whole or not at all.

    DIR/
      step_00000020/         one complete checkpoint: DCP's files (.metadata, __<rank>_0.distcp) + fsdp_lab.json
      step_00000040/
      latest                 one line naming the newest complete step directory, e.g. "step_00000040"
      .tmp-step_00000060/    a save in progress, or one that was interrupted: never read, removed by the next save

[Note: atomic save] Every rank writes into `.tmp-step_N` beside the final name. Only after all ranks have written
and DCP's coordinator has written `.metadata` does rank 0 fsync the directory, rename it to `step_N` (one
rename(2), atomic within a file system) and then replace `latest` (written to `latest.tmp`, fsynced, then
os.replace'd). A crash at any moment therefore leaves `latest` naming the previous complete checkpoint, and that
checkpoint's files are never opened for writing. The directory must be on a file system every rank can see
(one machine, or NFS/Lustre across nodes).

[Note: checksums] Before publishing, rank 0 records every file's size and SHA-256 in fsdp_lab.json; a load checks
them first, so a damaged or truncated shard is refused with the file's name instead of loading garbage (a
20 KB overwrite of a shard otherwise loads silently and turns the loss into NaN).

No torch.distributed here: these helpers are called by rank 0 only (see fsdp_lab.checkpoint).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

LATEST = "latest"
META_FILE = "fsdp_lab.json"
DCP_METADATA = ".metadata"
FORMAT = "fsdp_lab.checkpoint/1"
_STEP_DIR = re.compile(r"step_(\d{8,})")


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
    if final.exists():
        raise CheckpointError(f"{final} already exists: a checkpoint of step {step} was saved before. Resume "
                              f"from it (--resume) or use another checkpoint directory; fsdp_lab never "
                              f"overwrites a complete checkpoint")
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_latest(root: str | os.PathLike, name: str) -> None:
    """Point `latest` at `name` atomically: readers see the old name or the new one, never a torn file."""
    root = Path(root)
    staging = root / f"{LATEST}.tmp"
    with open(staging, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staging, root / LATEST)
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
    write_latest(root, final.name)
    return final


def read_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None if nothing was ever published there."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} should name a step directory like 'step_00000020', found {name!r}")
    target = root / name
    if not (target / DCP_METADATA).is_file():
        raise CheckpointError(f"{pointer} names {name}, but {target} is not a complete checkpoint "
                              f"(no {DCP_METADATA}); was the directory moved or partly deleted?")
    return target


def resolve(path: str | os.PathLike) -> Path:
    """Accept a checkpoint directory (follow its `latest`) or one step directory; return the step directory."""
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    found = read_latest(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: it has neither a '{LATEST}' pointer nor a "
                              f"{DCP_METADATA} file")
    return found


def read_meta(step_dir: str | os.PathLike) -> dict:
    path = Path(step_dir) / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, this fsdp_lab reads {FORMAT!r}")
    return meta


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_checksums(step_dir: str | os.PathLike) -> dict:
    """{file name: {"bytes": size, "sha256": hex}} for every file of a written checkpoint except fsdp_lab.json."""
    step_dir = Path(step_dir)
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != META_FILE}


def verify_checksums(step_dir: str | os.PathLike, meta: dict) -> list[str]:
    """One line per damaged, truncated or missing file (empty when all match). Checkpoints written before
    checksums were recorded have none to check."""
    step_dir = Path(step_dir)
    problems = []
    for name, want in (meta.get("checksums") or {}).items():
        path = step_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing (the save wrote {want['bytes']} bytes)")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, the save wrote {want['bytes']} (truncated or overwritten)")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{path}: contents changed since the save (SHA-256 differs from fsdp_lab.json)")
    return problems


def check_files(step_dir: str | os.PathLike, meta: dict) -> None:
    """Raise CheckpointError naming every bad file, one per line."""
    problems = verify_checksums(step_dir, meta)
    if problems:
        raise CheckpointError(f"{step_dir} is damaged, refusing to load it: " + "\n".join(problems)
                              + "\nRestore these files, or resume from another checkpoint (--resume PATH)")


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove complete checkpoints under `root` beyond the newest `keep`, never the one `latest` names.
    Called by rank 0 after a save was published; returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    latest = read_latest(root)
    steps = sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)),
                   key=lambda p: int(_STEP_DIR.fullmatch(p.name).group(1)))
    removed = []
    for path in steps[:-keep]:
        if latest is not None and path.name == latest.name:
            continue
        shutil.rmtree(path)
        removed.append(path)
    return removed
