"""Ranks that go apart on purpose, for tests/test_collective_log.py: each scenario is deterministic (a rank runs
one more step, enters a collective alone, or takes its steps in another order), and the ranks that fail return
the collective log's report and how long after the mismatching call it came.

Every unit is the same size (two Linear(4, 4) layers, the root owns no parameters), so a rank's all-gather meets a
peer's reduce-scatter of the same bytes and both wait until the group's timeout: gloo aborts the process instead
when the sizes of two mismatched collectives differ.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_lab import FSDP, fully_shard
from fsdp_lab.runtime.core import collective_log
from fsdp_lab.runtime.core.collectives import CollectiveFailed

RELEASED = "tests/collective_log/released"  # set by a failing rank once it reported: the idle ranks may leave


def build(front_end: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    if front_end == "FSDP":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def step(model) -> None:
    model(torch.ones(2, 4)).sum().backward()


def one_rank_only(model, front_end: str) -> None:
    """What rank 0 alone does: a full state dict (FSDP), an evaluation forward (fully_shard)."""
    if front_end == "FSDP":
        model.state_dict()
    else:
        with torch.no_grad():
            model(torch.ones(2, 4))


def _failing(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except CollectiveFailed as err:
        out = {"message": err.collective_log, "seconds": time.monotonic() - t0, "text": str(err), "pid": os.getpid()}
        dist.distributed_c10d._get_default_store().set(RELEASED, b"1")
        return out
    return {"message": None, "seconds": time.monotonic() - t0, "text": "", "pid": os.getpid()}


def _idle() -> dict:
    """A rank that is done and stays alive: it posts, then waits (with a deadline) for the failing rank's report."""
    collective_log.post_all("finished")
    dist.distributed_c10d._get_default_store().wait([RELEASED], timedelta(seconds=60))
    return {"message": None, "seconds": 0.0, "text": "", "pid": os.getpid()}


def uneven_batches(rank, world_size, front_end):
    """Rank 0 has one more batch than the others, which finish and leave."""
    model = build(front_end)
    step(model)
    if rank != 0:
        return {"message": None, "seconds": 0.0, "text": "", "pid": os.getpid()}
    return _failing(lambda: step(model))


def only_on_rank_0(rank, world_size, front_end):
    """After a step together, rank 0 alone enters a collective; the others wait idle."""
    model = build(front_end)
    step(model)
    if rank != 0:
        return _idle()
    return _failing(lambda: one_rank_only(model, front_end))


def swapped_order(rank, world_size, front_end):
    """Rank 1 does the state dict (FSDP) or evaluation (fully_shard) before its step, the others after."""
    model = build(front_end)
    if rank == 1:
        return _failing(lambda: (one_rank_only(model, front_end), step(model)))
    return _failing(lambda: (step(model), one_rank_only(model, front_end)))


def ring_of_one_step(rank, world_size, front_end):
    """The records one training step leaves, as posted (the unit test of what is recorded)."""
    model = build(front_end)
    step(model)
    log = collective_log.log_of(dist.group.WORLD)
    return log.snapshot("finished")


def side_collective_on_rank_0_only(rank, world_size, what):
    """After a step with AdamW, rank 0 alone asks for the full optimizer state dict (what="optim_state_dict": it
    gathers each rank's keys as objects first) or saves a checkpoint (what="checkpoint": every rank says whether
    its state is finite); the others wait idle."""
    import tempfile

    from fsdp_lab import checkpoint

    model = build("FSDP")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model)
    opt.step()
    if rank != 0:
        return _idle()
    if what == "optim_state_dict":
        return _failing(lambda: FSDP.optim_state_dict(model, opt))
    with tempfile.TemporaryDirectory() as directory:
        return _failing(lambda: checkpoint.save(model, opt, directory, step=1))


def patient_collective(rank, world_size, front_end):
    """Rank 1 enters an all_gather_object two group timeouts after rank 0 (time.sleep: rank 1's imports, say):
    a patient one completes, and the group's timeout is back to its own after it; the timeouts seen are returned."""
    from fsdp_lab.runtime.core.side_collectives import issue, patient_timeout, set_patient_timeout

    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    own = backend.options._timeout.total_seconds()
    set_patient_timeout(60.0)
    with patient_timeout(group):
        inside = backend.options._timeout.total_seconds()
    if rank == 1:
        time.sleep(2 * own)
    everyone = [None] * world_size
    issue(dist.all_gather_object, everyone, rank, group=None, phase="init", patient=True)
    log = collective_log.log_of(None)
    return {"own": own, "inside": inside, "after": backend.options._timeout.total_seconds(), "everyone": everyone,
            "record": log.snapshot("finished")["records"][-1][:8], "pid": os.getpid()}
