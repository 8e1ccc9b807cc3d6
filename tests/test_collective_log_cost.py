"""benchmarks/collective_log_cost.py times each front end's step with the collective log on and off, side by side
([Note: the log's cost, and bar 11] there): the off steps must really make no record, the log must be back on
after them, and the report must carry both times for each front end. The run here is the smallest (2 blocks, 2
steps each way), a check of the script, not a measurement."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lab.runtime.core import collective_log

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "collective_log_cost.py"


def _script():
    spec = importlib.util.spec_from_file_location("collective_log_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_log_is_back_on_after_the_off_steps_even_when_they_raise():
    lookup = collective_log.log_of
    with pytest.raises(ValueError):
        with _script().log_switched_off():
            assert collective_log.log_of(None) is None
            raise ValueError("a step that failed")
    assert collective_log.log_of is lookup


def test_each_front_end_is_timed_with_the_log_on_and_off_and_only_on_makes_records():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--steps", "2", "--records", "200",
                           "--timeout", "240"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["front_ends"]) == ["fsdp_lab", "fsdp_lab_fully_shard"]
    for mode, row in result["front_ends"].items():
        # 2 blocks and the root: 3 units, each gathered in forward and backward and reduce-scattered, less the
        # root's re-gather (it stays gathered from forward to backward) under either front end
        assert row["records_per_step"] >= 8, (mode, row)
        assert row["records_per_step_off"] == 0, (mode, row)
        assert row["step_ms"] > 0 and row["log_off_step_ms"] > 0, (mode, row)
        for key in ("on_minus_off_quartiles_ms", "cpu_on_minus_off_quartiles_ms"):  # wall and thread CPU time
            low, high = row[key]
            assert low <= high, (mode, key, row)
        assert row["cpu_ms"] > 0 and row["log_off_cpu_ms"] > 0, (mode, row)
        assert f"{mode:22} log on " in proc.stdout
