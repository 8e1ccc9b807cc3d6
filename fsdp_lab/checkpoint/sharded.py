"""Sharded checkpoints through torch.distributed.checkpoint (DCP), and the full state dict for one-GPU use.

    save(model, optimizer, directory, step)   every rank writes its own piece, in parallel; atomic (see below)
    load(model, optimizer, path) -> meta      any world size, any sharding strategy, same wrap policy
    full_state_dict(model)                    rank 0 gets {original name: fp32 tensor}, the plain model's keys
    export_full_state_dict(model, out)        that, written to `out` atomically; a non-finite model is refused
    export_checkpoint(path, out)              a plain torch.save file from a checkpoint, in one process

[Note: a world-size-independent layout] A rank's shard is a chunk of its unit's *padded* flat buffer, and the
padding depends on the world size N, so saving the shards as they are would tie a checkpoint to N. Instead we
save, for each unit and requires_grad kind, the *unpadded* flat buffer: one 1-D tensor of `numel` elements,
described to DCP as a DTensor sharded on dim 0. Rank r's piece is [r·S, min((r+1)·S, numel)) with
S = ceil(numel/N): exactly the unpadded front of its shard, and exactly torch.chunk's uneven layout, which is
what DTensor's Shard(0) means, so the piece is a view and nothing is copied. AdamW's exp_avg and exp_avg_sq
(same shape as the shard) are saved the same way; its `step` as a plain replicated tensor. Loading on N' ranks,
each rank asks DCP for its new piece and DCP reads the overlapping ranges of the old ones: 4 ranks → 2 ranks is
a reshard, not a conversion. NO_SHARD loads into its full copy (Replicate placement), ZERO1 into its shard (the
next forward refreshes its replica), so a FULL_SHARD checkpoint also resumes under NO_SHARD or ZERO1. The padding
is zero and stays zero (its gradient is zero), so it is simply left zero on load.

Why not one entry per original parameter: a shard cuts parameters at arbitrary elements (half a row of a
matrix), which Shard placements cannot describe without copies. The flat layout's price is that a checkpoint is
tied to the unit layout (which parameters form which unit, in which order). That depends on the model and the
wrap policy only, never on N or the strategy; it is recorded in `fsdp_lab.json` with every parameter's name,
shape and offset, checked on load, and used by the export to restore the original names. Why DTensor and not
ShardedTensor: torch.distributed._shard is deprecated; DTensor is what DCP is built around in torch ≥ 2.4.

Atomicity (a tmp directory, then rename, then an atomic `latest` pointer) is in fsdp_lab/checkpoint/files.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fsdp_lab.checkpoint import files, trust
from fsdp_lab.checkpoint.files import FORMAT, CheckpointError
from fsdp_lab.checkpoint.ownership import output_problem
from fsdp_lab.runtime.core.side_collectives import issue, patient_timeout
from fsdp_lab.runtime.core.strategy import ShardingStrategy
from fsdp_lab.runtime.features.hybrid import checkpoint_mesh
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.state_dict import FullStateDictConfig, StateDictType
from fsdp_lab.user_files import replace_file


# -- the layout: which piece of which flat buffer each rank writes and reads ------------------------------
def flat_key(unit, flat) -> str:
    return f"{unit.name}/{'params' if flat.requires_grad else 'frozen_params'}"


def flats(model):
    return [(flat_key(unit, flat), unit, flat) for unit in model.units for flat in unit.flats]


def piece(flat, ctx) -> tuple[int, int]:
    """(start, length) of this rank's piece of the unpadded flat buffer: torch.chunk's layout."""
    chunk = -(-flat.numel // ctx.world_size)
    start = min(ctx.rank * chunk, flat.numel)
    return start, max(0, min(chunk, flat.numel - start))


def my_piece(tensor: torch.Tensor, flat, ctx) -> torch.Tensor:
    """This rank's piece of a shard-shaped tensor (the shard itself, or an optimizer state of the same shape)."""
    start, length = piece(flat, ctx)
    if ctx.strategy is ShardingStrategy.NO_SHARD:  # the "shard" is the whole unpadded buffer
        return tensor[start:start + length]
    return tensor[:length]  # a chunk of the padded buffer: its unpadded front


def mesh_of(model):
    """A 1-D DeviceMesh over the model's process group: what DTensor needs to describe the pieces. Under
    HYBRID_SHARD a 2-D one (replicate, shard): every shard group holds the same pieces, which DCP then writes once
    and loads into each ([Note: hybrid checkpoints])."""
    from torch.distributed.device_mesh import DeviceMesh

    if model._ctx.replicate_pg is not None:
        return checkpoint_mesh(model._groups, model._ctx.device.type)
    return DeviceMesh.from_group(model._ctx.pg, model._ctx.device.type)


