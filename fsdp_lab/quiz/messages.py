"""Every sentence the quiz front ends print, in both languages, in one place (so a test can check both and a
translator finds them all)."""
from __future__ import annotations

from types import MappingProxyType

from fsdp_lab.quiz.model import check_lang

_EN = {
    "header": "Chapter {key} · {title} — {n} questions",
    "rule": ("Multi-select scoring: net-correct partial credit (PrairieLearn 'PC'): (right picks − wrong picks)"
             " ÷ number of right options, never below 0; single choice is right or wrong."),
    "question": "Q{number}/{total} [{type} · {difficulty}]",
    "single": "single choice", "multi": "multiple choice, select all that apply",
    "ask_single": "Your answer (one letter {span}): ",
    "ask_multi": "Your answer (one or more letters {span}, e.g. AB): ",
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
    "saved": "Progress saved to {path}.",
    "not_saved": "Progress not saved: {reason}",
    "submit": "Submit", "retry": "Retry", "unanswered": "(no answer)",
    "chapters": "Chapters (fsdp-lab quiz NN to start one):",
    "best": "best {score} / {max}, {attempts} attempt(s)",
    "never": "not tried yet",
}
_ZH = {
    "header": "第 {key} 章 · {title} — 共 {n} 题",
    "rule": ("多选题计分：按“净正确”给部分分（PrairieLearn 的 PC 规则）：(选对数 − 选错数) ÷ 正确选项数，"
             "最低 0 分；单选题只分对错。"),
    "question": "第 {number}/{total} 题 [{type} · {difficulty}]",
    "single": "单选题", "multi": "多选题",
    "ask_single": "你的答案（一个字母 {span}）：",
    "ask_multi": "你的答案（一个或多个字母 {span}，如 AB）：",
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
    "saved": "进度已保存到 {path}。",
    "not_saved": "进度未保存：{reason}",
    "submit": "提交", "retry": "重做", "unanswered": "（未作答）",
    "chapters": "章节（用 fsdp-lab quiz NN 开始）：",
    "best": "最好成绩 {score} / {max}，共 {attempts} 次",
    "never": "尚未作答",
}
MESSAGES = MappingProxyType({"en": MappingProxyType(_EN), "zh": MappingProxyType(_ZH)})
assert _EN.keys() == _ZH.keys(), sorted(_EN.keys() ^ _ZH.keys())


def msg(lang: str, name: str, **values) -> str:
    """The `name` sentence in `lang` with `values` filled in (str.format on our own constants only)."""
    return MESSAGES[check_lang(lang)][name].format(**values)


def points(x: float) -> str:
    """0.5 -> "0.5", 7.0 -> "7", 6.6667 -> "6.67"."""
    return f"{x:.2f}".rstrip("0").rstrip(".")
