"""Chapter 06b's measurements, one function per topic, each run on every rank of one job (collective):

    meta_init(rank, world_size)        a model larger than one rank's budget, built on meta and wrapped: the peak
    hybrid_bytes(rank, world_size)     HYBRID_SHARD on a (nodes, ranks per node) mesh: bytes sent per group
    offload_cost(rank, world_size)     CPUOffload(offload_params=True) against none: host/device bytes, step time
    save_for_reshard(rank, ws, dir)    a FULL_SHARD checkpoint and the loss of the next batch, for a reshard
    load_resharded(rank, ws, path)     that checkpoint loaded on another world size, and the same loss again

fsdp_lab/lessons/experiments/two_nodes.py runs the first four on 2 × 2 ranks under two torchrun launchers; the
chapter runs `meta_init` and `load_resharded` again on its two live ranks.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.observe.storage_peak import StoragePeak
from fsdp_lab.training.models import GPT, Block, GPTConfig, batch_for_step, count_params, rank_slice

# Untied: a meta model materialised module by module gets two tensors for a tied weight (deferred_init.py refuses).
BIG = GPTConfig(vocab_size=512, block_size=64, n_layer=6, n_head=4, n_embd=128, tie_weights=False)
BUDGET_BYTES = 4 * 2**20  # what one rank may hold in this story: less than BIG's fp32 parameters (5.5 MB)
HSDP_CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)  # the tiny preset
GLOBAL_BATCH, SEQ = 8, 32


def init_weights(module: nn.Module) -> None:
    """A param_init_fn as a script writes one: give this module (not its children) storage, then GPT's init."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def largest_unit_bytes(model) -> int:
    """The largest unit's unsharded fp32 buffer: what a rank holds for a moment while that unit is initialised."""
    return max(sum(f.full_bytes for f in u.flats) for u in model.units)


def shard_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def meta_init(rank: int, world_size: int, cfg: GPTConfig = BIG, budget: int = BUDGET_BYTES) -> dict:
    """Peak bytes of float storage while building and wrapping `cfg`, on meta with a param_init_fn, and built whole
    first (fsdp_lab.observe.storage_peak); the prediction is this rank's shards plus the largest unit."""
    from fsdp_lab import FSDP
    from fsdp_lab.wrap import ModuleWrapPolicy

    out = {"rank": rank, "world_size": world_size, "budget": budget, "params": None}
    for path in ("meta", "real"):
        with StoragePeak() as counter:
            if path == "meta":
                with torch.device("meta"):
                    model = GPT(cfg)
            else:
                torch.manual_seed(0)
                model = GPT(cfg)
            out["params"] = count_params(model)
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                         param_init_fn=init_weights if path == "meta" else None)
            out[path] = {"peak": counter.peak, "final": counter.settled()}
        out[path].update(shards=shard_bytes(model), unit=largest_unit_bytes(model))
        del model
    out["model_bytes"] = 4 * out["params"]
    return out


def _hsdp_model(strategy: str, nodes: int, per_node: int, tracer_steps: int = 2):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab import FSDP, ShardingStrategy
    from fsdp_lab.training.models import build_gpt
    from fsdp_lab.wrap import ModuleWrapPolicy

    kwargs = {"auto_wrap_policy": ModuleWrapPolicy({Block}), "sharding_strategy": ShardingStrategy[strategy]}
    if strategy == "HYBRID_SHARD":
        kwargs["device_mesh"] = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    return FSDP(build_gpt(HSDP_CFG), **kwargs)


def hybrid_bytes(rank: int, world_size: int, nodes: int = 2, steps: int = 2) -> dict:
    """HYBRID_SHARD on (nodes, world_size // nodes), then FULL_SHARD on all ranks, same model and batches: bytes
    each rank sent in the last step per process group (fsdp_lab.observe.traffic.bytes_by_group), its groups' ranks,
    its state bytes and the losses."""
    from fsdp_lab.lessons.experiments.common import unit_table
    from fsdp_lab.observe import trace
    from fsdp_lab.observe.traffic import bytes_by_group
    from fsdp_lab.training.models import build_gpt

    per_node = world_size // nodes
    out = {"rank": rank, "nodes": nodes, "per_node": per_node}
    for strategy in ("HYBRID_SHARD", "FULL_SHARD"):
        model = _hsdp_model(strategy, nodes, per_node)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracer = trace.Tracer(None, rank=rank, model=model, optimizer=opt)
        trace.attach(model, tracer)
        losses = []
        for step in range(steps):
            x, y = (rank_slice(t, rank, world_size) for t in batch_for_step(HSDP_CFG, step, GLOBAL_BATCH, SEQ))
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        groups = {e["group"]: e["group_ranks"] for e in tracer.events if e.get("group")}
        sent: dict = {}
        for (group, collective), n in bytes_by_group(tracer.events, step=steps - 1, collective=True).items():
            sent.setdefault(group, {})[collective] = n
        out[strategy] = {"bytes": sent, "phi": count_params(build_gpt(HSDP_CFG)),
                         "groups": groups, "losses": losses, "units": unit_table(model),
                         "state": model.memory_report(opt).as_dict()}
    return out


