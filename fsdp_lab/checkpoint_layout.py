"""The world-size-independent layout of a sharded checkpoint: which piece of which flat buffer each rank
writes and reads. See [Note: a world-size-independent layout] in fsdp_lab/checkpoint.py."""
from __future__ import annotations

import torch

from fsdp_lab.checkpoint_files import CheckpointError
from fsdp_lab.strategy import ShardingStrategy


def group_key(unit, group) -> str:
    return f"{unit.name}/{'params' if group.requires_grad else 'frozen_params'}"


def groups(model):
    return [(group_key(unit, group), unit, group) for unit in model.units for group in unit.groups]


def piece(group, ctx) -> tuple[int, int]:
    """(start, length) of this rank's piece of the unpadded flat buffer: torch.chunk's layout."""
    chunk = -(-group.numel // ctx.world_size)
    start = min(ctx.rank * chunk, group.numel)
    return start, max(0, min(chunk, group.numel - start))


def my_piece(tensor: torch.Tensor, group, ctx) -> torch.Tensor:
    """This rank's piece of a shard-shaped tensor (the shard itself, or an optimizer state of the same shape)."""
    start, length = piece(group, ctx)
    if ctx.strategy is ShardingStrategy.NO_SHARD:  # the "shard" is the whole unpadded buffer
        return tensor[start:start + length]
    return tensor[:length]  # a chunk of the padded buffer: its unpadded front


def mesh_of(model):
    """A 1-D DeviceMesh over the model's process group: what DTensor needs to describe the pieces."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(model._ctx.group, model._ctx.device.type)


def dtensor(local: torch.Tensor, mesh, numel: int, replicated: bool):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placement = Replicate() if replicated else Shard(0)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size([numel]), stride=(1,))


def save_target(tensor: torch.Tensor, group, ctx, mesh):
    """What this rank hands DCP for a shard-shaped tensor: its piece, as a Shard(0) DTensor over the buffer."""
    return dtensor(my_piece(tensor, group, ctx), mesh, group.numel, replicated=False)


def load_target(tensor: torch.Tensor, group, ctx, mesh, is_param: bool):
    """Where DCP writes a loaded buffer: this rank's piece, or the full copy a replicated strategy keeps."""
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return dtensor(tensor[:group.numel], mesh, group.numel, replicated=True)
    if is_param and group.replica is not None:  # ZERO1: the shard is a window onto the replicated master
        return dtensor(group.replica.data[:group.numel], mesh, group.numel, replicated=True)
    return dtensor(my_piece(tensor, group, ctx), mesh, group.numel, replicated=False)


def persistent_buffers(model):
    for prefix, module in model.module.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def state_dict_order(model) -> list[tuple[str, int, int, int]]:
    """(name, unit index, group index, slot index) of every original parameter, in the plain model's
    state_dict() order: by the owning module's position, then the order the parameters were found in."""
    position = {}
    for i, (_name, module) in enumerate(model.module.named_modules(remove_duplicate=False)):
        position.setdefault(id(module), i)
    entries, seen = [], 0
    for ui, unit in enumerate(model.units):
        for gi, group in enumerate(unit.groups):
            for si, slot in enumerate(group.slots):
                for owner, _attr, qualified in slot.aliases:
                    entries.append((position.get(id(owner), 1 << 30), seen, qualified, ui, gi, si))
                    seen += 1
    return [(name, ui, gi, si) for _pos, _seen, name, ui, gi, si in sorted(entries)]


def describe(model) -> list[dict]:
    return [{"key": key, "numel": group.numel, "requires_grad": group.requires_grad,
             "slots": [{"names": [a[2] for a in slot.aliases], "shape": list(slot.shape), "offset": slot.offset,
                        "numel": slot.numel} for slot in group.slots]} for key, _unit, group in groups(model)]


def optimizer_keys(model, optimizer) -> list[tuple[torch.Tensor, str, object]]:
    by_id = {id(group.shard): (key, group) for key, _unit, group in groups(model)}
    out = []
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one of "
                                      f"this FSDP model's flat shards; build it from model.parameters()")
            out.append((p, *by_id[id(p)]))
    return out
