"""Progress files: atomic writes, a schema version, and bad files moved aside (never lost, never fatal)."""
import json
import os
import re
from datetime import datetime, timezone

import pytest

from fsdp_lab.lessons.quiz import ProgressFileError, ProgressStore, QuizRun, load_chapter_by_key
from fsdp_lab.lessons.quiz.progress import SCHEMA_VERSION, read_progress
from fsdp_lab.user_files import replace_text as write_atomic

FIXED = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)


def attempt(answers="ABBC"):
    run = QuizRun(load_chapter_by_key("10"), "en", clock=lambda: FIXED)
    for i, letters in enumerate(answers):
        run.submit(i, letters)
    return run.attempt()


def test_roundtrip_and_version(tmp_path):
    store = ProgressStore(tmp_path / "p.json", clock=lambda: FIXED)
    assert store.record(attempt(), "ada") is None
    assert store.record(attempt("BBBC"), None) is None
    data = json.loads((tmp_path / "p.json").read_text(encoding="utf-8"))
    assert data["schema_version"] == SCHEMA_VERSION == 1 and data["learner"] == "ada"
    progress = read_progress(tmp_path / "p.json")
    assert [a.score for a in progress.attempts] == [4.0, 3.0]
    first = progress.attempts[0]
    assert (first.chapter, first.answered, first.total, first.complete, first.max) == ("10", 4, 10, False, 10)
    assert first.answers["interview-q1"] == {"chosen": "A", "score": 1.0}
    assert first.finished == "2025-03-04T05:06:07+00:00"


def test_chosen_letters_are_saved_in_bank_order_even_when_shuffled(tmp_path):
    run = QuizRun(load_chapter_by_key("10"), "en", seed=5)
    shown = run.shown[4]
    run.submit(4, shown.answer_letters)
    assert run.attempt().answers["interview-q5"] == {"chosen": "AB", "score": 1.0}


def test_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "p.json"
    target.write_text('{"old": true}', encoding="utf-8")
    calls = []
    real_replace = os.replace

    def spy(src, dst):
        calls.append((os.path.dirname(src), os.path.basename(src), dst))
        assert json.loads(open(src, encoding="utf-8").read()) == {"new": 1}  # fully written before the swap
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_atomic(target, '{"new": 1}')
    assert calls == [(str(tmp_path), calls[0][1], target)] and calls[0][1].startswith(".p.json.")
    assert json.loads(target.read_text(encoding="utf-8")) == {"new": 1}

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, '{"newer": 2}')
    assert json.loads(target.read_text(encoding="utf-8")) == {"new": 1}  # old content intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temp file left behind


@pytest.mark.parametrize("content, words", [
    ("{not json", "not valid JSON (line 1, column 2"),
    ("[1, 2]", "not a progress file"),
    ('{"schema_version": 1, "learner": "x", "attempts": [{"chapter": "10"}]}', "attempts/0"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_corrupt_file_is_moved_aside_with_a_clear_message(tmp_path, content, words):
    path = tmp_path / "p.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProgressFileError, match=re.escape(words)):
        read_progress(path)
    store = ProgressStore(path, clock=lambda: FIXED)
    progress, notice = store.load("ada")
    moved = tmp_path / "p.json.corrupt-20250304T050607Z"
    assert progress.attempts == [] and progress.learner == "ada"
    assert str(path) in notice and str(moved) in notice and words.split(" (")[0] in notice
    assert moved.read_bytes() == (content if isinstance(content, bytes) else content.encode())
    assert not path.exists()
    store.record(attempt())  # a fresh, valid file
    assert len(read_progress(path).attempts) == 1


def test_other_version_is_moved_aside_not_overwritten(tmp_path):
    path = tmp_path / "p.json"
    future = {"schema_version": 2, "learner": "ada", "attempts": [], "new_field": 1}
    path.write_text(json.dumps(future), encoding="utf-8")
    with pytest.raises(ProgressFileError) as info:
        read_progress(path)
    assert info.value.kind == "v2" and "schema_version is 2, this fsdp-lab reads version 1" in str(info.value)
    store = ProgressStore(path, clock=lambda: FIXED)
    notice = store.record(attempt(), "ada")
    moved = tmp_path / "p.json.v2-20250304T050607Z"
    assert json.loads(moved.read_text(encoding="utf-8")) == future
    assert "schema_version is 2" in notice and str(moved) in notice
    assert read_progress(path).attempts[0].chapter == "10"


def test_two_bad_files_in_one_second_do_not_collide(tmp_path):
    path = tmp_path / "p.json"
    store = ProgressStore(path, clock=lambda: FIXED)
    for _ in range(2):
        path.write_text("garbage", encoding="utf-8")
        store.load()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json.corrupt-20250304T050607Z",
                                                          "p.json.corrupt-20250304T050607Z-1"]


def test_default_path_follows_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ProgressStore().path == tmp_path / ".fsdp-lab" / "progress.json"


@pytest.mark.parametrize("number, words", [("NaN", "NaN is not a number"), ("Infinity", "Infinity is not a number"),
                                           ("-Infinity", "-Infinity is not a number"), ("1e400", "the number 1e400 is out of range")])
def test_a_score_that_is_not_a_finite_number_never_reaches_the_csv(tmp_path, monkeypatch, capsys, number, words):
    """Python's json reads NaN, Infinity and 1e400 (as inf), and JSON Schema's "number" lets them through:
    the file is refused as it is read, and the class export skips it and says why."""
    from fsdp_lab import cli

    store = ProgressStore(tmp_path / "ok.json", clock=lambda: FIXED)
    store.record(attempt(), "bo")
    text = store.path.read_text(encoding="utf-8")
    text = re.sub(r'"score": 4\.0', f'"score": {number}', text, count=1)
    assert number in text
    bad = tmp_path / "class" / "bo.json"
    bad.parent.mkdir()
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(ProgressFileError, match=re.escape(words)):
        read_progress(bad)
    assert cli.main(["scores", str(bad.parent)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1:] == []  # the header row only: no row carries the bad number
    assert f"skipped {bad}: not a progress file ({words}" in captured.err
