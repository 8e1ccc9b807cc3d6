"""Gradient-norm clipping across shards: each rank's shard holds a disjoint slice of the gradient, so the global
squared norm is the sum over ranks of each shard's squared norm (NO_SHARD's gradients are whole: local norm).

No host sync before the final scale: the per-gradient norms (each in float32, as torch takes them) are combined
on the device (`torch.stack(...)`, never a Python `max` or `sum` over tensors, which would read each one back),
and the zero for "no gradients" is made on the device, not copied from a host scalar. When nothing is sharded
(NO_SHARD), torch FSDP1 calls nn.utils.clip_grad_norm_ and so does this.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core.collectives import all_reduce_sum
from fsdp_lab.runtime.core.misuse import FLAT_OF
from fsdp_lab.runtime.core.strategy import ShardingStrategy


def _local_norm_term(grads: list, norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| (inf-norm) or sum ‖g‖^p over this rank's gradients, as a 0-dim float32 tensor on `device`. Each
    norm is taken in float32 whatever the gradient's dtype (a bf16 model's bf16 gradients), as torch does: the
    terms are summed across ranks next, where a bf16 partial sum would lose most of its bits."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
    if norm_type == float("inf"):
        return norms.max()
    # the norm of the norms, raised to p: the order of rounding torch's FSDP1 has, so that a bf16 model's
    # clipping coefficient (hence its bf16 gradients) comes out bit for bit the same
    return torch.linalg.vector_norm(norms, norm_type) ** norm_type


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    ctx = model._ctx
    norm_type = float(norm_type)
    if ctx.strategy is ShardingStrategy.NO_SHARD:  # every gradient is whole: torch FSDP1 hands this case to
        # nn.utils.clip_grad_norm_, whose norms are in the gradients' own dtype (bf16 for a bf16 model)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad.detach() for p in params]
    # an ignored module's parameters (ignored.py) are whole on every rank: their term is added once, as in torch
    sharded = [p.grad.detach() for p in params if hasattr(p, FLAT_OF)]
    local = [p.grad.detach() for p in params if not hasattr(p, FLAT_OF)]
    # Offloaded gradients are on the host: their local term is reduced on the device and the total returned on the
    # host, as torch FSDP1 does (fsdp_lab/runtime/features/offload.py).
    offloaded = model._placement.offloaded
    total = _local_norm_term(sharded, norm_type, ctx.device).to(ctx.device)
    if ctx.strategy is not ShardingStrategy.NO_SHARD:
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        all_reduce_sum(total, ctx.pg, ctx.world_size, "<root>", ctx.shard_tag, "clip_grad_norm_", op)
    if local:
        term = _local_norm_term(local, norm_type, ctx.device)
        total = torch.maximum(total, term) if norm_type == float("inf") else total + term
    if norm_type != float("inf"):
        total = total ** (1.0 / norm_type)
    if offloaded:
        total = total.cpu()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_kind: dict = {}  # offloaded gradients are on the host, an ignored module's on the device
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for (dtype, device), group in by_kind.items():
        torch._foreach_mul_(group, coef.to(device, dtype))
    if grads:  # the widest gradient dtype (bf16 for a bf16 model), as torch returns it; none: float32
        return total.to(functools.reduce(torch.promote_types, (g.dtype for g in grads)))
    return total
