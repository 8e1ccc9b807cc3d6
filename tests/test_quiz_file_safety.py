"""Progress files and class exports are files a user names: only regular files are read or replaced, reads are
bounded, an export never overwrites one of its inputs, CSV cells cannot run as formulas, learner text cannot
drive the terminal, and quiz processes saving to one file at once keep every attempt."""
import csv
import io
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.lessons.quiz.progress import READ_LIMIT, ProgressFileError, read_progress

REPO = Path(__file__).resolve().parents[1]
KEY = ["A", "B", "B", "C", "AB", "C", "AB", "A", "A", "AB"]


def fsdp_lab(args, tmp_path, stdin="", memory_gb=None):
    """The real command in a child process (a hang or a memory blow-up stays there: timeout, address-space cap)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}

    def cap():
        if memory_gb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_gb << 30, memory_gb << 30))

    return subprocess.run([sys.executable, "-m", "fsdp_lab", *map(str, args)], input=stdin, capture_output=True,
                          text=True, encoding="utf-8", errors="replace", cwd=REPO, env=env, timeout=240,
                          preexec_fn=cap)


def inline(monkeypatch, capsys, args, stdin=""):
    """The command in this process (fast); for cases that cannot hang or eat memory on any version."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def make_progress(path, learner, chapter="10", score=5.0, finished="2025-01-01T10:00:00+00:00"):
    attempt = {"chapter": chapter, "started": finished, "finished": finished, "lang": "en", "seed": None,
               "score": score, "max": 10, "answered": 10, "total": 10, "complete": True, "answers": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "learner": learner, "updated": finished,
                                "attempts": [attempt]}), encoding="utf-8")


