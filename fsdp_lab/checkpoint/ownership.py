"""What belongs to a run, and so what it may write, replace or delete: the one place for those rules.

    RunLock(root)               held by the run that saves into `root` for as long as it runs
    prunable(root, run, keep)   the step directories `--keep-last` may delete: this run's own, oldest first
    output_problem(...)         why an output path (--export, --json-log, --trace) would overwrite run data

[Note: one run per checkpoint directory] Two runs saving into one directory would prune each other's
checkpoints, one of them perhaps the one the other is loading, and both would move `latest`. The run holds an
exclusive flock(2) on `root/.lock` (the lock file records its pid and host, so the refusal can name them). The
kernel drops the lock when the process ends, however it ends (kill -9 included), so a stale lock file never
blocks anyone. flock works across nodes on NFSv4 and Lustre, where the checkpoint directory of a multi-node
run lives.

[Note: the run marker] Every manifest records the id of the run that wrote it (`run` in fsdp_lab.json); a
resumed run keeps the id of the checkpoint it resumed from in the same directory. Pruning deletes only real
directories (never a link, never through one) whose manifest carries this run's id: a user's own `step_N`
folder, a checkpoint copied in from elsewhere and one `latest` names are never touched.

[Note: run data is never an output] An output written over `latest`, a manifest or a shard breaks every later
resume, silently. So no output may lie inside the run's own checkpoint directory, inside the step directory
being resumed from, or on a name with a meaning in a checkpoint directory being read (`latest`, `step_N`,
`.tmp-step_N`, `.lock`); and no two outputs may be the same file. Paths are compared after resolving links and `..`.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path

from fsdp_lab.checkpoint.files import DCP_METADATA, LATEST, META_FILE, CheckpointError, read_latest, step_dirname, \
    step_of
from fsdp_lab.checkpoint.trust import Kind, inspect, published, step_dirs

LOCK = ".lock"


class RunLock:
    """A lock on a checkpoint directory ([Note: one run per checkpoint directory]): exclusive for the run that
    saves there, shared (`reading=True`) for a run that resumes from a checkpoint there, so the saving run
    cannot prune it meanwhile. `with RunLock(root): ...`, or acquire()/release(); acquire raises
    CheckpointError naming the holder."""

    def __init__(self, root: str | os.PathLike, reading: bool = False):
        self.root = Path(root)
        self.reading = reading
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        path = self.root / LOCK
        try:
            if self.reading:
                if not path.is_file():
                    return self  # no run ever saved here: nothing to keep out
                fd = os.open(path, os.O_RDONLY)  # not inherited by child processes
            else:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if self.reading:
                return self  # a directory we may read but not lock (another user's): read without the lock
            raise CheckpointError(f"cannot lock {path}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.reading else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if not isinstance(err, BlockingIOError):
                raise CheckpointError(f"cannot lock {path}: {err.strerror or err}") from None
            why = ("its pruning could remove the checkpoint this run loads; wait for it to end, or copy the "
                   "checkpoint elsewhere" if self.reading else
                   "which saves, prunes or loads checkpoints there; wait for it to end, or use another "
                   "--checkpoint-dir")
            raise CheckpointError(f"{self.root} is in use by another run ({holder}): {why}") from None
        if not self.reading:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock: the saving run records its pid and host; a run resuming from the directory (a shared
    holder) records nothing, so a recorded pid that is gone means a reader."""
    words = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
    if len(words) < 2 or not words[0].isdigit():
        return "a process that did not say which"
    pid, host = int(words[0]), words[1]
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "a run resuming from a checkpoint there"
        except PermissionError:
            pass  # alive, another user's
    return f"pid {pid} on {host}"


def check_unlocked(root: str | os.PathLike) -> None:
    """CheckpointError if another run holds `root` (the launcher asks before it starts any rank)."""
    if Path(root).is_dir():
        RunLock(root).acquire().release()


