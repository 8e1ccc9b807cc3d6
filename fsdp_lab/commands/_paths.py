"""Output paths checked before any work starts: a path that cannot be written fails in the first second with
one line naming the flag, not after an hour of training (or a learner's quiz) with the result lost."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _writable_dir(flag: str, path: Path, directory: Path) -> str | None:
    """None if a file can be created in `directory` (tried for real: root ignores permission bits, but not a
    read-only mount), else the reason."""
    if not directory.is_dir():
        return f"{flag} {path}: {directory} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        return f"{flag} {path}: cannot create files in {directory}: {err.strerror or err}"
    return None


def output_file_problem(flag: str, path: str | os.PathLike | None) -> str | None:
    """Why `path` cannot be written as a file (created with its parent folders if needed), or None."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path}: is a directory; give a file path"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{flag} {path}: the file exists and is not writable"
        return _writable_dir(flag, path, path.parent if str(path.parent) else Path("."))
    return _writable_dir(flag, path, _nearest_existing(path.parent))


def replaced_file_problem(flag: str, path: str | os.PathLike | None) -> str | None:
    """`output_file_problem` for a file that is replaced whole (a temp file, then os.replace): also refuses
    whatever is not a regular file (a device, a FIFO, a symlink to one), see fsdp_lab.user_files."""
    from fsdp_lab.user_files import FileRefused, replaceable

    if path is None:
        return None
    if problem := output_file_problem(flag, path):
        return problem
    try:
        replaceable(path)
    except FileRefused as exc:
        return f"{flag} {exc}"
    return None


def output_dir_problem(flag: str, path: str | os.PathLike | None) -> str | None:
    """Why `path` cannot be used as an output directory (created if needed), or None."""
    if path is None:
        return None
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{flag} {path}: is a file, not a directory"
    return _writable_dir(flag, path, _nearest_existing(path))


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)
