"""One layout's gradient reduction: copy-in, reduce-scatter (or all-reduce), HSDP's all-reduce across replicas,
the user's hook, the division, and copy-out onto the shard, on the reduce stream.

The unit (fsdp_lab/runtime/core/unit.py) decides when a flat's gradient is complete and calls
`reduce_flat_param`; the gather path's counterpart is `gather_flat_param` in streams.py. What fully_shard's
FSDPModule.set_* methods change about a reduction is one `ReduceOptions` per unit; FSDP1 keeps the defaults.

[Note: where the division happens] Gradients are averaged over the data-parallel ranks (shard × replicate), or
divided by the factor the user set (set_gradient_divide_factor). Which tensor is divided, and when, is visible to
the user's all-reduce hook, so it follows torch 2.13's FSDP2 (`_get_gradient_divide_factors`):
- float32 and bfloat16, without force-sum: torch lets the collective divide (ReduceOp.AVG, or PREMUL_SUM by
  1/factor). gloo has neither for reduce-scatter, so here the sum is divided right after each collective, which
  is what those ops compute: by the shard size after the reduce-scatter and by the replicate size after the
  all-reduce; with a factor, by the factor after the reduce-scatter and not at all after the all-reduce. The hook
  then sees the mean.
- float16 (and any dtype but those two), or with set_force_sum_reduction_for_comms(True): every collective sums;
  float16 divides by `pre` (about √factor, [Note: dividing by N without overflow] in collectives.py) before the
  sum and by factor/pre after it, other dtypes by the whole factor after it. The hook sees the sum.
At world size 1 no reduce-scatter runs; torch then divides the copy by the user's factor, and with force-sum
divides by it again after the hook, and so does this.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fsdp_lab.runtime.core.collectives import all_reduce_sum, reduce_scatter_sum
from fsdp_lab.runtime.core.strategy import ShardingStrategy
from fsdp_lab.runtime.core.streams import GradOff, label

EXACT_SUM_DTYPES = (torch.float32, torch.bfloat16)  # torch lets the collective divide these


@dataclass
class ReduceOptions:
    """How one unit reduces its gradients: fully_shard's FSDPModule.set_* methods set these; FSDP1 never does."""

    divide_factor: Optional[float] = None  # set_gradient_divide_factor; None: the data-parallel size
    force_sum: bool = False  # set_force_sum_reduction_for_comms
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None  # set_all_reduce_hook
    hook_stream: Any = None
    requires_all_reduce: bool = True  # set_requires_all_reduce (HSDP: reduce-scatter only, sum kept)
    reduce_unused: bool = False  # set_reduce_scatter_unused_params
    max_input_buffers: Optional[int] = None  # set_reduce_scatter_max_input_buffers; None: the state's bound
    custom_reduce_scatter: Any = None  # set_custom_reduce_scatter ([Note: custom collectives] in collectives.py)
    reduce_scatter_pg: Any = None  # set_separate_reduce_scatter_group; None: the shard group


@dataclass(frozen=True)
class DividePlan:
    """Divisors applied in order: before the sum, after the reduce-scatter, after the all-reduce, after the
    hook ([Note: where the division happens]). 1.0 means no division."""

    pre: float = 1.0
    after_scatter: float = 1.0
    after_all_reduce: float = 1.0
    post: float = 1.0


@functools.lru_cache(maxsize=64)  # the same few arguments every step, every unit: work them out once
def divide_plan(shard_size: int, replicate_size: int, dtype: torch.dtype, factor: Optional[float] = None,
                force_sum: bool = False) -> DividePlan:
    """torch 2.13 FSDP2's division of a gradient over `shard_size` × `replicate_size` ranks."""
    if dtype in EXACT_SUM_DTYPES and not force_sum:
        if factor is None:
            return DividePlan(after_scatter=float(shard_size), after_all_reduce=float(replicate_size))
        return DividePlan(after_scatter=float(factor))
    total = float(factor) if factor is not None else float(shard_size * replicate_size)
    if dtype in EXACT_SUM_DTYPES:
        return DividePlan(post=total, after_scatter=_single_rank_copy(shard_size, factor))
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return DividePlan(pre=float(pre), post=total / pre, after_scatter=_single_rank_copy(shard_size, factor))


def _single_rank_copy(shard_size: int, factor: Optional[float]) -> float:
    """torch's world-size-1 path copies the input divided by the user's factor (besides the post-division)."""
    return float(factor) if shard_size == 1 and factor is not None else 1.0


