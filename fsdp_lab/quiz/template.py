"""`{name}` placeholders in question text: option letters (`{B}`), the key (`{answer}`) and computed numbers
(`{m_zero2_gb}`). Rendering is a plain lookup in a dict of strings: no eval, no attribute access, no format
specs, so a YAML file can never run code. `{{` and `}}` are literal braces.

[Note: letters in text] The article's explanations name options ("B 是 DDP 的做法"). When options are shuffled
those letters must follow them, so the bank writes `{B}`, the presenter maps it to the shown letter, and the
loader rejects a bare option letter left in any text (`bare_letters`)."""
from __future__ import annotations

import re
from typing import Mapping

_LETTER_VERBS = frozenset("is and or was would does describes gives says names means counts also only are".split())
_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")


class TemplateError(ValueError):
    """A placeholder that names nothing, or a stray brace; the loader adds file, question and field."""


def placeholders(template: str) -> list[str]:
    """Names used in `template`, in order of appearance (literal `{{`/`}}` skipped)."""
    return [m.group(1) for m in _TOKEN.finditer(template) if m.group(1)]


def render(template: str, values: Mapping[str, str]) -> str:
    """Fill every `{name}` from `values`; raise TemplateError naming the first unknown name or stray brace."""

    def fill(m: re.Match) -> str:
        token, name = m.group(0), m.group(1)
        if token in ("{{", "}}"):
            return token[0]
        if name is None:
            raise TemplateError(f"stray {token!r} at character {m.start()}; write {token * 2} for a literal brace")
        if name not in values:
            known = ", ".join(sorted(values)) or "none"
            raise TemplateError(f"unknown placeholder {{{name}}} (known here: {known})")
        return values[name]

    return _TOKEN.sub(fill, template)


def bare_letters(template: str, letters: str) -> list[str]:
    """Option letters written without braces, which a shuffle would leave pointing at the wrong option.

    A letter counts as bare when it stands alone: not part of a word or number (DDP, 7B, A100, C_gather)
    and not the English article "A" before a word ("A Transformer block"), though "A is", "A and" are
    letters. `letters` are the question's own, e.g. "ABCD"."""
    if not letters:
        return []
    text = _TOKEN.sub("0", template)  # a filled value reads like a number: "{phi}B" is "7B", not a bare B
    alone = re.compile(rf"(?<![A-Za-z0-9_\-./])([{letters}])(?![A-Za-z0-9_\-+/])")
    found = []
    for m in alone.finditer(text):
        word = re.match(r" ([A-Za-z0-9]\w*)", text[m.end():])
        if m.group(1) == "A" and word and word.group(1).lower() not in _LETTER_VERBS:
            continue  # "A model ...", "A 7B model ..."
        found.append(m.group(1))
    return found
