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
    w.submit_button.click()  # nine questions are blank: the first click only warns
    assert w.score == 0 and not w.submit_button.disabled and "9 question(s) left blank" in w.summary.value
    w.submit_button.click()  # the second submits anyway
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


def test_a_full_form_submits_on_the_first_click_and_right_wrong_are_coloured():
    w = quiz("10", progress=False)
    for i, letters in enumerate(KEY):
        w.select(i, letters if i else "B")  # Q1 wrong, the rest right
    w.submit_button.click()
    assert w.score == 9.0 and "blank" not in w.summary.value
    assert "#b91c1c" in w.feedback[0].value and "#15803d" in w.feedback[1].value


def test_blank_answers_read_once_in_both_languages_and_difficulty_is_translated():
    en, zh = quiz("10", lang="en", progress=False), quiz("10", lang="zh", progress=False)
    en.submit(), zh.submit()
    assert "(no answer)" in en.feedback[0].value and "((no answer))" not in en.feedback[0].value
    assert "（未作答）" in zh.feedback[0].value and "（（未作答））" not in zh.feedback[0].value
    titles = " ".join(child.children[0].value for child in zh.box.children if hasattr(child, "children")
                      and child.children and hasattr(child.children[0], "value"))
    assert "易" in titles and not any(word in titles for word in ("easy", "mid", "hard"))


def test_best_score_and_earlier_attempts_come_from_the_progress_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    store = tmp_path / ".fsdp-lab" / "progress.json"
    first = quiz("10", progress=store)
    assert "No earlier attempt" in first.history.value
    for i, letters in enumerate(KEY[:7]):
        first.select(i, letters)
    first.submit()
    assert str(tmp_path) not in first.summary.value and "~/.fsdp-lab/progress.json" in first.summary.value
    second = quiz("10", progress=store)
    second.select(0, "A")
    second.submit()
    third = quiz("10", progress=store)
    assert "earlier attempts at this chapter: 2" in third.history.value
    assert "best score 7 / 10" in third.history.value and "latest 1 / 10" in third.history.value
    assert "earlier attempts" in quiz("10", progress=store, lang="en").history.value
    assert "No earlier attempt" in quiz("01", progress=store).history.value  # other chapters do not count


def test_no_python_repr_before_the_cell_runs():
    bundle = quiz("03", progress=False)._repr_mimebundle_()
    assert bundle["text/plain"] == "" and "application/vnd.jupyter.widget-view+json" in bundle


def test_long_options_wrap_instead_of_overlapping_the_next():
    """ipywidgets gives radio labels a fixed one-line height: a long option (chapter 09's B) overflowed onto C and
    pushed its own radio button out of view. The quiz box carries a class whose CSS lets options wrap and grow."""
    from fsdp_lab.lessons.quiz import quiz

    w = quiz("09", lang="en", progress=False)
    assert "fsdp-quiz" in w.box._dom_classes
    header = w.box.children[0].value
    assert ".fsdp-quiz .widget-radio-box label{height:auto" in header and "white-space:normal" in header
    assert ".fsdp-quiz .widget-radio-box input{float:none" in header


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_submit_does_not_count_itself_as_an_earlier_attempt(tmp_path, monkeypatch, lang):
    monkeypatch.setenv("HOME", str(tmp_path))
    store = tmp_path / ".fsdp-lab" / "progress.json"
    first = quiz("10", progress=store, lang=lang)
    first.select(0, KEY[0])
    first.submit()
    no_history = {"en": "No earlier attempt", "zh": "还没有本章的作答记录"}[lang]
    assert no_history in first.history.value and len(read_progress(store).attempts) == 1
    first.retry()
    first.submit()  # the second Submit has the first one before it
    one_earlier = {"en": "earlier attempts at this chapter: 1", "zh": "本章之前的作答：1 次"}[lang]
    assert one_earlier in first.history.value
