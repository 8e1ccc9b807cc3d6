"""Reading one bank file as YAML, strictly: duplicate keys are errors (PyYAML would keep the last one and
silently drop a whole option), `7e9` is a float (YAML 1.1 would make it a string), and a syntax error says
which question and field it is in."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fsdp_lab.quiz.errors import QuizFileError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader (no Python objects) that refuses duplicate keys; a subclass, so the global one is untouched."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key; SafeConstructor reports it properly below
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.add_implicit_resolver(  # 7e9, 1.5e-3 and 1_000 as numbers, like YAML 1.2 and JSON
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_ID_LINE = re.compile(r"^\s*(?:-\s+)?id:\s*[\"']?([^\"'\s#]+)")
_KEY_LINE = re.compile(r"^\s*(?:-\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*:")


def _locate(lines: list[str], line: int) -> tuple[str | None, str | None]:
    """Best guess at (question id, field) for a 0-based line: the nearest `id:` and key at or above it."""
    qid = field = None
    for text in reversed(lines[: line + 1]):
        if field is None and (m := _KEY_LINE.match(text)):
            field = m.group(1)
        if m := _ID_LINE.match(text):
            qid = m.group(1)
            break
    return qid, field


def read_yaml(path: Path) -> Any:
    """Parse `path`; any YAML problem becomes a QuizFileError with line, column and the question around it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuizFileError(path, f"cannot read the file: {exc}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        if mark is None:
            raise QuizFileError(path, f"malformed YAML: {problem}") from None
        start = getattr(exc, "context_mark", None)  # where the unfinished construct began, if known
        qid, field = _locate(text.splitlines(), (start or mark).line)
        detail = f"malformed YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
        if start is not None and start.line != mark.line:
            detail += f" ({getattr(exc, 'context', None) or 'construct'} started at line {start.line + 1})"
        raise QuizFileError(path, detail, question_id=qid, field=field) from None
