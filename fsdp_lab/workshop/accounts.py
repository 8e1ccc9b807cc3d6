"""The class list, and each learner and instructor as a real Unix user.

[Note: which authenticator] JupyterHub's own PAMAuthenticator: the class logs in with Unix accounts. The
spawner (LocalProcessSpawner) runs every learner's server as their Unix user anyway, so the account is the one
identity a learner has: file permissions keep learners apart (each home is 0700), `passwd` changes a password,
and nothing else (no second user database, no first-use sign-up an outsider could win) has to be kept safe.
PAM ships with JupyterHub (through `pamela`) and is maintained with it.

A user on the list who does not exist yet is made here when the command runs as root (useradd, home 0700) and
given a random password; the new passwords are written, once, to a file only root can read, for the
instructor to hand out. An existing account is left as it is, password included. Without root, missing users
are refused by name: the hub could not start their servers.
"""
from __future__ import annotations

import os
import pwd
import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from fsdp_lab.user_files import printable, read_text

NAME_PATTERN = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")  # useradd's portable names
PASSWORD_BYTES = 9  # 12 characters of token_urlsafe


@dataclass(frozen=True)
class ClassList:
    learners: tuple[str, ...]
    instructors: tuple[str, ...]

    @property
    def everyone(self) -> tuple[str, ...]:
        return self.learners + self.instructors


def check_name(name: str, where: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"{where}: {printable(name)!r} is not a usable Unix user name (lower-case letters, "
                         f"digits, _ and -, starting with a letter or _, at most 32)")
    if name == "root":
        raise ValueError(f"{where}: root cannot be a learner or an instructor (its server would run as root)")
    return name


def parse_class_list(text: str, source: str = "class list") -> list[str]:
    """One user name a line; blank lines and `#` comments are skipped; a name listed twice is refused."""
    names = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        check_name(name, f"{source} line {number}")
        if name in names:
            raise ValueError(f"{source} line {number}: {name} is listed twice")
        names.append(name)
    return names


def load_class(path: Path, instructors: Iterable[str]) -> ClassList:
    learners = parse_class_list(read_text(path, limit=1 << 20), str(path))
    staff = [check_name(n, "--instructor") for n in instructors]
    both = sorted(set(learners) & set(staff))
    if both:
        raise ValueError(f"{', '.join(both)} is both a learner and an instructor")
    if not learners:
        raise ValueError(f"{path} names no learner")
    if not staff:
        raise ValueError("name at least one --instructor (the admin who sees the class view)")
    return ClassList(tuple(learners), tuple(staff))


def exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def missing(names: Iterable[str]) -> list[str]:
    return [n for n in names if not exists(n)]


def create_user(name: str) -> str:
    """A new Unix user with a 0700 home and a random password, which is returned (root only)."""
    subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name], check=True,
                   capture_output=True, text=True, timeout=60)
    home = Path(pwd.getpwnam(name).pw_dir)
    os.chmod(home, 0o700)
    password = secrets.token_urlsafe(PASSWORD_BYTES)
    subprocess.run(["chpasswd"], input=f"{name}:{password}\n", check=True, capture_output=True, text=True,
                   timeout=60)
    return password


def remove_user(name: str) -> None:
    """userdel -r: the account, its home and its mail spool (what a test made, it takes away)."""
    subprocess.run(["userdel", "--remove", name], capture_output=True, text=True, timeout=60)


def ensure_users(names: Iterable[str], passwords_file: Path) -> dict[str, str]:
    """Make every missing user (root only, else ValueError naming them); {new user: password}, also appended
    to `passwords_file` (0600)."""
    absent = missing(names)
    if not absent:
        return {}
    if os.geteuid() != 0:
        raise ValueError(f"user(s) {', '.join(absent)} do not exist and only root can make them; create them "
                         f"(useradd), or run `fsdp-lab workshop` as root")
    made = {name: create_user(name) for name in absent}
    passwords_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(passwords_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.writelines(f"{name} {password}\n" for name, password in made.items())
    return made
