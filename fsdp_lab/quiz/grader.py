"""Scoring, as a pure function of (question, selection): no I/O, no state, so every front end and every
test gets the same number.

Single choice: 1 if the one right option is the selection, else 0.

Multi-select uses PrairieLearn's "PC" rule (percentage correct, also called net-correct), the default of its
pl-checkbox element: score = max(0, (right picks − wrong picks) / number of right options), and exactly 1
when the selection is the key. So with key AB: AB → 1, A → 0.5, ABC → 0.5, ABCD → 0, C → 0, nothing → 0.
Guessing "everything" scores nothing, and one wrong extra costs as much as one right answer earns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from fsdp_lab.quiz.model import Question, QuestionType

PARTIAL_CREDIT_RULE = "net-correct (PrairieLearn 'PC', percentage correct)"


@dataclass(frozen=True)
class Grade:
    """The score in [0, 1] and which authoring-order options were right picks, wrong picks and missed."""

    score: float
    chosen_right: frozenset[int]
    chosen_wrong: frozenset[int]
    missed: frozenset[int]

    @property
    def full(self) -> bool:
        return self.score == 1.0


def net_correct(right: int, wrong: int, n_correct: int) -> float:
    """PrairieLearn PC: max(0, (right − wrong) / n_correct)."""
    if n_correct < 1:
        raise ValueError(f"a question needs at least one right option, got n_correct={n_correct}")
    return max(0.0, (right - wrong) / n_correct)


def grade(question: Question, selected: Iterable[int]) -> Grade:
    """Score `selected` (authoring-order option indices) against `question.answer`."""
    chosen = frozenset(selected)
    n = len(question.options)
    if bad := sorted(i for i in chosen if not 0 <= i < n):
        raise ValueError(f"question {question.id!r} has {n} options (0..{n - 1}); selection has {bad}")
    right, wrong = chosen & question.answer, chosen - question.answer
    missed = question.answer - chosen
    if question.type is QuestionType.SINGLE:
        score = 1.0 if chosen == question.answer else 0.0
    else:
        score = 1.0 if chosen == question.answer else net_correct(len(right), len(wrong), len(question.answer))
    return Grade(score=score, chosen_right=right, chosen_wrong=wrong, missed=missed)
