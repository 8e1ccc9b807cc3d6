"""The grader: single choice is right or wrong; multi-select uses PrairieLearn's net-correct ("PC") rule."""
import pytest
from quiz_fixtures.factory import idx, make_question

import fsdp_lab.lessons.quiz.scoring as grader_module
from fsdp_lab.lessons.quiz.scoring import PARTIAL_CREDIT_RULE, grade, net_correct


@pytest.mark.parametrize("selected, expected", [
    ("AB", 1.0),     # all right
    ("A", 0.5),      # one of two
    ("B", 0.5),
    ("ABC", 0.5),    # both right plus one wrong extra: (2 - 1) / 2
    ("ABCD", 0.0),   # select all: (2 - 2) / 2
    ("", 0.0),       # empty selection
    ("C", 0.0),      # none right: max(0, -1/2)
    ("CD", 0.0),
    ("AC", 0.0),     # one right, one wrong
])
def test_multi_net_correct_two_right(selected, expected):
    g = grade(make_question("AB"), idx(selected))
    assert g.score == pytest.approx(expected), (selected, g)


@pytest.mark.parametrize("selected, expected", [
    ("ABD", 1.0), ("AB", 2 / 3), ("D", 1 / 3), ("ABCD", 2 / 3), ("ABC", 1 / 3), ("C", 0.0), ("", 0.0),
])
def test_multi_net_correct_three_right(selected, expected):
    assert grade(make_question("ABD"), idx(selected)).score == pytest.approx(expected)


@pytest.mark.parametrize("selected, expected", [("B", 1.0), ("A", 0.0), ("", 0.0), ("AB", 0.0), ("ABCD", 0.0)])
def test_single_is_right_or_wrong(selected, expected):
    assert grade(make_question("B"), idx(selected)).score == expected


def test_grade_reports_right_wrong_and_missed_picks():
    g = grade(make_question("AB"), idx("BC"))
    assert (g.chosen_right, g.chosen_wrong, g.missed) == (frozenset(idx("B")), frozenset(idx("C")), frozenset(idx("A")))
    assert not g.full and g.score == 0.0


def test_grade_is_pure():
    q = make_question("AB")
    before = (q.answer, q.options)
    assert grade(q, [0, 2]) == grade(q, (2, 0)) == grade(q, {0, 2})
    assert (q.answer, q.options) == before


def test_out_of_range_selection_names_the_numbers():
    with pytest.raises(ValueError, match=r"has 4 options \(0\.\.3\); selection has \[4, 7\]"):
        grade(make_question("A"), [4, 7, 0])


def test_net_correct_rule_and_its_name():
    assert net_correct(2, 1, 2) == 0.5 and net_correct(0, 3, 2) == 0.0
    with pytest.raises(ValueError, match="n_correct=0"):
        net_correct(1, 0, 0)
    assert "net-correct" in PARTIAL_CREDIT_RULE and "PrairieLearn" in PARTIAL_CREDIT_RULE
    assert "PrairieLearn" in grader_module.__doc__ and "net-correct" in grader_module.__doc__
