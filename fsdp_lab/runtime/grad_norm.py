"""Gradient-norm clipping across shards: each rank's shard holds a disjoint slice of the gradient, so the global
squared norm is the sum over ranks of each shard's squared norm (replicated strategies use local grads)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab.runtime.strategy import ShardingStrategy


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = model._ctx
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = ctx.device
    if float(norm_type) == float("inf"):
        local = max((g.detach().abs().max() for g in grads), default=torch.tensor(0.0, device=device))
        total = local.float().clone()
        if ctx.strategy is not ShardingStrategy.NO_SHARD:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=ctx.pg)
    else:
        local = sum((g.detach().float().norm(norm_type) ** norm_type for g in grads),
                    torch.tensor(0.0, device=device))
        total = local.clone()
        if ctx.strategy is not ShardingStrategy.NO_SHARD:
            dist.all_reduce(total, group=ctx.pg)
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
