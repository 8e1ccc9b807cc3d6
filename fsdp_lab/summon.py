"""`FSDP.summon_full_params`: the whole fp32 model under its original parameter names, for inspection or edits.

Inside the context every original parameter is a real `nn.Parameter` again (a view into a gathered fp32 copy of
its unit's masters), so `model.named_parameters()` lists `blocks.0.attn.qkv.weight` and friends. On exit, with
writeback=True, each rank copies its own chunk back into its shard, so writes made inside reach the masters.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from fsdp_lab.collectives import all_gather_flat
from fsdp_lab.strategy import ShardingStrategy
from fsdp_lab.unit import UnitState


def _gather_master(unit, group) -> torch.Tensor:
    ctx = unit.ctx
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return group.shard.data
    full = torch.empty(group.padded_numel, dtype=group.shard.dtype, device=group.shard.device)
    work, _ = all_gather_flat(full, group.shard.detach().clone(), ctx.group, ctx.world_size)
    work.wait()
    return full


@contextlib.contextmanager
def summon_full_params(model, writeback: bool = True):
    from fsdp_lab.api import FSDP

    if not isinstance(model, FSDP):
        raise TypeError(f"summon_full_params expects an fsdp_lab.FSDP model, got {type(model).__name__}")
    ctx = model._ctx
    if ctx.in_backward:
        raise RuntimeError("summon_full_params cannot be used during backward")
    model._reshard_all("summon")
    restored = []  # (unit, group, full fp32, registered names)
    try:
        for unit in model.units:
            for group in unit.groups:
                full = _gather_master(unit, group)
                flat_name = "_fsdp_flat_param" + ("" if group.requires_grad else "_frozen")
                unit.module._parameters.pop(flat_name, None)
                registered = []
                for slot in group.slots:
                    view = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    param = nn.Parameter(view, requires_grad=group.requires_grad)
                    for owner, attr, _q in slot.aliases:
                        if hasattr(owner, attr) and attr not in owner._parameters:
                            delattr(owner, attr)
                        owner.register_parameter(attr, param)
                        registered.append((owner, attr))
                restored.append((unit, group, full, registered, flat_name))
        yield model
    finally:
        with torch.no_grad():
            for unit, group, full, registered, flat_name in restored:
                for owner, attr in registered:
                    owner._parameters.pop(attr, None)
                if writeback and ctx.strategy is not ShardingStrategy.NO_SHARD:
                    group.shard.data.copy_(group.my_chunk(full))
                    if group.replica is not None:
                        group.replica.data.copy_(full)
                unit.module.register_parameter(flat_name, group.shard)
                group.install_views()
                if unit.state is not UnitState.SHARDED:
                    unit.free("summon")
