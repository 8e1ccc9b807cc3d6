"""A sitting of one chapter: the shown (shuffled) questions, the grade of each answer and its feedback.

Scoring, as a pure function of (question, selection): no I/O, no state, so every front end and every
test gets the same number.

Single choice: 1 if the one right option is the selection, else 0.

Multi-select uses PrairieLearn's "PC" rule (percentage correct, also called net-correct), the default of its
pl-checkbox element: score = max(0, (right picks − wrong picks) / number of right options), and exactly 1
when the selection is the key. So with key AB: AB → 1, A → 0.5, ABC → 0.5, ABCD → 0, C → 0, nothing → 0.
Guessing "everything" scores nothing, and one wrong extra costs as much as one right answer earns.

A question as one learner sees it: one language, options in a seeded order, letters renamed to match.

[Note: deterministic shuffle] The order comes from `random.Random(f"{seed}:{question.id}")`. Seeding with a
string is stable across processes and Python versions (it hashes with SHA-512, not `hash()`), so seed 7 shows
the same letters in the notebook, in the terminal and in a test. seed=None keeps the authoring order, which
for chapter 10 is the article's own (answer key A, B, B, C, AB, C, AB, A, A, AB).

What a learner reads after answering one question, built once and shown by both front ends: the verdict,
each picked option's feedback (and the right ones they missed), the key in shown letters, the explanation.

One sitting of one chapter, shared by the notebook widget and the terminal: the shown questions, the
answers so far, the running score, and the Attempt that goes into the progress file (also when cut short).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterable

from fsdp_lab.lessons.quiz.progress import Attempt, iso, utc_now
from fsdp_lab.lessons.quiz.questions import (LETTERS, Chapter, Question, QuestionType, check_lang, msg, placeholders,
                                             points, render)

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


def option_order(question: Question, seed: int | None) -> tuple[int, ...]:
    """order[k] = authoring index of the option shown at position k."""
    order = list(range(len(question.options)))
    if seed is not None:
        random.Random(f"{seed}:{question.id}").shuffle(order)
    return tuple(order)


@dataclass(frozen=True)
class ShownOption:
    letter: str  # as shown
    original: int  # index in the bank (0 = the file's A)
    text: str
    feedback: str
    correct: bool


@dataclass(frozen=True)
class ShownQuestion:
    """Rendered text plus the letter mapping; `number` is 1-based within the chapter."""

    question: Question
    number: int
    lang: str
    prompt: str
    options: tuple[ShownOption, ...]
    explanation: str

    @property
    def letters(self) -> str:
        return LETTERS[: len(self.options)]

    @property
    def answer_letters(self) -> str:
        return "".join(o.letter for o in self.options if o.correct)

    def to_original(self, letters: Iterable[str]) -> frozenset[int]:
        """Shown letters -> bank indices; letters outside this question raise ValueError naming them."""
        out = set()
        for letter in letters:
            if letter not in self.letters:
                raise ValueError(f"{letter!r} is not an option of question {self.number} ({self.letters})")
            out.add(self.options[self.letters.index(letter)].original)
        return frozenset(out)

    def to_shown(self, originals: Iterable[int]) -> str:
        """Bank indices -> shown letters, sorted ("AC")."""
        by_original = {o.original: o.letter for o in self.options}
        return "".join(sorted(by_original[i] for i in originals))


def present(question: Question, lang: str, seed: int | None = None, number: int = 1) -> ShownQuestion:
    """Render `question` for `lang` with options shuffled by `seed` and every `{X}` letter remapped."""
    check_lang(lang)
    order = option_order(question, seed)
    shown_letter = {orig: LETTERS[pos] for pos, orig in enumerate(order)}
    answer = "".join(sorted(shown_letter[i] for i in question.answer))
    values = {**question.values, **{LETTERS[i]: shown_letter[i] for i in range(len(order))}, "answer": answer}
    options = tuple(
        ShownOption(letter=LETTERS[pos], original=orig, text=render(question.options[orig].text.get(lang), values),
                    feedback=render(question.options[orig].feedback.get(lang), values),
                    correct=orig in question.answer)
        for pos, orig in enumerate(order))
    return ShownQuestion(question=question, number=number, lang=lang,
                         prompt=render(question.prompt.get(lang), values), options=options,
                         explanation=render(question.explanation.get(lang), values))


@dataclass(frozen=True)
class Feedback:
    """`lines` are the per-option remarks in shown-letter order. `key` is empty when the explanation states the
    answer itself (the article's style: "答案：B。...")."""

    number: int
    score: float
    verdict: str
    lines: tuple[str, ...]
    key: str
    explanation: str

    def as_text(self) -> str:
        parts = (self.verdict, *("  " + line for line in self.lines), self.key, self.explanation)
        return "\n".join(p for p in parts if p)


def make_feedback(shown: ShownQuestion, grade: Grade) -> Feedback:
    lang = shown.lang
    if grade.full:
        verdict = msg(lang, "right")
    elif grade.score > 0:
        verdict = msg(lang, "partly", score=points(grade.score))
    else:
        verdict = msg(lang, "wrong")
    lines = []
    for opt in shown.options:
        if opt.original in grade.chosen_right:
            lines.append(msg(lang, "picked_right", letter=opt.letter, feedback=opt.feedback))
        elif opt.original in grade.chosen_wrong:
            lines.append(msg(lang, "picked_wrong", letter=opt.letter, feedback=opt.feedback))
        elif opt.original in grade.missed:
            lines.append(msg(lang, "missed", letter=opt.letter, feedback=opt.feedback))
    if "answer" in placeholders(shown.question.explanation.get(lang)):  # "答案：{answer}。..." says it already
        key, explanation = "", shown.explanation
    else:
        key, explanation = msg(lang, "key", letters=shown.answer_letters), msg(lang, "why", text=shown.explanation)
    return Feedback(number=shown.number, score=grade.score, verdict=verdict, lines=tuple(lines), key=key,
                    explanation=explanation)


@dataclass(frozen=True)
class Answer:
    letters: str  # as shown, e.g. "AC"
    grade: Grade
    feedback: Feedback


class QuizRun:
    """Present `chapter` in `lang` with options shuffled by `seed` (None: as written) and collect answers."""

    def __init__(self, chapter: Chapter, lang: str = "en", seed: int | None = None,
                 clock: Callable[[], datetime] = utc_now):
        self.chapter = chapter
        self.lang = check_lang(lang)
        self.seed = seed
        self.clock = clock
        self.shown: list[ShownQuestion] = [present(q, lang, seed, number=i + 1)
                                           for i, q in enumerate(chapter.questions)]
        self.answers: dict[int, Answer] = {}
        self.started = clock()

    def __len__(self) -> int:
        return len(self.shown)

    def submit(self, index: int, letters: str) -> Answer:
        """Grade shown `letters` ("" = nothing picked) for question `index` (0-based); a resubmit replaces."""
        shown = self.shown[index]
        g = grade(shown.question, shown.to_original(letters))
        answer = Answer(letters="".join(sorted(set(letters))), grade=g, feedback=make_feedback(shown, g))
        self.answers[index] = answer
        return answer

    @property
    def score(self) -> float:
        return sum(a.grade.score for a in self.answers.values())

    @property
    def max_score(self) -> int:
        """Every question counts, answered or not: a partial run is scored out of the whole chapter."""
        return len(self.shown)

    @property
    def answered(self) -> int:
        """Questions with at least one option picked (the widget grades an untouched question as 0)."""
        return sum(1 for a in self.answers.values() if a.letters)

    @property
    def complete(self) -> bool:
        return self.answered == len(self.shown)

    def attempt(self) -> Attempt:
        """This run as a progress record; chosen options are saved in the bank's letters, not the shuffle's."""
        answers = {}
        for index, a in sorted(self.answers.items()):
            shown = self.shown[index]
            chosen = "".join(LETTERS[i] for i in sorted(shown.to_original(a.letters)))
            answers[shown.question.id] = {"chosen": chosen, "score": a.grade.score}
        return Attempt(chapter=self.chapter.key, started=iso(self.started), finished=iso(self.clock()),
                       lang=self.lang, seed=self.seed, score=round(self.score, 4), max=self.max_score,
                       answered=self.answered, total=len(self.shown), complete=self.complete, answers=answers)