def special_files(tmp_path):
    """{description: path} of things that are not regular files, made without root."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "to-pipe").symlink_to(fifo)
    (tmp_path / "folder").mkdir()
    found = {"a FIFO (named pipe)": fifo, "a symlink to": tmp_path / "to-pipe", "a directory": tmp_path / "folder"}
    if os.path.exists("/dev/null"):
        (tmp_path / "to-null").symlink_to("/dev/null")
        found["a symlink to /dev/null, a character device"] = tmp_path / "to-null"
    return found


def unchanged(path):
    st = os.lstat(path)
    return lambda: os.lstat(path)[:2] == st[:2]  # same mode and inode: not replaced


@pytest.mark.parametrize("flag", ["scores", "quiz"])
def test_a_path_that_is_not_a_regular_file_is_refused_and_left_alone(monkeypatch, capsys, tmp_path, flag):
    cls = tmp_path / "class"
    make_progress(cls / "ada.json", "ada")
    for what, path in special_files(tmp_path).items():
        still = unchanged(path)
        if flag == "scores":
            done = inline(monkeypatch, capsys, ["scores", cls, "--csv", path])
        else:  # the old quiz blocked reading the FIFO, or replaced the file it pointed at with its own
            done = inline(monkeypatch, capsys, ["quiz", "10", "--progress", path, "--name", "ada"],
                          "\n".join(KEY) + "\n")
        assert done.returncode == 2, (what, done.stdout, done.stderr)
        [line] = done.stderr.strip().splitlines()
        assert str(path) in line and what in line and "Traceback" not in line, line
        assert still(), f"{path} ({what}) was replaced"
    assert not list(tmp_path.glob("*.corrupt-*")) and not list(tmp_path.glob(".*.tmp"))


def test_an_unreadable_progress_file_is_moved_aside_only_if_it_is_a_regular_file(monkeypatch, capsys, tmp_path):
    """The quiz moves a bad file aside; through a symlink it moves the target, never the device behind one."""
    real = tmp_path / "real.json"
    real.write_text("{broken", encoding="utf-8")
    link = tmp_path / "p.json"
    link.symlink_to(real)
    done = inline(monkeypatch, capsys, ["quiz", "10", "--progress", link], "\n".join(KEY) + "\n")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and read_progress(link).attempts[0].score == 10  # the learner's link is kept
    [aside] = tmp_path.glob("real.json.corrupt-*")
    assert aside.read_text(encoding="utf-8") == "{broken"


def test_progress_reads_are_bounded(monkeypatch, capsys, tmp_path):
    """/dev/zero behind a symlink, or a huge file, is refused by name in well under a second per file; one
    learner's file cannot take down the instructor's export (the old code read /dev/zero until killed)."""
    cls = tmp_path / "class"
    make_progress(cls / "ada.json", "ada")
    (cls / "zero.json").symlink_to("/dev/zero")
    big = cls / "big.json"
    big.write_text('{"pad": "' + "x" * READ_LIMIT + '"}', encoding="utf-8")
    os.mkfifo(cls / "pipe.json")
    done = fsdp_lab(["scores", cls], tmp_path, memory_gb=4)
    assert done.returncode == 0, done.stderr
    assert list(csv.reader(done.stdout.splitlines()))[1][:2] == ["ada.json", "ada"]
    skipped = sorted(done.stderr.strip().splitlines())
    assert skipped == [
        f"skipped {big}: is {big.stat().st_size:,} bytes (2.0 MiB), over the {READ_LIMIT:,} bytes (2.0 MiB) limit "
        f"for this file; nothing was read",
        f"skipped {cls / 'pipe.json'}: is a FIFO (named pipe), not a regular file; nothing was read",
        f"skipped {cls / 'zero.json'}: is a symlink to /dev/zero, a character device, not a regular file; nothing "
        f"was read"]
    done = fsdp_lab(["quiz", "10", "--progress", cls / "zero.json"], tmp_path, "\n".join(KEY) + "\n", memory_gb=4)
    assert done.returncode == 2 and "Q1/10" not in done.stdout
    assert done.stderr.strip() == (f"fsdp-lab quiz: error: --progress {cls / 'zero.json'}: is a symlink to "
                                   f"/dev/zero, a character device; only a regular file is replaced, so it was "
                                   f"left alone; your answers could not be saved there")
    before = big.read_bytes()
    done = inline(monkeypatch, capsys, ["quiz", "10", "--progress", big], "\n".join(KEY) + "\n")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"fsdp-lab quiz: error: --progress {big}: is {len(before):,} bytes (2.0 MiB), over the {READ_LIMIT:,} bytes "
        f"(2.0 MiB) limit for this file; nothing was read")
    assert big.read_bytes() == before and not list(cls.glob("big.json.*"))  # neither replaced nor moved


@pytest.mark.parametrize("nested", ["[" * 100_000 + "]" * 100_000, '{"schema_version": ' + "9" * 5000 + "}"])
def test_json_that_python_cannot_convert_is_an_unreadable_file_not_a_crash(tmp_path, nested):
    path = tmp_path / "p.json"
    path.write_text(nested, encoding="utf-8")
    with pytest.raises(ProgressFileError, match=r"p.json: not a progress file \((its JSON is nested too deeply|"
                                                r"Exceeds the limit)"):
        read_progress(path)


def test_the_export_never_overwrites_one_of_its_inputs(monkeypatch, capsys, tmp_path):
    cls = tmp_path / "class"
    make_progress(cls / "ada.json", "ada")
    (cls / "bo.json").write_text("{unreadable, but still a learner's file", encoding="utf-8")
    os.link(cls / "ada.json", tmp_path / "hard.csv")
    (tmp_path / "soft.csv").symlink_to(cls / "bo.json")
    before = {p: p.read_bytes() for p in cls.iterdir()}
    for target, input_ in [(cls / "ada.json", cls / "ada.json"), (cls / "bo.json", cls / "bo.json"),
                           (tmp_path / "hard.csv", cls / "ada.json"), (tmp_path / "soft.csv", cls / "bo.json")]:
        done = inline(monkeypatch, capsys, ["scores", cls, "--csv", target])
        assert done.returncode == 2, done.stdout
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"fsdp-lab scores: error: {target}: is one of the inputs") and "--csv" in line
        if target != input_:
            assert f"({input_})" in line
    assert {p: p.read_bytes() for p in cls.iterdir()} == before


def test_csv_cells_cannot_run_as_formulas_and_names_cannot_drive_the_terminal(monkeypatch, capsys, tmp_path):
    cls = tmp_path / "class"
    names = ["=HYPERLINK(\"http://x\",\"ok\")", "+1+1", "-2+3", "@SUM(A1)", "\tindent", "\rreturn",
             "\x1b[2J\x1b]0;owned\x07cleared", "evil\u202etxt", "Ada, \"the\" first"]
    for i, name in enumerate(names):
        make_progress(cls / f"l{i}.json", name)
    (cls / "\x1b[31mred.json").write_text("{", encoding="utf-8")
    out = tmp_path / "out.csv"
    done = inline(monkeypatch, capsys, ["scores", cls, "--csv", out])
    assert done.returncode == 0, done.stderr
    rows = {row[0]: row[1] for row in csv.reader(out.open(encoding="utf-8"))}
    assert [rows[f"l{i}.json"] for i in range(len(names))] == [
        "'=HYPERLINK(\"http://x\",\"ok\")", "'+1+1", "'-2+3", "'@SUM(A1)", "\\x09indent", "\\x0dreturn",
        "\\x1b[2J\\x1b]0;owned\\x07cleared", "evil\\u202etxt", "Ada, \"the\" first"]
    text = out.read_text(encoding="utf-8")
    assert '"\'=HYPERLINK(""http://x"",""ok"")"' in text  # quoted, so the cell is text in any spreadsheet
    assert "\x1b" not in text and "\t" not in text and "\r" not in text
    shown = inline(monkeypatch, capsys, ["scores", cls])  # the table on the instructor's terminal, and the skip line
    assert shown.returncode == 0
    for stream in (shown.stdout, shown.stderr, done.stdout, done.stderr):
        assert not any(ch in stream for ch in "\x1b\x07\r\u202e"), repr(stream)
    assert f"skipped {cls}/\\x1b[31mred.json: not valid JSON" in shown.stderr


CONCURRENT_SAVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fsdp_lab.lessons.quiz.progress import Attempt, ProgressStore
    path, who, n, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    store = ProgressStore(path)
    for i in range(n):
        stamp = f"2025-01-01T10:{i:02d}:00+00:00"
        store.record(Attempt(chapter="10", started=f"{who}-{i}", finished=stamp, lang="en", seed=None, score=1.0,
                             max=10, answered=1, total=10, complete=False), who)
    print("saved", n)
""")


