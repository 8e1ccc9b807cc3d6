"""What every unit of one FSDP model shares: the process group, the policy, and the step's flags.

It is owned by the root FSDP object and handed to each unit, so there is no module-level state: two models in one
notebook (or a cell re-run) never see each other's flags.

[Note: async collectives] `async_comm` says whether collectives are issued with async_op=True and waited for
where their result is needed. Left as None it is chosen here: on CUDA with NCCL always (waiting on a handle makes
the compute stream wait, it never blocks the host); on CPU with gloo when some prefetch is on (a prefetched
gather then runs in gloo's threads while the previous unit computes); otherwise off. gloo with CUDA tensors
(several ranks sharing one GPU, a memory-only setup) stays synchronous: its collectives block the host anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fsdp_lab.runtime.mixed_precision import MixedPrecision
from fsdp_lab.runtime.strategy import BackwardPrefetch, ShardingStrategy
from fsdp_lab.runtime.streams import CommStreams, ReduceQueue


@dataclass
class FSDPState:
    pg: Any  # the process group
    world_size: int
    rank: int
    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device
    forward_prefetch: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = None
    max_gathers_in_flight: int = 2
    async_comm: Optional[bool] = None  # None: chosen in __post_init__ ([Note: async collectives])
    max_reduces_in_flight: int = 2
    # -- flags of the step in progress ----------------------------------------------------------------------
    sync_gradients: bool = True
    in_backward: bool = False
    final_callback_queued: bool = False
    forward_order: list = field(default_factory=list)
    post_forward_order: list = field(default_factory=list)
    order_frozen: bool = False
    tracer: Any = None
    on_backward_start: Optional[Callable[[], None]] = None
    streams: Optional[CommStreams] = None
    reduces: Optional[ReduceQueue] = None

    def __post_init__(self):
        if self.async_comm is None:
            self.async_comm = default_async_comm(self)
        if self.streams is None:
            self.streams = CommStreams(self.device)
        if self.reduces is None:
            self.reduces = ReduceQueue(self.streams, self.max_reduces_in_flight)

    def emit(self, event: str, unit: str, phase: str, collectives: tuple = (), **extra) -> None:
        """Hand one lifecycle event to the attached tracer, if any; `collectives` are what the beat issued
        (fsdp_lab.runtime.collectives.Collective), from which a tracer can work out the bytes."""
        if self.tracer is not None:
            self.tracer.emit(event, unit=unit, phase=phase, collectives=collectives, **extra)

    def record_forward(self, unit) -> None:
        """The first forward's order of pre-forward hooks drives forward prefetch (the next unit to start)."""
        if not self.order_frozen and unit not in self.forward_order:
            self.forward_order.append(unit)

    def record_post_forward(self, unit) -> None:
        """The first forward's order of post-forward hooks, reversed, is the order backward reaches the units: the
        root starts forward first but finishes it last, so its backward (the head) comes first, then the last
        block's. torch's FSDP prefetches in backward by the same order."""
        if not self.order_frozen and unit not in self.post_forward_order:
            self.post_forward_order.append(unit)

    def neighbour(self, unit, step: int):
        """step=+1: the unit whose forward starts after `unit`'s; step=-1: the unit whose backward comes next."""
        order = self.forward_order if step > 0 else self.post_forward_order
        if unit not in order:
            return None
        i = order.index(unit) + (1 if step > 0 else -1)
        return order[i] if 0 <= i < len(order) else None

def default_async_comm(ctx: FSDPState) -> bool:
    if ctx.world_size == 1:
        return False  # nothing is communicated
    try:
        backend = str(dist.get_backend(ctx.pg)).lower()
    except (RuntimeError, ValueError):
        return False
    if ctx.device.type == "cuda":
        return backend != "gloo"
    return backend == "gloo" and (ctx.forward_prefetch or ctx.backward_prefetch is not None)
