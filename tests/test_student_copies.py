"""The learner's copies of the chapters (fsdp_lab.lessons.student_copy): every "Your turn" exercise cell of the
repository's (solved) notebooks has its solution marked, the copy holds stubs and none of the solutions' text,
the stubs run on live ranks and say "not written yet", the launcher opens the copies, and the "show the
solution" button reads the solution from the solved notebook."""
from __future__ import annotations

import json
import re
import shutil
import shlex
import sys
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.commands import lab
from fsdp_lab.lessons import student_copy as sc

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
WITH_EXERCISES = [p for p in PATHS if not p.name.startswith("00-")]  # 00 shows the live ranks, asks nothing


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _text(cell) -> str:
    return sc._text(cell["source"])


def your_turn_cells(nb: dict) -> list:
    """The cells of the "## Your turn" section, in order."""
    out, inside = [], False
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown" and _text(cell).startswith("## "):
            inside = "Your turn" in _text(cell)
        if inside:
            out.append(cell)
    return out


def _flat(text: str) -> str:
    return " ".join(text.split())


def distinctive_lines(block: str) -> list:
    """The lines of one solution that give it away, whitespace collapsed and a trailing comment dropped: not
    blank, not a comment, a markdown fence or a label ending in ":" (`for b in blocks:`, `FSDP2:`: the frame
    around an answer, which the text and the stub show too), and longer than a lone bracket or `return x`."""
    out = []
    for line in block.splitlines():
        code = _flat(line.split("  #")[0])
        if len(code) > 10 and not code.startswith(("#", "```")) and not code.endswith(":"):
            out.append(code)
    return out


def _shown(cell) -> str:
    """Everything a cell of a copy shows: its text and its saved outputs (text, HTML with its tags and entities)."""
    import html

    parts = [_text(cell)]
    for out in cell.get("outputs", []):
        parts.append(sc._text(out.get("text", "")))
        for value in out.get("data", {}).values():
            if isinstance(value, (str, list)):
                parts.append(html.unescape(re.sub(r"<[^>]+>", " ", sc._text(value))))
    return _flat("\n".join(parts))


def leaks(nb: dict, name: str = "<notebook>") -> list:
    """Where the learner's copy of a notebook shows a solution's distinctive line: (solution's cell, line, the
    copy's cell that shows it)."""
    copy = sc.student_notebook(nb, name)
    shown = [(c["id"], _shown(c)) for c in copy["cells"]]
    return [(cell_id, line, where) for cell_id, blocks in sc.solutions_of(nb, name).items() for block in blocks
            for line in distinctive_lines(block) for where, text in shown if line in text]


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_every_chapter_marks_its_exercises_in_your_turn(path):
    nb = _load(path)
    marked = sc.exercise_cells(nb)
    assert marked, f"{path.name}: no cell of its Your turn section has a ### BEGIN SOLUTION block"
    ids = {c["id"] for c in your_turn_cells(nb)}
    assert all(c["id"] in ids for c in marked), f"{path.name}: a marked cell outside Your turn"
    for cell in your_turn_cells(nb):  # an "← yours" left in a cell means a solution nobody marked
        if cell["cell_type"] == "code" and "← yours" in _text(cell):
            assert cell in marked and all("← yours" not in b for b in sc.solutions_of(nb)[cell["id"]]), \
                f"{path.name} cell {cell['id']}: '← yours' outside a ### STUB line"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_the_copy_has_stubs_and_no_solution_and_every_other_cell_as_it_was(path):
    nb = _load(path)
    copy = sc.student_notebook(nb, path.name)
    text = "\n".join(_text(c) for c in copy["cells"] if c["cell_type"] == "code")
    assert sc.BEGIN not in text and sc.END not in text and sc.STUB not in text
    marked = {c["id"] for c in sc.marked_cells(nb)}
    by_id = {c["id"]: c for c in copy["cells"]}
    for cell in nb["cells"]:
        got = by_id[cell["id"]]
        if cell["id"] not in marked:
            assert got == cell, f"{path.name}: cell {cell['id']} changed in the copy"
            continue
        if cell["cell_type"] == "markdown":  # a note: only its marked part is gone
            assert sc.BEGIN not in _text(got) and "<!--" not in _text(got), _text(got)
        else:
            assert got["outputs"] == [] and got["execution_count"] is None
            assert "raise NotImplementedError(" in _text(got) or re.search(r"= None  # ← your", _text(got)), \
                _text(got)
        after = copy["cells"][copy["cells"].index(got) + 1]
        assert f"show_solution({cell['id']!r})" in _text(after) and after["id"] == f"{cell['id']}-solution"
    assert [c["id"] for c in copy["cells"] if not c["id"].endswith("-solution")] == [c["id"] for c in nb["cells"]]
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.from_dict(copy))  # JupyterLab opens it


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_no_solution_shows_anywhere_else_in_the_copy(path):
    """Not in a note, another cell, or a saved output: a solution is reachable through its button only."""
    found = leaks(_load(path), path.name)
    assert not found, f"{path.name}: the learner's copy shows solution lines outside their markers:\n" + "\n".join(
        f"  solution of {cell}: {line!r} in cell {where}" for cell, line, where in found)


