"""train, demo and bench refuse more ranks than this machine has cores, before any process starts, in one line
naming both numbers; --allow-oversubscribe lets such a run through. One check (commands/_ranks.py) serves all."""
from __future__ import annotations

import os

import pytest

from fsdp_lab import cli

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
RANKS = 64
COMMANDS = {"train": ["--global-batch", str(RANKS)], "demo": ["--global-batch", str(RANKS)],
            "bench": ["--device", "cpu"]}


class Started(Exception):
    pass


@pytest.fixture
def no_process_starts(monkeypatch):
    """Whatever would start the ranks raises Started instead: a check that came too late fails the test, and
    never starts 64 processes."""
    def refuse(*_args, **_kwargs):
        raise Started("ranks were about to start")

    import torch.distributed.run

    import fsdp_lab.bench.run
    import fsdp_lab.training.demo
    monkeypatch.setattr(torch.distributed.run, "run", refuse)
    monkeypatch.setattr(fsdp_lab.training.demo, "run_demo", refuse)
    monkeypatch.setattr(fsdp_lab.bench.run, "run_bench", refuse)
    # train, run in this process, sets LOGLEVEL, OMP_NUM_THREADS and the launcher pid for the torchrun it
    # starts; left behind, every later test's `fsdp-lab train` would inherit them (LOGLEVEL=CRITICAL set by a
    # user turns train's own silencing of torchrun's log lines off).
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.skipif(CORES >= RANKS, reason=f"this machine has {CORES} cores")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_more_ranks_than_cores_is_refused_before_any_process_starts(command, capsys, no_process_starts):
    code = cli.main([command, "--nproc-per-node", str(RANKS), *COMMANDS[command]])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err == (f"fsdp-lab {command}: error: --nproc-per-node {RANKS} starts {RANKS} rank processes but this "
                   f"machine has {CORES} CPU core(s); use at most {CORES}, or add --allow-oversubscribe")


@pytest.mark.skipif(CORES >= RANKS, reason=f"this machine has {CORES} cores")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_allow_oversubscribe_lets_the_run_start(command, capsys, no_process_starts):
    with pytest.raises(Started):  # 64 processes' memory is the other check's (tests/test_host_memory.py)
        cli.main([command, "--nproc-per-node", str(RANKS), "--allow-oversubscribe", "--allow-low-memory",
                  *COMMANDS[command]])


def test_as_many_ranks_as_cores_is_not_refused(capsys, no_process_starts):
    with pytest.raises(Started):
        cli.main(["demo", "--nproc-per-node", str(CORES), "--global-batch", str(CORES)])
