"""`fsdp-lab quiz` and `fsdp-lab scores` driven through stdin, as a learner or an instructor would."""
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from fsdp_lab import cli
from fsdp_lab.lessons.quiz import load_chapter_by_key, present
from fsdp_lab.lessons.quiz.progress import read_progress

REPO = Path(__file__).resolve().parents[1]
HEADER = '"file","name","chapter","score","max","attempts","last_attempt"'
KEY = ["A", "B", "B", "C", "AB", "C", "AB", "A", "A", "AB"]


def run_process(args, stdin, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "fsdp_lab", *args], input=stdin, capture_output=True, text=True,
                          encoding="utf-8", cwd=REPO, env=env, timeout=300)


def run_inline(monkeypatch, capsys, args, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_all_ten_in_english_through_stdin(tmp_path):
    progress = tmp_path / "p.json"
    result = run_process(["quiz", "10", "--lang", "en", "--progress", str(progress), "--name", "ada"],
                         "\n".join(KEY) + "\n", tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Q10/10 [multiple choice, select all that apply · hard]" in out
    assert out.count("Correct.") == 10
    assert "Score: 10 / 10 (100%)" in out
    assert "net-correct" in out and "PrairieLearn" in out  # the rule is named in the summary
    assert f"Progress saved to {progress}." in out
    saved = read_progress(progress)
    assert saved.learner == "ada" and saved.attempts[0].complete and saved.attempts[0].score == 10


def test_all_ten_in_chinese_through_stdin_with_partial_credit(tmp_path):
    answers = ["A", "B", "B", "C", "ab", "C", "A,B", "A", "A", "A B C"]  # last one: one wrong extra
    result = run_process(["quiz", "10", "--lang", "zh", "--progress", str(tmp_path / "p.json")],
                         "\n".join(answers) + "\n", tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "第 1/10 题 [单选题 · 易] FSDP 的核心思想是什么？" in out
    assert "  A. 每张卡只存部分参数按需聚合" in out
    assert "答案：A。FSDP 的立身之本就是“分着存”" in out
    assert "部分正确：得 0.5 分（满分 1 分）。" in out
    assert "✗ C（已选，错误）：" in out
    assert "得分：9.5 / 10（95%）" in out and "PrairieLearn" in out


def test_invalid_input_reprompts_with_a_clear_message(monkeypatch, capsys, tmp_path):
    stdin = "E\n\nAB\nxyz\na\n" + "\n".join(KEY[1:]) + "\n"
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(tmp_path / "p.json")], stdin)
    assert code == 0
    assert "Not accepted: 'E' is not an option here: type letters A–D. Please try again." in out
    assert "Not accepted: no answer given: type a letter A–D." in out
    assert "Not accepted: this question takes exactly one letter (A–D); you typed 2." in out
    assert "'X', 'Y', 'Z' is not an option here" in out
    assert out.count("Your answer (one letter A–D; q to quit): ") >= 5
    assert "Score: 10 / 10 (100%)" in out


def test_eof_saves_a_partial_result(monkeypatch, capsys, tmp_path):
    progress = tmp_path / "p.json"
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--lang", "en", "--progress", str(progress)],
                              "A\nB\nC\n")
    assert code == 0
    assert "Input ended after 3 of 10 questions; partial result 2 / 10 is saved." in out
    a = read_progress(progress).attempts[0]
    assert (a.complete, a.answered, a.total, a.score) == (False, 3, 10, 2.0)


def test_q_stops_and_says_so_not_input_ended(monkeypatch, capsys, tmp_path):
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(tmp_path / "p.json")], "A\nq\n")
    assert code == 0 and "Input ended" not in out
    assert "Stopped (q) after 1 of 10 questions" in out and "resume" in out
    a = read_progress(tmp_path / "p.json").attempts[0]
    assert (a.complete, a.answered) == (False, 1)  # unfinished: the next run offers to resume it


