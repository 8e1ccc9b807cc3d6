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


def _gather_master(unit, flat) -> torch.Tensor:
    ctx = unit.ctx
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return flat.shard.data
    full = torch.empty(flat.padded_numel, dtype=flat.shard.dtype, device=flat.shard.device)
    all_gather_flat(full, flat.shard.detach().clone(), ctx.pg, ctx.world_size)
    return full


@contextlib.contextmanager
def summon_full_params(model, writeback: bool = True):
    """`model` is an FSDP root; FSDP.summon_full_params checks that before calling here."""
    ctx = model._ctx
    if ctx.in_backward:
        raise RuntimeError("summon_full_params cannot be used during backward")
    model._reshard_all("summon")
    restored = []  # (unit, flat, full fp32, registered names)
    try:
        for unit in model.units:
            for flat in unit.flats:
                full = _gather_master(unit, flat)
                flat_name = "_fsdp_flat_param" + ("" if flat.requires_grad else "_frozen")
                unit.module._parameters.pop(flat_name, None)
                registered = []
                for slot in flat.slots:
                    view = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    param = nn.Parameter(view, requires_grad=flat.requires_grad)
                    for owner, attr, _q in slot.aliases:
                        if hasattr(owner, attr) and attr not in owner._parameters:
                            delattr(owner, attr)
                        owner.register_parameter(attr, param)
                        registered.append((owner, attr))
                restored.append((unit, flat, full, registered, flat_name))
        yield model
    finally:
        with torch.no_grad():
            for unit, flat, full, registered, flat_name in restored:
                for owner, attr in registered:
                    owner._parameters.pop(attr, None)
                if writeback and ctx.strategy is not ShardingStrategy.NO_SHARD:
                    flat.shard.data.copy_(flat.my_chunk(full))
                    if flat.replica is not None:
                        flat.replica.data.copy_(full)
                unit.module.register_parameter(flat_name, flat.shard)
                flat.install_views()
                if unit.state is not UnitState.SHARDED:
                    unit.free("summon")
