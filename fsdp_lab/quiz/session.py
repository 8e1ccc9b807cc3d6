"""One sitting of one chapter, shared by the notebook widget and the terminal: the shown questions, the
answers so far, the running score, and the Attempt that goes into the progress file (also when cut short)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from fsdp_lab.quiz.feedback import Feedback, make_feedback
from fsdp_lab.quiz.grader import Grade, grade
from fsdp_lab.quiz.model import LETTERS, Chapter, check_lang
from fsdp_lab.quiz.present import ShownQuestion, present
from fsdp_lab.quiz.progress import Attempt, iso, utc_now


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
