"""Collectives that only some ranks enter. Each broken version runs on a short-timeout group, so the hang ends in
seconds as CollectiveFailed, and the collective log names who waits where ([Note: a group of its own for a hang]
in .common).

- uneven batches: samples dealt round-robin without padding give rank 0 one more batch than rank 1;
- a save decided on rank 0 alone: `if rank == 0: model.state_dict()` gathers on rank 0 only;
- a module run on some ranks only: an MoE expert that no token of a rank's batch picks is skipped there.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.lessons.zoo.common import WIDTH, batch, loss_of, mine, run_broken, short_group, tiny
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.wrap import ModuleWrapPolicy


def wrapped(group, model: Optional[nn.Module] = None) -> FSDP:
    """`model` (default: the zoo's tiny one) wrapped by FSDP, one unit per Linear, on `group`."""
    return FSDP(model if model is not None else tiny(), process_group=group,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _said(rank: int, report: str, done: str, began: float) -> str:
    took = time.monotonic() - began
    return (f"hung, named after {took:.0f} s: {report}" if report else done)


# -- uneven batches -------------------------------------------------------------------------------------------------
def epoch_batches(rank: int, world_size: int, samples: int = 9, size: int = 2) -> list:
    """This rank's batches of one epoch: samples dealt round-robin, no padding, no drop_last. With 9 samples on 2
    ranks, rank 0 gets 5 samples (3 batches) and rank 1 gets 4 (2 batches)."""
    x, y = batch(0, samples)
    idx = torch.arange(rank, samples, world_size)
    return [(x[idx[i:i + size]], y[idx[i:i + size]]) for i in range(0, len(idx), size)]


def train_epoch(batches: list) -> tuple[int, str]:
    """(steps this rank ran, the collective log's report or ""): one epoch of `batches` on a short-timeout group."""
    group = short_group()
    model = wrapped(group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def epoch():
        for x, y in batches:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        return len(batches)

    steps, report = run_broken(epoch, group)
    return (steps or 0), report


def uneven_epoch(batches: list) -> str:
    """What one epoch of `batches` does on this rank, in a line."""
    began = time.monotonic()
    steps, report = train_epoch(batches)
    return f"{len(batches)} batches: " + _said(dist.get_rank(), report, f"ran {steps} steps and finished", began)


# -- a save decided on rank 0 alone ---------------------------------------------------------------------------------
def save_on_rank_0_only(model: FSDP):
    """The bug as users write it: only rank 0 asks for the state dict, which gathers every unit."""
    if dist.get_rank() == 0:
        return model.state_dict()
    return None


def try_save(save: Callable) -> tuple[object, str]:
    """(what `save(model)` returned on this rank, the report of a hang or ""), on a fresh tiny model."""
    group = short_group()
    model = wrapped(group)
    return run_broken(lambda: save(model), group)


def saving(save: Callable) -> str:
    began = time.monotonic()
    state, report = try_save(save)
    got = f"got a state dict of {len(state)} tensors" if isinstance(state, dict) else f"got {state!r}"
    return _said(dist.get_rank(), report, got, began)


# -- a module run on some ranks only ---------------------------------------------------------------------------------
class MoE(nn.Module):
    """An input Linear, then two expert Linears; each row goes to the expert its `choice` names, and `mix` decides
    how the experts are run (the part users get wrong). The root owns no parameters ([Note: units of one size])."""

    def __init__(self, mix: Callable, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.mix = mix

    def forward(self, x, choice):
        return self.mix(self.experts, torch.relu(self.inp(x)), choice)


def mix_skipping_idle(experts, h, choice):
    """The bug: an expert that no row of this rank's batch picked is not run here."""
    out = torch.zeros_like(h)
    for i, expert in enumerate(experts):
        picked = choice == i
        if picked.any():
            out[picked] = expert(h[picked])
    return out


def routed_batch(rank: int, world_size: int):
    """This rank's rows and their experts: rank 0's rows pick both experts, every other rank's rows only expert 0
    (a vision tower that only some ranks' samples need behaves the same)."""
    x, y = batch(0)
    x, y = mine(x, rank, world_size), mine(y, rank, world_size)
    choice = torch.arange(len(x)) % 2 if rank == 0 else torch.zeros(len(x), dtype=torch.long)
    return x, y, choice


def moe_step(mix: Callable) -> tuple[Optional[float], Optional[float], str]:
    """(the FSDP loss, one process's loss on these rows, the report of a hang or "") for one step. One process
    routes each row to the expert it picked and to no other (skipping an idle expert is right there: no peer
    waits for it), so a mix that runs the experts differently gives another loss."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y, choice = routed_batch(rank, world_size)
    reference = loss_of(lambda t: MoE(mix_skipping_idle)(t, choice), x, y).item()
    group = short_group()
    model = wrapped(group, MoE(mix))
    loss, report = run_broken(lambda: _step(model, x, y, choice), group)
    return loss, reference, report


def _step(model, x, y, choice) -> float:
    loss = loss_of(lambda t: model(t, choice), x, y)
    loss.backward()
    return loss.item()


def moe(mix: Callable) -> str:
    began = time.monotonic()
    loss, _reference, report = moe_step(mix)
    return _said(dist.get_rank(), report, "" if report else f"one step, loss {loss:.4f}", began)