def job_group(model):
    """[Note: hybrid checkpoints] The group that saves and loads together and whose rank 0 publishes: the model's
    process group, or under HYBRID_SHARD every rank (None: the default group), so two shard groups never both
    publish one step. The shard and replicate groups must then tile the whole job (checkpoint_mesh checks)."""
    return None if model._ctx.replicate_pg is not None else model._ctx.pg


def dtensor(local: torch.Tensor, mesh, numel: int, replicated: bool):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Replicate()] * (mesh.ndim - 1) + [Replicate() if replicated else Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def save_target(tensor: torch.Tensor, flat, ctx, mesh):
    """What this rank hands DCP for a shard-shaped tensor: its piece, as a Shard(0) DTensor over the buffer."""
    return dtensor(my_piece(tensor, flat, ctx), mesh, flat.numel, replicated=False)


def load_target(tensor: torch.Tensor, flat, ctx, mesh, is_param: bool):
    """Where DCP writes a loaded buffer: this rank's piece, or the full copy NO_SHARD keeps. ZERO1 loads its
    shard like the sharded strategies: the next forward refreshes the replica from the shards."""
    if ctx.strategy is ShardingStrategy.NO_SHARD:
        return dtensor(tensor[:flat.numel], mesh, flat.numel, replicated=True)
    return dtensor(my_piece(tensor, flat, ctx), mesh, flat.numel, replicated=False)


def persistent_buffers(model):
    for prefix, module in model.module.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def state_dict_order(model) -> list[tuple[str, int, int, int]]:
    """(name, unit index, flat index, slot index) of every original parameter, in the plain model's
    state_dict() order: by the owning module's position, then the order the parameters were found in."""
    position = {}
    for i, (_name, module) in enumerate(model.module.named_modules(remove_duplicate=False)):
        position.setdefault(id(module), i)
    entries, seen = [], 0
    for ui, unit in enumerate(model.units):
        for gi, flat in enumerate(unit.flats):
            for si, slot in enumerate(flat.slots):
                for owner, _attr, qualified in slot.aliases:
                    entries.append((position.get(id(owner), 1 << 30), seen, qualified, ui, gi, si))
                    seen += 1
    return [(name, ui, gi, si) for _pos, _seen, name, ui, gi, si in sorted(entries)]


def describe(model) -> list[dict]:
    return [{"key": key, "numel": flat.numel, "requires_grad": flat.requires_grad,
             "slots": [{"names": [a[2] for a in slot.aliases], "shape": list(slot.shape), "offset": slot.offset,
                        "numel": slot.numel} for slot in flat.slots]} for key, _unit, flat in flats(model)]


def optimizer_members(model, optimizer) -> list[tuple[str, object, list[tuple[torch.Tensor, int, int]]]]:
    """(key, flat, [(parameter, start in the shard, length), ...]) for each flat the optimizer updates. The
    parameter is the flat shard itself, or with use_orig_params each original parameter, a view of its part of
    the shard ([Note: original parameters] in fsdp_lab/runtime/fsdp1/flat_param.py): their states are laid side by side
    into one shard-shaped tensor, so both modes save the same layout."""
    owner = {}
    for key, _unit, flat in flats(model):
        owner[id(flat.shard)] = (key, flat, 0, flat.shard_numel)
        for p, slot in zip(flat.orig_params or [], flat.slots):
            owner[id(p)] = (key, flat, *flat.local_range(slot))
    grouped: dict[str, tuple] = {}
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            if id(p) not in owner:
                raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one of "
                                      f"this FSDP model's parameters; build it from model.parameters()")
            key, flat, start, length = owner[id(p)]
            grouped.setdefault(key, (flat, []))[1].append((p, start, length))
    return [(key, flat, members) for key, (flat, members) in grouped.items()]


def shard_shaped_state(optimizer, flat, members, name: str):
    """One optimizer state of one flat: a shard-shaped tensor for a per-element state (exp_avg), else the value
    itself (AdamW's step, equal for every member). None if no member has it (this rank holds none of it)."""
    values = [(p, start, length, optimizer.state[p][name]) for p, start, length in members
              if name in optimizer.state.get(p, {})]
    if not values:
        return None, False
    for _p, _s, _n, value in values:
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"optimizer state '{name}' is a {type(value).__name__}; only tensors can be saved")
    p0, _s, _n, first = values[0]
    if first.shape != p0.shape:
        return first, False
    if p0 is flat.shard:
        return first, True
    out = torch.zeros(flat.shard_numel, dtype=first.dtype, device=first.device)
    for _p, start, length, value in values:
        out[start:start + length].copy_(value.detach())
    return out, True


