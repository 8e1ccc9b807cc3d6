"""Files a user names (a flag's path, a learner's file in a class folder) and the text read from them.

[Note: user-named files] Such a path can be anything: a device, a FIFO, a symlink to /dev/zero, a directory,
a 50 MB file, or one of the command's own inputs. Every command that reads or replaces one goes through here,
so each rule holds for every such file, not only for the cases someone thought of:

- A read opens with O_NONBLOCK (a FIFO cannot hang the open), checks with fstat that it holds a regular file
  and reads at most `limit` bytes. Anything else is refused by name, before a byte is read.
- A replace writes a temporary file beside the target, fsyncs it and `os.replace`s it in, so a crash leaves the
  old file or the new one. It only ever replaces an absent path or a regular file (a symlink is followed to its
  target, which must be one too): `os.replace` over /dev/full, run as root, would replace the device.
- `refuse_inputs` stops an output that is one of the command's inputs (same device and inode, so a symlink or
  a hard link is caught too) before anything is written.
- `locked` serialises a read-merge-write of one file between processes (flock on a hidden sidecar file,
  waited on with a deadline).
- `printable` escapes control characters, so text that came from a file cannot drive the terminal it is
  printed on (colours, cursor moves, a retitled window, a hidden line).

Every refusal is a FileRefused: an OSError whose message is one line, `<path>: <what it is and why>`.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, so `locked` only serialises within one process
    fcntl = None

MiB = 1 << 20
READ_LIMIT = 8 * MiB  # default bound on one read: a progress file of thousands of attempts is well under 1 MiB
LOCK_TIMEOUT_S = 30.0


class FileRefused(OSError):
    """A user-named file this program will not read or replace; `str()` is `<path>: <detail>`, one line."""

    def __init__(self, path: str | os.PathLike, detail: str):
        self.path = Path(path)
        self.detail = detail
        super().__init__(f"{printable(str(self.path))}: {detail}")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def kind(mode: int) -> str:
    """What a file of `mode` is, in words ("a character device")."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def describe(path: str | os.PathLike) -> str:
    """What `path` is, following a symlink and saying so ("a symlink to /dev/zero, a character device")."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISLNK(st.st_mode):
        return kind(st.st_mode)
    target = printable(os.readlink(path))
    try:
        return f"a symlink to {target}, {kind(os.stat(path).st_mode)}"
    except FileNotFoundError:
        return f"a symlink to {target}, which does not exist"
    except OSError as exc:  # a symlink loop
        return f"a symlink to {target}, which cannot be followed ({exc.strerror})"


def size_text(n: int) -> str:
    return f"{n:,} bytes" if n < MiB else f"{n:,} bytes ({n / MiB:.1f} MiB)"


def read_bytes(path: str | os.PathLike, limit: int = READ_LIMIT) -> bytes:
    """The contents of the regular file at `path` (symlinks followed), at most `limit` bytes, or FileRefused.
    Missing files and permission errors raise the usual OSError."""
    st = os.stat(path)  # FileNotFoundError / PermissionError as usual
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(path, f"is {describe(path)}, not a regular file; nothing was read")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)  # what was opened, which may differ from what was checked a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"is {kind(st.st_mode)}, not a regular file; nothing was read")
        if st.st_size > limit:
            raise FileRefused(path, f"is {size_text(st.st_size)}, over the {size_text(limit)} limit for this "
                                    f"file; nothing was read")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(MiB, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:  # it grew while being read
            raise FileRefused(path, f"grew past the {size_text(limit)} limit for this file while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int = READ_LIMIT) -> str:
    """`read_bytes` decoded as UTF-8 (UnicodeDecodeError as usual)."""
    return read_bytes(path, limit).decode("utf-8")


def replaceable(path: str | os.PathLike) -> Path:
    """The path a replace of `path` writes: `path` itself if absent or a regular file, a symlink's target if
    that is absent or regular; anything else is FileRefused (nothing is touched)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISREG(st.st_mode):
        return path
    if stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        try:
            if stat.S_ISREG(os.stat(target).st_mode):
                return target
        except FileNotFoundError:
            if target.parent.is_dir():
                return target
        except OSError:
            pass
    raise FileRefused(path, f"is {describe(path)}; only a regular file is replaced, so it was left alone")


def replace_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to a temp file beside `path`, fsync, then os.replace it in; returns the path written
    (a symlink's target). Parent folders are created. FileRefused if `path` is not replaceable."""
    return replace_file(path, lambda f: f.write(text.encode("utf-8")))


def replace_file(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """`write(f)` into a binary temp file beside `path`, fsync, then os.replace it in; returns the path written
    (a symlink's target). If `write` raises, `path` is untouched and the temp file removed. Parent folders are
    created. FileRefused if `path` is not replaceable."""
    target = replaceable(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # mode 0600
    try:
        if target.exists():  # keep who may read it: a class export shared with co-instructors stays shared
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replaceable(target)  # still absent or regular: nothing swapped a device in while we wrote
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def move_aside(path: str | os.PathLike, suffix: str) -> Path:
    """Rename the regular file at `path` (a symlink's target) to its name + `suffix` in its folder, or that
    + `-1`, `-2`... if taken; returns the new path. Never replaces an existing file."""
    source = replaceable(path)
    if not source.exists():
        raise FileNotFoundError(f"{source}: nothing to move aside")
    name = source.name + suffix
    target, n = source.with_name(name), 1
    while True:
        try:
            os.link(source, target)  # fails if `target` exists: no other process's file is clobbered
        except FileExistsError:
            target, n = source.with_name(f"{name}-{n}"), n + 1
            continue
        except OSError:  # no hard links on this file system: check, then rename
            if target.exists():
                target, n = source.with_name(f"{name}-{n}"), n + 1
                continue
            os.rename(source, target)
            return target
        os.unlink(source)
        return target


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True if `a` and `b` are the same existing file (symlinks followed, hard links included)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_inputs(flag: str, output: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """FileRefused if the file `output` names is one of `inputs`: writing it would destroy what is being read."""
    for source in inputs:
        if same_file(output, source):
            also = "" if Path(output) == Path(source) else f" ({printable(str(source))})"
            raise FileRefused(output, f"is one of the inputs{also}; {flag} must name a different file, so it was "
                                      f"left alone")


@contextmanager
def locked(path: str | os.PathLike, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[Path]:
    """Hold an exclusive lock for the file at `path` (a hidden `.<name>.lock` beside its target) for a
    read-merge-write; yields the target. Waits at most `timeout_s`, then FileRefused naming who to wait for."""
    target = replaceable(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(f".{target.name}.lock")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock, flags, 0o600)
    except OSError as exc:
        raise FileRefused(lock, f"cannot be used as a lock file ({describe(lock)}: {exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileRefused(lock, f"is {describe(lock)}, not a lock file")
        if fcntl is not None:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise FileRefused(path, f"is being written by another process (it held {lock.name} for "
                                                f"over {timeout_s:g} s); try again when it has finished") from None
                    time.sleep(0.02)
        yield target
    finally:
        os.close(fd)  # closing releases the lock


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def control_character(text: str, allow: str = "\n") -> str | None:
    """The first character of `text` that `printable` would escape, other than those in `allow`, or None."""
    return next((m.group() for m in _UNPRINTABLE.finditer(text) if m.group() not in allow), None)


def printable(text: str) -> str:
    """`text` with control characters (C0, DEL, C1, bidirectional overrides) written as `\\x1b`-style escapes,
    so it prints as itself on one line and cannot drive the terminal."""
    def escape(m: re.Match) -> str:
        code = ord(m.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _UNPRINTABLE.sub(escape, text)
