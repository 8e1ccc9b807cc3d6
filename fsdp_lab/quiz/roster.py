"""A class's progress files, gathered for the instructor: one row per learner × chapter.

`score` is the learner's best attempt on that chapter (partial attempts included), `max` the chapter's
question count at that attempt, `attempts` how many were recorded and `last_attempt` when the latest
finished (UTC, ISO 8601). Files that cannot be read are reported and skipped; they never stop the export."""
from __future__ import annotations

import csv
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import TextIO

from fsdp_lab.quiz.errors import ProgressFileError
from fsdp_lab.quiz.progress import read_progress


@dataclass(frozen=True)
class Row:
    name: str
    chapter: str
    score: float
    max: int
    attempts: int
    last_attempt: str


COLUMNS = tuple(f.name for f in fields(Row))


def rows_for(path: Path) -> list[Row]:
    """Rows of one progress file (ProgressFileError if it is unreadable); name falls back to the file name."""
    progress = read_progress(path)
    name = progress.learner or path.stem
    rows = []
    for chapter in sorted({a.chapter for a in progress.attempts}):
        tries = [a for a in progress.attempts if a.chapter == chapter]
        best = max(tries, key=lambda a: (a.score, a.finished))
        rows.append(Row(name=name, chapter=chapter, score=best.score, max=best.max, attempts=len(tries),
                        last_attempt=max(a.finished for a in tries)))
    return rows


def collect(directory: str | Path) -> tuple[list[Row], list[str]]:
    """(rows, problems) for every *.json under `directory`; a problem is "<file>: <what is wrong>"."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")
    rows: list[Row] = []
    problems: list[str] = []
    for path in sorted(directory.rglob("*.json")):
        try:
            rows += rows_for(path)
        except ProgressFileError as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"{path}: cannot read: {exc}")
    rows.sort(key=lambda r: (r.name, r.chapter))
    return rows, problems


def write_csv(rows: list[Row], out: TextIO) -> None:
    """CSV with a header row; scores as plain numbers (9.5, 10), one line per row ending in \\n."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([format(v, "g") if isinstance(v, float) else v for v in astuple(row)])