def prunable(root: str | os.PathLike, run: str, keep: int) -> list[Path]:
    """This run's checkpoints under `root` beyond its newest `keep`, oldest first ([Note: the run marker])."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    try:
        latest = read_latest(root, check_target=False)
    except CheckpointError:
        latest = None
    ours = []
    for path in step_dirs(root):  # newest first
        verdict = inspect(path, deep=False)
        if verdict.kind in (Kind.ABSENT, Kind.INCOMPLETE, Kind.MALFORMED) or verdict.meta.get("run") != run:
            continue
        ours.append(path)
    return [p for p in reversed(ours[keep:]) if latest is None or p.name != latest.name]


def remove_checkpoint(path: Path) -> None:
    """Delete one step directory that prunable() chose; never through a link."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path} is not a real directory any more; not removing it")
    shutil.rmtree(path)


def save_conflict(root: str | os.PathLike, start: int, saves: list[int]) -> str | None:
    """Why a run that starts at step `start` and saves steps `saves` into `root` would collide with what is
    already there, in one line; None if it would not. Asked before training, not when the first save fails."""
    root = Path(root)
    pointer = root / LATEST
    if saves and os.path.lexists(pointer) and (pointer.is_symlink() or not pointer.is_file()):
        return (f"{pointer} is {'a link' if pointer.is_symlink() else 'a directory'}, not the file fsdp_lab keeps "
                f"there, and each save must replace it; move it away, or use another --checkpoint-dir")
    for verdict in published(root):
        if step_of(verdict.path.name) > start:
            return (f"{root} already holds {verdict.describe()}, newer than step {start} where this run starts; "
                    f"continue from its newest checkpoint with --resume (no PATH), or use another --checkpoint-dir")
    for step in saves:
        path = root / step_dirname(step)
        if os.path.lexists(path):
            return (f"{path} already exists ({inspect(path, deep=False).kind.value}) and this run would save step "
                    f"{step} there; fsdp_lab never overwrites it: move it away, or use another --checkpoint-dir")
    return None


# -- output paths --------------------------------------------------------------------------------------------
def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _is_step_dir(path: Path) -> bool:
    return step_of(path.name) is not None or (path / DCP_METADATA).exists() or (path / META_FILE).exists()


def _protected(checkpoint_dir, resume) -> list[tuple[Path, str, bool]]:
    """(root, what it is, whether the whole tree is off limits or only the protocol's names in it)."""
    trees = []
    if checkpoint_dir:
        trees.append((_real(checkpoint_dir), f"--checkpoint-dir {checkpoint_dir}, the run's own checkpoints", True))
    if resume:
        source = _real(resume)
        what = f"--resume {resume}, the checkpoint this run loads"
        if _is_step_dir(source):  # all of it, and the bookkeeping of the directory that holds it
            trees += [(source, what, True), (source.parent, what, False)]
        else:  # a checkpoint directory: its bookkeeping and step directories (other files are the user's)
            trees.append((source, what, False))
    return trees


def _protocol_name(path: Path, root: Path) -> bool:
    """Whether `path` is, or is inside, an entry of `root` that the checkpoint protocol owns."""
    if root not in path.parents:
        return False
    first = path.relative_to(root).parts[0]
    return first in (LATEST, f"{LATEST}.tmp", LOCK) or step_of(first.removeprefix(".tmp-")) is not None


def output_problem(outputs: dict, checkpoint_dir=None, resume=None) -> str | None:
    """Why one of `outputs` ({flag: path or None}) would overwrite the run's own data or another output, as
    one line naming the flag; None when they are all safe ([Note: run data is never an output])."""
    trees = _protected(checkpoint_dir, resume if resume not in (None, "latest") else None)
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        real = _real(path)
        for root, what, whole in trees:
            if (whole and _inside(real, root)) or _protocol_name(real, root):
                return f"{flag} {path}: inside {what}; writing there would break later resumes, write it elsewhere"
        if real in seen:
            return f"{flag} {path}: the same file as {seen[real]}; give each output its own path"
        seen[real] = flag
    return None
