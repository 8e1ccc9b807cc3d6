"""The learner's copy of a chapter: every "Your turn" solution replaced by its stub, everything else kept.

The repository's notebooks are the instructor's source and hold the solved exercises, so Run All (and nbval in
CI) runs the solutions. Inside an exercise cell a solution sits between nbgrader's markers, with the stub the
learner starts from right before them:

    ### STUB: predicted = None  # ← yours: bytes per rank after one AdamW step
    ### BEGIN SOLUTION
    predicted = 16 * phi / world_size
    ### END SOLUTION

The copy keeps each `### STUB:` line (the prefix removed, at the marker's indentation) in place of the block;
a block with no stub gets nbgrader's `raise NotImplementedError(...)`. [Note: stubs the checks recognise] A
stub either leaves a value None or a function that raises NotImplementedError, and every check in
fsdp_lab.lessons.live.checks answers those with "not written yet" (a check that also reads a model asks about the
function first: the model may be the plain one an unwritten exercise above left); a stub that raises in a
`%%ranks` cell is shown by the live ranks as "not written yet: <its message>", without a traceback. Such a stub
stands for the line that defines what the later cells read (`model = FSDP(...)` in a bigger cell, and then
`checks.state_bytes(predicted, model, opt)`): until that cell runs without it, a later cell's NameError, or a
kernel cell's `live_ranks.pull` of the name, says "not written yet: <name> comes from the exercise above ..."
([Note: a name an unwritten exercise would define] in fsdp_lab/lessons/live/unwritten.py). Every stub and every check
runs on the ranks, none in the kernel (tests/test_student_copies.py checks both). The copy of an exercise cell
loses its outputs (they came from the solution), and a "show the solution" cell follows it, which reads the
solution from the instructor's notebook (fsdp_lab.lessons.widgets.solution), so the copy holds none of it.

[Note: answers in the notes around an exercise] A markdown note can show an exercise's answer too: the legacy
notes put the FSDP1 line an exercise asks for beside its FSDP2 twin. Such a note marks that part with the same
markers as HTML comments, which the rendered instructor's notebook does not show:

    <!-- ### STUB: *The lines compared here are the exercise below.* -->
    <!-- ### BEGIN SOLUTION -->
    FSDP1 (legacy): ...
    <!-- ### END SOLUTION -->

The copy keeps the stub text (or MARKDOWN_STUB) in place of the part, and a "show the solution" cell follows
the note as it follows an exercise cell. tests/test_student_copies.py checks that no solution's line shows
anywhere else in a copy.
"""
from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import Optional

BEGIN, END, STUB = "### BEGIN SOLUTION", "### END SOLUTION", "### STUB:"
DEFAULT_STUB = 'raise NotImplementedError("write this part: the text above the cell says what")'
MARKDOWN_STUB = ("*This part holds the answer of the exercise below: write yours first, then the button under this "
                 "note shows it.*")
INSTRUCTOR_NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"


class MarkerError(ValueError):
    """Unbalanced or misplaced solution markers; the message names the cell and line."""


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


def _marker(line: str, markdown: bool) -> str:
    """The line as a marker would read: stripped, and in markdown taken out of its HTML comment."""
    text = line.strip()
    if markdown:
        if not (text.startswith("<!--") and text.endswith("-->")):
            return text if not text.startswith(("### BEGIN", "### END", "### STUB")) else "<bare " + text + ">"
        text = text[4:-3].strip()
    return text


def split_cell(source: str, where: str = "<cell>", markdown: bool = False) -> tuple[str, list[str]]:
    """(the learner's version of one cell's text, the solutions it held, in order); MarkerError on bad markers.
    markdown: the markers are HTML comments ([Note: answers in the notes around an exercise])."""
    lines = source.split("\n")
    out, stubs, solutions, inside, body = [], [], [], None, []
    default = MARKDOWN_STUB if markdown else DEFAULT_STUB
    for number, line in enumerate(lines, 1):
        marker, indent = _marker(line, markdown), line[:len(line) - len(line.lstrip())]
        if marker.startswith("<bare "):
            raise MarkerError(f"{where}:{number}: a marker in markdown goes inside an HTML comment: "
                              f"<!-- {line.strip()} -->")
        if inside is not None:
            if marker == BEGIN:
                raise MarkerError(f"{where}:{number}: {BEGIN} inside the solution opened on line {inside}")
            if marker == END:
                solutions.append("\n".join(body))
                inside, body = None, []
            else:
                body.append(line)
            continue
        if marker.startswith(STUB):
            stubs.append(indent + marker[len(STUB):].strip())
            continue
        if marker == END:
            raise MarkerError(f"{where}:{number}: {END} without a {BEGIN} before it")
        if marker == BEGIN:
            out += stubs or [indent + default]
            stubs, inside = [], number
            continue
        if stubs:
            raise MarkerError(f"{where}:{number - 1}: {STUB} must come right before {BEGIN}")
        out.append(line)
    if inside is not None:
        raise MarkerError(f"{where}:{inside}: {BEGIN} is never closed by {END}")
    if stubs:
        raise MarkerError(f"{where}: {STUB} at the end of the cell, with no solution after it")
    student = "\n".join(out)
    if markdown:
        return student, solutions
    python = "\n".join(line for line in out if not line.startswith("%%"))  # %%ranks: a cell magic, not Python
    try:
        ast.parse(python, where)
    except SyntaxError as err:
        raise MarkerError(f"{where}: the learner's copy is not valid Python: {err}") from None
    return student, solutions