def offload_cost(rank: int, world_size: int, preset: str = "small", steps: int = 4) -> dict:
    """The same FSDP1 model with CPUOffload(offload_params=True) and without: memory_report's host and device split
    after the last optimizer step (before zero_grad, so the sharded gradients count), the most bytes of
    unsharded parameters and gradients alive at once (the trace's memory records: what a GPU would hold), and the
    median step time of `steps` steps after a first one (the optimizer state exists then)."""
    from fsdp_lab import FSDP
    from fsdp_lab.observe import trace
    from fsdp_lab.runtime.features.offload import CPUOffload
    from fsdp_lab.training.models import PRESETS, build_gpt
    from fsdp_lab.wrap import ModuleWrapPolicy

    cfg, out = PRESETS[preset], {"rank": rank, "preset": preset}
    for offload in (False, True):
        model = FSDP(build_gpt(preset), cpu_offload=CPUOffload(offload_params=offload),
                     auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracer = trace.Tracer(None, rank=rank, model=model, optimizer=opt)
        trace.attach(model, tracer)
        times = []
        for step in range(steps + 1):
            x, y = (rank_slice(t, rank, world_size) for t in batch_for_step(cfg, step, GLOBAL_BATCH, SEQ))
            dist.barrier()
            start = time.perf_counter()
            model(x, y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
            if step == steps:
                report = model.memory_report(opt)
            opt.zero_grad()
        gathered = max(e["mem"]["params_unsharded"] + e["mem"]["grads_unsharded"] for e in tracer.events
                       if "mem" in e)
        out["offload" if offload else "none"] = {
            **report.as_dict(), "host": report.host, "device": report.device, "gathered_peak": gathered,
            "step_ms": 1000 * statistics.median(times[1:]), "step_ms_all": [1000 * t for t in times],
            "numel_padded": sum(f.padded_numel for u in model.units for f in u.flats),
            "units": [(u.name, sum(f.full_bytes for f in u.flats)) for u in model.units]}
    return out


def next_batch_loss(model, rank: int, world_size: int, cfg: GPTConfig, step: int) -> float:
    """The mean loss over the global batch of `step`, whatever the world size (equal slices per rank)."""
    x, y = (rank_slice(t, rank, world_size) for t in batch_for_step(cfg, step, GLOBAL_BATCH, SEQ))
    with torch.no_grad():
        loss = model(x, y).detach().reshape(1)
    dist.all_reduce(loss)
    return loss.item() / world_size


def save_for_reshard(rank: int, world_size: int, directory: str) -> dict:
    """Two FULL_SHARD steps on `world_size` ranks, a sharded checkpoint (fsdp_lab.checkpoint.save, DCP), and the
    loss of the next batch measured with the saved weights."""
    from fsdp_lab import checkpoint

    model = _hsdp_model("FULL_SHARD", 1, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        x, y = (rank_slice(t, rank, world_size) for t in batch_for_step(HSDP_CFG, step, GLOBAL_BATCH, SEQ))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    path = checkpoint.save(model, None, directory, step=2)  # the parameters only: the course ships this one
    return {"rank": rank, "world_size": world_size, "path": str(path), "shard_numel": shard_bytes(model) // 4,
            "next_loss": next_batch_loss(model, rank, world_size, HSDP_CFG, 2)}


def load_resharded(rank: int, world_size: int, path: str) -> dict:
    """Load a checkpoint saved on any number of ranks into a fresh FULL_SHARD model on `world_size` ranks; the loss
    of the same next batch, and the element count of this rank's new shard."""
    from fsdp_lab import checkpoint

    model = _hsdp_model("FULL_SHARD", 1, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = checkpoint.load(model, opt, path)
    return {"rank": rank, "world_size": world_size, "saved_world_size": meta["world_size"], "step": meta["step"],
            "shard_numel": shard_bytes(model) // 4, "next_loss": next_batch_loss(model, rank, world_size,
                                                                                  HSDP_CFG, 2)}
