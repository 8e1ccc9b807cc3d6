"""Rank functions for the parity tests (importable by spawned ranks, so they live in a module, not a test)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab import FSDP, MixedPrecision
from fsdp_lab.training.models import Block, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy

GLOBAL_BATCH = 12  # divides by world sizes 1, 2, 3 and 4
STEPS = 3
LR = 1e-3


def _mp(dtype_name):
    if dtype_name == "bf16":
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def _mean_over_ranks(loss: torch.Tensor) -> float:
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_fsdp_lab(rank, world_size, strategy, dtype_name, preset="tiny"):
    base = build_gpt(preset)
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 mixed_precision=_mp(dtype_name))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch_for_step(base.cfg, step, GLOBAL_BATCH)
        loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over_ranks(loss))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params


def train_fsdp2(rank, world_size, dtype_name, preset="tiny"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_gpt(preset)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype_name == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch_for_step(model.cfg, step, GLOBAL_BATCH)
        loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over_ranks(loss))
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return losses, params


def run_matrix(rank, world_size, configs):
    """Run several configurations in one process group: [(kind, strategy, dtype)] -> results in order."""
    results = []
    for kind, strategy, dtype_name in configs:
        if kind == "fsdp2":
            results.append(train_fsdp2(rank, world_size, dtype_name))
        else:
            results.append(train_fsdp_lab(rank, world_size, strategy, dtype_name))
    return results if rank == 0 else None


def train_reference(dtype_name="fp32", preset="tiny"):
    """Single process, whole global batch. bf16: the same casts FSDP makes (bf16 compute, fp32 master update)."""
    model = build_gpt(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch_for_step(model.cfg, step, GLOBAL_BATCH)
        if dtype_name == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
