"""benchmarks/hook_floor.py, the floor host_overhead.py measures fully_shard's hooks against ([Note: the hooks'
floor] there): with its bare hooks a fully_shard model must train exactly as with the real ones, or the floor
would time less work than the runtime must do; and host_overhead.py must report it beside the real front end.
The benchmark run here is the smallest, a check of the script, not a measurement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ranks_hook_floor import floor_against_fully_shard

from fsdp_lab.training.launch import run_on_ranks

REPO = Path(__file__).resolve().parent.parent


def test_the_bare_hooks_train_exactly_as_fully_shard_s_own():
    out = run_on_ranks(floor_against_fully_shard, 1, 5, timeout_s=120)[0]
    real, bare = out["losses"]
    assert len(real) == 5 and real == bare, out  # bit for bit: the same tensor operations in the same order
    assert out["same_parameters"], out
    assert out["gathers"]["real"] > 0 and out["gathers"]["bare"] == 0, out  # the swapped hooks ran, not the runtime's
    first_step, settings = out["refused"]
    assert "run one step first" in first_step and "set_* settings the floor does not model" in settings, out


def test_host_overhead_reports_the_floor_beside_fully_shard():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"), "--setup",
                           "fsdp_lab_fully_shard", "fully_shard_floor", "fsdp2", "--rounds", "2", "--steps", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["this_checkout"]["fully_shard_floor"]
    assert isinstance(row["addition_vs_fsdp2"], float) and len(row["per_round_additions_vs_fsdp2"]) == 2, row
    assert "fully_shard_floor" not in result["addition_bars"], result["addition_bars"]  # measured, not barred
    assert "fully_shard's hooks as bare tensor operations" in proc.stderr
