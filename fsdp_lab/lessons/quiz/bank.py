"""The question bank on disk: `quizzes/NN-name.yaml` read strictly, checked, turned into Chapter objects.

Reading one bank file as YAML, strictly: duplicate keys are errors (PyYAML would keep the last one and
silently drop a whole option), `7e9` is a float (YAML 1.1 would make it a string), and a syntax error says
which question and field it is in. A bank is bounded like any file a user names: at most READ_LIMIT bytes,
MAX_DEPTH levels of nesting (PyYAML composes recursively, so 100,000 `[` would end in a RecursionError),
integers of at most MAX_DIGITS digits (Python refuses to convert 4,300) and no aliases (`*name`: nine
nested aliases of nine make a billion nodes for the schema check to walk). Each is one QuizFileError
naming the line.

JSON Schema check of one bank file, with errors told in the bank's own words: which question (by id),
which field (options by letter: `options.B.feedback.en`), what was expected.

Turn `quizzes/NN-name.yaml` into Chapter objects, or say exactly what is wrong with it.

Order of checks: YAML syntax → JSON Schema (shape) → each question's meaning (answer letters in range,
ids unique, numbers computable, every placeholder known, no bare option letters, no two options that read
the same once the numbers are filled in). Every failure is a QuizFileError naming file, question and field.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import jsonschema
import yaml

from fsdp_lab.lessons.quiz.computed import ComputeError, default_registry, resolve
from fsdp_lab.lessons.quiz.questions import (CHAPTERS, LANGS, LETTERS, Chapter, Difficulty, Option, Question,
                                             QuestionType, QuizFileError, TemplateError, Text, bare_letters, render)
from fsdp_lab.user_files import FileRefused, MiB, control_character, read_text

READ_LIMIT = 1 * MiB  # the largest chapter is about 25 KB
MAX_DEPTH = 32  # a question is six levels deep (chapter, questions, question, options, option, text)
MAX_DIGITS = 100


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader (no Python objects) that refuses duplicate keys, deep nesting, huge integers and aliases;
    a subclass, so the global one is untouched."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a question bank; "
                                              "write the value out", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        digits = sum(ch.isdigit() for ch in node.value)
        if digits > MAX_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {digits} digits (at most "
                                                    f"{MAX_DIGITS} in a question bank)", node.start_mark)
        return super().construct_yaml_int(node)

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


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
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
        text = read_text(path, READ_LIMIT)
    except FileRefused as exc:
        raise QuizFileError(path, exc.detail) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise QuizFileError(path, f"cannot read the file: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except (RecursionError, ValueError) as exc:  # the bounds above should catch these first
        raise QuizFileError(path, f"cannot be read as a question bank: {type(exc).__name__}: {exc}") from None
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


@lru_cache(maxsize=None)
def _schema_text(name: str) -> str:
    return resources.files("fsdp_lab.lessons.quiz").joinpath(name).read_text(encoding="utf-8")


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


RESERVED = ("answer",)


def default_quiz_dir() -> Path:
    """`quizzes/` at the repository root, beside the `fsdp_lab` package (editable installs and checkouts)."""
    return Path(__file__).resolve().parents[3] / "quizzes"


def chapter_key(text: str) -> str:
    """"10", "1", "01", "10-interview" or "interview" -> "10"; "06a", "6a" or "fsdp2" -> "06a"; anything else is a
    ValueError listing keys."""
    raw = str(text).strip().lower()
    for key, stem in CHAPTERS.items():
        if raw in (key, stem, stem.split("-", 1)[1]) or _same_number(raw, key):
            return key
    raise ValueError(f"unknown chapter {text!r}; expected one of: {', '.join(CHAPTERS)} "
                     f"(or a name such as {', '.join(list(CHAPTERS.values())[:2])}, ...)")


def _same_number(raw: str, key: str) -> bool:
    """"6" is "06" and "6a" is "06a": the number without its leading zero, with the same letter after it."""
    got, want = re.fullmatch(r"(\d+)([a-z]?)", raw), re.fullmatch(r"(\d+)([a-z]?)", key)
    return bool(got and want) and int(got[1]) == int(want[1]) and got[2] == want[2]


def _text(d: Mapping) -> Text:
    return Text(zh=d["zh"], en=d["en"])


def _answer(path: Path, qid: str, raw: str, qtype: QuestionType, n: int) -> frozenset[int]:
    letters = LETTERS[:n]
    key = raw.replace(",", "").replace(" ", "")
    if not key:
        raise QuizFileError(path, "no correct option: answer is empty (write e.g. 'A' or 'AB')", qid, "answer")
    for ch in key:
        if ch not in letters:
            raise QuizFileError(path, f"answer letter {ch!r} is out of range: this question has {n} options "
                                      f"({letters[0]}–{letters[-1]})", qid, "answer")
    if len(set(key)) != len(key):
        raise QuizFileError(path, f"answer {raw!r} repeats a letter", qid, "answer")
    if qtype is QuestionType.SINGLE and len(key) != 1:
        raise QuizFileError(path, f"a single-choice question has exactly 1 right option; answer {raw!r} names "
                                  f"{len(key)} (use type: multi)", qid, "answer")
    return frozenset(letters.index(ch) for ch in key)


def _check_texts(path: Path, q: Question) -> None:
    """Render every text in both languages with identity letters, and reject bare letters."""
    letters = LETTERS[: len(q.options)]
    values = {**q.values, **{c: c for c in letters}, "answer": q.answer_letters}
    fields: list[tuple[str, Text]] = [("prompt", q.prompt), ("explanation", q.explanation)]
    for i, opt in enumerate(q.options):
        fields += [(f"options.{letters[i]}.text", opt.text), (f"options.{letters[i]}.feedback", opt.feedback)]
    for name, text in fields:
        for lang in LANGS:
            template = text.get(lang)
            if (bad := control_character(template)) is not None:
                raise QuizFileError(path, f"control character U+{ord(bad):04X} in the text: it would drive the "
                                          f"learner's terminal; write plain text", q.id, f"{name}.{lang}")
            try:
                render(template, values)
            except TemplateError as exc:
                raise QuizFileError(path, str(exc), q.id, f"{name}.{lang}") from None
            if bare := bare_letters(template, letters):
                raise QuizFileError(path, f"bare option letter {bare[0]!r}: write {{{bare[0]}}} so shuffled "
                                          f"options keep the right letter", q.id, f"{name}.{lang}")
    for lang in LANGS:
        seen: dict[str, str] = {}
        for i, opt in enumerate(q.options):
            shown = render(opt.text.get(lang), values)
            if shown in seen:
                raise QuizFileError(path, f"options {seen[shown]} and {letters[i]} both read {shown!r}",
                                    q.id, f"options.{letters[i]}.text.{lang}")
            seen[shown] = letters[i]


def _question(path: Path, d: Mapping[str, Any], registry: Mapping[str, Callable]) -> Question:
    qid = d["id"]
    params, computed = d.get("params", {}), d.get("computed", {})
    for name in list(params) + list(computed):
        if name in RESERVED:
            raise QuizFileError(path, f"{name!r} is reserved for the answer key placeholder", qid, f"params.{name}")
    if clash := set(params) & set(computed):
        raise QuizFileError(path, f"{sorted(clash)[0]!r} is both a param and a computed value", qid, "computed")
    try:
        values = resolve(params, computed, registry)
    except ComputeError as exc:
        raise QuizFileError(path, str(exc), qid, exc.field) from None
    qtype = QuestionType(d["type"])
    options = tuple(Option(_text(o["text"]), _text(o["feedback"])) for o in d["options"])
    q = Question(id=qid, type=qtype, difficulty=Difficulty(d["difficulty"]), prompt=_text(d["prompt"]),
                 options=options, answer=_answer(path, qid, d["answer"], qtype, len(options)),
                 explanation=_text(d["explanation"]), tags=tuple(d["tags"]), values=values,
                 source=d.get("source"))
    _check_texts(path, q)
    return q


def load_chapter(path: str | Path, registry: Mapping[str, Callable] | None = None) -> Chapter:
    """Load and check one bank file. `registry` maps `fn:` names to functions (default: fsdp_lab.theory.formulas)."""
    path = Path(path)
    data = read_yaml(path)
    if data is None:
        raise QuizFileError(path, "the file is empty")
    check_schema(path, data)
    stem_key = path.stem.split("-", 1)[0]  # "06" of 06-engineering, "06a" of 06a-fsdp2
    if re.fullmatch(r"\d\d[a-z]?", stem_key) and data["chapter"] != stem_key:
        raise QuizFileError(path, f"chapter {data['chapter']!r} does not match the file name ({stem_key!r})",
                            field="chapter")
    for lang in LANGS:
        if (bad := control_character(data["title"][lang])) is not None:
            raise QuizFileError(path, f"control character U+{ord(bad):04X} in the title; write plain text",
                                field=f"title.{lang}")
    registry = default_registry() if registry is None else registry
    questions, first_seen = [], {}
    for index, d in enumerate(data["questions"]):
        if d["id"] in first_seen:
            raise QuizFileError(path, f"duplicate id: question #{index + 1} reuses the id of question "
                                      f"#{first_seen[d['id']] + 1}", d["id"], "id")
        first_seen[d["id"]] = index
        questions.append(_question(path, d, registry))
    return Chapter(key=data["chapter"], title=_text(data["title"]), questions=tuple(questions), path=path)


def bank_files(directory: str | Path | None = None) -> list[Path]:
    """The `*.yaml` files of the bank in `directory` (default: the repository's quizzes/), sorted."""
    directory = Path(directory) if directory is not None else default_quiz_dir()
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise QuizFileError(directory, "no *.yaml question files here")
    return files


def load_bank(directory: str | Path | None = None,
              registry: Mapping[str, Callable] | None = None) -> dict[str, Chapter]:
    """Every `*.yaml` in `directory` (default: the repository's quizzes/), keyed by chapter, ids unique."""
    files = bank_files(directory)
    registry = default_registry() if registry is None else registry
    chapters: dict[str, Chapter] = {}
    owner: dict[str, Path] = {}
    for file in files:
        chapter = load_chapter(file, registry)
        if chapter.key in chapters:
            raise QuizFileError(file, f"chapter {chapter.key!r} is also defined in {chapters[chapter.key].path}",
                                field="chapter")
        for q in chapter.questions:
            if q.id in owner:
                raise QuizFileError(file, f"duplicate id: also used in {owner[q.id]}", q.id, "id")
            owner[q.id] = file
        chapters[chapter.key] = chapter
    return dict(sorted(chapters.items()))


def load_chapter_by_key(key: str, directory: str | Path | None = None,
                        registry: Mapping[str, Callable] | None = None) -> Chapter:
    """The chapter file for `key` ("10", "interview", ...) without loading the others."""
    key = chapter_key(key)
    directory = Path(directory) if directory is not None else default_quiz_dir()
    path = directory / f"{CHAPTERS[key]}.yaml"
    if not path.exists():
        raise QuizFileError(path, f"no question file for chapter {key}")
    return load_chapter(path, registry)