def exercise_cells(nb: dict) -> list[dict]:
    """The code cells of a notebook (its JSON) that hold a marked solution."""
    return [c for c in nb["cells"] if c["cell_type"] == "code" and BEGIN in _text(c["source"])]


def marked_cells(nb: dict) -> list[dict]:
    """The exercise cells and the markdown notes that hold a marked answer, in notebook order."""
    return [c for c in nb["cells"] if c["cell_type"] in ("code", "markdown") and BEGIN in _text(c["source"])]


def _split(cell: dict, where: str) -> tuple[str, list[str]]:
    return split_cell(_text(cell["source"]), where, markdown=cell["cell_type"] == "markdown")


def solutions_of(nb: dict, name: str = "<notebook>") -> dict[str, list[str]]:
    """{cell id: [solution, ...]} for every marked cell of a notebook (exercise cells and notes)."""
    return {c["id"]: _split(c, f"{name} cell {c['id']}")[1] for c in marked_cells(nb)}


def _solution_cell(cell_id: str) -> dict:
    source = ("from fsdp_lab.lessons.widgets import show_solution\n\n"
              f"show_solution({cell_id!r})  # stuck? the button shows the solution of the cell above")
    return {"cell_type": "code", "execution_count": None, "id": f"{cell_id}-solution",
            "metadata": {"tags": ["solution-button"]}, "outputs": [], "source": source}


def student_notebook(nb: dict, name: str = "<notebook>") -> dict:
    """A copy of the notebook (its JSON) with every solution replaced by its stub and a solution button after it."""
    nb = copy.deepcopy(nb)
    cells = []
    for cell in nb["cells"]:
        cells.append(cell)
        if cell["cell_type"] not in ("code", "markdown") or BEGIN not in _text(cell["source"]):
            continue
        cell["source"], _ = _split(cell, f"{name} cell {cell.get('id')}")
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(_solution_cell(cell["id"]))
    nb["cells"] = cells
    return nb


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"  # nbformat's own layout


def write_student_copies(source_dir: Path = INSTRUCTOR_NOTEBOOKS, out_dir: Optional[Path] = None,
                         overwrite: bool = False) -> list[Path]:
    """Write the learner's copy of every notebook in source_dir into out_dir; return the files written.

    A copy that already exists is the learner's work: it is kept unless overwrite is set."""
    source_dir = Path(source_dir)
    out_dir = Path(out_dir) if out_dir is not None else source_dir.parent / "my-notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source_dir.glob("*.ipynb")):
        target = out_dir / path.name
        if target.exists() and not overwrite:
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        target.write_text(_dump(student_notebook(nb, path.name)), encoding="utf-8")
        written.append(target)
    return written


def write_fresh_copy(source: Path, out_dir: Path, stamp: str) -> Path:
    """A fresh learner's copy of one chapter `source` in out_dir, never over a file there: under the chapter's
    own name when the learner has none, else as `<chapter>.fresh-<stamp>.ipynb` beside their work."""
    source, out_dir = Path(source), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = student_notebook(json.loads(source.read_text(encoding="utf-8")), source.name)
    for target in (out_dir / source.name, out_dir / f"{source.stem}.fresh-{stamp}.ipynb"):
        try:
            with open(target, "x", encoding="utf-8") as f:  # "x": an existing file is never opened for writing
                f.write(_dump(nb))
            return target
        except FileExistsError:
            continue
    raise FileExistsError(f"{out_dir} already holds {source.name} and {source.stem}.fresh-{stamp}.ipynb")


def find_solution(cell_id: str, source_dir: Path = INSTRUCTOR_NOTEBOOKS) -> tuple[str, list[str]]:
    """(the notebook's name, the solutions) of the marked cell `cell_id` (an exercise or a note), read from the
    instructor's notebooks."""
    source_dir = Path(source_dir)
    paths = sorted(source_dir.glob("*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no instructor notebooks in {source_dir}: the solutions are read from a checkout "
                                f"of fsdp-lab")
    for path in paths:
        nb = json.loads(path.read_text(encoding="utf-8"))
        found = solutions_of(nb, path.name)
        if cell_id in found:
            return path.name, found[cell_id]
    raise KeyError(f"no exercise cell {cell_id!r} in {source_dir} ({len(paths)} notebooks)")
