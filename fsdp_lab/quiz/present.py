"""A question as one learner sees it: one language, options in a seeded order, letters renamed to match.

[Note: deterministic shuffle] The order comes from `random.Random(f"{seed}:{question.id}")`. Seeding with a
string is stable across processes and Python versions (it hashes with SHA-512, not `hash()`), so seed 7 shows
the same letters in the notebook, in the terminal and in a test. seed=None keeps the authoring order, which
for chapter 10 is the article's own (answer key A, B, B, C, AB, C, AB, A, A, AB)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable

from fsdp_lab.quiz.model import LETTERS, Question, check_lang
from fsdp_lab.quiz.template import render


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
