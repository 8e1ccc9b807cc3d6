"""What a question is: the bank as frozen data, its `{placeholder}` text, its errors and its messages.

Errors a learner or an author can act on: each one names the file, and for a question bank the question
id and the field, so a typo in a 300-line YAML file is found in one look.

The question bank as plain frozen data. Text fields keep their `{placeholders}` (option letters, `answer`,
computed numbers); `present.py` fills them for one language and one shuffle, so the bank itself never changes
when a notebook cell is re-run.

`{name}` placeholders in question text: option letters (`{B}`), the key (`{answer}`) and computed numbers
(`{m_zero2_gb}`). Rendering is a plain lookup in a dict of strings: no eval, no attribute access, no format
specs, so a YAML file can never run code. `{{` and `}}` are literal braces.

[Note: letters in text] The article's explanations name options ("B 是 DDP 的做法"). When options are shuffled
those letters must follow them, so the bank writes `{B}`, the presenter maps it to the shown letter, and the
loader rejects a bare option letter left in any text (`bare_letters`).

Every sentence the quiz front ends print, in both languages, in one place (so a test can check both and a
translator finds them all).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Mapping


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


LETTERS = "ABCDEFGH"  # at most eight options per question (the schema says so too)
LANGS = ("zh", "en")

# Chapter key -> file stem under quizzes/, in the article's section order. A chapter the article does not have is
# lettered after the section it extends ("06a": FSDP2, after 06's engineering practice).
CHAPTERS: Mapping[str, str] = MappingProxyType({
    "01": "01-core-idea", "02": "02-sharding", "03": "03-lifecycle", "04": "04-mixed-precision",
    "05": "05-zero", "06": "06-engineering", "06a": "06a-fsdp2", "06b": "06b-beyond-one-node",
    "06c": "06c-composing", "07": "07-when-to-use", "08": "08-python-demo", "09": "09-misconceptions",
    "09a": "09a-bug-zoo", "10": "10-interview",
})


def check_lang(lang: str) -> str:
    """Front ends take the language from users; reject anything but zh/en by name."""
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; expected one of: {', '.join(LANGS)}")
    return lang


class QuestionType(str, Enum):
    """How many options a learner may pick, and so how the grader scores them."""

    SINGLE = "single"  # exactly one option is right; the score is 0 or 1
    MULTI = "multi"  # one or more options are right; partial credit (see grader.py)


class Difficulty(str, Enum):
    """The article's labels: easy / mid / hard."""

    EASY = "easy"
    MID = "mid"
    HARD = "hard"


@dataclass(frozen=True)
class Text:
    """One string per language."""

    zh: str
    en: str

    def get(self, lang: str) -> str:
        return getattr(self, check_lang(lang))


@dataclass(frozen=True)
class Option:
    """An option and what a learner who picks it should read."""

    text: Text
    feedback: Text


@dataclass(frozen=True)
class Question:
    """One question in authoring order: `answer` holds indices into `options` (0 = A as written)."""

    id: str
    type: QuestionType
    difficulty: Difficulty
    prompt: Text
    options: tuple[Option, ...]
    answer: frozenset[int]
    explanation: Text
    tags: tuple[str, ...]
    values: Mapping[str, str] = field(default_factory=dict)  # placeholder name -> display string
    source: str | None = None  # e.g. "article Q3" for the article's own questions

    @property
    def answer_letters(self) -> str:
        """The key as written in the file, e.g. "AB"."""
        return "".join(LETTERS[i] for i in sorted(self.answer))


@dataclass(frozen=True)
class Chapter:
    """One YAML file: a chapter key such as "10", its title and its questions in file order."""

    key: str
    title: Text
    questions: tuple[Question, ...]
    path: Path


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


