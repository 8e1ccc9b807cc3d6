"""What nbval cannot see: every chapter exists, was committed with real outputs and no errors or warnings, gives
key terms in Chinese, labels its plots, and ends with a "Check yourself" section."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10"]
CJK = re.compile(r"[\u4e00-\u9fff]")


def _chapter(number: str) -> Path:
    found = sorted(NOTEBOOKS.glob(f"{number}-*.ipynb"))
    assert len(found) == 1, f"expected exactly one notebooks/{number}-*.ipynb, found {found}"
    return found[0]


@pytest.fixture(params=CHAPTERS)
def notebook(request):
    path = _chapter(request.param)
    return path, json.loads(path.read_text(encoding="utf-8"))


def _outputs(nb):
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            yield cell, out


def test_committed_with_real_outputs_and_no_errors_or_warnings(notebook):
    path, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: run every cell before committing"
    for cell, out in _outputs(nb):
        assert out["output_type"] != "error", f"{path.name}: error output {out.get('ename')}"
        text = "".join(out.get("text", "")) if out["output_type"] == "stream" else ""
        assert not re.search(r"\w+Warning:", text), f"{path.name}: stray warning in output: {text[:200]}"


def test_key_terms_in_chinese_and_check_yourself_at_the_end(notebook):
    path, nb = notebook
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert CJK.search(markdown), f"{path.name}: no Chinese key terms"
    headings = [line for c in nb["cells"] if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")]
    assert headings and "check yourself" in headings[-1].lower(), f"{path.name}: last heading {headings[-1:]}"


def test_every_plot_has_axis_labels_with_units(notebook):
    path, nb = notebook
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or not re.search(r"\.(plot|bar|barh|scatter|step|fill_between)\(", src):
            continue
        labels = re.findall(r"(?:set_[xy]label|[xy]label)\(\s*[rf]?[\"']([^\"']*)", src)
        assert labels, f"{path.name}: a plotting cell without axis labels:\n{src[:300]}"
        assert all("(" in label for label in labels if label.strip()), f"{path.name}: labels without units {labels}"