def test_the_leak_check_finds_an_answer_in_a_note_and_in_an_output():
    """The check itself, on the legacy note before it was marked and on an output that prints the answer."""
    nb = _load(NOTEBOOKS / "01-core-idea.ipynb")
    note = next(c for c in nb["cells"] if c["id"] == "legacy-01")
    note["source"] = [line for line in note["source"] if "<!--" not in line]  # the note, its markers removed
    assert ("yourturn-01-03", "model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}))", "legacy-01") in leaks(nb)
    nb = _load(NOTEBOOKS / "01-core-idea.ipynb")
    other = next(c for c in nb["cells"] if c["cell_type"] == "code" and c["id"] not in sc.solutions_of(nb))
    other["outputs"] = [{"output_type": "display_data", "metadata": {},
                         "data": {"text/html": "<pre>predicted = 16 * phi / world_size</pre>"}}]
    assert [where for cell, _, where in leaks(nb) if cell == "yourturn-01-07"] == [other["id"]]
    assert distinctive_lines("for b in blocks:  # the forward\n    events += [x]  # mine\n```python\nFSDP2:") == [
        "events += [x]"]


def test_make_student_copies_writes_every_chapter_without_its_solutions(tmp_path):
    sys.path.insert(0, str(NOTEBOOKS.parent / "course"))
    try:
        import make_student_copies as msc
    finally:
        sys.path.remove(str(NOTEBOOKS.parent / "course"))
    assert msc.main(["--out", str(tmp_path / "s")]) == 0
    for path in PATHS:
        written = (tmp_path / "s" / "notebooks" / path.name).read_text(encoding="utf-8")
        assert json.loads(written) == sc.student_notebook(_load(path), path.name)


CELL = """%%ranks
x = 1
### STUB: y = None  # ← yours
### BEGIN SOLUTION
y = 2 * x
### END SOLUTION
def f():
    ### BEGIN SOLUTION
    return 3
    ### END SOLUTION
print(y)"""


def test_a_cell_keeps_its_stub_or_gets_raise_not_implemented_at_the_markers_indentation():
    student, solutions = sc.split_cell(CELL)
    assert solutions == ["y = 2 * x", "    return 3"]
    assert student.splitlines() == ["%%ranks", "x = 1", "y = None  # ← yours", "def f():",
                                    f"    {sc.DEFAULT_STUB}", "print(y)"]


