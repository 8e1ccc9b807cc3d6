"""benchmarks/notebook_times.py reads the times the suite's notebook report prints (the root conftest.py): the two
must agree on the line's format, or the budget check would find no time and call every chapter over budget."""
from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bench():
    spec = importlib.util.spec_from_file_location("notebook_times", REPO / "benchmarks" / "notebook_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_reads_the_reports_lines_with_and_without_the_mark():
    times = bench()
    line = times.LINE_FORMAT.format
    text = "\n".join([line(seconds=41.25, notebook="notebooks/01-core-idea.ipynb", mark=""),
                      line(seconds=96.5, notebook="notebooks/09a-bug-zoo.ipynb", mark=times.OVER_MARK)])
    assert times.TIME_LINE.findall(text) == [("41.2", "notebooks/01-core-idea.ipynb"),
                                             ("96.5", "notebooks/09a-bug-zoo.ipynb")]


def test_a_notebook_that_does_not_exist_is_named(capsys):
    assert bench().main([str(REPO / "notebooks" / "99-none.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err
