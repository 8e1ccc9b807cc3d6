"""Seeded shuffling is deterministic, and every letter in the text follows its option."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from quiz_fixtures.factory import make_question

from fsdp_lab.lessons.quiz import grade, load_chapter_by_key, present
from fsdp_lab.lessons.quiz.scoring import option_order
from fsdp_lab.lessons.quiz.questions import TemplateError, bare_letters, placeholders, render

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def interview():
    return load_chapter_by_key("10")


def test_no_seed_keeps_the_authoring_order(interview):
    for q in interview.questions:
        assert option_order(q, None) == tuple(range(len(q.options)))


def test_same_seed_same_order_different_seeds_differ(interview):
    orders = {seed: [option_order(q, seed) for q in interview.questions] for seed in range(6)}
    assert orders[3] == [option_order(q, 3) for q in interview.questions]
    assert len({tuple(v) for v in orders.values()}) > 1
    assert any(o != tuple(range(4)) for o in orders[3])


def test_order_is_the_same_in_another_process():
    code = ("from fsdp_lab.lessons.quiz import load_chapter_by_key\n"
            "from fsdp_lab.lessons.quiz.scoring import option_order\n"
            "print([option_order(q, 7) for q in load_chapter_by_key('10').questions])")
    outs = set()
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(REPO)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                                check=True, timeout=120).stdout)
    assert len(outs) == 1


@pytest.mark.parametrize("seed", range(8))
def test_letters_in_the_article_explanation_follow_the_options(interview, seed):
    q1 = present(interview.questions[0], "zh", seed)
    letter = {o.text: o.letter for o in q1.options}
    assert q1.explanation.startswith(f"答案：{letter['每张卡只存部分参数按需聚合']}。")
    assert f"{letter['每张卡保存一份完整模型副本']} 是 DDP 的做法" in q1.explanation
    assert f"{letter['用 CPU 内存缓存所有模型参数']} 是 CPU offload" in q1.explanation
    assert f"{letter['将模型量化到低精度来训练']} 是量化压缩" in q1.explanation
    q5 = present(interview.questions[4], "en", seed)
    right = sorted(o.letter for o in q5.options if o.correct)
    assert q5.answer_letters == "".join(right)
    assert q5.explanation.startswith(f"Answer: {''.join(right)}.")
    assert f"({right[0]} and {right[1]} are right)" in q5.explanation or \
        f"({right[1]} and {right[0]} are right)" in q5.explanation


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 11])
def test_choosing_the_shown_key_scores_full_marks(interview, seed):
    for q in interview.questions:
        shown = present(q, "en", seed)
        assert grade(q, shown.to_original(shown.answer_letters)).full
        assert shown.to_shown(q.answer) == shown.answer_letters


def test_feedback_mentions_shown_letters():
    q = make_question("A", explanation="{B} is wrong; {answer} is right")
    for seed in range(5):
        shown = present(q, "en", seed)
        b_letter = next(o.letter for o in shown.options if o.original == 1)
        assert shown.explanation == f"{b_letter} is wrong; {shown.answer_letters} is right"


def test_render_and_its_errors():
    assert render("{a} and {{literal}}", {"a": "1"}) == "1 and {literal}"
    assert placeholders("{A}{answer} {{x}} {m_zero2_gb}") == ["A", "answer", "m_zero2_gb"]
    with pytest.raises(TemplateError, match=r"unknown placeholder \{b\}"):
        render("{b}", {"a": "1"})
    with pytest.raises(TemplateError, match="stray"):
        render("a } b", {})
    with pytest.raises(TemplateError):  # no attribute access or format specs: only names
        render("{a.__class__}", {"a": "1"})


@pytest.mark.parametrize("text, letters, bare", [
    ("B 是 DDP 的做法", "ABCD", ["B"]),
    ("（A、B 对）", "ABCD", ["A", "B"]),
    ("{B} 是 DDP 的做法，DCP、ZeRO-3、7B、A100", "ABCD", []),
    ("A Transformer block and A 7B model", "ABCD", []),
    ("A is what DDP does", "ABCD", ["A"]),
    ("{phi}B on {n} GPUs", "ABCD", []),
    ("E is not an option of a four-option question", "ABCD", []),
])
def test_bare_letters(text, letters, bare):
    assert bare_letters(text, letters) == bare
