"""train, bench, demo and the live ranks refuse a CPU run whose ranks need more host memory than is free, before any
process starts, in one line naming both numbers and the way past it (--allow-low-memory, allow_low_memory=True).
The estimate (fsdp_lab.training.host_memory) is checked against the peak RSS of a real run, measured here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_oversubscribe import Started, no_process_starts  # noqa: F401  (the fixture: nothing may start)

from fsdp_lab import cli
from fsdp_lab.training import host_memory
from fsdp_lab.training.host_memory import Available

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"train": ["--nproc-per-node", "2"], "demo": ["--nproc-per-node", "2"],
            "bench": ["--device", "cpu", "--nproc-per-node", "2"]}
SMALL = Available(50 * 10**6, "MemAvailable")  # 0.05 GB: less than one Python process with torch


@pytest.fixture
def small_machine(monkeypatch):
    """This machine reports SMALL free: the check reads it through host_memory.available_memory."""
    monkeypatch.setattr(host_memory, "available_memory", lambda *a, **k: SMALL)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_run_bigger_than_free_memory_is_refused_in_one_line_before_any_process(command, capsys, small_machine,
                                                                                no_process_starts):
    code = cli.main([command, *COMMANDS[command]])
    err = capsys.readouterr().err.strip()
    from fsdp_lab.commands import _exit_codes

    assert code == _exit_codes.USAGE != 0, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"fsdp-lab {command}: error: this run needs about "), err
    assert " GB of host memory (2 rank(s) x " in err and "but only 0.05 GB is available (MemAvailable)" in err
    assert err.endswith("or add --allow-low-memory"), err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_allow_low_memory_lets_the_run_start(command, small_machine, no_process_starts):
    with pytest.raises(Started):
        cli.main([command, *COMMANDS[command], "--allow-low-memory"])


def test_a_run_that_fits_is_not_refused(no_process_starts):
    with pytest.raises(Started):
        cli.main(["train", "--nproc-per-node", "1"])


def test_the_message_names_what_the_ranks_need_and_what_is_free():
    need = host_memory.HostMemoryNeed(ranks=4, baseline=3 * 10**8, state=10**9, unsharded=2 * 10**8,
                                      activations=5 * 10**8)
    assert need.total == 4 * 2 * 10**9
    assert host_memory.memory_problem(need, Available(3 * 10**9, "cgroup memory.max"), "add --allow-low-memory") == (
        "this run needs about 8.00 GB of host memory (4 rank(s) x 2.00 GB: 1.00 state, 0.20 gathered, 0.50 "
        "activations, 0.30 process) but only 3.00 GB is available (cgroup memory.max); use fewer ranks or a "
        "smaller model or batch, or add --allow-low-memory")
    assert host_memory.memory_problem(need, Available(need.total, "MemAvailable"), "x") is None
    assert host_memory.memory_problem(need, None, "x") is None  # nothing known: nothing refused


def test_free_memory_is_the_smaller_of_memavailable_and_the_cgroup_room(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert host_memory.available_memory(meminfo, cg) == Available(8000000 * 1024, "MemAvailable")  # no limit file
    (cg / "memory.max").write_text("max\n")
    assert host_memory.available_memory(meminfo, cg) == Available(8000000 * 1024, "MemAvailable")  # v2: no limit
    (cg / "memory.max").write_text(f"{4 * 10**9}\n")
    (cg / "memory.current").write_text(f"{10**9}\n")
    assert host_memory.available_memory(meminfo, cg) == Available(3 * 10**9, "cgroup memory.max")
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * 10**9}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{5 * 10**8}\n")
    assert host_memory.cgroup_room(v1.parent) == 15 * 10**8
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_memory.cgroup_room(v1.parent) is None
    assert host_memory.available_memory(tmp_path / "absent", tmp_path / "absent") is None


def test_the_estimate_uses_the_theory_formulas():
    """State is formulas.runtime_state_bytes of the padded units, not a second formula."""
    from fsdp_lab.theory.formulas import runtime_state_bytes
    from fsdp_lab.training.models import PRESETS

    cfg = PRESETS["medium"]
    phi, block, root = host_memory._unit_numels(cfg)
    padded = -(-root // 4) * 4 + cfg.n_layer * (-(-block // 4) * 4)
    state, _unsharded, _act = host_memory.gpt_model_need(cfg, "FULL_SHARD", 4, 2, cfg.block_size)
    assert state == max(runtime_state_bytes("FULL_SHARD", padded, 4).total, 4 * phi)
    one, _, _ = host_memory.gpt_model_need(cfg, "NO_SHARD", 4, 2, cfg.block_size)
    assert one == 16 * phi  # replicated: every rank holds all of it


# [Note: how close the estimate is] Measured on this 2-core machine (1 rank, preset medium, 2 steps, fp32):
# the estimate was within a few percent of the run's peak RSS. The bound asserted is a factor of 1.5 either
# way: loose enough for another allocator or torch build, tight enough that a term left out (the activations
# here are half the total) or counted twice fails the test.
FACTOR = 1.5


def test_the_estimate_is_within_a_factor_of_a_real_runs_peak_rss():
    argv = ["--preset", "medium", "--steps", "2", "--no-progress"]
    code = ("import resource, subprocess, sys\n"
            f"done = subprocess.run([sys.executable, '-m', 'fsdp_lab', 'train', *{argv!r}], capture_output=True, "
            "text=True, timeout=280)\n"
            "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "sys.stderr.write(done.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    rc, peak_kib = done.stdout.split()
    assert rc == "0", done.stderr
    measured = int(peak_kib) * 1024  # the largest process of the run: its one rank (the launcher is smaller)
    from fsdp_lab.training.loop import TrainConfig

    need = host_memory.train_need(TrainConfig(preset="medium", steps=2), 1, 1, host_memory.process_baseline())
    assert 1 / FACTOR <= need.per_rank / measured <= FACTOR, (need.parts(), measured)


def test_live_ranks_refuse_before_any_engine_starts(monkeypatch, small_machine):
    import ipyparallel

    from fsdp_lab.lessons.live.ranks import Ranks

    def refuse(*_args, **_kwargs):
        raise Started("an engine cluster was about to start")

    monkeypatch.setattr(ipyparallel, "Cluster", refuse)
    ranks = Ranks(2)
    with pytest.raises(MemoryError) as err:
        ranks.start()
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    assert text.startswith("2 live ranks: this run needs about ") and " (2 rank(s) x " in text
    assert "but only 0.05 GB is available (MemAvailable); start fewer ranks, or pass allow_low_memory=True" in text
    assert ranks._cluster is None and ranks.pids == []
    with pytest.raises(Started):  # the override starts them
        Ranks(2, allow_low_memory=True).start()


def test_live_ranks_that_fit_pay_no_fresh_measurement(monkeypatch):
    """The kernel's own size bounds an engine's from above; only when that bound fails is a process started."""
    from fsdp_lab.lessons.live.ranks import Ranks

    calls = []
    real = host_memory.process_baseline
    monkeypatch.setattr(host_memory, "process_baseline", lambda fresh=False: calls.append(fresh) or real(fresh))
    assert Ranks(2)._memory_problem() is None and calls == [False]
