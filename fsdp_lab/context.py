"""What every unit of one FSDP model shares: the process group, the policy, and the step's flags.

It is owned by the root FSDP object and handed to each unit, so there is no module-level state: two models in one
notebook (or a cell re-run) never see each other's flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from fsdp_lab.collectives import NO_COMM, CommBytes
from fsdp_lab.mixed_precision import MixedPrecision
from fsdp_lab.strategy import BackwardPrefetch, ShardingStrategy


@dataclass
class RunContext:
    group: Any
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
    async_comm: bool = False
    # -- flags of the step in progress ----------------------------------------------------------------------
    sync_gradients: bool = True
    in_backward: bool = False
    final_callback_queued: bool = False
    forward_order: list = field(default_factory=list)
    order_frozen: bool = False
    tracer: Any = None
    on_backward_start: Optional[Callable[[], None]] = None

    def emit(self, event: str, unit: str, phase: str, comm: CommBytes = NO_COMM, **extra) -> None:
        if self.tracer is not None:
            self.tracer.emit(event, unit=unit, phase=phase, bytes_sent=comm.sent, bytes_received=comm.received,
                             **extra)

    def record_forward(self, unit) -> None:
        """The first forward's unit order drives prefetch: next in forward, previous in backward."""
        if not self.order_frozen and unit not in self.forward_order:
            self.forward_order.append(unit)

    def neighbour(self, unit, step: int):
        if unit not in self.forward_order:
            return None
        i = self.forward_order.index(unit) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None
