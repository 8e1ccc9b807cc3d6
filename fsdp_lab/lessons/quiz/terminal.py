"""Reading a typed answer: `A`, `ab`, `A,B`, `a b` and `A、B` all mean the same; anything else is refused
with a message that says what would be accepted, so the terminal can ask again.

The quiz in a terminal: question, options, a prompt that re-asks on bad input, feedback, a score.

It reads lines from any text stream, so tests pipe answers through stdin. End of input (or `q`) stops the
run cleanly; the caller then saves the partial attempt.
"""
from __future__ import annotations

import re
from typing import TextIO

from fsdp_lab.lessons.quiz.scoring import QuizRun
from fsdp_lab.lessons.quiz.questions import AnswerFormatError, QuestionType, msg, points

_SEPARATORS = re.compile(r"[\s,，、;；/]+")


def parse_answer(text: str, letters: str, qtype: QuestionType, lang: str = "en") -> str:
    """Return the chosen letters sorted and unique ("b,a" -> "AB"), or raise AnswerFormatError in `lang`."""
    cleaned = _SEPARATORS.sub("", text).upper()
    span = f"{letters[0]}–{letters[-1]}"
    if not cleaned:
        raise AnswerFormatError(msg(lang, "empty", span=span))
    bad = sorted({ch for ch in cleaned if ch not in letters})
    if bad:
        raise AnswerFormatError(msg(lang, "not_option", bad=", ".join(map(repr, bad)), span=span))
    chosen = "".join(sorted(set(cleaned)))
    if qtype is QuestionType.SINGLE and len(chosen) != 1:
        raise AnswerFormatError(msg(lang, "one_letter", span=span, count=len(chosen)))
    return chosen


QUIT_WORDS = ("q", "quit", "exit")


def summary(run: QuizRun) -> str:
    """"Score: 8.5 / 10 (85%)" and the partial-credit rule, in the run's language."""
    pct = round(100 * run.score / run.max_score) if run.max_score else 0
    return "\n".join((msg(run.lang, "score", score=points(run.score), max=run.max_score, pct=pct),
                      msg(run.lang, "rule")))


def ask(run: QuizRun, index: int, inp: TextIO, out: TextIO, echo: bool) -> str | None:
    """Prompt until a valid answer arrives; None at end of input or on `q`."""
    shown = run.shown[index]
    qtype = shown.question.type
    span = f"{shown.letters[0]}–{shown.letters[-1]}"
    while True:
        out.write(msg(run.lang, "ask_single" if qtype is QuestionType.SINGLE else "ask_multi", span=span))
        out.flush()
        line = inp.readline()
        if not line:
            out.write("\n")
            return None
        if echo:
            out.write(line if line.endswith("\n") else line + "\n")
        if line.strip().lower() in QUIT_WORDS:
            return None
        try:
            return parse_answer(line, shown.letters, qtype, run.lang)
        except AnswerFormatError as exc:
            out.write(msg(run.lang, "retype", reason=exc) + "\n")


def run_terminal(run: QuizRun, inp: TextIO, out: TextIO, echo: bool = False) -> bool:
    """Ask every question of `run` in order; True if all were answered, False if input ended first.

    `echo` writes each typed line back, so a transcript of piped input reads like a session."""
    lang = run.lang
    out.write(msg(lang, "header", key=run.chapter.key, title=run.chapter.title.get(lang), n=len(run)) + "\n")
    out.write(msg(lang, "rule") + "\n\n")
    for index, shown in enumerate(run.shown):
        q = shown.question
        out.write(msg(lang, "question", number=shown.number, total=len(run), type=msg(lang, q.type.value),
                      difficulty=q.difficulty.value) + " " + shown.prompt + "\n")
        for opt in shown.options:
            out.write(f"  {opt.letter}. {opt.text}\n")
        letters = ask(run, index, inp, out, echo)
        if letters is None:
            return False
        out.write(run.submit(index, letters).feedback.as_text() + "\n\n")
    out.write(summary(run) + "\n")
    return True