def test_terminal_wraps_at_word_boundaries():
    from fsdp_lab.lessons.quiz.terminal import wrap
    text = "Right: FSDP moves about 3Φ (two all-gathers and a reduce-scatter), DDP about 2Φ (its all-reduce)."
    lines = wrap(text, 30, indent="  ").splitlines()
    assert all(len(line) <= 30 for line in lines) and len(lines) > 2
    words = text.split()
    assert " ".join(w for line in lines for w in line.split()) == " ".join(words)  # no word was cut
    zh = wrap("对：FSDP 约 3Φ（两次 all-gather 加一次 reduce-scatter），DDP 约 2Φ，比值约 1.5。", 20)
    from fsdp_lab.lessons.quiz.terminal import _columns
    assert all(sum(map(_columns, line)) <= 20 for line in zh.splitlines())
    assert "all-gather" in zh.replace("\n", " ")  # Latin words inside Chinese stay whole


def test_the_terminal_quiz_never_cuts_a_word_at_its_width(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "60")
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(tmp_path / "p.json")],
                              "\n".join(KEY) + "\n")
    assert code == 0
    long = [line for line in out.splitlines()  # the prompt with its echoed answer, and a path, may run over
            if len(line) > 60 and not line.startswith(("Progress saved to", "Your answer"))]
    assert not long, long[:3]


def test_seed_shuffles_and_the_shown_key_still_scores_full(monkeypatch, capsys, tmp_path):
    chapter = load_chapter_by_key("10")
    shown_key = [present(q, "en", 3).answer_letters for q in chapter.questions]
    assert shown_key != KEY
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--seed", "3", "--progress",
                                                    str(tmp_path / "p.json")], "\n".join(shown_key) + "\n")
    assert code == 0 and "Score: 10 / 10 (100%)" in out
    assert read_progress(tmp_path / "p.json").attempts[0].seed == 3


def test_new_chapter_with_numbers(monkeypatch, capsys, tmp_path):
    chapter = load_chapter_by_key("05")
    key = [q.answer_letters for q in chapter.questions]
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "zero", "--progress", str(tmp_path / "p.json")],
                              "\n".join(key) + "\n")
    assert code == 0 and "38.5 GB" in out and f"Score: {len(key)} / {len(key)} (100%)" in out


def test_unknown_chapter_and_listing(monkeypatch, capsys, tmp_path):
    progress = tmp_path / "p.json"
    code, _, err = run_inline(monkeypatch, capsys, ["quiz", "42", "--progress", str(progress)], "")
    assert code == 2 and "unknown chapter '42'; expected one of: 01, 02" in err
    run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(progress)], "A\nA\n")
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "--progress", str(progress)], "")
    assert code == 0
    assert "  10  Interview questions (10) — best 1 / 10, 1 attempt(s)" in out
    assert "  01  The core idea (4) — not tried yet" in out


def test_bad_bank_is_reported_not_raised(monkeypatch, capsys, tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "10-interview.yaml").write_text("questions: [\n", encoding="utf-8")
    code, _, err = run_inline(monkeypatch, capsys, ["quiz", "10", "--bank", str(bank), "--progress",
                                                    str(tmp_path / "p.json")], "")
    assert code == 1 and "10-interview.yaml" in err and "malformed YAML" in err


def test_corrupt_progress_file_is_moved_aside_and_the_quiz_goes_on(monkeypatch, capsys, tmp_path):
    progress = tmp_path / "p.json"
    progress.write_text("{oops", encoding="utf-8")
    code, out, err = run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(progress)],
                                "\n".join(KEY) + "\n")
    assert code == 0 and "Score: 10 / 10" in out
    assert f"Progress file {progress} could not be used" in err and ".corrupt-" in err
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("p.json.corrupt-")]
    assert len(moved) == 1 and moved[0].read_text(encoding="utf-8") == "{oops"
    assert read_progress(progress).attempts[0].score == 10


