"""Sharded checkpoints through torch.distributed.checkpoint (DCP), and the full state dict for one-GPU use.

    save(model, optimizer, directory, step)   every rank writes its own piece, in parallel; atomic (see below)
    load(model, optimizer, path) -> meta      any world size, any sharding strategy, same wrap policy
    full_state_dict(model)                    rank 0 gets {original name: fp32 tensor}, the plain model's keys
    export_checkpoint(path, out)              a plain torch.save file from a checkpoint, in one process

[Note: a world-size-independent layout] A rank's shard is a chunk of its unit's *padded* flat buffer, and the
padding depends on the world size N, so saving the shards as they are would tie a checkpoint to N. Instead we
save, for each unit and requires_grad kind, the *unpadded* flat buffer: one 1-D tensor of `numel` elements,
described to DCP as a DTensor sharded on dim 0. Rank r's piece is [r·S, min((r+1)·S, numel)) with
S = ceil(numel/N): exactly the unpadded front of its shard, and exactly torch.chunk's uneven layout, which is
what DTensor's Shard(0) means, so the piece is a view and nothing is copied. AdamW's exp_avg and exp_avg_sq
(same shape as the shard) are saved the same way; its `step` as a plain replicated tensor. Loading on N' ranks,
each rank asks DCP for its new piece and DCP reads the overlapping ranges of the old ones: 4 ranks → 2 ranks is
a reshard, not a conversion. Replicated strategies load into their full copies (Replicate placement), so a
FULL_SHARD checkpoint also resumes under NO_SHARD or ZERO1. The padding is zero and stays zero (its gradient is
zero), so it is simply left zero on load.

Why not one entry per original parameter: a shard cuts parameters at arbitrary elements (half a row of a
matrix), which Shard placements cannot describe without copies. The flat layout's price is that a checkpoint is
tied to the unit layout (which parameters form which unit, in which order). That depends on the model and the
wrap policy only, never on N or the strategy; it is recorded in `fsdp_lab.json` with every parameter's name,
shape and offset, checked on load, and used by the export to restore the original names. Why DTensor and not
ShardedTensor: torch.distributed._shard is deprecated; DTensor is what DCP is built around in torch ≥ 2.4.

Atomicity (a tmp directory, then rename, then an atomic `latest` pointer) is in fsdp_lab/checkpoint_files.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fsdp_lab import checkpoint_files as files
from fsdp_lab import checkpoint_layout as layout
from fsdp_lab.checkpoint_files import FORMAT, CheckpointError, read_meta
from fsdp_lab.checkpoint_full import export_checkpoint, full_state_dict

__all__ = ["save", "load", "full_state_dict", "export_checkpoint", "read_meta", "CheckpointError"]


def _on_rank0(fn: Callable, model):
    """Run fn on the group's rank 0 and give every rank its result, or raise CheckpointError on every rank."""
    ctx = model._ctx
    box = [None]
    if ctx.rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # reported on every rank, not just the one that failed
            box[0] = ("error", str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}")
    device = ctx.device if ctx.device.type == "cuda" else None
    dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.group, 0), group=ctx.group, device=device)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value)
    return value


