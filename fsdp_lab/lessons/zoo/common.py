"""What every zoo entry shares: a tiny model whose FSDP units are all the same size, its batches, the one-process
reference, and a short-timeout process group for the entries that hang.

[Note: units of one size] gloo aborts the whole process when two ranks meet in collectives of different sizes, and
a live rank must survive its own bug. Every unit here is one Linear(4, 4) (20 elements) and the root owns no
parameters, so a rank's all-gather that meets a peer's reduce-scatter, or no peer at all, waits until the group's
timeout and fails as CollectiveFailed, which names the mismatch (fsdp_lab/runtime/core/collective_log.py).

[Note: a group of its own for a hang] A collective that timed out leaves its group unusable. The broken versions
therefore run on a fresh group with a timeout of a few seconds (`short_group`), and the ranks meet again on the
default group afterwards (`run_broken`), which stays healthy for the next cell.
"""
from __future__ import annotations

import copy
import textwrap
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_lab.runtime.core import collective_log
from fsdp_lab.runtime.core.collectives import CollectiveFailed
from fsdp_lab.runtime.core.side_collectives import patient_timeout

WIDTH = 4
HANG_TIMEOUT_S = 2.0


def tiny(seed: int = 0, layers: int = 2) -> nn.Sequential:
    """`layers` Linear(4, 4) with ReLUs between, from `seed`: each Linear one FSDP unit of 20 elements."""
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*mods)


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: the same on every rank (each rank takes its rows with `mine`)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def mine(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous rows of a global batch."""
    return t.chunk(world_size)[rank]


def loss_of(model, x, y, reduction: str = "mean") -> torch.Tensor:
    return F.mse_loss(model(x), y, reduction=reduction)


def one_process(model: nn.Module, steps: int = 1, lr: float = 0.1) -> nn.Module:
    """A copy of the unwrapped `model` trained `steps` SGD steps on the whole global batches, in this process:
    what every FSDP run here must match."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(step)
        loss_of(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def short_group(timeout_s: float = HANG_TIMEOUT_S):
    """A fresh gloo group over every rank that gives up after `timeout_s` ([Note: a group of its own for a hang]).
    Every rank must call it, in the same order."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def run_broken(fn: Callable[[], object], group) -> tuple[object, str]:
    """(fn's result or None, the collective log's report of the hang or ""), fn's collectives running on `group`.
    A rank that finishes posts its log, so a peer stuck in a collective names it by its last one (or as having
    issued none on the group); then every rank meets on the default group, patiently ([Note: patient
    collectives] in fsdp_lab/runtime/core/side_collectives.py): a rank that never entered the hang gets there a
    whole hang timeout and a report exchange before the rank that waited in it."""
    result, report = None, ""
    collective_log.log_of(group)  # made now: a rank that issues nothing on the group still posts that it did not
    try:
        result = fn()
        collective_log.post_all("finished")
    except CollectiveFailed as err:
        report = err.collective_log or str(err).splitlines()[0]
    with patient_timeout():
        dist.barrier()
    return result, report


def wrap(text: str, width: int = 100) -> str:
    """A report folded to `width` columns (a notebook wraps longer printed lines), later lines indented."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in text.splitlines() or [""])


def world_of(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def gathered(value) -> list:
    """`value` from every rank, in rank order (on the default group)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
