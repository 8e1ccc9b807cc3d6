"""Suite-wide report: each notebook's time under nbval, against the budget of benchmarks/notebook_times.py.

nbval reports one item per cell; the plugin below adds up each notebook's setup (kernel start) and cell times and
prints them at the end of the run, marking a notebook over budget. It does not fail the run: a wall time measures
the machine's load as much as the notebook, and the suite must pass on a loaded machine. The budget itself is
checked by benchmarks/notebook_times.py, which runs the chapters one at a time, prints each time with the load it
ran under, and fails when one is over.
"""
from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path


def _budget():
    """benchmarks/notebook_times.py: the budget, and the line it reads back from this report."""
    path = Path(__file__).resolve().parent / "benchmarks" / "notebook_times.py"
    spec = importlib.util.spec_from_file_location("fsdp_lab_notebook_times", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BUDGET = _budget()


class NotebookTimes:
    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.seconds: "defaultdict[str, float]" = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if path.endswith(".ipynb"):
            self.seconds[path] += report.duration

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        terminalreporter.write_sep("-", f"notebook wall times (budget {self.budget_s:.0f} s each, checked by "
                                        f"benchmarks/notebook_times.py)")
        for nb, t in sorted(self.seconds.items()):
            mark = _BUDGET.OVER_MARK if t > self.budget_s else ""
            terminalreporter.write_line(_BUDGET.LINE_FORMAT.format(seconds=t, notebook=nb, mark=mark))


def pytest_configure(config):
    config.pluginmanager.register(NotebookTimes(_BUDGET.NOTEBOOK_BUDGET_S), "notebook-times")