def _divide(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    return tensor if divisor == 1.0 else tensor.div_(divisor)


def reduce_flat_param(ctx, flat, grad: torch.Tensor, unit_name: str, options: Optional[ReduceOptions] = None
                      ) -> None:
    """Reduce one flat's unsharded gradient on the reduce stream and put this rank's part on shard.grad:
    reduce-scatter for the sharded strategies and ZERO1, all-reduce for NO_SHARD; under HSDP the reduced shard
    is then all-reduced across the replicate group ([Note: hybrid sharding] in hybrid.py), unless the unit
    skips that (set_requires_all_reduce(False)): then the sum waits in `flat.partial_reduce` and no gradient is
    stored yet. The compute stream waits for it through the ReduceQueue, at the latest at the end of
    backward."""
    opts = options or ReduceOptions()
    streams = ctx.streams
    scatter = ctx.strategy is not ShardingStrategy.NO_SHARD
    hsdp = ctx.replicate_pg is not None
    plan = divide_plan(ctx.world_size, ctx.replicate_size if hsdp else 1,
                       flat.reduce_dtype, opts.divide_factor, opts.force_sum)
    calls = []
    stored = True
    with label("fsdp_lab::reduce ", unit_name), GradOff(), streams.side("reduce"):
        send = flat.reduce_input(grad) if scatter else grad
        if send.dtype != flat.reduce_dtype:
            send = send.to(flat.reduce_dtype)
        elif plan.pre != 1.0 and send is grad and scatter:
            send = send.clone()  # the pre-division must not change the gradient autograd handed us
        _divide(send, plan.pre)
        if scatter:
            comm, out = reduce_scatter_sum(send, opts.reduce_scatter_pg or ctx.pg, ctx.world_size, unit_name,
                                           ctx.shard_tag, opts.custom_reduce_scatter)
            if out is send and plan.after_scatter != 1.0 and send is grad:
                out = out.clone()
        else:
            comm, out = all_reduce_sum(send, ctx.pg, ctx.world_size, unit_name, ctx.shard_tag)
        calls.append(("reduce_scatter" if scatter else "all_reduce", comm))
        _divide(out, plan.after_scatter)
        if hsdp:
            if not opts.requires_all_reduce:
                flat.partial_reduce = out if flat.partial_reduce is None else flat.partial_reduce.add_(out)
                stored = False
            else:
                if flat.partial_reduce is not None:
                    out, flat.partial_reduce = out.add_(flat.partial_reduce), None
                across, out = all_reduce_sum(out, ctx.replicate_pg, ctx.replicate_size, unit_name,
                                             ctx.replicate_tag)
                calls.append(("all_reduce", across))
                _divide(out, plan.after_all_reduce)
        if stored:
            if opts.all_reduce_hook is not None:
                with _hook_stream(streams, opts.hook_stream):
                    opts.all_reduce_hook(out)
            store_grad(ctx, flat, grad, _divide(out, plan.post))
        event = streams.record("reduce")
    if stored:
        ctx.grads_reduced = True  # the optimizer may step now ([Note: ZeRO-1 replicas] in streams.py)
    ctx.reduces.push(event, keep=(grad,) if streams.enabled else (), limit=opts.max_input_buffers)
    for kind, call in calls:
        ctx.emit(kind, unit_name, "backward", (call,))


def _hook_stream(streams, stream):
    """Run the user's hook on the stream they asked for (CUDA only), else where the reduction ran."""
    if stream is None or not streams.enabled:
        return contextlib.nullcontext()
    stream.wait_stream(streams.reduce)
    return streams.cuda.stream(stream)


def store_grad(ctx, flat, grad: torch.Tensor, out: torch.Tensor) -> None:
    """Copy-out: put the reduced gradient on the fp32 shard (accumulating if one is already there); how it lands
    on the shard is the layout's (`store_shard_grad`)."""
    if ctx.strategy is ShardingStrategy.ZERO1 and flat.shard.grad is None:  # [Note: ZeRO-1 replicas]
        local = grad if grad.dtype == flat.shard.dtype else grad.to(flat.shard.dtype)
        chunk = flat.my_chunk(local)
        chunk.copy_(out)
        flat.replica_grad, flat.shard.grad = local, chunk
    else:
        flat.store_shard_grad(out)
