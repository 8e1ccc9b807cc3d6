#!/usr/bin/env python3
"""Each chapter's time under nbval against the 60 s budget, one notebook at a time, with the load it ran under.

    PYTHONPATH=. python3 benchmarks/notebook_times.py                                  # every notebook
    PYTHONPATH=. python3 benchmarks/notebook_times.py notebooks/06b-beyond-one-node.ipynb notebooks/09a-bug-zoo.ipynb
    PYTHONPATH=. python3 benchmarks/notebook_times.py --json-out times.json

[Note: the notebook budget is a benchmark] A chapter must run top to bottom in under a minute on a 2-core laptop,
so a learner's Run All ends before they wonder. That is a wall time, and a wall time measures the machine as much
as the notebook: on a machine shared with other work the same chapter takes twice as long. So the suite only
prints each notebook's time (the root conftest.py), and this script checks the budget: it runs each notebook
alone under nbval (`pytest --nbval-lax`, the suite's own options), reads the time the suite's plugin adds up for it
(kernel start and every cell), and prints it beside the 1-minute load average before and after, the cores this
process may use, and whether it passed. It exits non-zero when a notebook fails or goes over budget. Figures are
meant for an idle machine; the load columns say whether it was one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_BUDGET_S = 60.0
LINE_FORMAT = "{seconds:6.1f} s  {notebook}{mark}"  # the suite's report (the root conftest.py) prints these
OVER_MARK = "  OVER BUDGET"
TIME_LINE = re.compile(r"^\s*([0-9.]+) s  (\S+\.ipynb)(?:" + re.escape(OVER_MARK) + r")?$", re.M)


def run_one(notebook: Path, timeout_s: float) -> dict:
    before = os.getloadavg()[0]
    began = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(notebook)],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = f"{exc.stdout or ''}{exc.stderr or ''}\nstopped after {timeout_s:.0f} s", None
    wall = time.monotonic() - began
    found = TIME_LINE.findall(output)
    nbval_s = float(found[-1][0]) if found else None
    return {"notebook": str(notebook.relative_to(REPO)), "nbval_s": nbval_s, "process_s": round(wall, 1),
            "passed": code == 0, "exit_code": code, "load_before": round(before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "tail": "" if code == 0 else "\n".join(output.strip().splitlines()[-15:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one notebook's run may take in all")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    notebooks = [n.resolve() for n in args.notebooks] or sorted((REPO / "notebooks").glob("*.ipynb"))
    missing = [str(n) for n in notebooks if not n.is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"budget {NOTEBOOK_BUDGET_S:.0f} s per notebook under nbval; {cores} usable core(s)")
    print(f"{'nbval s':>8} {'load before':>11} {'load after':>10}  result       notebook")
    rows, bad = [], 0
    for notebook in notebooks:
        row = run_one(notebook, args.timeout)
        over = row["nbval_s"] is None or row["nbval_s"] > NOTEBOOK_BUDGET_S
        row["within_budget"] = not over
        verdict = "FAILED" if not row["passed"] else ("OVER BUDGET" if over else "ok")
        bad += verdict != "ok"
        shown = f"{row['nbval_s']:8.1f}" if row["nbval_s"] is not None else "       ?"
        print(f"{shown} {row['load_before']:11.2f} {row['load_after']:10.2f}  {verdict:12} {row['notebook']}",
              flush=True)
        if row["tail"]:
            print("    " + row["tail"].replace("\n", "\n    "))
        rows.append(row)
    if args.json_out:
        args.json_out.write_text(json.dumps({"budget_s": NOTEBOOK_BUDGET_S, "cores": cores,
                                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                             "notebooks": rows}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
