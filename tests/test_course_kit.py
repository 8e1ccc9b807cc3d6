"""The workshop kit in course/: student copies, syllabus arithmetic, instructor notes, slides, multi-node scripts.

Everything here is checked against the real code: exercise checks run, every `fsdp-lab train` command in the
kit parses with the real CLI parser, the one-machine two-node rehearsal runs, and a slide deck is built.
"""
import importlib.util
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.commands import train as train_cmd
from fsdp_lab.training.launch import free_port

REPO = Path(__file__).resolve().parents[1]
COURSE = REPO / "course"
sys.path.insert(0, str(COURSE))
import make_student_copies as msc  # noqa: E402  (course/ is not a package)

EXERCISES = sorted(p for p in (COURSE / "exercises").glob("ex*.py"))
CHAPTERS = [f"{i:02d}" for i in range(7)] + ["06a", "06b", "06c"] + [f"{i:02d}" for i in range(7, 10)] + ["09a", "10"]  # 06a: after 06


def _solution_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.strip() == msc.BEGIN:
            current = []
        elif line.strip() == msc.END:
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    msc.make_student_copies(COURSE / "exercises", out)
    return out


def test_there_are_exercises_with_solutions():
    assert len(EXERCISES) >= 5
    for path in EXERCISES:
        assert _solution_blocks(path.read_text()), f"{path.name} has no solution block"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_student_copy_has_no_solution(student_dir, path):
    teacher, student = path.read_text(), (student_dir / path.name).read_text()
    assert msc.BEGIN not in student and msc.END not in student and msc.HINT not in student
    outside = "\n".join(line for line in teacher.splitlines()
                        if not any(line in block for block in _solution_blocks(teacher)))
    for block in _solution_blocks(teacher):
        for line in block:
            code = line.strip()
            if len(code) > 8 and code not in outside:
                assert code not in student, f"{path.name}: solution line {code!r} left in the student copy"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_student_copy_imports_and_its_stubs_raise_with_a_hint(student_dir, path):
    module = _import(student_dir / path.name, f"student_{path.stem}")  # runs all non-exercise code
    stubs = [fn for name, fn in vars(module).items() if inspect.isfunction(fn) and not name.startswith("check_")
             and "raise NotImplementedError" in inspect.getsource(fn)]
    assert len(stubs) == len(_solution_blocks(path.read_text())), f"{path.name}: one stub per solution"
    for fn in stubs:
        with pytest.raises(NotImplementedError, match=rf"{path.stem} {fn.__name__}\(\): \S+"):
            fn(*[None] * len(inspect.signature(fn).parameters))


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_student_copy_runs_and_reports_todo(student_dir, path):
    done = subprocess.run([sys.executable, path.name], cwd=student_dir, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "TODO" in done.stdout and "not implemented yet" in done.stdout and "FAIL" not in done.stdout


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_teacher_copy_passes_its_checks(path):
    done = subprocess.run([sys.executable, path.name], cwd=path.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout


@pytest.mark.parametrize("text, problem", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "never closed"),
    ("def f():\n    return 1\n    ### END SOLUTION\n", "without a ### BEGIN SOLUTION"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function body"),
    ("def f():\n    ### HINT: try\n    return 1\n", "must come right before"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n", "inside the solution opened on line 2"),
])
def test_bad_markers_are_refused_with_the_line(text, problem):
    with pytest.raises(msc.MarkerError, match=re.escape(problem)):
        msc.strip_solutions(text, "exbad.py")


def test_make_student_copies_cli(tmp_path):
    assert msc.main(["--out", str(tmp_path / "s")]) == 0
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(
        [p.name for p in EXERCISES] + ["_package.py", "README.md", "notebooks"])
    assert sorted(p.name for p in (tmp_path / "s" / "notebooks").iterdir()) == sorted(
        p.name for p in (REPO / "notebooks").glob("*.ipynb"))


# -- the exercises' checks are the package's ----------------------------------------------------------------
def _wrong_pieces(numel, n):
    size = -(-numel // n)
    return [(r * size, (r + 1) * size) for r in range(n)]  # the padded in-memory layout


def _wrong_reads(numel, saved_n, new_n, rank):
    size = -(-numel // new_n)
    lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
    return [(s, max(lo, a), min(hi, b)) for s, (a, b) in
            enumerate((min(r * -(-numel // saved_n), numel), min((r + 1) * -(-numel // saved_n), numel))
                      for r in range(saved_n))]  # keeps the empty overlaps


def _root_regathered(units, n, pb, rb):
    return sum(v * pb * (n - 1) // n * 2 + v * rb * (n - 1) // n for v in units.values())


WRONG = [  # (exercise, function, wrong version, check, words the message must say)
    ("ex01_memory", "zero_bytes", lambda phi, n, stage: 16 * phi / n, "check_zero_stages",
     "stage 1, Φ = 7,000,000,000 on 8 GPUs: you predicted 14,000,000,000 B but rank 0 holds 63,000,000,000 B"),
    ("ex01_memory", "zero_bytes", lambda phi, n, stage: 16 * phi / n, "check_zero_stages",
     "that is ZeRO-3's: everything is sharded"),
    ("ex01_memory", "ddp_bytes", lambda phi: 8 * phi, "check_ddp", "AdamW's two moments are missing"),
    ("ex01_memory", "zero_bytes", lambda phi, n, stage: 16 * phi, "check_against_a_measurement",
     "that is the whole model's state: each of the 2 ranks keeps only 1/2 of parameters, gradients, AdamW state"),
    ("ex01_memory", "n_min", lambda phi, gpu: int(16 * phi // gpu), "check_n_min", "rounded down"),
    ("ex02_sharding", "padded_size", lambda numel, n: numel // n * n, "check_padding",
     "49,408 elements on 3 ranks: you say 49407, the runtime pads to 49,410"),
    ("ex02_sharding", "shard_range", lambda numel, n, r: (r * (numel // n), (r + 1) * (numel // n)), "check_ranges",
     "unit blocks.0 (49,408 elements on 3 ranks): you say rank 0 holds [0, 16,469), its shard is "
     "[0, 16,470); every chunk has padded_size / n = 49,410 / 3 = 16,470 elements (the padding counts)"),
    ("ex02_sharding", "owners", lambda slots, name, n: [0], "check_owners", "a parameter can straddle two ranks"),
    ("ex02_sharding", "gather_bytes_sent", lambda numel, n, w: numel * w, "check_gather_bytes_against_the_trace",
     "that is the whole buffer: each rank already holds its own 1/N"),
    ("ex03_lifecycle", "step_events", lambda blocks, s: [("gather", "<root>")] + [("gather", b) for b in blocks],
     "check_full_shard_order", "beat 3 of step 1: you say gather:blocks.1, rank 0's trace has free:blocks.0"),
    ("ex03_lifecycle", "bytes_sent_per_step", _root_regathered, "check_bill_against_the_trace",
     "the root is not re-gathered: it stays gathered from its forward to its backward"),
    ("ex06_checkpoint", "pieces", _wrong_pieces, "check_pieces",
     "that is the padded layout the shards have in memory; the checkpoint stores unpadded pieces"),
    ("ex06_checkpoint", "reads", _wrong_reads, "check_everything_is_read_once", "read nothing: leave out empty"),
    ("ex08_minifsdp", "shard", lambda layer, n: __import__("numpy").array_split(layer, n), "check_round_trip",
     "your chunks have [1025, 1024, 1024, 1024] elements, each should have 1,025 (padded to 4,100)"),
    ("ex08_minifsdp", "reduce_scatter_mean",
     lambda grads, n: [c * n for c in __import__("numpy").split(__import__("numpy").pad(
         __import__("numpy").mean(grads, axis=0), (0, -len(grads[0]) % n)), n)],
     "check_reduce_scatter", "that is the sum of the ranks' chunks: divide by world_size=4"),
    ("ex08_minifsdp", "all_gather", lambda chunks, numel: __import__("numpy").concatenate(chunks),
     "check_round_trip", "3 padding element(s) are still on the end: cut to numel"),
]


@pytest.mark.parametrize("exercise, name, wrong, check, says", WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_a_wrong_solution_is_told_what_is_wrong(exercise, name, wrong, check, says):
    """Each exercise's check, given a usual mistake, fails with a message naming it (fsdp_lab's checks say it)."""
    module = _import(COURSE / "exercises" / f"{exercise}.py", f"wrong_{exercise}_{name}")
    verdict = getattr(module, check)()
    assert verdict.ok, verdict  # the reference solution passes
    setattr(module, name, wrong)
    verdict = getattr(module, check)()
    assert not verdict.ok and not verdict.todo and says in verdict.message, verdict.message


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_checks_are_the_packages(path):
    """No check logic of its own: every check_* hands back a Verdict of fsdp_lab's checks, and none asserts."""
    from fsdp_lab.lessons.live.checks import Verdict

    source = path.read_text()
    assert "assert " not in source and "AssertionError" not in source, path.name
    module = _import(path, f"own_{path.stem}")
    found = [fn for name, fn in vars(module).items() if name.startswith("check_")]
    assert found and all(isinstance(fn(), Verdict) for fn in found), path.name


def test_a_learners_wrong_file_reports_from_the_terminal(student_dir, tmp_path):
    """`python ex02_sharding.py` on a learner's file: FAIL, with what is wrong, and exit code 1."""
    text = (student_dir / "ex02_sharding.py").read_text()
    stub = re.search(r"( *)raise NotImplementedError\('ex02_sharding shard_range\(\).*\)\n", text)
    learner = text.replace(stub.group(0), f"{stub.group(1)}return rank * (numel // n), (rank + 1) * (numel // n)\n")
    for name in ("ex02_sharding.py", "_package.py"):
        (tmp_path / name).write_text(learner if name.startswith("ex") else (student_dir / name).read_text())
    done = subprocess.run([sys.executable, "ex02_sharding.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "FAIL  On 3 ranks the tiny block is cut" in done.stdout
    assert "every chunk has padded_size / n" in done.stdout and "1 failed, 3 not implemented yet" in done.stdout


# -- syllabus -----------------------------------------------------------------------------------------------
def _syllabus_rows():
    rows = {}
    for line in (COURSE / "syllabus.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d\d[a-z]?|—|", cells[0]) and cells[3].strip("*").isdigit():
            rows[cells[0] or cells[1].strip("*")] = (cells[1], int(cells[3].strip("*")), int(cells[4].strip("*")))
    return rows


def test_syllabus_has_every_chapter_and_the_minutes_add_up():
    rows = _syllabus_rows()
    total = rows.pop("Total")
    assert [k for k in rows if k != "—"] == CHAPTERS
    chapters = [v for k, v in rows.items() if k != "—"]
    assert all(half > 0 and full > 0 for _t, half, full in chapters)
    others = [(t, h, f) for line in (COURSE / "syllabus.md").read_text().splitlines()
              if line.startswith("| — |") for t, h, f in [_row(line)]]
    assert sum(h for _t, h, _f in chapters + others) == total[1] == 210
    assert sum(f for _t, _h, f in chapters + others) == total[2] == 480


def _row(line):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return cells[1], int(cells[3]), int(cells[4])


@pytest.mark.parametrize("plan, start, end", [("Half day", "09:00", "12:30"), ("Full day", "09:00", "17:00")])
def test_clock_schedules_are_consistent(plan, start, end):
    text = (COURSE / "syllabus.md").read_text()
    section = text.split(f"## {plan} ")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\d\d:\d\d) \| (.+?) \| *(\d*) *\|$", section, re.M)
    minutes = [int(t[:2]) * 60 + int(t[3:]) for t, _item, _m in rows]
    assert rows[0][0] == start and rows[-1][0] == end and rows[-1][2] == ""
    for (t, item, dur), nxt in zip(rows, minutes[1:]):
        assert minutes[rows.index((t, item, dur))] + int(dur) == nxt, f"{plan}: {t} {item} + {dur} min"
    chapters_in_plan = [item.split()[0] for _t, item, _m in rows if re.match(r"\d\d[a-z]? ", item)]
    assert chapters_in_plan == CHAPTERS


def test_every_notebook_is_in_the_syllabus_and_has_notes():
    notes = {p.name.split("-", 1)[0]: p for p in (COURSE / "instructor-notes").glob("[0-9][0-9]*-*.md")}
    assert sorted(notes) == CHAPTERS
    syllabus = (COURSE / "syllabus.md").read_text()
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]*-*.ipynb")):
        number = nb.name.split("-", 1)[0]
        assert number in notes
        assert f"| {number} |" in syllabus


# -- instructor notes ---------------------------------------------------------------------------------------
def test_notes_of_every_chapter_calling_fsdp1_say_it_is_legacy():
    """Where a notebook calls FSDP(...) (torch's legacy FSDP1 API), its notes say so and name fully_shard and
    chapter 06a, as the notebook does."""
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]*-*.ipynb")):
        number = nb.name.split("-", 1)[0]
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        if number == "06a" or not any(c["cell_type"] == "code" and re.search(r"\bFSDP\(", "".join(c["source"]))
                                      for c in cells):
            continue
        text = next((COURSE / "instructor-notes").glob(f"{number}-*.md")).read_text()
        assert re.search(r"\blegacy\b", text) and "fully_shard" in text and "06a" in text, \
            f"notes {number}: the notebook calls FSDP(...) but the notes do not say FSDP1 is legacy"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_instructor_notes_have_the_four_parts_and_sourced_numbers(chapter):
    path = next((COURSE / "instructor-notes").glob(f"{chapter}-*.md"))
    text = path.read_text()
    for heading in ("## Goals", "## Live demo", "## Common questions", "## Numbers to expect"):
        assert heading in text, f"{path.name}: no '{heading}'"
    numbers = text.split("## Numbers to expect")[1]
    assert "**CPU" in numbers and "**GPU" in numbers, f"{path.name}: say what to expect on CPU and on a GPU"
    gpu = numbers.split("**GPU")[1]
    if re.search(r"\d+(\.\d+)? ?(ms|GiB|GB|MB)", gpu):
        assert "benchmarks/RESULTS.md" in gpu, f"{path.name}: GPU figures must cite benchmarks/RESULTS.md"
    measured = (COURSE / "measurements.md").read_text()
    for ref in set(re.findall(r"\bM(\d+)\b", text)):
        assert f"## M{ref} ·" in measured, f"{path.name} cites M{ref}, which measurements.md lacks"


def _gpu_section_of_results() -> str:
    results = REPO / "benchmarks" / "RESULTS.md"
    assert results.is_file(), "benchmarks/RESULTS.md is missing: the notes' GPU figures must come from it"
    return results.read_text().split("\n## GPU")[1].split("\n## ")[0]


def test_gpu_figures_in_the_notes_are_in_benchmarks_results():
    """Every GPU figure the kit quotes is one RESULTS.md's GPU section really contains; while that section says
    "not yet measured", the notes must say so too and quote none. Nothing cites a file the repo lacks."""
    section = _gpu_section_of_results()
    measured = "NOT YET MEASURED" not in section.upper().split("\n")[0]
    for path in sorted((COURSE / "instructor-notes").glob("*.md")) + [COURSE / "measurements.md"]:
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path.name} cites DESIGN.md, which is not in the repository"
        gpu = text.split("**GPU")[-1] if "**GPU" in text else ""
        figures = re.findall(r"(\d+(?:\.\d+)?) ?(?:ms|GiB|GB|MB)\b", gpu)
        for figure in figures:
            assert figure in section, f"{path.name}: GPU figure {figure} is not in benchmarks/RESULTS.md"
        if gpu and not measured:
            assert "not yet measured" in gpu.lower() or gpu.lower().startswith(".** none"), \
                f"{path.name}: RESULTS.md has no GPU figures yet; the notes' GPU part must say so"


# -- commands in the kit ------------------------------------------------------------------------------------
SHELL_VALUES = {"NNODES": "2", "NODE_RANK": "0", "HEAD": "node001", "PORT": "29500", "GPUS": "8", "CKPT": "/ck",
                "SLURM_NNODES": "2", "SLURM_NODEID": "1", "s": "FULL_SHARD", "STRATEGY": "ZERO1",
                "RDZV_BACKEND": "c10d", "RDZV_ID": "job", "DEVICE": "cuda", "PRESET": "369m", "PRECISION": "bf16",
                "BATCH": "16", "STEPS": "200", "EVERY": "50"}


def _train_commands():
    found = []
    for path in sorted(COURSE.rglob("*")):
        if path.suffix not in (".md", ".sh", ".sbatch") or "student" in path.parts:
            continue
        lines = path.read_text().splitlines()
        if path.suffix != ".md":  # shell comments mention the command in prose
            lines = [line for line in lines if not line.lstrip().startswith("#")]
        text = "\n".join(lines).replace("\\\n", " ")
        for match in re.finditer(r"(?:fsdp-lab|\"\$\{FSDP_LAB\[@\]\}\") train\b([^`\n']*)", text):
            found.append((path.relative_to(COURSE), match.group(1).split(";")[0].replace('"$@"', "")))
    return found


@pytest.mark.parametrize("where, args", _train_commands(), ids=lambda v: str(v)[:60])
def test_every_fsdp_lab_train_command_in_the_kit_parses(where, args):
    expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VALUES[m.group(1)], args.split(" #")[0])
    argv = shlex.split(expanded.split(" > ")[0].split(" && ")[0].replace("[", "").replace("]", ""))
    if argv == ["--help"]:
        return
    parsed = cli.build_parser().parse_args(["train", *argv])
    cfg = train_cmd.config_from_args(parsed)
    assert cfg.global_batch % (parsed.nproc_per_node * parsed.nnodes) == 0, f"{where}: {args}"
    if parsed.nnodes > 1:
        assert parsed.rdzv_endpoint, f"{where}: a multi-node command without --rdzv-endpoint"


def test_commands_were_found():
    places = {str(w) for w, _a in _train_commands()}
    assert {"multinode/torchrun_two_nodes.sh", "multinode/slurm_fsdp_lab.sbatch", "checklist.md",
            "measurements.md", "instructor-notes/06-engineering.md"} <= places


def test_shell_scripts_are_valid_bash():
    for path in list(COURSE.rglob("*.sh")) + list(COURSE.rglob("*.sbatch")):
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{path}: {done.stderr}"


def test_two_nodes_on_one_machine(tmp_path):
    env = {**os.environ, "FSDP_LAB": f"{sys.executable} -m fsdp_lab", "PORT": str(free_port()),
           "OUT": str(tmp_path), "STEPS": "4"}
    proc = subprocess.Popen(["bash", str(COURSE / "multinode" / "local_two_nodes.sh")], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out + (tmp_path / "node1.log").read_text()
    import json
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in log] == [2] * 4
    # the single-node 4-rank losses of measurements.md M8: two nodes of one rank follow the same curve
    expected = [5.561367034912109, 5.556169509887695, 5.542728900909424, 5.538495063781738]
    assert [r["loss"] for r in log] == pytest.approx(expected, rel=1e-5)


def _rehearse(out: Path, **env) -> list[dict]:
    """One run of local_two_nodes.sh (two torchrun_two_nodes.sh launchers); the per-step log it wrote."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FSDP_LAB": f"{sys.executable} -m fsdp_lab", "PORT": str(free_port()), "OUT": str(out),
           **env}
    proc = subprocess.Popen(["bash", str(COURSE / "multinode" / "local_two_nodes.sh")], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    node1 = out / "node1.log"
    assert proc.returncode == 0, output + (node1.read_text() if node1.exists() else "")
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()], output


def test_hybrid_shard_on_two_torchrun_nodes_resumes_exactly(tmp_path):
    """HYBRID_SHARD on 2 "nodes" x 2 ranks through torchrun's c10d rendezvous (torchrun assigns the node ranks):
    a run saved after 2 steps and resumed to 4 follows the uninterrupted run's losses exactly."""
    hsdp = {"NPROC": "2", "STRATEGY": "HYBRID_SHARD", "RDZV_BACKEND": "c10d", "EVERY": "2"}
    whole, _ = _rehearse(tmp_path / "whole", STEPS="4", CKPT=str(tmp_path / "whole" / "ckpt"), **hsdp)
    resumed = tmp_path / "resumed"
    first, _ = _rehearse(resumed, STEPS="2", CKPT=str(resumed / "ckpt"), **hsdp)
    assert (resumed / "ckpt" / "step_00000002").is_dir()
    (resumed / "log.jsonl").unlink()
    second, output = _rehearse(resumed, STEPS="4", CKPT=str(resumed / "ckpt"), RDZV_ID="second", **hsdp)
    assert "resumed from step 2" in output + (resumed / "node1.log").read_text()
    assert [r["world_size"] for r in whole] == [4] * 4 and [r["step"] for r in second] == [3, 4]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in whole], (first, second, whole)
    # sharded 2 ways inside a node, not 4 ways: each rank holds half of the tiny GPT's 119,424 fp32 parameters
    assert {r["memory"]["params_sharded"] for r in whole} == {119_424 // 2 * 4}
    # and HSDP's mean over 4 ranks is FULL_SHARD's over 4 (measurements.md M8's single-node curve)
    expected = [5.561367034912109, 5.556169509887695, 5.542728900909424, 5.538495063781738]
    assert [r["loss"] for r in whole] == pytest.approx(expected, rel=1e-5)


def test_slides_build_from_a_notebook(tmp_path):
    notebooks = sorted((REPO / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    if not notebooks:
        pytest.skip("no notebook yet")
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(COURSE / "make_slides.sh"), str(notebooks[0])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    deck = tmp_path / (notebooks[0].stem + ".slides.html")
    assert deck.is_file() and "reveal" in deck.read_text()
    assert "jupyter nbconvert --to slides" in (COURSE / "slides.md").read_text()


def test_checklist_covers_the_lab_server():
    text = (COURSE / "checklist.md").read_text()
    for needle in ("nvidia-smi", "torch.cuda.nccl.version()", "NCCL_DEBUG=INFO", "29500", "ss -ltn",
                   "fsdp-lab check", "fsdp-lab lab", "/dev/shm"):
        assert needle in text, needle
