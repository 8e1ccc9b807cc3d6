"""What each learner's server runs, as that learner: their copy of the chapters, then JupyterHub's server.

    python -m fsdp_lab.workshop.learner serve [single-user server arguments...]
    python -m fsdp_lab.workshop.learner push CHAPTER.ipynb

[Note: learner files are written as the learner] The hub runs as root, and a root process writing into a
folder a learner controls could be led by a symlink to write anywhere. So the hub never writes there: the
spawner starts this module as the learner (LocalProcessSpawner's setuid), which writes the missing chapters into
~/my-notebooks (fsdp_lab.lessons.student_copy: a copy that exists is the learner's work and is kept) and then
becomes the single-user server on that folder. The class view's "push a chapter" runs `push` the same way, as
each learner, and writes with O_EXCL (open mode "x"), so it can add a file but never replace one.
"""
from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from fsdp_lab.lessons.student_copy import INSTRUCTOR_NOTEBOOKS, write_fresh_copy, write_student_copies

LEARNER_DIR = "my-notebooks"  # the same folder name `fsdp-lab lab` uses beside a checkout


def learner_dir(home: str | os.PathLike | None = None) -> Path:
    return Path(home or os.path.expanduser("~")) / LEARNER_DIR


def serve(args: list[str]) -> None:
    folder = learner_dir()
    write_student_copies(INSTRUCTOR_NOTEBOOKS, folder)
    os.chdir(folder)
    argv = [sys.executable, "-m", "jupyterhub.singleuser", f"--ServerApp.root_dir={folder}", *args]
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, argv)


def push(chapter: str) -> Path:
    source = INSTRUCTOR_NOTEBOOKS / Path(chapter).name
    if source.suffix != ".ipynb" or not source.is_file():
        raise FileNotFoundError(f"no chapter {chapter!r} in {INSTRUCTOR_NOTEBOOKS}")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return write_fresh_copy(source, learner_dir(), stamp)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 1  # not reached: execv replaced this process
    if len(argv) == 2 and argv[0] == "push":
        print(push(argv[1]))
        return 0
    print("usage: python -m fsdp_lab.workshop.learner serve [ARGS...] | push CHAPTER.ipynb", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
