"""Chapter 08's bridge from the NumPy sketch (fsdp_lab.theory.minifsdp) to real collectives on real ranks.

Each rank wraps the course GPT (one unit per Block), then runs the three moves on every unit's flat buffer with
fsdp_lab.runtime.core.collectives, the same functions the runtime uses: all-gather the shards, reduce-scatter a gradient
(a different one per rank, as in data parallelism), take a sharded SGD step on its own slice, all-gather again.
It returns everything as NumPy arrays, so the notebook can hand the same shards and gradients to MiniFSDP and
compare the results number by number.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab.lessons.experiments.common import config_for
from fsdp_lab.observe.traffic import collective_bytes
from fsdp_lab.runtime import FSDP
from fsdp_lab.runtime.core.collectives import all_gather_flat, reduce_scatter_mean
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.models import Block, build_gpt


def rank_gradient(numel: int, rank: int, unit_index: int, seed: int = 0) -> torch.Tensor:
    """A reproducible stand-in for rank `rank`'s gradient of one unit (each rank's micro-batch differs)."""
    g = torch.Generator().manual_seed(seed * 10_007 + unit_index * 101 + rank)
    return torch.randn(numel, generator=g)


def gather_scatter_step(rank: int, world_size: int, preset: str = "tiny", lr: float = 0.1, seed: int = 0) -> dict:
    """Per unit: this rank's shard, the all-gathered buffer, its gradient, the reduce-scattered slice and the
    buffer all-gathered again after `shard -= lr * slice`. Collective: every rank calls it."""
    model = FSDP(build_gpt(config_for(preset)), auto_wrap_policy=ModuleWrapPolicy({Block}))
    pg = dist.group.WORLD
    out = {"rank": rank, "units": [], "numel": [], "padded_numel": [], "shard": [], "gathered": [], "grad": [],
           "grad_shard": [], "gathered_after_step": [], "bytes_sent": []}
    with torch.no_grad():
        for i, unit in enumerate(model.units):
            (flat,) = unit.trainable_flats
            shard = flat.shard.detach().clone()
            full = torch.empty(flat.padded_numel)
            sent = all_gather_flat(full, shard, pg, world_size)
            grad = torch.zeros(flat.padded_numel)
            grad[:flat.numel] = rank_gradient(flat.numel, rank, i, seed)
            rs_sent, grad_shard = reduce_scatter_mean(grad, pg, world_size, torch.float32)
            shard -= lr * grad_shard
            after = torch.empty(flat.padded_numel)
            all_gather_flat(after, shard, pg, world_size)
            out["units"].append(unit.name)
            out["numel"].append(flat.numel)
            out["padded_numel"].append(flat.padded_numel)
            out["bytes_sent"].append(collective_bytes([sent, rs_sent]).sent)
            for key, t in (("shard", flat.shard.detach()), ("gathered", full), ("grad", grad[:flat.numel]),
                           ("grad_shard", grad_shard), ("gathered_after_step", after)):
                out[key].append(t.numpy().copy())
    return out
