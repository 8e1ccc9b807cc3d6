"""`fsdp-lab demo`: the course GPT trained on N CPU ranks, step by step beside a single-process reference.

The reference sees the same global batch in one process; FSDP splits it across ranks and averages gradients,
so the two loss columns should agree to ~1e-6 in fp32. The byte columns are each rank's live sharded state,
counted by the runtime itself (fsdp_lab.runtime.core.memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core.side_collectives import issue
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.models import Block, batch_for_step, build_gpt, rank_slice


@dataclass(frozen=True)
class DemoStep:
    step: int  # 1..N, as in `fsdp-lab train`: step s trains on batch_for_step(..., s - 1)
    loss: float
    reference_loss: float
    per_rank: tuple  # (params_sharded, grads_sharded, optimizer_state) bytes, one triple per rank


def _global_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    issue(dist.all_reduce, value, phase="loss")
    return value.item() / dist.get_world_size()


def demo_rank(rank, world_size, preset, steps, global_batch, strategy, lr):
    base = build_gpt(preset)
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = []
    for step in range(steps):
        x, y = batch_for_step(base.cfg, step, global_batch)
        loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        mem = model.memory_report(opt)  # measured after the update, before zero_grad: grads still live
        opt.zero_grad(set_to_none=True)
        rows.append((_global_mean(loss), mem.params_sharded + mem.params_unsharded,
                     mem.grads_sharded + mem.grads_unsharded, mem.optimizer_state))
    return rows


def reference_losses(preset, steps, global_batch, lr) -> list[float]:
    model = build_gpt(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch_for_step(model.cfg, step, global_batch)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_demo(world_size=2, preset="tiny", steps=5, global_batch=8, strategy="FULL_SHARD", lr=3e-3,
             timeout_s=180.0) -> list[DemoStep]:
    from fsdp_lab.training.launch import run_on_ranks

    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} must divide by world size {world_size}")
    per_rank = run_on_ranks(demo_rank, world_size, preset, steps, global_batch, strategy, lr, timeout_s=timeout_s)
    reference = reference_losses(preset, steps, global_batch, lr)
    return [DemoStep(i + 1, per_rank[0][i][0], reference[i],
                     tuple(tuple(rows[i][1:]) for rows in per_rank)) for i in range(steps)]