def on_rank0(fn: Callable, pg=None, device: Optional[torch.device] = None):
    """Run fn on the group's rank 0 and give every rank its result; any error there is raised on every rank as a
    CheckpointError, so no rank is left waiting in the broadcast. The others wait for rank 0's work (files, mostly)
    with the patient timeout ([Note: patient collectives] in fsdp_lab/runtime/core/side_collectives.py)."""
    box = [None]
    if dist.get_rank(pg) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # reported on every rank, not just the one that failed
            box[0] = ("error", str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}")
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    issue(dist.broadcast_object_list, box, src=src, group=pg, device=device, phase="checkpoint", patient=True)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value, every_rank=True)
    return value


def _on_rank0(fn: Callable, model):
    """on_rank0 over the model's process group (its CUDA device carries the broadcast where there is one)."""
    ctx = model._ctx
    return on_rank0(fn, job_group(model), ctx.device if ctx.device.type == "cuda" else None)


def _rank_exceptions(err: BaseException) -> dict[int, BaseException]:
    """{rank: its exception}. DCP's CheckpointException maps each failing rank to an (exception, stack frames)
    pair; any other error is this rank's own."""
    failures = getattr(err, "failures", None)
    if not (isinstance(failures, dict) and failures):
        return {-1: err}
    return {rank: wrapped[0] if isinstance(wrapped, tuple) else wrapped for rank, wrapped in failures.items()}


def _one_line(err: BaseException) -> str:
    """DCP's CheckpointException carries every rank's traceback (about 100 lines per rank): keep each failing
    rank's exception, one line each."""
    parts = []
    for rank, exc in sorted(_rank_exceptions(err).items()):
        text = str(exc).strip().splitlines()
        parts.append(("" if rank < 0 else f"rank {rank}: ") + f"{type(exc).__name__}: {text[-1] if text else ''}")
    return "; ".join(parts)


def non_finite(model, optimizer=None) -> list[tuple[int, list[str]]]:
    """Collective: the ranks whose parameter shards (or, given `optimizer`, optimizer state) hold NaN or inf,
    each with the keys that do ("model/<unit>", "optim/<unit>/<state>"). The one check both a checkpoint save
    and a full-state-dict export run before they write anything."""
    bad = []
    for key, _unit, flat in flats(model):
        if not torch.isfinite(flat.shard.detach()).all():
            bad.append(f"model/{key}")
    if optimizer is not None:
        for key, _flat, members in optimizer_members(model, optimizer):
            for p, _start, _length in members:
                for name, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                            not torch.isfinite(value.detach()).all() and f"optim/{key}/{name}" not in bad:
                        bad.append(f"optim/{key}/{name}")
    ctx = model._ctx
    found = [None] * ctx.world_size
    issue(dist.all_gather_object, found, bad, group=ctx.pg, phase="checkpoint", patient=True)
    return [(rank, keys) for rank, keys in enumerate(found) if keys]


def _refuse_non_finite(model, optimizer, step: int, directory) -> None:
    """Collective: raise CheckpointError on every rank if any rank's parameters or optimizer state hold NaN or
    inf. Such a state is not saved, so `latest` keeps naming the last finite one."""
    named = non_finite(model, optimizer)
    if named:
        newest = trust.published(directory)
        rank, keys = named[0]
        raise CheckpointError(f"step {step} not saved: {keys[0]} holds NaN or inf on rank {rank} "
                              f"({len(named)} rank(s) affected); the newest checkpoint is still "
                              f"{newest[0].path.name if newest else 'none'}", every_rank=True)