def make_progress(path, learner, attempts):
    data = {"schema_version": 1, "learner": learner, "attempts": [
        {"chapter": ch, "started": t, "finished": t, "lang": "en", "seed": None, "score": s, "max": m,
         "answered": m, "total": m, "complete": True, "answers": {}} for ch, s, m, t in attempts]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_scores_csv_for_a_class(monkeypatch, capsys, tmp_path):
    cls = tmp_path / "class"
    make_progress(cls / "ada.json", "ada", [("10", 7.5, 10, "2025-01-01T10:00:00+00:00"),
                                           ("10", 9.5, 10, "2025-01-02T10:00:00+00:00"),
                                           ("05", 4, 4, "2025-01-03T10:00:00+00:00")])
    make_progress(cls / "sub" / "progress.json", "bo", [("10", 3, 10, "2025-01-05T09:00:00+00:00")])
    (cls / "cy.json").write_text("{broken", encoding="utf-8")
    (cls / "dee.json").write_text(json.dumps({"schema_version": 9, "learner": "dee", "attempts": []}))
    out_csv = tmp_path / "out.csv"
    code, out, err = run_inline(monkeypatch, capsys, ["scores", str(cls), "--csv", str(out_csv)], "")
    assert code == 0
    assert out_csv.read_text(encoding="utf-8").splitlines() == [
        HEADER,
        '"ada.json","ada","05",4,4,1,"2025-01-03T10:00:00+00:00"',
        '"ada.json","ada","10",9.5,10,2,"2025-01-02T10:00:00+00:00"',
        '"sub/progress.json","bo","10",3,10,1,"2025-01-05T09:00:00+00:00"',
    ]
    assert "wrote 3 rows (2 learners)" in out and "skipped 2 unreadable file(s)" in out
    assert f"skipped {cls / 'cy.json'}: not valid JSON" in err
    assert f"skipped {cls / 'dee.json'}: schema_version is 9" in err
    assert (cls / "cy.json").read_text(encoding="utf-8") == "{broken"  # the instructor's copy is left alone


def test_scores_to_stdout_and_missing_dir(monkeypatch, capsys, tmp_path):
    make_progress(tmp_path / "a.json", "", [("01", 2, 4, "2025-01-01T00:00:00+00:00")])
    code, out, _ = run_inline(monkeypatch, capsys, ["scores", str(tmp_path)], "")
    # the name comes from the file name
    assert code == 0 and out.splitlines()[1] == '"a.json","a","01",2,4,1,"2025-01-01T00:00:00+00:00"'
    code, _, err = run_inline(monkeypatch, capsys, ["scores", str(tmp_path / "nope")], "")
    assert code == 2 and "is not a directory" in err


def test_an_unwritable_progress_path_is_refused_before_the_first_question(tmp_path):
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "p.json"
    result = run_process(["quiz", "10", "--progress", str(bad)], "\n".join(KEY) + "\n", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"fsdp-lab quiz: error: --progress {bad}: {tmp_path / 'file'} is a file, not a "
                                     f"directory; your answers could not be saved there")
    assert "Q1/10" not in result.stdout  # the learner typed nothing that is then lost


def test_an_empty_attempt_is_not_recorded_and_does_not_count(monkeypatch, capsys, tmp_path):
    progress = tmp_path / "p.json"
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "10", "--progress", str(progress)], "")
    assert code == 0 and "Nothing was answered, so no attempt is recorded." in out
    assert not progress.exists()
    make_progress(progress, "ada", [("10", 0, 10, "2025-01-01T10:00:00+00:00")])  # an old file holding one
    data = json.loads(progress.read_text())
    data["attempts"][0].update(answered=0, complete=False, answers={})
    progress.write_text(json.dumps(data))
    code, out, _ = run_inline(monkeypatch, capsys, ["quiz", "--progress", str(progress)], "")
    assert "  10  " in out and "not tried yet" in out.split("  10  ")[1].splitlines()[0]
    code, out, _ = run_inline(monkeypatch, capsys, ["scores", str(tmp_path)], "")
    assert out.splitlines() == [HEADER]


def test_scores_tells_learners_with_the_same_name_apart(monkeypatch, capsys, tmp_path):
    cls = tmp_path / "class"
    for who in ("pc01", "pc02", "pc03"):
        make_progress(cls / who / "progress.json", "root", [("10", 5, 10, "2025-01-01T10:00:00+00:00")])
    out_csv = tmp_path / "out.csv"
    code, out, _ = run_inline(monkeypatch, capsys, ["scores", str(cls), "--csv", str(out_csv)], "")
    assert code == 0 and "wrote 3 rows (3 learners)" in out
    assert [row[:2] for row in list(csv.reader(out_csv.open()))[1:]] == [
        ["pc01/progress.json", "root"], ["pc02/progress.json", "root"], ["pc03/progress.json", "root"]]


def test_scores_warns_about_an_empty_directory(monkeypatch, capsys, tmp_path):
    code, out, err = run_inline(monkeypatch, capsys, ["scores", str(tmp_path)], "")
    assert code == 0 and out.splitlines() == [HEADER]
    assert err.strip() == (f"warning: no quiz results under {tmp_path} "
                           f"(no progress .json files with an answered attempt)")
