"""JSON Schema check of one bank file, with errors told in the bank's own words: which question (by id),
which field (options by letter: `options.B.feedback.en`), what was expected."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from fsdp_lab.quiz.errors import QuizFileError
from fsdp_lab.quiz.model import LETTERS


@lru_cache(maxsize=None)
def _schema_text(name: str) -> str:
    return resources.files("fsdp_lab.quiz").joinpath(name).read_text(encoding="utf-8")


def load_schema(name: str = "schema.json") -> dict:
    """A fresh copy of a schema shipped in the package (`schema.json` for banks, `progress.schema.json`)."""
    return json.loads(_schema_text(name))


def _question_id(data: Any, index: int) -> str:
    try:
        qid = data["questions"][index]["id"]
    except (KeyError, IndexError, TypeError):
        qid = None
    return qid if isinstance(qid, str) else f"#{index + 1} (no id)"


def _field(parts: list) -> str:
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, int) and i > 0 and parts[i - 1] == "options" and part < len(LETTERS):
            out.append(LETTERS[part])
        else:
            out.append(str(part))
    return ".".join(out)


def _explain(error: jsonschema.ValidationError, field: str | None) -> tuple[str | None, str]:
    """(field, detail) for the kinds of schema error an author actually makes."""
    inst, val = error.instance, error.validator_value
    if error.validator == "required" and isinstance(inst, dict):
        missing = next(p for p in val if p not in inst)
        return (f"{field}.{missing}" if field else missing), "missing required field"
    if error.validator == "additionalProperties" and isinstance(inst, dict):
        allowed = set(error.schema.get("properties", {}))
        extra = next((p for p in inst if p not in allowed), None)
        where = f"{field}.{extra}" if field else extra
        return where, f"unknown field (allowed: {', '.join(sorted(allowed))})"
    if error.validator == "enum":
        last = (field or "").rsplit(".", 1)[-1]
        what = "question type" if last == "type" else (last or "value")
        return field, f"unknown {what} {inst!r}; expected one of: {', '.join(map(str, val))}"
    return field, error.message


def check_schema(path: Path, data: Any, schema: dict | None = None) -> None:
    """Raise QuizFileError for the first schema violation (in document order), saying how many there are."""
    validator = jsonschema.Draft202012Validator(schema or load_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: [(0, p) if isinstance(p, int) else (1, str(p))
                                                                for p in e.absolute_path])
    if not errors:
        return
    error = errors[0]
    parts = list(error.absolute_path)
    qid = None
    if len(parts) >= 2 and parts[0] == "questions" and isinstance(parts[1], int):
        qid, parts = _question_id(data, parts[1]), parts[2:]
    field, detail = _explain(error, _field(parts) if parts else None)
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more schema problem{'s' if len(errors) > 2 else ''})"
    raise QuizFileError(path, detail, question_id=qid, field=field)
