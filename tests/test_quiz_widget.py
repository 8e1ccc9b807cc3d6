"""The notebook quiz driven from Python, with no browser: select, submit, read feedback, retry."""
import pytest

pytest.importorskip("ipywidgets")

from fsdp_lab.lessons.quiz import present, quiz  # noqa: E402
from fsdp_lab.lessons.quiz.progress import read_progress  # noqa: E402
from fsdp_lab.lessons.quiz.widget import QuizWidget  # noqa: E402

KEY = ["A", "B", "B", "C", "AB", "C", "AB", "A", "A", "AB"]


def test_full_marks_feedback_summary_and_saved_progress(tmp_path):
    w = quiz("10", lang="en", progress=tmp_path / "p.json", name="ada")
    assert isinstance(w, QuizWidget) and len(w.controls) == 10
    for i, letters in enumerate(KEY):
        w.select(i, letters)
    assert [w.selection(i) for i in range(10)] == KEY
    assert w.submit() == 10.0
    assert w.feedback_text(0).startswith("Correct.")
    assert "✓ A (you chose it, right)" in w.feedback_text(0)
    assert "Score: 10 / 10 (100%)" in w.summary_text and "net-correct" in w.summary_text
    assert "Score: 10 / 10 (100%)" in w.summary.value and "saved" in w.summary.value
    assert "Correct." in w.feedback[4].value
    assert w.submit_button.disabled and not w.retry_button.disabled
    assert all(c.disabled for c in (w.controls[0], *w.controls[4].children))
    assert read_progress(tmp_path / "p.json").attempts[0].score == 10


def test_partial_credit_empty_and_wrong_answers_in_chinese():
    w = quiz("10", lang="zh", progress=False)
    w.select(0, "B")          # wrong single
    w.select(4, "ABC")        # one wrong extra: 0.5
    w.select(6, "A")          # one of two: 0.5
    w.select(9, "ABCD")       # select all: 0
    assert w.submit() == pytest.approx(1.0)
    assert w.feedback_text(0).startswith("回答错误。") and "✗ B（已选，错误）" in w.feedback_text(0)
    assert "○ A（漏选）" in w.feedback_text(0)
    assert w.feedback_text(4).startswith("部分正确：得 0.5 分")
    assert w.feedback_text(1).startswith("回答错误。")  # nothing selected scores 0
    assert "（未作答）" in w.feedback[1].value
    assert "得分：1 / 10（10%）" in w.summary_text
    attempt = w.run.attempt()
    assert (attempt.answered, attempt.complete) == (4, False)
    assert attempt.answers["interview-q2"] == {"chosen": "", "score": 0.0}


def test_retry_clears_everything():
    w = quiz("10", progress=False)
    w.select(0, "A")
    w.submit()
    w.retry()
    assert w.score == 0 and w.selection(0) == "" and w.feedback_text(0) == ""
    assert w.feedback[0].value == "" and w.summary.value == ""
    assert not w.submit_button.disabled and w.retry_button.disabled and not w.controls[0].disabled
    w.select(0, "A")
    assert w.submit() == 1.0


def test_buttons_call_the_same_methods():
    w = quiz("10", progress=False)
    w.select(0, "A")
    w.submit_button.click()
    assert w.score == 1.0 and w.submit_button.disabled
    w.retry_button.click()
    assert w.score == 0 and not w.submit_button.disabled


def test_shuffled_widget_shows_shuffled_letters():
    w = quiz("10", lang="en", seed=4, progress=False)
    shown = present(w.chapter.questions[4], "en", 4)
    assert [label for label in (c.description for c in w.controls[4].children)] == \
        [f"{o.letter}. {o.text}" for o in shown.options]
    for i, q in enumerate(w.chapter.questions):
        w.select(i, present(q, "en", 4).answer_letters)
    assert w.submit() == 10.0


def test_select_rejects_bad_letters():
    w = quiz("10", progress=False)
    with pytest.raises(ValueError, match="question 1 has options ABCD; got 'E'"):
        w.select(0, "E")
    with pytest.raises(ValueError, match="single choice; got 2 letters"):
        w.select(0, "AB")


def test_it_displays_as_a_widget():
    bundle = quiz("01", progress=False)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