def test_concurrent_quiz_processes_keep_every_attempt(tmp_path):
    """Four processes save 15 attempts each to one file, all at once: 60 attempts, none lost (the old code
    re-read, appended and replaced without a lock, so each save dropped what others had saved meanwhile)."""
    path, go, procs, n = tmp_path / "p.json", tmp_path / "go", [], 15
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for who in "abcd":
        procs.append(subprocess.Popen([sys.executable, "-c", CONCURRENT_SAVER, path, who, str(n), go], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    go.touch()
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.strip() == f"saved {n}", err
    started = sorted(a.started for a in read_progress(path).attempts)
    assert started == sorted(f"{who}-{i}" for who in "abcd" for i in range(n))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p.json.lock", "go", "p.json"]


def test_the_progress_file_is_never_one_of_the_bank_files(monkeypatch, capsys, tmp_path):
    """Any output is checked against the command's inputs: a progress path naming a bank file (through a link
    too) would have been moved aside as "not JSON", taking the chapter away."""
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "10-interview.yaml").write_bytes((REPO / "quizzes" / "10-interview.yaml").read_bytes())
    (tmp_path / "p.json").symlink_to(bank / "10-interview.yaml")
    before = (bank / "10-interview.yaml").read_bytes()
    for path in (bank / "10-interview.yaml", tmp_path / "p.json"):
        done = inline(monkeypatch, capsys, ["quiz", "10", "--bank", bank, "--progress", path], "\n".join(KEY) + "\n")
        assert done.returncode == 2 and "Q1/10" not in done.stdout
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"fsdp-lab quiz: error: --progress {path}: is one of the inputs"), line
    assert (bank / "10-interview.yaml").read_bytes() == before and sorted(p.name for p in bank.iterdir()) == [
        "10-interview.yaml"]
