"""Turn `quizzes/NN-name.yaml` into Chapter objects, or say exactly what is wrong with it.

Order of checks: YAML syntax → JSON Schema (shape) → each question's meaning (answer letters in range,
ids unique, numbers computable, every placeholder known, no bare option letters, no two options that read
the same once the numbers are filled in). Every failure is a QuizFileError naming file, question and field."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from fsdp_lab.quiz.computed import ComputeError, default_registry, resolve
from fsdp_lab.quiz.errors import QuizFileError
from fsdp_lab.quiz.model import (CHAPTERS, LANGS, LETTERS, Chapter, Difficulty, Option, Question,
                                 QuestionType, Text)
from fsdp_lab.quiz.template import TemplateError, bare_letters, render
from fsdp_lab.quiz.validate import check_schema
from fsdp_lab.quiz.yamlfile import read_yaml

RESERVED = ("answer",)


def default_quiz_dir() -> Path:
    """`quizzes/` at the repository root, beside the `fsdp_lab` package (editable installs and checkouts)."""
    return Path(__file__).resolve().parents[2] / "quizzes"


def chapter_key(text: str) -> str:
    """"10", "1", "01", "10-interview" or "interview" -> "10"; anything else is a ValueError listing keys."""
    raw = str(text).strip().lower()
    for key, stem in CHAPTERS.items():
        if raw in (key, stem, stem.split("-", 1)[1]) or (raw.isdigit() and int(raw) == int(key)):
            return key
    raise ValueError(f"unknown chapter {text!r}; expected one of: {', '.join(CHAPTERS)} "
                     f"(or a name such as {', '.join(list(CHAPTERS.values())[:2])}, ...)")


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
    """Load and check one bank file. `registry` maps `fn:` names to functions (default: fsdp_lab.formulas)."""
    path = Path(path)
    data = read_yaml(path)
    if data is None:
        raise QuizFileError(path, "the file is empty")
    check_schema(path, data)
    stem_key = path.stem[:2]
    if stem_key.isdigit() and data["chapter"] != stem_key:
        raise QuizFileError(path, f"chapter {data['chapter']!r} does not match the file name ({stem_key!r})",
                            field="chapter")
    registry = default_registry() if registry is None else registry
    questions, first_seen = [], {}
    for index, d in enumerate(data["questions"]):
        if d["id"] in first_seen:
            raise QuizFileError(path, f"duplicate id: question #{index + 1} reuses the id of question "
                                      f"#{first_seen[d['id']] + 1}", d["id"], "id")
        first_seen[d["id"]] = index
        questions.append(_question(path, d, registry))
    return Chapter(key=data["chapter"], title=_text(data["title"]), questions=tuple(questions), path=path)


def load_bank(directory: str | Path | None = None,
              registry: Mapping[str, Callable] | None = None) -> dict[str, Chapter]:
    """Every `*.yaml` in `directory` (default: the repository's quizzes/), keyed by chapter, ids unique."""
    directory = Path(directory) if directory is not None else default_quiz_dir()
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise QuizFileError(directory, "no *.yaml question files here")
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
