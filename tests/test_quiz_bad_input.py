"""Every broken bank file gets a QuizFileError naming the file, the question id and the field."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lab.lessons.quiz import QuizFileError, load_bank, load_chapter, load_chapter_by_key

FIXTURES = Path(__file__).parent / "quiz_fixtures"
BAD = FIXTURES / "bad"

CASES = {  # fixture: (question id, field, words in the message)
    "malformed_yaml": ("fx-multi", "prompt", ["malformed YAML", "line 29"]),
    "unknown_type": ("fx-multi", "type", ["unknown question type 'truefalse'", "single, multi"]),
    "answer_out_of_range": ("fx-multi", "answer", ["'D' is out of range", "3 options (A–C)"]),
    "duplicate_ids": ("fx-single", "id", ["duplicate id", "#2", "#1"]),
    "no_correct_option": ("fx-multi", "answer", ["no correct option"]),
    "missing_answer": ("fx-multi", "answer", ["missing required field"]),
    "single_with_two_answers": ("fx-single", "answer", ["exactly 1 right option", "'AB'"]),
    "unknown_placeholder": ("fx-single", "options.B.feedback.zh", ["unknown placeholder {E}"]),
    "bare_letter": ("fx-multi", "explanation.en", ["bare option letter 'C'", "{C}"]),
    "unknown_function": ("fx-single", "computed.z3.fn", ["unknown function 'm_zero4'", "m_zero3"]),
    "unknown_argument_name": ("fx-single", "computed.z2.args.n", ["'gpus' is not a param"]),
    "duplicate_key": ("fx-single", "explanation", ["duplicate key 'en'"]),
    "same_option_text": ("fx-single", "options.B.text.zh", ["options A and B both read '38.5 GB'"]),
    "missing_english": ("fx-multi", "prompt.en", ["missing required field"]),
    "stray_brace": ("fx-multi", "prompt.en", ["stray '{'"]),
}


def test_every_bad_fixture_has_a_case():
    assert sorted(p.stem for p in BAD.glob("*.yaml")) == sorted(CASES)


def test_good_fixture_loads():
    chapter = load_chapter(FIXTURES / "good.yaml")
    assert [q.answer_letters for q in chapter.questions] == ["A", "AB"]
    assert chapter.questions[0].values["z2"] == "38.5"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_error_names_file_question_and_field(name):
    qid, field, words = CASES[name]
    path = BAD / f"{name}.yaml"
    with pytest.raises(QuizFileError) as info:
        load_chapter(path)
    err = info.value
    assert (err.path, err.question_id, err.field) == (path, qid, field)
    message = str(err)
    assert message.startswith(f"{path}, question {qid!r}, field {field!r}: ")
    for word in words:
        assert word in message, (word, message)


def test_empty_file_and_chapter_mismatch(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(QuizFileError, match="empty.yaml: the file is empty"):
        load_chapter(empty)
    wrong = tmp_path / "03-lifecycle.yaml"
    shutil.copy(FIXTURES / "good.yaml", wrong)  # says chapter "05"
    with pytest.raises(QuizFileError, match=r"field 'chapter': chapter '05' does not match the file name \('03'\)"):
        load_chapter(wrong)


def test_duplicate_ids_across_files(tmp_path):
    shutil.copy(FIXTURES / "good.yaml", tmp_path / "05-zero.yaml")
    text = (FIXTURES / "good.yaml").read_text(encoding="utf-8").replace('chapter: "05"', 'chapter: "06"')
    (tmp_path / "06-engineering.yaml").write_text(text.replace("fx-multi", "fx-other"), encoding="utf-8")
    with pytest.raises(QuizFileError) as info:
        load_bank(tmp_path)
    assert info.value.question_id == "fx-single" and info.value.field == "id"
    assert "also used in" in str(info.value) and "05-zero.yaml" in str(info.value)


def test_missing_chapter_file_and_unknown_chapter(tmp_path):
    with pytest.raises(QuizFileError, match="no question file for chapter 10"):
        load_chapter_by_key("10", tmp_path)
    with pytest.raises(ValueError, match="unknown chapter '42'"):
        load_chapter_by_key("42", tmp_path)


GOOD = (FIXTURES / "good.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize("edit, words", [
    (lambda t: t + "extra: " + "[" * 100_000 + "]" * 100_000 + "\n", ["line 38", "nested more than 32 levels"]),
    (lambda t: t.replace("n: 8", "n: " + "7" * 5000), ["line 12", "an integer of 5000 digits"]),
    (lambda t: t.replace("n: 8", "n: !!int '" + "7" * 5000 + "'"), ["line 12", "an integer of 5000 digits"]),
    (lambda t: t.replace("tags: [fixture]", "tags: &t [fixture]", 1).replace("tags: [fixture]", "tags: *t"),
     ["aliases (*name) are not allowed"]),
    (lambda t: t.replace('en: "Pick two"', 'en: "Pick \\e[2J\\e]0;owned\\atwo"'),
     ["question 'fx-multi', field 'prompt.en'", "control character U+001B"]),
    (lambda t: t.replace('en: "Test"', 'en: "Te\\u202est"'), ["field 'title.en'", "control character U+202E"]),
])
def test_a_bank_too_deep_too_big_or_too_clever_is_one_line(tmp_path, edit, words):
    """A bank is read like any file a user names: bounded, and every refusal is one QuizFileError line."""
    path = tmp_path / "05-zero.yaml"
    path.write_text(edit(GOOD), encoding="utf-8")
    with pytest.raises(QuizFileError) as info:
        load_chapter(path)
    message = str(info.value)
    assert message.startswith(f"{path}") and "\n" not in message and len(message) < 300, message
    for word in words:
        assert word in message, (word, message)


def test_a_bank_file_is_read_only_if_it_is_a_small_regular_file(tmp_path):
    big = tmp_path / "05-zero.yaml"
    big.write_text(GOOD + "#" * (2 << 20) + "\n", encoding="utf-8")
    with pytest.raises(QuizFileError, match=r"05-zero.yaml: is 2,09\d,\d+ bytes \(2.0 MiB\), over the 1,048,576 "
                                            r"bytes \(1.0 MiB\) limit"):
        load_chapter(big)
    fifo = tmp_path / "06-engineering.yaml"
    os.mkfifo(fifo)
    with pytest.raises(QuizFileError, match=r"06-engineering.yaml: is a FIFO \(named pipe\), not a regular file"):
        load_chapter(fifo)  # returns at once: the old read blocked here until a writer came


def test_the_quiz_command_reports_a_bad_bank_in_one_line(tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "05-zero.yaml").write_text(GOOD.replace("n: 8", "n: " + "7" * 5000), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "quiz", "05", "--bank", str(bank), "--progress",
                           str(tmp_path / "p.json")], input="", capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"fsdp-lab quiz: {bank / '05-zero.yaml'}, question 'fx-single', field 'n': malformed YAML at line 12, "
        f"column 10: an integer of 5000 digits (at most 100 in a question bank)"]