def save(model, optimizer, directory: str | os.PathLike, step: int, extra: Optional[dict] = None,
         writer_factory: Optional[Callable] = None) -> Path:
    """Save model (and optimizer) state as `directory/step_N` on every rank; return the published path.
    `writer_factory(path)` may supply the DCP StorageWriter (the tests use it to break a save half-way)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    ctx, mesh = model._ctx, layout.mesh_of(model)
    tmp = Path(_on_rank0(lambda: str(files.prepare_tmp(directory, step)), model))
    state = {"step": torch.tensor(step, dtype=torch.int64)}
    for key, _unit, group in layout.groups(model):
        state[f"model/{key}"] = layout.save_target(group.shard.detach(), group, ctx, mesh)
    for name, buf in layout.persistent_buffers(model):
        state[f"buffer/{name}"] = buf.detach()
    optim_meta = None
    if optimizer is not None:
        for p, key, group in layout.optimizer_keys(model, optimizer):
            for name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"optimizer state '{name}' of {key} is a {type(value).__name__}; "
                                          f"only tensors can be saved")
                if value.shape == p.shape:
                    value = layout.save_target(value.detach(), group, ctx, mesh)
                state[f"optim/{key}/{name}"] = value
        optim_meta = {"class": type(optimizer).__name__,
                      "param_groups": [{k: v for k, v in pg.items() if k != "params"}
                                       for pg in optimizer.param_groups]}
    writer = (writer_factory or dcp.FileSystemWriter)(str(tmp))
    try:
        dcp.save(state, storage_writer=writer, process_group=ctx.group)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"saving step {step} into {tmp} failed; '{files.LATEST}' still names the previous "
                              f"checkpoint. Cause: {err}") from err
    cfg = getattr(model.module, "cfg", None)
    meta = {"format": FORMAT, "step": step, "world_size": ctx.world_size, "strategy": ctx.strategy.name,
            "torch": torch.__version__, "units": layout.describe(model),
            "model_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "state_dict_order": [name for name, *_ in layout.state_dict_order(model)],
            "buffers": [name for name, _ in layout.persistent_buffers(model)], "optimizer": optim_meta,
            "extra": extra or {}}

    def finish():
        (tmp / files.META_FILE).write_text(json.dumps(meta, indent=1, default=str), encoding="utf-8")
        return str(files.publish(directory, step))

    return Path(_on_rank0(finish, model))


def _check_layout(meta: dict, model, where) -> None:
    saved = {u["key"]: u["numel"] for u in meta["units"]}
    ours = {key: group.numel for key, _unit, group in layout.groups(model)}
    if saved == ours:
        return
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    sizes = [f"{k}: saved {saved[k]}, model {ours[k]}" for k in sorted(set(saved) & set(ours)) if saved[k] != ours[k]]
    raise CheckpointError(f"{where} does not fit this model (saved for {meta.get('model_config')}). Units only in "
                          f"the model: {missing[:4]}; only in the checkpoint: {extra[:4]}; element counts that "
                          f"differ: {sizes[:4]}. Use the same preset and wrap policy as the run that saved it.")


def load(model, optimizer, path: str | os.PathLike) -> dict:
    """Load `path` (a checkpoint directory, via its `latest`, or one step directory) into model and optimizer,
    whatever world size and strategy saved it. Returns the checkpoint's metadata (meta["step"] is the step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model._reshard_all("summon")  # nothing gathered may outlive the load with stale values
    ctx, mesh = model._ctx, layout.mesh_of(model)
    step_dir = Path(_on_rank0(lambda: str(files.resolve(path)), model))
    meta = read_meta(step_dir)
    _check_layout(meta, model, step_dir)
    reader = dcp.FileSystemReader(str(step_dir))
    saved = reader.read_metadata().state_dict_metadata
    state = {"step": torch.zeros((), dtype=torch.int64)}
    for key, _unit, group in layout.groups(model):
        state[f"model/{key}"] = layout.load_target(group.shard.data, group, ctx, mesh, is_param=True)
    for name, buf in layout.persistent_buffers(model):
        state[f"buffer/{name}"] = buf.data
    loaded_optim = []
    if optimizer is not None:
        for p, key, group in layout.optimizer_keys(model, optimizer):
            prefix = f"optim/{key}/"
            entry = {}
            for full_key, md in saved.items():
                if not full_key.startswith(prefix):
                    continue
                if tuple(md.size) == (group.numel,):
                    entry[full_key[len(prefix):]] = target = torch.zeros_like(p.detach())
                    state[full_key] = layout.load_target(target, group, ctx, mesh, is_param=False)
                else:
                    entry[full_key[len(prefix):]] = state[full_key] = torch.zeros(
                        tuple(md.size), dtype=md.properties.dtype)
            loaded_optim.append((p, entry))
    try:
        dcp.load(state, storage_reader=reader, process_group=ctx.group)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"loading {step_dir} failed: {err}") from err
    for p, entry in loaded_optim:
        if entry:
            optimizer.state[p] = entry
    if int(state["step"]) != meta["step"]:
        raise CheckpointError(f"{step_dir}: fsdp_lab.json says step {meta['step']}, the tensors say "
                              f"{int(state['step'])}")
    return meta


def _main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_lab.checkpoint",
                                     description="Inspect or export an fsdp_lab sharded checkpoint.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="print a checkpoint's step, world size, strategy and model config")
    p_info.add_argument("path")
    p_exp = sub.add_parser("export", help="write a plain torch.save state dict for the plain GPT")
    p_exp.add_argument("path")
    p_exp.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "info":
            step_dir = files.resolve(args.path)
            meta = read_meta(step_dir)
            print(f"{step_dir}: step {meta['step']}, saved by {meta['world_size']} rank(s) with {meta['strategy']}, "
                  f"torch {meta['torch']}\nmodel config: {meta['model_config']}\nunits: "
                  + ", ".join(f"{u['key']} ({u['numel']:,})" for u in meta["units"]))
        else:
            meta = export_checkpoint(args.path, args.out)
            print(f"wrote {args.out}: step {meta['step']}, {len(meta['state_dict_order'])} tensors; load it with "
                  f"GPT(GPTConfig(**{meta['model_config']})).load_state_dict(torch.load(path))")
    except CheckpointError as err:
        print(f"error: {err}")
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
