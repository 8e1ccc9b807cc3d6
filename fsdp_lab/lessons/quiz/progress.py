"""A learner's progress: one JSON file of attempts, written atomically, never lost.

[Note: never lose progress] A save writes a temporary file beside the target, fsyncs it and `os.replace`s it
in, so a crash leaves either the old file or the new one. A file that cannot be read (not JSON, wrong shape,
another schema version) is moved aside to `<name>.corrupt-<UTC time>` (`<name>.v<N>-<time>` for another
version), the learner is told where it went, and a fresh file starts. Nothing is overwritten in place. Two
quiz sittings that finish at once on one file both count: a save holds the file's lock while it re-reads the
file, adds its attempt and writes it back. What is not a regular file, or is over READ_LIMIT, is refused and
left where it is (see [Note: user-named files] in fsdp_lab.user_files).

A class's progress files, gathered for the instructor: one row per learner × chapter.

`file` is the progress file's path under the class folder: it tells learners apart (several may share a
name, or the default login "root"). `score` is the learner's best attempt on that chapter (partial attempts
included), `max` the chapter's question count at that attempt, `attempts` how many were recorded (an attempt
with nothing answered does not count) and `last_attempt` when the latest finished (UTC, ISO 8601). Files that
cannot be read are reported and skipped; they never stop the export.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, astuple, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TextIO

import jsonschema

from fsdp_lab.lessons.quiz.bank import load_schema
from fsdp_lab.lessons.quiz.questions import ProgressFileError
from fsdp_lab.user_files import FileRefused, MiB, locked, move_aside, printable, read_text, replace_text

SCHEMA_VERSION = 1
READ_LIMIT = 2 * MiB  # about 2,000 ten-question attempts; a bigger file is refused, not parsed


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="seconds")


def default_progress_path() -> Path:
    """~/.fsdp-lab/progress.json, looked up on each call so a changed HOME is respected."""
    return Path.home() / ".fsdp-lab" / "progress.json"


@dataclass
class Attempt:
    """One run through a chapter, finished or cut short; `answers` maps question id -> chosen/score."""

    chapter: str
    started: str
    finished: str
    lang: str
    seed: int | None
    score: float
    max: int
    answered: int
    total: int
    complete: bool
    answers: dict[str, dict] = field(default_factory=dict)


@dataclass
class Progress:
    learner: str
    attempts: list[Attempt] = field(default_factory=list)

    def to_json(self, now: datetime) -> dict:
        return {"schema_version": SCHEMA_VERSION, "learner": self.learner, "updated": iso(now),
                "attempts": [asdict(a) for a in self.attempts]}


class _NotFinite(ValueError):
    """A NaN or an infinity in a progress file: JSON has no such numbers, and a score of NaN would reach the CSV."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a number a progress file can hold")


