"""Suite-wide rule: each notebook must run top to bottom within NOTEBOOK_BUDGET_S under nbval.

nbval reports one item per cell; the plugin below adds up each notebook's setup (kernel start) and cell times and
fails the run, naming the notebook and its time, when one goes over budget.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

NOTEBOOK_BUDGET_S = 60.0


class NotebookBudget:
    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.seconds: "defaultdict[str, float]" = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if path.endswith(".ipynb"):
            self.seconds[path] += report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        over = {nb: t for nb, t in self.seconds.items() if t > self.budget_s}
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if self.seconds and reporter is not None:
            reporter.write_sep("-", f"notebook wall times (budget {self.budget_s:.0f} s each)")
            for nb, t in sorted(self.seconds.items()):
                reporter.write_line(f"{t:6.1f} s  {nb}{'  OVER BUDGET' if nb in over else ''}")
        if over and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.pluginmanager.register(NotebookBudget(NOTEBOOK_BUDGET_S), "notebook-budget")