_EN = {
    "header": "Chapter {key} · {title} — {n} questions",
    "rule": ("Multi-select scoring: net-correct partial credit (PrairieLearn 'PC'): (right picks − wrong picks)"
             " ÷ number of right options, never below 0; single choice is right or wrong."),
    "question": "Q{number}/{total} [{type} · {difficulty}]",
    "single": "single choice", "multi": "multiple choice, select all that apply",
    "ask_single": "Your answer (one letter {span}; q to quit): ",
    "ask_multi": "Your answer (one or more letters {span}, e.g. AB; q to quit): ",
    "retype": "Not accepted: {reason}. Please try again.",
    "empty": "no answer given: type a letter {span}",
    "not_option": "{bad} is not an option here: type letters {span}",
    "one_letter": "this question takes exactly one letter ({span}); you typed {count}",
    "right": "Correct.", "partly": "Partly right: {score} of 1 point.", "wrong": "Not right.",
    "key": "Answer: {letters}",
    "picked_right": "✓ {letter} (you chose it, right): {feedback}",
    "picked_wrong": "✗ {letter} (you chose it, wrong): {feedback}",
    "missed": "○ {letter} (you missed it): {feedback}",
    "why": "Why: {text}",
    "score": "Score: {score} / {max} ({pct}%)",
    "eof": "Input ended after {answered} of {total} questions; partial result {score} / {max} is saved.",
    "quit": "Stopped (q) after {answered} of {total} questions. Your answers so far are saved as an unfinished "
            "attempt: run the same command again to resume it.",
    "saved": "Progress saved to {path}.",
    "not_saved": "Progress not saved: {reason}",
    "submit": "Submit", "retry": "Retry", "unanswered": "(no answer)",
    "chapters": "Chapters (fsdp-lab quiz NN to start one):",
    "best": "best {score} / {max}, {attempts} attempt(s)",
    "never": "not tried yet",
    "resume": "You stopped this chapter after {answered} of {total} questions ({when}). Resume there? [Y/n] ",
    "resume_retype": "Please type y (resume) or n (start over).",
    "resumed": "Resuming: {answered} answers restored, {left} question(s) left.",
    "nothing": "Nothing was answered, so no attempt is recorded.",
    "interrupted": "interrupted (Ctrl-C); {answered} of {total} answers saved to {path}; run the same command "
                   "again to resume",
}
_ZH = {
    "header": "第 {key} 章 · {title} — 共 {n} 题",
    "rule": ("多选题计分：按“净正确”给部分分（PrairieLearn 的 PC 规则）：(选对数 − 选错数) ÷ 正确选项数，"
             "最低 0 分；单选题只分对错。"),
    "question": "第 {number}/{total} 题 [{type} · {difficulty}]",
    "single": "单选题", "multi": "多选题",
    "ask_single": "你的答案（一个字母 {span}；输入 q 退出）：",
    "ask_multi": "你的答案（一个或多个字母 {span}，如 AB；输入 q 退出）：",
    "retype": "无法接受：{reason}。请重新输入。",
    "empty": "没有输入答案：请输入字母 {span}",
    "not_option": "{bad} 不是本题的选项：请输入字母 {span}",
    "one_letter": "本题只能选一个字母（{span}），你输入了 {count} 个",
    "right": "回答正确。", "partly": "部分正确：得 {score} 分（满分 1 分）。", "wrong": "回答错误。",
    "key": "答案：{letters}",
    "picked_right": "✓ {letter}（已选，正确）：{feedback}",
    "picked_wrong": "✗ {letter}（已选，错误）：{feedback}",
    "missed": "○ {letter}（漏选）：{feedback}",
    "why": "解析：{text}",
    "score": "得分：{score} / {max}（{pct}%）",
    "eof": "输入结束：已答 {answered}/{total} 题，部分成绩 {score} / {max} 已保存。",
    "quit": "已按 q 停止：已答 {answered}/{total} 题。已答部分已存为一次未完成的作答；再次运行同一命令即可继续。",
    "saved": "进度已保存到 {path}。",
    "not_saved": "进度未保存：{reason}",
    "submit": "提交", "retry": "重做", "unanswered": "（未作答）",
    "chapters": "章节（用 fsdp-lab quiz NN 开始）：",
    "best": "最好成绩 {score} / {max}，共 {attempts} 次",
    "never": "尚未作答",
    "resume": "你上次在本章答了 {answered}/{total} 题后停下（{when}）。从那里继续吗？[Y/n] ",
    "resume_retype": "请输入 y（继续）或 n（重新开始）。",
    "resumed": "继续作答：已恢复 {answered} 个答案，还剩 {left} 题。",
    "nothing": "没有作答任何题目，本次不计为一次尝试。",
    "interrupted": "已中断（Ctrl-C）；已答 {answered}/{total} 题，答案保存在 {path}；再次运行同一命令即可继续",
}
MESSAGES = MappingProxyType({"en": MappingProxyType(_EN), "zh": MappingProxyType(_ZH)})
assert _EN.keys() == _ZH.keys(), sorted(_EN.keys() ^ _ZH.keys())


def msg(lang: str, name: str, **values) -> str:
    """The `name` sentence in `lang` with `values` filled in (str.format on our own constants only)."""
    return MESSAGES[check_lang(lang)][name].format(**values)


DIFFICULTY_LABELS = MappingProxyType({"en": {"easy": "easy", "mid": "mid", "hard": "hard"},
                                      "zh": {"easy": "易", "mid": "中", "hard": "难"}})


def difficulty_label(difficulty: Difficulty, lang: str) -> str:
    """How a question's difficulty reads in `lang` (the bank stores the article's easy / mid / hard)."""
    return DIFFICULTY_LABELS[check_lang(lang)][difficulty.value]


def points(x: float) -> str:
    """0.5 -> "0.5", 7.0 -> "7", 6.6667 -> "6.67"."""
    return f"{x:.2f}".rstrip("0").rstrip(".")
