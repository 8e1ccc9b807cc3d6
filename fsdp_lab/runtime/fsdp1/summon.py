"""`FSDP.summon_full_params`: the whole fp32 model under its original parameter names, for inspection or edits.

Inside the context every original parameter is a real `nn.Parameter` again (a view into a gathered fp32 copy of
its unit's masters), so `model.named_parameters()` lists `blocks.0.attn.qkv.weight` and friends. On exit, with
writeback=True, each rank copies its own chunk back into its shard, so writes made inside reach the masters.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.runtime.core.collectives import all_gather_flat, all_reduce_sum
from fsdp_lab.runtime.core.strategy import ShardingStrategy
from fsdp_lab.runtime.core.unit import UnitState


def gather_master(unit, flat, phase: str = "summon_full_params") -> torch.Tensor:
    """The whole padded fp32 master of one flat, on every rank (collective); `phase` names the caller in the
    collective log (fsdp_lab/runtime/core/collective_log.py)."""
    ctx = unit.ctx
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return flat.shard.data
    # On the compute device, where the collective runs (an offloaded shard is copied there first: offload.py)
    full = torch.empty(flat.padded_numel, dtype=flat.shard.dtype, device=flat.compute_device)
    all_gather_flat(full, flat.shard.detach().to(flat.compute_device, copy=True), ctx.pg, ctx.world_size, unit.name,
                    ctx.shard_tag, phase=phase)
    return full


def flat_param_name(flat) -> str:
    """The name a flat shard is registered under on its unit's module (use_orig_params=False)."""
    return "_flat_param" + ("" if flat.requires_grad else "_frozen")  # torch FSDP1: _flat_param


def gather_grad(unit, flat):
    """The whole padded fp32 gradient of one trainable flat on every rank (collective), or None where no rank has
    one. A rank without a gradient contributes zeros, as an unsharded gradient that was never set would be."""
    ctx = unit.ctx
    if not flat.requires_grad:
        return None
    grad = flat.shard.grad
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return grad  # all-reduced: the same whole gradient on every rank
    anyone = torch.tensor([float(grad is not None)], device=flat.compute_device)
    all_reduce_sum(anyone, ctx.pg, ctx.world_size, unit.name, ctx.shard_tag, "summon_full_params", dist.ReduceOp.MAX)
    if not anyone.item():
        return None
    local = grad.detach().to(flat.compute_device, copy=True) if grad is not None else \
        torch.zeros_like(flat.shard, device=flat.compute_device)
    full = torch.empty(flat.padded_numel, dtype=local.dtype, device=local.device)
    all_gather_flat(full, local, ctx.pg, ctx.world_size, unit.name, ctx.shard_tag, phase="summon_full_params")
    return full


def register_full_params(unit, flat, full: torch.Tensor, grad=None) -> list[tuple]:
    """Make every original attribute of `flat` a real nn.Parameter again, a view of `full` (with `grad`'s view as
    its .grad), and unregister what stood in for them (the flat shard, or the sharded original parameters).
    Returns what to put back."""
    replaced = [(unit.module, flat_param_name(flat), unit.module._parameters.pop(flat_param_name(flat), None))]
    for slot in flat.slots:
        param = nn.Parameter(full[slot.offset:slot.offset + slot.numel].view(slot.shape),
                             requires_grad=flat.requires_grad)
        if grad is not None:
            param.grad = grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        for owner, attr, _q in slot.aliases:
            owner.__dict__.pop(attr, None)  # what stands in while sharded, or a view left by the last forward
            replaced.append((owner, attr, owner._parameters.get(attr)))
            owner._parameters[attr] = param
    return replaced


def put_back(flat, replaced: list[tuple]) -> None:
    """Undo register_full_params: the stand-ins go back, and the attributes are what they are outside forward
    (views of a buffer that stays unsharded, or what stands in for a freed one)."""
    for owner, attr, previous in reversed(replaced):
        if previous is None:
            owner._parameters.pop(attr, None)
        else:
            owner._parameters[attr] = previous
    flat.install_views()