def save(model, optimizer, directory: str | os.PathLike, step: int, extra: Optional[dict] = None,
         writer_factory: Optional[Callable] = None, run: Optional[str] = None) -> Path:
    """Save model (and optimizer) state as `directory/step_N` on every rank; return the published path.
    `writer_factory(path)` may supply the DCP StorageWriter (the tests use it to break a save half-way).
    `run`: the id of the run saving, recorded in the manifest (what --keep-last prunes; see ownership.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    ctx, mesh = model._ctx, mesh_of(model)
    _refuse_non_finite(model, optimizer, step, directory)
    tmp = Path(_on_rank0(lambda: str(files.prepare_tmp(directory, step)), model))
    state = {"step": torch.tensor(step, dtype=torch.int64)}
    for key, _unit, flat in flats(model):
        state[f"model/{key}"] = save_target(flat.shard.detach(), flat, ctx, mesh)
    for name, buf in persistent_buffers(model):
        state[f"buffer/{name}"] = buf.detach()
    optim_meta = None
    if optimizer is not None:
        for key, flat, members in optimizer_members(model, optimizer):
            names = dict.fromkeys(name for p, _s, _n in members for name in optimizer.state.get(p, {}))
            for name in names:
                value, per_element = shard_shaped_state(optimizer, flat, members, name)
                if value is not None:
                    state[f"optim/{key}/{name}"] = \
                        save_target(value.detach(), flat, ctx, mesh) if per_element else value
        optim_meta = {"class": type(optimizer).__name__,
                      "param_groups": [{k: v for k, v in pg.items() if k != "params"}
                                       for pg in optimizer.param_groups]}
    writer = (writer_factory or dcp.FileSystemWriter)(str(tmp))
    try:
        with patient_timeout(job_group(model)):  # DCP writes each rank's files between its collectives
            dcp.save(state, storage_writer=writer, process_group=job_group(model))
    except (Exception, CheckpointException) as err:
        needed = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in state.values())
        raise CheckpointError(f"saving step {step} into {tmp} failed; '{files.LATEST}' still names the previous "
                              f"checkpoint. {files.disk_full(_rank_exceptions(err).values(), tmp, needed)}"
                              f"Cause: {_one_line(err)}", every_rank=True) from err
    cfg = getattr(model.module, "cfg", None)
    meta = {"format": FORMAT, "step": step, "world_size": ctx.world_size, "strategy": ctx.strategy.name,
            "torch": torch.__version__, "units": describe(model),
            "model_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "state_dict_order": [name for name, *_ in state_dict_order(model)],
            "buffers": [name for name, _ in persistent_buffers(model)], "optimizer": optim_meta,
            "extra": extra or {}, "run": run}

    def finish():
        meta["checksums"] = trust.file_checksums(tmp)
        (tmp / files.META_FILE).write_text(json.dumps(meta, indent=1, default=str), encoding="utf-8")
        return str(files.publish(directory, step))

    return Path(_on_rank0(finish, model))


def _check_layout(meta: dict, model, where) -> None:
    saved = {u["key"]: u["numel"] for u in meta["units"]}
    ours = {key: flat.numel for key, _unit, flat in flats(model)}
    if saved == ours:
        return
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    sizes = [f"{k}: saved {saved[k]}, model {ours[k]}" for k in sorted(set(saved) & set(ours)) if saved[k] != ours[k]]
    raise CheckpointError(f"{where} does not fit this model (saved for {meta.get('model_config')}). Units only in "
                          f"the model: {missing[:4]}; only in the checkpoint: {extra[:4]}; element counts that "
                          f"differ: {sizes[:4]}. Use the same preset and wrap policy as the run that saved it.")


def load(model, optimizer, path: str | os.PathLike, allow_unverified: bool = False) -> dict:
    """Load `path` (a checkpoint directory: its newest checkpoint; or one step directory) into model and
    optimizer, whatever world size and strategy saved it, once rank 0 has verified every file (trust.py).
    Returns the checkpoint's metadata (meta["step"] is the step; meta["note"] what resume should say)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model._reshard_all("summon")  # nothing gathered may outlive the load with stale values
    ctx, mesh = model._ctx, mesh_of(model)
    def find():
        found = trust.find(path, allow_unverified)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} yet")
        return str(found.step_dir), found.note

    where, note = _on_rank0(find, model)
    step_dir = Path(where)
    meta = dict(trust.read_meta(step_dir), note=note)
    _check_layout(meta, model, step_dir)
    reader = dcp.FileSystemReader(str(step_dir))
    saved = reader.read_metadata().state_dict_metadata
    state = {"step": torch.zeros((), dtype=torch.int64)}
    for key, _unit, flat in flats(model):
        state[f"model/{key}"] = load_target(flat.shard.data, flat, ctx, mesh, is_param=True)
    for name, buf in persistent_buffers(model):
        state[f"buffer/{name}"] = buf.data
    loaded_optim = []
    if optimizer is not None:
        for key, flat, members in optimizer_members(model, optimizer):
            prefix = f"optim/{key}/"
            entry = {}  # name -> (shard-shaped or scalar tensor, per element?)
            for full_key, md in saved.items():
                if not full_key.startswith(prefix):
                    continue
                if tuple(md.size) == (flat.numel,):
                    target = torch.zeros(flat.shard_numel, dtype=md.properties.dtype, device=flat.shard.device)
                    state[full_key] = load_target(target, flat, ctx, mesh, is_param=False)
                    entry[full_key[len(prefix):]] = (target, True)
                else:
                    state[full_key] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                    entry[full_key[len(prefix):]] = (state[full_key], False)
            loaded_optim.append((flat, members, entry))
    try:
        with patient_timeout(job_group(model)):
            dcp.load(state, storage_reader=reader, process_group=job_group(model))
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"loading {step_dir} failed: {_one_line(err)}", every_rank=True) from err
    restored = []  # (parameter, its state): the flat shard, or with use_orig_params each original parameter
    for flat, members, entry in loaded_optim:
        for p, start, length in members if entry else ():
            if p is flat.shard:
                restored.append((p, {name: value for name, (value, _) in entry.items()}))
            elif length:  # an original parameter this rank holds none of has no state (it never gets a grad)
                restored.append((p, {name: value[start:start + length].clone() if per_element else value.clone()
                                     for name, (value, per_element) in entry.items()}))
    if optimizer is not None:
        restore_optimizer_state(optimizer, restored)
    for _key, _unit, flat in flats(model):
        flat.replica_epoch = None  # ZERO1: only this rank's chunk of the replica was loaded
    if int(state["step"]) != meta["step"]:
        raise CheckpointError(f"{step_dir}: fsdp_lab.json says step {meta['step']}, the tensors say "
                              f"{int(state['step'])}")
    return meta


