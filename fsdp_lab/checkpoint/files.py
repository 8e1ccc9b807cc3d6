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

No torch.distributed here: these helpers are called by rank 0 only (see fsdp_lab.checkpoint).
"""
from __future__ import annotations

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
    """A checkpoint could not be written, found or loaded; the message names the path and the problem."""


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
