"""Errors a learner or an author can act on: each one names the file, and for a question bank the question
id and the field, so a typo in a 300-line YAML file is found in one look."""
from __future__ import annotations

from pathlib import Path


class QuizFileError(ValueError):
    """A question bank file that cannot be used: malformed YAML, a schema violation or a broken question.

    The message reads `<file>: question '<id>', field '<field>': <detail>`; the parts that are unknown (a YAML
    syntax error before the first question, say) are left out rather than guessed."""

    def __init__(self, path: str | Path, detail: str, question_id: str | None = None, field: str | None = None):
        self.path = Path(path)
        self.detail = detail
        self.question_id = question_id
        self.field = field
        where = [str(self.path)]
        if question_id is not None:
            where.append(f"question {question_id!r}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(", ".join(where) + ": " + detail)


class ProgressFileError(ValueError):
    """A learner's progress file that cannot be read: not JSON, wrong shape or another schema version.

    `kind` is "corrupt", or "v<N>" for a file of another schema version N; it becomes the suffix of the name
    the file is moved aside to, instead of being overwritten."""

    def __init__(self, path: str | Path, detail: str, kind: str = "corrupt"):
        self.path = Path(path)
        self.detail = detail
        self.kind = kind
        super().__init__(f"{self.path}: {detail}")


class AnswerFormatError(ValueError):
    """Typed answer that names no valid option (`E` on a four-option question, `1`, an empty line...)."""
