"""Reading a typed answer: `A`, `ab`, `A,B`, `a b` and `A、B` all mean the same; anything else is refused
with a message that says what would be accepted, so the terminal can ask again.

The quiz in a terminal: question, options, a prompt that re-asks on bad input, feedback, a score.

It reads lines from any text stream, so tests pipe answers through stdin. End of input, `q` or Ctrl-C stops
the run; the caller then saves the partial attempt, and the next run offers to resume it (`resume_from`).
"""
from __future__ import annotations

import re
from typing import TextIO

from fsdp_lab.lessons.quiz.progress import Attempt
from fsdp_lab.lessons.quiz.questions import LETTERS, AnswerFormatError, QuestionType, difficulty_label, msg, points
from fsdp_lab.lessons.quiz.scoring import QuizRun

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


def _prompt(text: str, inp: TextIO, out: TextIO, echo: bool) -> str | None:
    """Show `text`, read one line (None at end of input); `echo` writes it back so a piped transcript reads
    like a session."""
    out.write(text)
    out.flush()
    line = inp.readline()
    if not line:
        out.write("\n")
        return None
    if echo:
        out.write(line if line.endswith("\n") else line + "\n")
    return line


def ask(run: QuizRun, index: int, inp: TextIO, out: TextIO, echo: bool) -> str | None:
    """Prompt until a valid answer arrives; None at end of input or on `q`."""
    shown = run.shown[index]
    qtype = shown.question.type
    span = f"{shown.letters[0]}–{shown.letters[-1]}"
    while True:
        line = _prompt(msg(run.lang, "ask_single" if qtype is QuestionType.SINGLE else "ask_multi", span=span),
                       inp, out, echo)
        if line is None:
            return None
        if line.strip().lower() in QUIT_WORDS:
            return None
        try:
            return parse_answer(line, shown.letters, qtype, run.lang)
        except AnswerFormatError as exc:
            out.write(msg(run.lang, "retype", reason=exc) + "\n")


def offer_resume(partial: Attempt, lang: str, inp: TextIO, out: TextIO, echo: bool) -> bool:
    """Ask whether to continue `partial`; Enter or y resumes, n starts over, end of input starts over."""
    while True:
        line = _prompt(msg(lang, "resume", answered=partial.answered, total=partial.total, when=partial.finished),
                       inp, out, echo)
        if line is None:
            return False
        reply = line.strip().lower()
        if reply in ("", "y", "yes", "是"):
            return True
        if reply in ("n", "no", "否"):
            return False
        out.write(msg(lang, "resume_retype") + "\n")


def resume_from(run: QuizRun, partial: Attempt) -> int:
    """Put `partial`'s answers (saved in the bank's letters) into `run`, whatever its shuffle; answers to
    questions no longer in the chapter, or with letters it no longer has, are dropped. Returns how many."""
    restored = 0
    for index, shown in enumerate(run.shown):
        saved = partial.answers.get(shown.question.id)
        if not saved or not saved.get("chosen"):
            continue
        originals = {LETTERS.index(c) for c in saved["chosen"] if c in LETTERS}
        if not originals or max(originals) >= len(shown.options):
            continue
        run.submit(index, shown.to_shown(originals))
        restored += 1
    return restored


def run_terminal(run: QuizRun, inp: TextIO, out: TextIO, echo: bool = False) -> bool:
    """Ask every question of `run` not answered yet, in order; True if all are answered, False if input ended
    (or `q` was typed) first. Ctrl-C propagates as KeyboardInterrupt; `run` keeps the answers given so far.

    `echo` writes each typed line back, so a transcript of piped input reads like a session."""
    lang = run.lang
    out.write(msg(lang, "header", key=run.chapter.key, title=run.chapter.title.get(lang), n=len(run)) + "\n")
    out.write(msg(lang, "rule") + "\n\n")
    for index, shown in enumerate(run.shown):
        if index in run.answers:  # restored from an interrupted attempt
            continue
        q = shown.question
        out.write(msg(lang, "question", number=shown.number, total=len(run), type=msg(lang, q.type.value),
                      difficulty=difficulty_label(q.difficulty, lang)) + " " + shown.prompt + "\n")
        for opt in shown.options:
            out.write(f"  {opt.letter}. {opt.text}\n")
        letters = ask(run, index, inp, out, echo)
        if letters is None:
            return False
        out.write(run.submit(index, letters).feedback.as_text() + "\n\n")
    out.write(summary(run) + "\n")
    return True