def read_progress(path: Path) -> Progress:
    """Parse a progress file or raise ProgressFileError saying what is wrong (it never moves anything)."""
    try:
        data = json.loads(read_text(path, READ_LIMIT), parse_float=_finite_float, parse_constant=_no_constant)
    except _NotFinite as exc:
        raise ProgressFileError(path, f"not a progress file ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ProgressFileError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ProgressFileError(path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise ProgressFileError(path, "not a progress file (its JSON is nested too deeply to read)") from None
    except ValueError as exc:  # an integer of thousands of digits: Python's int conversion limit
        raise ProgressFileError(path, f"not a progress file ({exc})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version != SCHEMA_VERSION:
        raise ProgressFileError(path, f"schema_version is {version}, this fsdp-lab reads version {SCHEMA_VERSION}",
                                kind=f"v{version}")
    errors = sorted(jsonschema.Draft202012Validator(load_schema("progress.schema.json")).iter_errors(data),
                    key=lambda e: len(e.absolute_path))
    if errors:
        where = "/".join(map(str, errors[0].absolute_path)) or "top level"
        raise ProgressFileError(path, f"not a progress file ({where}: {errors[0].message})")
    return Progress(learner=data["learner"], attempts=[Attempt(**{k: a[k] for k in Attempt.__dataclass_fields__})
                                                        for a in data["attempts"]])


class ProgressStore:
    """The progress file at `path`. `load` never raises for a bad file: it moves it aside and says so."""

    def __init__(self, path: str | Path | None = None, clock: Callable[[], datetime] = utc_now):
        self.path = Path(path) if path is not None else default_progress_path()
        self.clock = clock

    def _aside(self, error: ProgressFileError) -> Path:
        stamp = self.clock().astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return move_aside(self.path, f".{error.kind}-{stamp}")

    def load(self, learner: str | None = None) -> tuple[Progress, str | None]:
        """(progress, notice). notice is None unless a bad file was moved aside; it names both paths."""
        if not self.path.exists():
            return Progress(learner=learner or ""), None
        try:
            progress = read_progress(self.path)
        except ProgressFileError as exc:
            moved = self._aside(exc)
            notice = (f"Progress file {self.path} could not be used ({exc.detail}). It was moved to {moved} "
                      f"and a fresh progress file is started; nothing in it was deleted.")
            return Progress(learner=learner or ""), notice
        if learner:
            progress.learner = learner
        return progress, None

    def save(self, progress: Progress) -> None:
        """Replace the file with `progress` as it is; `record` is the way to add an attempt (it merges)."""
        replace_text(self.path, json.dumps(progress.to_json(self.clock()), ensure_ascii=False, indent=1) + "\n")

    def record(self, attempt: Attempt, learner: str | None = None, replaces: Attempt | None = None) -> str | None:
        """Add one attempt to what the file holds now and save, under the file's lock, so attempts another
        process saved meanwhile are kept; returns the notice from loading (a moved-aside file), if any.
        `replaces`: a partial attempt this one continued, removed so the sitting counts once."""
        with locked(self.path):
            progress, notice = self.load(learner)
            if replaces is not None:
                progress.attempts = [a for a in progress.attempts
                                     if (a.chapter, a.started, a.finished) != (replaces.chapter, replaces.started,
                                                                              replaces.finished)]
            progress.attempts.append(attempt)
            self.save(progress)
        return notice


def counts(attempt: Attempt) -> bool:
    """An attempt with nothing answered (opened, then left at once) is no attempt."""
    return attempt.answered > 0


def resumable(progress: Progress, chapter: str) -> Attempt | None:
    """The chapter's latest attempt if it was cut short with answers given, else None."""
    tries = [a for a in progress.attempts if a.chapter == chapter and counts(a)]
    latest = max(tries, key=lambda a: a.finished, default=None)
    return latest if latest is not None and not latest.complete and latest.answered < latest.total else None


@dataclass(frozen=True)
class Row:
    file: str
    name: str
    chapter: str
    score: float
    max: int
    attempts: int
    last_attempt: str


COLUMNS = tuple(f.name for f in fields(Row))


def rows_for(path: Path, root: Path | None = None) -> list[Row]:
    """Rows of one progress file (ProgressFileError if it is unreadable); name falls back to the file name."""
    progress = read_progress(path)
    name = progress.learner or path.stem
    file = path.relative_to(root).as_posix() if root is not None else path.name
    attempts = [a for a in progress.attempts if counts(a)]
    rows = []
    for chapter in sorted({a.chapter for a in attempts}):
        tries = [a for a in attempts if a.chapter == chapter]
        best = max(tries, key=lambda a: (a.score, a.finished))
        rows.append(Row(file=file, name=name, chapter=chapter, score=best.score, max=best.max, attempts=len(tries),
                        last_attempt=max(a.finished for a in tries)))
    return rows


def progress_files(directory: str | Path) -> list[Path]:
    """Every *.json under `directory`, sorted: what `collect` reads (and so what an export must not overwrite)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"{printable(str(directory))} is not a directory")
    return sorted(directory.rglob("*.json"))


def collect(directory: str | Path) -> tuple[list[Row], list[str]]:
    """(rows, problems) for every *.json under `directory`; a problem is "<file>: <what is wrong>"."""
    rows: list[Row] = []
    problems: list[str] = []
    for path in progress_files(directory):
        try:
            rows += rows_for(path, Path(directory))
        except (ProgressFileError, FileRefused) as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"{path}: cannot read: {exc.strerror or exc}")
    rows.sort(key=lambda r: (r.name, r.file, r.chapter))
    return rows, problems


_FORMULA_START = ("=", "+", "-", "@")  # OWASP's other two, tab and CR, are escaped by `printable` already


def spreadsheet_cell(value: str | float | int) -> str | float | int:
    """A cell a spreadsheet shows as written and never evaluates (OWASP, "CSV Injection"): text starting with
    a formula character gets a leading single quote, control characters are escaped, numbers stay numbers.
    The writer quotes every text cell, so a comma or quote inside one cannot start another cell."""
    if not isinstance(value, str):
        return int(value) if isinstance(value, float) and value.is_integer() else value
    text = printable(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def write_csv(rows: list[Row], out: TextIO) -> None:
    """CSV with a header row, text cells quoted and neutralised (`spreadsheet_cell`), scores as plain numbers
    (9.5, 10), one line per row ending in \\n."""
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([spreadsheet_cell(v) for v in astuple(row)])
