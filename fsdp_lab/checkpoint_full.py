"""The consolidated model: `full_state_dict` from a live sharded model (collective), `export_checkpoint` from a
checkpoint on disk (one process). Both give the plain GPT's state_dict: original names, fp32, its key order."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from fsdp_lab import checkpoint_files as files
from fsdp_lab.checkpoint_layout import persistent_buffers, state_dict_order
from fsdp_lab.collectives import all_gather_flat
from fsdp_lab.strategy import ShardingStrategy


def _gather_master(group, ctx) -> torch.Tensor:
    """The whole unpadded fp32 master of one flat group, on every rank."""
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return group.shard.detach()[:group.numel]
    if group.replica is not None:
        return group.replica.detach()[:group.numel]
    full = torch.empty(group.padded_numel, dtype=group.shard.dtype, device=group.shard.device)
    work, _bytes = all_gather_flat(full, group.shard.detach().clone(), ctx.group, ctx.world_size)
    work.wait()
    return full[:group.numel]


def full_state_dict(model) -> dict:
    """Collective: every rank must call it. Rank 0 gets the plain model's state dict (original names, fp32,
    on CPU, tied weights sharing one tensor); the other ranks get {}. One unit is gathered at a time."""
    ctx = model._ctx
    if ctx.in_backward:
        raise RuntimeError("full_state_dict cannot run during backward")
    model._reshard_all("summon")
    tensors = {}
    for ui, unit in enumerate(model.units):
        for gi, group in enumerate(unit.groups):
            flat = _gather_master(group, ctx)
            if ctx.rank == 0:
                for si, slot in enumerate(group.slots):
                    piece = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    tensors[(ui, gi, si)] = piece.detach().to("cpu", torch.float32, copy=True)
    if ctx.rank != 0:
        return {}
    out = {name: tensors[(ui, gi, si)] for name, ui, gi, si in state_dict_order(model)}
    for name, buf in persistent_buffers(model):
        out[name] = buf.detach().to("cpu", copy=True)
    return out


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write a checkpoint's model as a plain `torch.save` state dict (original names, fp32). One process, no
    process group, any world size saved it. Returns the checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp

    step_dir = files.resolve(path)
    meta = files.read_meta(step_dir)
    flats = {f"model/{u['key']}": torch.empty(u["numel"]) for u in meta["units"]}
    state = dict(flats)
    buffers = {}
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    for name in meta["buffers"]:
        md = saved[f"buffer/{name}"]
        state[f"buffer/{name}"] = buffers[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    by_name = {}
    for unit in meta["units"]:
        flat = flats[f"model/{unit['key']}"]
        for slot in unit["slots"]:
            tensor = flat[slot["offset"]:slot["offset"] + slot["numel"]].view(slot["shape"]).clone()
            for name in slot["names"]:
                by_name[name] = tensor
    result = {name: by_name[name] for name in meta["state_dict_order"]}
    result.update(buffers)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, out)
    return meta