def settle(model, what: str) -> None:
    """Before gathering the masters outside forward and backward: forget a backward that raised half-way, refuse
    one that is running, and free every unit (so the masters are the only copy that counts)."""
    model._drop_abandoned_backward()
    if model._ctx.in_backward:
        raise RuntimeError(f"{what} cannot be used during backward")
    model._reshard_all("summon")


def write_back(ctx, flat, full: torch.Tensor, grad) -> None:
    """Copy this rank's part of a summoned (and perhaps edited) full buffer, and gradient, back to the shard."""
    if full.data_ptr() != flat.shard.data_ptr():  # NO_SHARD's master is the live buffer itself, unless offloaded
        flat.shard.data.copy_(full if ctx.strategy is ShardingStrategy.NO_SHARD else flat.my_chunk(full))
        if flat.replica is not None:
            flat.replica.data.copy_(full)
    if grad is not None and (flat.shard.grad is None or grad.data_ptr() != flat.shard.grad.data_ptr()):
        mine = grad if ctx.strategy is ShardingStrategy.NO_SHARD else flat.my_chunk(grad)
        if flat.shard.grad is None:
            flat.shard.grad = mine.to(flat.shard.device, copy=True)
        else:
            flat.shard.grad.copy_(mine)


@contextlib.contextmanager
def summon_full_params(model, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """`model` is an FSDP root; FSDP.summon_full_params checks the options and finds the roots.

    [Note: recurse=False] torch FSDP1 has one FSDP object per wrapped module, and recurse=False summons only the
    one it is given: its own parameters, not those of the FSDP modules nested in it (TRL summons the root this way
    to generate, while the nested ones gather in their own forwards). Here too each unit has its FSDP instance
    ([Note: one FSDP instance per unit] in nesting.py), and the root's unit is what torch's root FSDP module owns:
    the parameters no wrapped submodule claims. So recurse=False summons the given instance's own unit only; every
    other unit stays sharded, as torch's nested FSDP modules do,
    and still gathers in its own forward. A unit that is summoned does not gather or free in forward: it
    computes with the summoned parameters.

    [Note: a unit without flats] A unit can own no parameter at all: the root of an nn.Sequential whose every
    Linear the policy wrapped. It is marked summoned like the others, but it has no flat to restore, so the mark
    is undone from the list of marked units, not from the list of gathered flats (which would leave it marked,
    and every later summon, load_state_dict and apply would take itself for a nested one).
    """
    ctx = model._ctx
    if any(u.summoned for u in model._root.units):
        raise RuntimeError("summon_full_params cannot be nested: this model's parameters are already summoned")
    settle(model, "summon_full_params")
    # an inner instance ([Note: one FSDP instance per unit] in nesting.py) summons its subtree, or its own unit
    units = model.units if recurse else [u for u in model.units if u.module is model.module]
    keep = not rank0_only or ctx.rank == 0  # rank0_only: the others take part in the gathers and see shards
    restored = []  # (unit, flat, full fp32, full gradient or None, what to put back or None)
    marked = []  # every unit marked summoned, flats or none ([Note: a unit without flats])
    # the FSDP instances summoned, on every rank as in torch (rank0_only too): their names lose the levels
    instances = [m for m in model.modules() if m.__dict__.get("_root") is model._root] if recurse else [model]
    try:
        for instance in instances:
            instance._summoning = True
        for unit in units:
            for flat in unit.flats:
                full, grad = gather_master(unit, flat), gather_grad(unit, flat) if with_grads else None
                if offload_to_cpu:
                    full, grad = full.cpu(), grad.cpu() if grad is not None else None
                replaced = register_full_params(unit, flat, full, grad) if keep else None
                restored.append((unit, flat, full, grad, replaced))
            unit.summoned = keep
            marked.append(unit)
        yield model
    finally:
        for instance in instances:
            instance._summoning = False
        for unit in marked:
            unit.summoned = False
        with torch.no_grad():
            for unit, flat, full, grad, replaced in restored:
                if replaced is not None:
                    put_back(flat, replaced)
                if writeback:
                    write_back(ctx, flat, full, grad)
                if unit.state is not UnitState.SHARDED:
                    unit.free("summon")
