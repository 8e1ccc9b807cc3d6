"""`FSDP.summon_full_params`: the whole fp32 model under its original parameter names, for inspection or edits.

Inside the context every original parameter is a real `nn.Parameter` again (a view into a gathered fp32 copy of
its unit's masters), so `model.named_parameters()` lists `blocks.0.attn.qkv.weight` and friends. On exit, with
writeback=True, each rank copies its own chunk back into its shard, so writes made inside reach the masters.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from fsdp_lab.runtime.collectives import all_gather_flat
from fsdp_lab.runtime.strategy import ShardingStrategy
from fsdp_lab.runtime.unit import UnitState


def gather_master(unit, flat) -> torch.Tensor:
    """The whole padded fp32 master of one flat, on every rank (collective)."""
    ctx = unit.ctx
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return flat.shard.data
    full = torch.empty(flat.padded_numel, dtype=flat.shard.dtype, device=flat.shard.device)
    all_gather_flat(full, flat.shard.detach().clone(), ctx.pg, ctx.world_size, unit.name)
    return full


def flat_param_name(flat) -> str:
    """The name a flat shard is registered under on its unit's module (use_orig_params=False)."""
    return "_fsdp_flat_param" + ("" if flat.requires_grad else "_frozen")


def register_full_params(unit, flat, full: torch.Tensor) -> list[tuple]:
    """Make every original attribute of `flat` a real nn.Parameter again, a view of `full`, and unregister what
    stood in for them (the flat shard, or the sharded original parameters). Returns what to put back."""
    replaced = [(unit.module, flat_param_name(flat), unit.module._parameters.pop(flat_param_name(flat), None))]
    for slot in flat.slots:
        param = nn.Parameter(full[slot.offset:slot.offset + slot.numel].view(slot.shape),
                             requires_grad=flat.requires_grad)
        for owner, attr, _q in slot.aliases:
            owner.__dict__.pop(attr, None)  # an unsharded view installed by the last forward
            replaced.append((owner, attr, owner._parameters.get(attr)))
            owner._parameters[attr] = param
    return replaced


def put_back(flat, replaced: list[tuple]) -> None:
    """Undo register_full_params: the stand-ins go back, and the attributes are views of the unsharded buffer
    again (with use_orig_params a freed unit's attribute is the registered parameter, so nothing to install)."""
    for owner, attr, previous in reversed(replaced):
        if previous is None:
            owner._parameters.pop(attr, None)
        else:
            owner._parameters[attr] = previous
    if not flat.views_dropped_when_freed:
        flat.install_views()


def settle(model, what: str) -> None:
    """Before gathering the masters outside forward and backward: forget a backward that raised half-way, refuse
    one that is running, and free every unit (so the masters are the only copy that counts)."""
    model._drop_abandoned_backward()
    if model._ctx.in_backward:
        raise RuntimeError(f"{what} cannot be used during backward")
    model._reshard_all("summon")


@contextlib.contextmanager
def summon_full_params(model, writeback: bool = True):
    """`model` is an FSDP root; FSDP.summon_full_params checks that before calling here."""
    ctx = model._ctx
    settle(model, "summon_full_params")
    restored = []  # (unit, flat, full fp32, what to put back)
    try:
        for unit in model.units:
            for flat in unit.flats:
                full = gather_master(unit, flat)
                restored.append((unit, flat, full, register_full_params(unit, flat, full)))
        yield model
    finally:
        with torch.no_grad():
            for unit, flat, full, replaced in restored:
                put_back(flat, replaced)
                if writeback and ctx.strategy is not ShardingStrategy.NO_SHARD:
                    flat.shard.data.copy_(flat.my_chunk(full))
                    if flat.replica is not None:
                        flat.replica.data.copy_(full)
                if unit.state is not UnitState.SHARDED:
                    unit.free("summon")
