"""Reading a typed answer: `A`, `ab`, `A,B`, `a b` and `A、B` all mean the same; anything else is refused
with a message that says what would be accepted, so the terminal can ask again."""
from __future__ import annotations

import re

from fsdp_lab.quiz.errors import AnswerFormatError
from fsdp_lab.quiz.messages import msg
from fsdp_lab.quiz.model import QuestionType

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