@pytest.mark.parametrize("text,problem", [
    ("### BEGIN SOLUTION\nx = 1", "is never closed"),
    ("x = 1\n### END SOLUTION", "without a ### BEGIN SOLUTION"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside the solution"),
    ("### STUB: x = None\nx = 1", "must come right before"),
    ("if True:\n### BEGIN SOLUTION\n    x = 1\n### END SOLUTION", "not valid Python"),
])
def test_bad_markers_are_refused_with_the_line(text, problem):
    with pytest.raises(sc.MarkerError, match=re.escape(problem)):
        sc.split_cell(text, "cell")


# -- the launcher opens the copies --------------------------------------------------------------------------------
def _dry_run(capsys, *argv):
    assert cli.main(["lab", "--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_lab_opens_the_learners_copies_and_solved_opens_the_solved_ones(capsys):
    argv = _dry_run(capsys)
    assert f"--notebook-dir={NOTEBOOKS.parent / lab.LEARNER_DIR}" in argv
    assert f"--notebook-dir={NOTEBOOKS}" in _dry_run(capsys, "--solved")


def test_learner_copies_are_written_once_and_the_learners_work_is_kept(tmp_path):
    solved = tmp_path / "notebooks"
    solved.mkdir()
    for path in PATHS[:3]:
        shutil.copy(path, solved / path.name)
    folder, written = lab.learner_copies(solved)
    assert folder == tmp_path / lab.LEARNER_DIR and sorted(p.name for p in written) == [p.name for p in PATHS[:3]]
    mine = folder / PATHS[1].name
    mine.write_text("my work", encoding="utf-8")
    (folder / PATHS[2].name).unlink()
    _, written = lab.learner_copies(solved)
    assert [p.name for p in written] == [PATHS[2].name] and mine.read_text(encoding="utf-8") == "my work"


# -- the solution button ------------------------------------------------------------------------------------------
def test_the_button_shows_one_exercises_solution_read_from_the_solved_notebook(tmp_path):
    pytest.importorskip("ipywidgets")
    from fsdp_lab.lessons.widgets import show_solution

    nb = _load(NOTEBOOKS / "06a-fsdp2.ipynb")
    (cell_id, blocks), *others = sc.solutions_of(nb).items()
    button = show_solution(cell_id)
    assert not button.shown and blocks[0].strip().splitlines()[0] not in repr(button.get_state())
    button.button.click()
    assert button.shown and all(line.split("#")[0].strip().replace('"', "&quot;") in button.body.value
                                for line in blocks[0].splitlines() if line.strip())
    other = sc.solutions_of(nb)[others[0][0]][0].strip().splitlines()[0]
    assert other.split("#")[0].strip() not in button.body.value  # one exercise at a time
    button.button.click()
    assert not button.shown

    moved = tmp_path / "nowhere"
    moved.mkdir()
    lost = show_solution(cell_id, source_dir=moved)
    lost.toggle()
    assert "cannot be read" in lost.body.value and "no instructor notebooks" in lost.body.value


# -- the stubs on live ranks: each exercise cell says "not written yet" ---------------------------------------------
@pytest.fixture(scope="module")
def ranks():
    pytest.importorskip("ipyparallel")
    from fsdp_lab.lessons.live import Ranks

    handle = Ranks(2, timeout_s=120, start_timeout_s=150)
    handle.start()
    yield handle
    handle.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_each_stub_run_on_live_ranks_says_not_written_yet(ranks, path):
    """The Your turn section's %%ranks cells in order, as the learner's copy has them; after each stubbed cell
    its solution runs, so the next exercise starts from the state it expects."""
    nb = _load(path)
    copy = {c["id"]: c for c in sc.student_notebook(nb, path.name)["cells"]}
    marked = {c["id"] for c in sc.exercise_cells(nb)}
    seen = 0
    for cell in your_turn_cells(nb):
        source = _text(cell)
        if cell["cell_type"] != "code" or not source.startswith("%%ranks"):
            continue  # the kernel's own cells: starting and stopping the ranks, the charts
        if cell["id"] in marked:
            run = ranks.run(_text(copy[cell["id"]]).split("\n", 1)[1])
            said = run.render() + "\n" + run.failures()
            assert "not written yet" in said, f"{path.name} cell {cell['id']}, the stub gave:\n{said}"
            assert "Traceback" not in said and "line " not in run.failures(), said
            seen += 1
        run = ranks.run(source.split("\n", 1)[1])
        assert run.ok, f"{path.name} cell {cell['id']}: {run.failures()}"
    assert seen == len(marked)


# -- a learner who writes nothing: each check after an unwritten exercise says "not written yet" --------------------
CHECK_CALL = re.compile(r"\bchecks\.\w+\(")
PULL = re.compile(r"""live_ranks\.pull\(["']([^"']+)["']\)""")


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_every_stub_and_every_check_of_your_turn_runs_on_the_live_ranks(path):
    """The kernel's own cells never hold a stub or call a check, and reach what the ranks defined only through
    live_ranks.pull, which says "not written yet" like a %%ranks cell ([Note: a name an unwritten exercise would
    define] in fsdp_lab/lessons/live/ranks.py): so a kernel cell after a stub needs nothing of its own."""
    copy = sc.student_notebook(_load(path), path.name)
    for cell in your_turn_cells(copy):
        text = _text(cell)
        if cell["cell_type"] == "code" and not text.startswith("%%ranks"):
            assert "NotImplementedError" not in text and "= None  # ← your" not in text, (path.name, cell["id"])
            assert not CHECK_CALL.search(text), f"{path.name} cell {cell['id']}: a check run in the kernel"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_each_check_after_an_unwritten_exercise_says_not_written_yet(ranks, path):
    """The learner's copy run as it is, no solution written: the Your turn section's cells in order, on fresh ranks
    (the chapter's own live.start). Every cell that calls a check says "not written yet", also when what it reads
    comes from a stubbed cell above (a NameError on `model`, `fsdp_losses`); no cell shows a bare NameError, and
    a kernel cell's live_ranks.pull of a name no rank has says "not written yet" too."""
    from fsdp_lab.lessons.live import RanksFailed

    ranks.restart()
    checked = 0
    for cell in your_turn_cells(sc.student_notebook(_load(path), path.name)):
        source = _text(cell)
        if cell["cell_type"] != "code":
            continue
        if not source.startswith("%%ranks"):
            for name in PULL.findall(source):
                try:
                    ranks.pull(name)
                except RanksFailed as err:
                    assert str(err).startswith("not written yet: "), f"{path.name} cell {cell['id']}: {err}"
            continue
        run = ranks.run(source.split("\n", 1)[1])
        said = run.render() + "\n" + run.failures()
        assert "NameError" not in said, f"{path.name} cell {cell['id']}:\n{said}"
        if CHECK_CALL.search(source):
            assert "not written yet" in said and "Traceback" not in said, f"{path.name} cell {cell['id']}:\n{said}"
            checked += 1
    assert checked, f"{path.name}: no check in Your turn"
