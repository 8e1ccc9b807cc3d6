"""What every unit of one FSDP model shares: the process group, the policy, and the step's flags.

It is owned by the root FSDP object and handed to each unit, so there is no module-level state: two models in one
notebook (or a cell re-run) never see each other's flags.

`param_epoch` advances at a root forward that follows a gradient reduction (an optimizer step may have changed
the masters in between): ZeRO-1 refreshes its replicas once per epoch ([Note: ZeRO-1 replicas] in
fsdp_lab/runtime/core/streams.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from fsdp_lab.runtime.core.mixed_precision import MixedPrecision
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy
from fsdp_lab.runtime.core.streams import CommStreams, FreeQueue, ReduceQueue

ALL_GATHER_LIMIT = 2  # limit_all_gathers=True: torch FSDP1's rate limiter allows two all-gathers in flight


@dataclass
class FSDPState:
    pg: Any  # the process group
    world_size: int
    rank: int
    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    compute_dtype: Optional[torch.dtype]  # None: each flat buffer's own master dtype (no MixedPrecision field)
    reduce_dtype: Optional[torch.dtype]
    device: torch.device
    forward_prefetch: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = None
    limit_all_gathers: bool = True
    max_gathers_in_flight: Optional[int] = None  # explicit prefetch's bound (default: from limit_all_gathers)
    max_reduces_in_flight: int = 2
    # HSDP ([Note: hybrid sharding] in hybrid.py): `pg` is the shard group; the reduced shards are all-reduced
    # over `replicate_pg`. Each group's (label, global ranks) goes with its collectives into the trace.
    replicate_pg: Any = None
    replicate_size: int = 1
    shard_tag: tuple = ("shard", ())
    replicate_tag: tuple = ("replicate", ())
    # -- flags of the step in progress ----------------------------------------------------------------------
    sync_gradients: bool = True
    param_epoch: int = 0
    grads_reduced: bool = False  # since the last root forward
    in_backward: bool = False
    final_callback_queued: bool = False
    forward_order: list = field(default_factory=list)
    post_forward_order: list = field(default_factory=list)
    order_frozen: bool = False
    tracer: Any = None
    on_backward_start: Optional[Callable[[], None]] = None
    post_optim_event: Any = None  # FSDPModule.set_post_optim_event: what the next iteration's gathers wait for
    streams: Optional[CommStreams] = None
    reduces: Optional[ReduceQueue] = None
    frees: Optional[FreeQueue] = None

    def __post_init__(self):
        if self.max_gathers_in_flight is None:
            self.max_gathers_in_flight = ALL_GATHER_LIMIT if self.limit_all_gathers else 1 << 30
        self.use_streams(self.streams or CommStreams(self.device))

    def use_streams(self, streams: CommStreams) -> None:
        """Run on `streams` (tests hand in stand-in CUDA streams), with fresh queues ordered by them."""
        self.streams = streams
        self.reduces = ReduceQueue(streams, self.max_reduces_in_flight)
        self.frees = FreeQueue(streams, ALL_GATHER_LIMIT if self.limit_all_gathers else None)

    def begin_iteration(self) -> None:
        """The root's forward starts, on the stream that is current now. If gradients were reduced since the last
        one, the optimizer may have stepped: a new parameter epoch begins. The gather stream waits for compute
        here, once per iteration, which also releases every freed buffer still held ([Note: three streams] and
        [Note: memory across streams] in fsdp_lab/runtime/core/streams.py)."""
        if self.grads_reduced:
            self.param_epoch += 1
            self.grads_reduced = False
        event, self.post_optim_event = self.post_optim_event, None  # used once, as torch's
        ordered = self.streams.begin_iteration(event)
        self.frees.drain(ordered=ordered)

    def emit(self, event: str, unit: str, phase: str, collectives: tuple = (), **extra) -> None:
        """Hand one lifecycle event to the attached tracer, if any; `collectives` are what the beat issued
        (fsdp_lab.runtime.core.collectives.Collective), from which a tracer can work out the bytes."""
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
