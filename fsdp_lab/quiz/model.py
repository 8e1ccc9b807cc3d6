"""The question bank as plain frozen data. Text fields keep their `{placeholders}` (option letters, `answer`,
computed numbers); `present.py` fills them for one language and one shuffle, so the bank itself never changes
when a notebook cell is re-run."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

LETTERS = "ABCDEFGH"  # at most eight options per question (the schema says so too)
LANGS = ("zh", "en")

# Chapter key -> file stem under quizzes/, in the article's section order.
CHAPTERS: Mapping[str, str] = MappingProxyType({
    "01": "01-core-idea", "02": "02-sharding", "03": "03-lifecycle", "04": "04-mixed-precision",
    "05": "05-zero", "06": "06-engineering", "07": "07-when-to-use", "08": "08-python-demo",
    "09": "09-misconceptions", "10": "10-interview",
})


def check_lang(lang: str) -> str:
    """Front ends take the language from users; reject anything but zh/en by name."""
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; expected one of: {', '.join(LANGS)}")
    return lang


class QuestionType(str, Enum):
    """How many options a learner may pick, and so how the grader scores them."""

    SINGLE = "single"  # exactly one option is right; the score is 0 or 1
    MULTI = "multi"  # one or more options are right; partial credit (see grader.py)


class Difficulty(str, Enum):
    """The article's labels: easy / mid / hard."""

    EASY = "easy"
    MID = "mid"
    HARD = "hard"


@dataclass(frozen=True)
class Text:
    """One string per language."""

    zh: str
    en: str

    def get(self, lang: str) -> str:
        return getattr(self, check_lang(lang))


@dataclass(frozen=True)
class Option:
    """An option and what a learner who picks it should read."""

    text: Text
    feedback: Text


@dataclass(frozen=True)
class Question:
    """One question in authoring order: `answer` holds indices into `options` (0 = A as written)."""

    id: str
    type: QuestionType
    difficulty: Difficulty
    prompt: Text
    options: tuple[Option, ...]
    answer: frozenset[int]
    explanation: Text
    tags: tuple[str, ...]
    values: Mapping[str, str] = field(default_factory=dict)  # placeholder name -> display string
    source: str | None = None  # e.g. "article Q3" for the article's own questions

    @property
    def answer_letters(self) -> str:
        """The key as written in the file, e.g. "AB"."""
        return "".join(LETTERS[i] for i in sorted(self.answer))


@dataclass(frozen=True)
class Chapter:
    """One YAML file: a chapter key such as "10", its title and its questions in file order."""

    key: str
    title: Text
    questions: tuple[Question, ...]
    path: Path

    @property
    def slug(self) -> str:
        return CHAPTERS.get(self.key, self.path.stem)
