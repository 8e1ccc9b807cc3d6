"""What a learner reads after answering one question, built once and shown by both front ends: the verdict,
each picked option's feedback (and the right ones they missed), the key in shown letters, the explanation."""
from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.quiz.grader import Grade
from fsdp_lab.quiz.messages import msg, points
from fsdp_lab.quiz.present import ShownQuestion
from fsdp_lab.quiz.template import placeholders


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
