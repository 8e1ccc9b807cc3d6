"""Reading a typed answer: `A`, `ab`, `A,B`, `a b` and `A、B` all mean the same; anything else is refused
with a message that says what would be accepted, so the terminal can ask again.

The quiz in a terminal: question, options, a prompt that re-asks on bad input, feedback, a score.

It reads lines from any text stream, so tests pipe answers through stdin. End of input, `q` or Ctrl-C stops
the run; the caller then saves the partial attempt, and the next run offers to resume it (`resume_from`).
`run_terminal` says which of these ended it (`Ending`). Questions, options and feedback are wrapped at word
boundaries to the terminal's width (CJK characters count two columns), so the terminal never cuts a word.
"""
from __future__ import annotations

import enum
import re
import shutil
import unicodedata
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


class Ending(enum.Enum):
    """How a terminal run ended. Only FINISHED is true, so `if run_terminal(...)` still reads "all answered"."""

    FINISHED = "finished"
    INPUT_ENDED = "input ended"
    QUIT = "quit"  # the learner typed q, quit or exit

    def __bool__(self) -> bool:
        return self is Ending.FINISHED


def _columns(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def wrap(text: str, width: int, indent: str = "") -> str:
    """`text` broken into lines of at most `width` columns at spaces; a run without spaces (Chinese) may break
    between any two characters, never inside a Latin word shorter than a line. Continuation lines start with
    `indent`. Existing line breaks are kept."""
    out = []
    for paragraph in text.split("\n"):
        line, used = "", 0
        for token in re.findall(r"\S+\s*|\s+", paragraph):
            word = token.rstrip()
            need = sum(map(_columns, word))
            if line and used + need > width:
                if any(_columns(c) == 2 for c in word):  # CJK: fill this line, then go on
                    for ch in token:
                        if used + _columns(ch) > width and line.strip():
                            out.append(line.rstrip())
                            line, used = indent, len(indent)
                        line, used = line + ch, used + _columns(ch)
                    continue
                out.append(line.rstrip())
                line, used = indent, len(indent)
            line, used = line + token, used + sum(map(_columns, token))
        out.append(line.rstrip())
    return "\n".join(out)


def terminal_width() -> int:
    """The terminal's columns (COLUMNS, else the tty, else 100), at most 120 so lines stay readable."""
    return max(40, min(120, shutil.get_terminal_size((100, 24)).columns))


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


def ask(run: QuizRun, index: int, inp: TextIO, out: TextIO, echo: bool) -> str | Ending:
    """Prompt until a valid answer arrives; Ending.INPUT_ENDED at end of input, Ending.QUIT on `q`."""
    shown = run.shown[index]
    qtype = shown.question.type
    span = f"{shown.letters[0]}–{shown.letters[-1]}"
    while True:
        line = _prompt(msg(run.lang, "ask_single" if qtype is QuestionType.SINGLE else "ask_multi", span=span),
                       inp, out, echo)
        if line is None:
            return Ending.INPUT_ENDED
        if line.strip().lower() in QUIT_WORDS:
            return Ending.QUIT
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


def run_terminal(run: QuizRun, inp: TextIO, out: TextIO, echo: bool = False, width: int | None = None) -> Ending:
    """Ask every question of `run` not answered yet, in order: Ending.FINISHED (true) if all are answered,
    INPUT_ENDED or QUIT (false) if input ended or `q` was typed first. Ctrl-C propagates as KeyboardInterrupt;
    `run` keeps the answers given so far.

    `echo` writes each typed line back, so a transcript of piped input reads like a session. `width`: columns to
    wrap at (default: the terminal's)."""
    lang, width = run.lang, width or terminal_width()
    out.write(wrap(msg(lang, "header", key=run.chapter.key, title=run.chapter.title.get(lang), n=len(run)), width)
              + "\n")
    out.write(wrap(msg(lang, "rule"), width) + "\n\n")
    for index, shown in enumerate(run.shown):
        if index in run.answers:  # restored from an interrupted attempt
            continue
        q = shown.question
        title = msg(lang, "question", number=shown.number, total=len(run), type=msg(lang, q.type.value),
                    difficulty=difficulty_label(q.difficulty, lang))
        out.write(wrap(title + " " + shown.prompt, width) + "\n")
        for opt in shown.options:
            out.write(wrap(f"  {opt.letter}. {opt.text}", width, indent="     ") + "\n")
        letters = ask(run, index, inp, out, echo)
        if isinstance(letters, Ending):
            return letters
        out.write(wrap(run.submit(index, letters).feedback.as_text(), width, indent="    ") + "\n\n")
    out.write(wrap(summary(run), width) + "\n")
    return Ending.FINISHED
