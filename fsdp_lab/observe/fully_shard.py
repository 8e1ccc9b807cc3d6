"""What the tracer needs of a `fully_shard` model: where to attach, and its live bytes by kind.

A `FSDP` model carries its run state itself (`model.set_tracer`, `model.memory_report`). A fully_shard model
only has one after its first forward decides the root ([Note: the root of a fully_shard model] in
fsdp_lab/runtime/fully_shard.py), so attaching a tracer decides it now, as that forward would.
Parameters and gradients are DTensors: what a rank holds is their local tensor.
"""
from __future__ import annotations

import torch

from fsdp_lab.runtime.fsdp_module import FSDPModule
from fsdp_lab.runtime.memory import MemoryBytes, _Counter


def is_fully_shard(model) -> bool:
    return isinstance(model, FSDPModule) and hasattr(model, "_fsdp_lab_state")


def root_state(model):
    """The root's FullyShardState, with its run state built (the same lazy init the first forward runs)."""
    if not is_fully_shard(model):
        raise TypeError(f"expected a module fsdp_lab.fully_shard was applied to, got {type(model).__name__}")
    state = model._fsdp_lab_state
    state.lazy_init()
    if state.root is not state:
        raise ValueError(f"{type(model).__name__} is not the root of its fully_shard model: attach to the module "
                         f"whose forward runs first (the one fully_shard was applied to last)")
    return state


def set_tracer(model, tracer) -> None:
    """fully_shard's counterpart of FSDP.set_tracer: every unit of the model reports to `tracer` (None: off)."""
    root_state(model).ctx.tracer = tracer


def local(tensor):
    """This rank's piece of a DTensor (the tensor itself otherwise)."""
    return getattr(tensor, "_local_tensor", tensor)


def memory_report(model, optimizer=None) -> MemoryBytes:
    """The same kinds as fsdp_lab.runtime.memory.memory_report, for a fully_shard model (storage counted once)."""
    counter = _Counter()
    for unit in root_state(model).units:
        for group in unit.flats:
            for slot in group.slots:
                param = slot.registered()
                counter.add("params_sharded", local(param))
                counter.add("grads_sharded", None if param.grad is None else local(param.grad))
            counter.add("params_unsharded", group.full)
            counter.add("grads_unsharded", group.full.grad)
            counter.add("grads_unsharded", group.grad_stash)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    counter.add("optimizer_state", local(value))
    return MemoryBytes(**counter.bytes)


def unit_table(model) -> list[dict]:
    """One row per group (innermost unit first, root last), in the columns of
    fsdp_lab.lessons.experiments.common.unit_table. shard_numel is what this rank holds: unlike a flat shard, no
    padding is stored (it exists only in the send buffer)."""
    rows = []
    for unit in root_state(model).units:
        for group in unit.flats:
            numel = sum(s.numel for s in group.slots)
            rows.append({"unit": unit.name, "is_root": unit.is_root, "requires_grad": group.requires_grad,
                         "numel": numel, "padded_numel": group.full.numel(),
                         "shard_numel": sum(s.local_rows * s.row_numel for s in group.slots),
                         "full_bytes": group.full.numel() * group.full.element_size(),
                         "full_dtype": str(group.full.dtype).replace("torch.", "")})
    return rows
