"""`FSDP.optim_state_dict` and `FSDP.optim_state_dict_to_load`: the optimizer's state under the original
parameter names, as torch FSDP1 gives it.

The optimizer steps on flat shards (or, with use_orig_params, on each rank's 1-D pieces of the original
parameters), so its own `state_dict()` is keyed by shard indices and holds 1/N of each state tensor, cut wherever
the flat buffer's chunk boundary falls. torch FSDP1 turns that into a dict a plain module's optimizer would have:

    {"state": {"blocks.0.up.weight": {"step": tensor(3.), "exp_avg": (9, 7) tensor, ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": ["embed.weight", "blocks.0.up.weight", ...]}]}

[Note: optimizer state by original name] Per flat buffer, each state value that has one element per shard
element (AdamW's exp_avg and exp_avg_sq) is all-gathered into the padded flat layout, then cut per original
parameter and viewed to its shape; any other value (AdamW's step, a scalar) is the same on every rank that holds
it and is kept as it is. Under FULL_STATE_DICT the result holds full tensors (on the CPU unless
FullOptimStateDictConfig(offload_to_cpu=False); rank0_only: an empty dict on the other ranks, which still take
part). Under SHARDED_STATE_DICT each full tensor becomes this rank's dim-0 DTensor piece, the layout the model's
SHARDED_STATE_DICT gives, so torch.distributed.checkpoint saves it and loads it on any world size. Loading
inverts the cut: each parameter's full tensor is laid into a padded flat buffer and this rank keeps its chunk.
Neither form depends on the world size, so a run saved on 2 ranks continues on 4. Loading also takes the
ShardedTensors torch's load_sharded_optimizer_state_dict reads a DCP checkpoint into, the way torch's FSDP1
documentation resumes ([Note: reading a checkpoint into ShardedTensors]). One flat buffer at a time is
gathered, never the whole state. Tied parameters appear once, under their first name, as in torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core.collectives import all_gather_flat
from fsdp_lab.runtime.core.side_collectives import issue
from fsdp_lab.runtime.fsdp1.state_dict import StateDictType, shard_dim0


def _check_group(model, group) -> None:
    if group is not None and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(model._ctx.pg):
        raise ValueError(f"group covers ranks {dist.get_process_group_ranks(group)} but the model is sharded over "
                         f"{dist.get_process_group_ranks(model._ctx.pg)}: pass the model's process group or None")


def _owners(model) -> dict:
    """id(parameter the optimizer may hold) -> (flat, slots it covers)."""
    owners = {}
    for unit in model.units:
        for flat in unit.flats:
            owners[id(flat.shard)] = (flat, list(flat.slots))
            for param, slot in zip(flat.orig_params or (), flat.slots):
                owners[id(param)] = (flat, [slot])
    return owners


def _optimizer_params(optim, model) -> list:
    params = [p for group in optim.param_groups for p in group["params"]]
    owners = _owners(model)
    foreign = [tuple(p.shape) for p in params if id(p) not in owners]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} parameter(s) this FSDP model does not own (shapes "
                         f"{foreign[:3]}): build it from model.parameters() after wrapping")
    return params


def _per_element(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _local_flat_state(flat, params_state: dict) -> dict:
    """This rank's optimizer state for one flat, as shard-sized tensors (per element) and plain values."""
    if flat.orig_params is None:
        state = params_state.get(id(flat.shard), {})
        return {k: (v if _per_element(v, flat.shard_numel) else ("value", v)) for k, v in state.items()}
    out = {}
    for param, slot in zip(flat.orig_params, flat.slots):
        start, length = flat.local_range(slot)
        for key, value in params_state.get(id(param), {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == param.shape and length:
                buf = out.setdefault(key, torch.zeros(flat.shard_numel, dtype=value.dtype, device=value.device))
                buf[start:start + length].copy_(value)
            elif not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == param.shape):
                out.setdefault(key, ("value", value))
    return out


def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict:
    """Collective: `optim`'s state keyed by original parameter names ([Note: optimizer state by original name]),
    full or sharded as FSDP.state_dict_type says. `optim_state_dict`: optim.state_dict() taken earlier."""
    _check_group(model, group)
    ctx, settings = model._ctx, model._state_dict_settings
    config = settings.optim_state_dict_config
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    keep = sharded or not config.rank0_only or ctx.rank == 0
    params = _optimizer_params(optim, model)
    source = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    params_state = {id(p): source["state"][i] for i, p in enumerate(params) if i in source["state"]}
    owners = _owners(model)
    flats = list(dict.fromkeys(owners[id(p)][0] for p in params))  # in the optimizer's order, once each
    local = [_local_flat_state(flat, params_state) for flat in flats]
    # Which keys each rank has per flat, and its plain values: a rank may hold none of a use_orig_params parameter.
    described = [{k: (v if isinstance(v, tuple) else ("tensor", v.dtype)) for k, v in s.items()} for s in local]
    everyone = [None] * ctx.world_size
    issue(dist.all_gather_object, everyone, described, group=ctx.pg, phase="optim_state_dict")
    mesh = None
    if sharded:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(ctx.pg, ctx.device.type)
    state = {}
    for i, flat in enumerate(flats):
        merged = {}
        for theirs in everyone:
            for key, value in theirs[i].items():
                merged.setdefault(key, value)
        for key, (kind, value) in merged.items():
            if kind == "tensor":  # per element: gather the padded flat layout, one flat at a time
                mine = local[i].get(key)
                mine = torch.zeros(flat.shard_numel, dtype=value) if mine is None else mine
                full = _gather(ctx, flat, mine.to(ctx.device, copy=True))
            for slot in flat.slots:
                if kind == "tensor":
                    out = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    if sharded:
                        out = shard_dim0(out, mesh, ctx.rank, ctx.world_size, config.offload_to_cpu)
                    else:
                        out = out.to("cpu", copy=True) if config.offload_to_cpu else out.clone()
                else:
                    out = value.clone() if isinstance(value, torch.Tensor) else value
                if keep:
                    state.setdefault(slot.name, {})[key] = out
    if not keep:
        return {}
    groups = []
    for group_state in source["param_groups"]:
        names = [slot.name for i in group_state["params"] for slot in owners[id(params[i])][1]]
        groups.append({**{k: v for k, v in group_state.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def _gather(ctx, flat, mine: torch.Tensor) -> torch.Tensor:
    """The padded flat buffer of one per-element state value (NO_SHARD: every rank's is already whole)."""
    if flat.shard_numel == flat.padded_numel:
        return mine
    full = torch.empty(flat.padded_numel, dtype=mine.dtype, device=mine.device)
    all_gather_flat(full, mine, ctx.pg, ctx.world_size, flat.unit_name, ctx.shard_tag, phase="optim_state_dict")
    return full


def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer: bool = False,
                             load_directly: bool = False, group=None) -> dict:
    """Collective: turn a dict from FSDP.optim_state_dict (full or sharded, any world size) into what
    `optim.load_state_dict` takes on this rank; load_directly=True loads it too ([Note: optimizer state by original
    name])."""
    _check_group(model, group)
    if is_named_optimizer:
        raise ValueError("FSDP.optim_state_dict_to_load option is_named_optimizer=True (torchrec's KeyedOptimizer) "
                         "is not supported by fsdp_lab; pass a torch.optim optimizer's dict")
    ctx, settings = model._ctx, model._state_dict_settings
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and settings.optim_state_dict_config.rank0_only:
        box = [optim_state_dict if ctx.rank == 0 else None]  # rank0_only: only rank 0 holds it
        # patient ([Note: patient collectives] in side_collectives.py): rank 0 has just read the dict, maybe from disk
        issue(dist.broadcast_object_list, box, src=dist.get_global_rank(ctx.pg, 0), group=ctx.pg,
              phase="optim_state_dict", patient=True)
        optim_state_dict = box[0]
    if not isinstance(optim_state_dict, dict) or set(optim_state_dict) != {"state", "param_groups"}:
        raise ValueError(f"optim_state_dict should be FSDP.optim_state_dict's dict with keys 'state' and "
                         f"'param_groups', got {type(optim_state_dict).__name__} with keys "
                         f"{sorted(optim_state_dict) if isinstance(optim_state_dict, dict) else '-'}")
    params = _optimizer_params(optim, model)
    owners = _owners(model)
    saved = optim_state_dict["state"]
    by_alias = {q: slot.name for p in params for slot in owners[id(p)][1] for _m, _a, q in slot.aliases}
    unknown = sorted(set(saved) - set(by_alias))
    if unknown:
        raise ValueError(f"optim_state_dict has state for {len(unknown)} parameter(s) this optimizer does not hold: "
                         f"{unknown[:3]}")
    saved = {by_alias[q]: v for q, v in saved.items()}
    full_values = {name: {k: _whole(v, ctx.device) for k, v in sorted(entry.items())}
                   for name, entry in sorted(saved.items())}  # the same order on every rank: collectives
    state = {}
    for i, param in enumerate(params):
        flat, slots = owners[id(param)]
        entries = [full_values.get(slot.name) for slot in flat.slots]
        if all(e is None for e in entries):
            continue
        keys = dict.fromkeys(k for e in entries if e for k in e)
        out = {}
        for key in keys:
            values = [e.get(key) if e else None for e in entries]
            if all(_per_param(v, s) for v, s in zip(values, flat.slots) if v is not None):
                chunk = _my_chunk(flat, values)
                if flat.orig_params is None:
                    out[key] = chunk
                else:
                    start, length = flat.local_range(slots[0])
                    out[key] = chunk[start:start + length].clone()
            else:
                value = next(v for v in values if v is not None)
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[i] = out
    if len(optim_state_dict["param_groups"]) != len(optim.param_groups):
        raise ValueError(f"optim_state_dict has {len(optim_state_dict['param_groups'])} param groups, the optimizer "
                         f"{len(optim.param_groups)}")
    groups, start = [], 0
    for theirs, ours in zip(optim_state_dict["param_groups"], optim.param_groups):
        groups.append({**{k: v for k, v in theirs.items() if k != "params"},
                       "params": list(range(start, start + len(ours["params"])))})
        start += len(ours["params"])
    result = {"state": state, "param_groups": groups}
    if load_directly:
        optim.load_state_dict(result)
    return result


def _whole(value, device: torch.device):
    """The full tensor of a saved state value, gathered if it is distributed: a DTensor (the sharded dict this
    module gives) or a ShardedTensor (what torch's load_sharded_optimizer_state_dict reads a checkpoint into,
    chunked over the whole world whatever the model's layout: [Note: reading a checkpoint into ShardedTensors])."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, ShardedTensor):
        return _gather_sharded_tensor(value, device)
    return value


# [Note: reading a checkpoint into ShardedTensors] torch's load_sharded_optimizer_state_dict does not ask the
# model how it lays its optimizer state out: it allocates each saved tensor as a ShardedTensor cut on dim 0 into
# one chunk per rank of its process group (the default group), and DCP fills it. Which rows a rank holds there has
# nothing to do with the flat shard it keeps, so each value is first made whole: every rank sends its local shards
# (flattened, end to end, padded to the largest rank's count), one all-gather moves them, and each shard is put
# back at its offsets from the ShardedTensor's global metadata. One tensor at a time, so the peak is one full
# state tensor beside the flat state being built, as for the DTensor path.
def _gather_sharded_tensor(value, device: torch.device) -> torch.Tensor:
    meta = value.metadata()
    pg = value._process_group
    world = dist.get_world_size(pg)
    dtype = meta.tensor_properties.dtype
    by_rank = [[m for m in meta.shards_metadata if m.placement.rank() == r] for r in range(world)]
    counts = [sum(_numel(m.shard_sizes) for m in shards) for shards in by_rank]
    width = max(counts + [1])
    mine = torch.zeros(width, dtype=dtype, device=device)
    local = sorted(value.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
    expected = sorted(by_rank[dist.get_rank(pg)], key=lambda m: tuple(m.shard_offsets))
    if [tuple(s.metadata.shard_offsets) for s in local] != [tuple(m.shard_offsets) for m in expected]:
        raise ValueError(f"ShardedTensor of size {tuple(meta.size)}: this rank's local shards (offsets "
                         f"{[tuple(s.metadata.shard_offsets) for s in local]}) are not the ones its metadata "
                         f"places here ({[tuple(m.shard_offsets) for m in expected]})")
    at = 0
    for shard in local:
        n = shard.tensor.numel()
        mine[at:at + n].copy_(shard.tensor.reshape(-1))
        at += n
    everyone = torch.empty(world * width, dtype=dtype, device=device)
    issue(dist.all_gather_into_tensor, everyone, mine, group=pg, phase="optim_state_dict")
    full = torch.empty(tuple(meta.size), dtype=dtype, device=device)
    for r, shards in enumerate(by_rank):
        at = r * width
        for m in sorted(shards, key=lambda m: tuple(m.shard_offsets)):
            n = _numel(m.shard_sizes)
            where = tuple(slice(o, o + size) for o, size in zip(m.shard_offsets, m.shard_sizes))
            full[where].copy_(everyone[at:at + n].view(tuple(m.shard_sizes)))
            at += n
    return full


def _numel(sizes) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n


def _per_param(value, slot) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(slot.shape)


def _my_chunk(flat, values: list) -> torch.Tensor:
    """This rank's chunk of the padded flat buffer the per-parameter `values` (None: zeros) are laid into."""
    first = next(v for v in values if v is not None)
    full = torch.zeros(flat.padded_numel, dtype=first.dtype, device=flat.shard.device)
    for slot, value in zip(flat.slots, values):
        if value is not None:
            full[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1))
    return full[flat.shard_offset:flat.shard_offset + flat.shard_numel].clone()
