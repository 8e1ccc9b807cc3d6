"""What the instructor sees of each learner, read live from the learner's own files and processes.

[Note: what the class view reads] Nothing is reported by the learners' kernels; the view reads, as root, what
each learner's work leaves behind, at the moment the page is asked for:
- quiz: ~/.fsdp-lab/progress.json (fsdp_lab.lessons.quiz.progress), best score per chapter, exactly the rows
  `fsdp-lab scores` makes, so the class CSV is that command's format (`file` is "<user>/.fsdp-lab/...", and
  `name` the login, which is who a learner is on the hub);
- exercise checks passed: the check outputs ("ok: ...", a passing Verdict's text) of the cells the learner
  ran, in the chapters' notebooks as last saved in ~/my-notebooks (JupyterLab autosaves every two minutes);
- chapter reached: the latest chapter with a run cell in its saved notebook or an answered quiz;
- live ranks running: the learner's ipyparallel engine processes (psutil, by uid), and whether their server runs.
A file that cannot be read shows as a problem on the page and never stops it. Files are read with a size limit
and only when they are regular files (fsdp_lab.user_files), since a learner controls their home.
"""
from __future__ import annotations

import functools
import json
import pwd
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

import psutil

from fsdp_lab.lessons.quiz.progress import Row, rows_for
from fsdp_lab.lessons.quiz.questions import ProgressFileError
from fsdp_lab.lessons.student_copy import INSTRUCTOR_NOTEBOOKS, student_notebook
from fsdp_lab.user_files import FileRefused, MiB, read_text

NOTEBOOK_LIMIT = 32 * MiB
ENGINE_MODULE = "ipyparallel.engine"  # what a live rank's process runs (ipyparallel's engine launcher)
SERVER_MODULE = "jupyterhub.singleuser"
_CHAPTER = re.compile(r"^(\d\d[a-z]?)-")


@dataclass
class LearnerState:
    name: str
    chapter_reached: str = ""
    quiz: list[Row] = field(default_factory=list)
    checks_passed: int = 0
    ranks_running: int = 0
    server_running: bool = False
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"name": self.name, "chapter_reached": self.chapter_reached, "checks_passed": self.checks_passed,
                "ranks_running": self.ranks_running, "server_running": self.server_running,
                "quiz": {r.chapter: {"score": r.score, "max": r.max, "attempts": r.attempts} for r in self.quiz},
                "problems": self.problems}


def chapter_of(notebook: Path) -> str:
    found = _CHAPTER.match(notebook.name)
    return found.group(1) if found else ""


@functools.lru_cache(maxsize=64)
def _fresh_counts(source: Path, mtime_ns: int) -> dict:
    """{cell id: execution_count} of the learner's copy as written from the instructor's notebook `source`."""
    nb = student_notebook(json.loads(source.read_text(encoding="utf-8")), source.name)
    return {c.get("id"): c.get("execution_count") for c in nb["cells"] if c.get("cell_type") == "code"}


def fresh_counts(name: str) -> dict:
    source = INSTRUCTOR_NOTEBOOKS / name
    return _fresh_counts(source, source.stat().st_mtime_ns) if source.is_file() else {}


def notebook_facts(path: Path, fresh: dict) -> tuple[bool, int]:
    """(the learner ran a code cell, passing check outputs of the cells they ran) in one saved notebook. A cell
    counts as run by the learner when its execution count differs from the copy they were given (the copies
    keep the solved chapters' outputs outside the exercises, so outputs alone say nothing)."""
    nb = json.loads(read_text(path, limit=NOTEBOOK_LIMIT))
    ran, passed = False, 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code" or cell.get("execution_count") is None:
            continue
        if cell.get("id") in fresh and fresh[cell.get("id")] == cell.get("execution_count"):
            continue
        ran = True
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain") or ""
            text = "".join(text) if isinstance(text, list) else str(text)
            passed += sum(1 for line in text.splitlines() if line.startswith("ok: "))
    return ran, passed


def _processes_of(uid: int) -> tuple[int, bool]:
    engines, server = 0, False
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            cmdline = proc.info["cmdline"] or []
        except (psutil.Error, KeyError):
            continue
        engines += ENGINE_MODULE in cmdline
        server = server or SERVER_MODULE in cmdline
    return engines, server


def learner_state(name: str, notebooks_dir: str = "my-notebooks") -> LearnerState:
    state = LearnerState(name)
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        state.problems.append(f"no Unix user {name}")
        return state
    home = Path(account.pw_dir)
    reached = set()
    progress = home / ".fsdp-lab" / "progress.json"
    if progress.exists():
        try:
            state.quiz = [replace(r, name=name) for r in rows_for(progress, home.parent)]
            reached |= {r.chapter for r in state.quiz if _CHAPTER.match(r.chapter + "-")}
        except (ProgressFileError, FileRefused, OSError) as exc:
            state.problems.append(str(exc))
    for notebook in sorted((home / notebooks_dir).glob("*.ipynb")):
        try:
            ran, passed = notebook_facts(notebook, fresh_counts(notebook.name))
        except (FileRefused, OSError, ValueError, AttributeError) as exc:
            state.problems.append(f"{notebook.name}: {exc}")
            continue
        state.checks_passed += passed
        if ran and chapter_of(notebook):
            reached.add(chapter_of(notebook))
    state.chapter_reached = max(reached, default="")
    state.ranks_running, state.server_running = _processes_of(account.pw_uid)
    return state


def class_state(learners: Iterable[str]) -> list[LearnerState]:
    return [learner_state(name) for name in learners]


def class_rows(states: Iterable[LearnerState]) -> list[Row]:
    """The class's rows in `fsdp-lab scores` order (name, file, chapter)."""
    rows = [row for state in states for row in state.quiz]
    return sorted(rows, key=lambda r: (r.name, r.file, r.chapter))