def restore_optimizer_state(optimizer, loaded: list) -> None:
    """Hand the loaded state to `optimizer.load_state_dict`, which puts each value on its parameter's device and
    dtype (and `step` where fused or capturable AdamW needs it: a float32 on the GPU). Assigning the tensors
    directly would leave `step` on the CPU, where fused AdamW on CUDA refuses it."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    current = optimizer.state_dict()
    state = {index[id(p)]: entry for p, entry in loaded if entry}
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


# -- the consolidated model: from a live sharded model (collective) or from disk (one process) ------------
def full_state_dict(model) -> dict:
    """Collective: every rank must call it. Rank 0 gets the plain model's state dict (original names, fp32,
    on CPU, tied weights sharing one tensor); the other ranks get {}. One unit is gathered at a time: it is
    `model.state_dict()` with torch FSDP1's usual FullStateDictConfig(offload_to_cpu=True, rank0_only=True)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        return dict(model.state_dict())


def export_full_state_dict(model, out: str | os.PathLike) -> int:
    """Collective: write the plain model's state dict (`full_state_dict`) to `out` from rank 0 and return the
    number of tensors written (0 on the other ranks). A model holding NaN or inf is not written: CheckpointError
    on every rank naming the tensors, and an existing `out` (a good export of an earlier run) is kept. The
    write is atomic (temp file beside `out`, then rename), so a crash leaves the old file or the new one."""
    named = non_finite(model)
    if named:
        keys = sorted({key for _rank, ks in named for key in ks})
        ranks = ", ".join(str(rank) for rank, _ks in named)
        raise CheckpointError(f"{out} not written: NaN or inf in {', '.join(keys)} (on rank(s) {ranks}); "
                              f"{out} is left as it was", every_rank=True)
    state = full_state_dict(model)
    if model._ctx.rank == 0:
        replace_file(out, lambda f: torch.save(state, f))
    return len(state)


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike, allow_unverified: bool = False) -> dict:
    """Write a checkpoint's model as a plain `torch.save` state dict (original names, fp32). One process, no
    process flat, any world size saved it. `out` may not be any of the checkpoint's own files (ownership.py).
    Returns the checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp

    problem = output_problem({"out": out}, resume=str(path))
    if problem:
        raise CheckpointError(problem)
    found = trust.find(path, allow_unverified)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path} yet")
    step_dir, meta = found.step_dir, found.meta
    flats = {f"model/{u['key']}": torch.empty(u["numel"]) for u in meta["units"]}
    state = dict(flats)
    buffers = {}
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    for name in meta["buffers"]:
        md = saved[f"buffer/{name}"]
        state[f"buffer/{name}"] = buffers[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it runs without a process flat: that is the point here
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
    replace_file(out, lambda f: torch.save(result, f))
    return meta
