"""Sharding strategies and prefetch modes, named as in torch.distributed.fsdp so scripts can swap imports.

ZeRO stage map (DeepSpeed's names → ours):
    ZeRO-3  FULL_SHARD     parameters, gradients and optimizer state sharded; layers freed after forward
    ZeRO-2  SHARD_GRAD_OP  gradients and optimizer state sharded; gathered parameters kept from forward to backward
    ZeRO-1  ZERO1          only optimizer state sharded; parameters and gradients replicated (torch has no such mode)
    DDP     NO_SHARD       everything replicated; gradients all-reduced
    HSDP    HYBRID_SHARD, _HYBRID_SHARD_ZERO2: FULL_SHARD / SHARD_GRAD_OP inside the shard group (a node), replicated
            across the replicate group (the nodes); fsdp_lab/runtime/features/hybrid.py
"""
from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    ZERO1 = "ZERO1"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage inside the shard group (the hybrid strategies replicate across groups on top)."""
        return {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2, "_HYBRID_SHARD_ZERO2": 2, "ZERO1": 1,
                "NO_SHARD": 0}[self.value]

    @property
    def shards_params(self) -> bool:
        """Whether a rank keeps only its 1/N slice of the parameters between steps (N: the shard group)."""
        return self.zero_stage >= 2

    @property
    def frees_after_forward(self) -> bool:
        return self.zero_stage == 3

    @property
    def is_hybrid(self) -> bool:
        """Sharded inside one group, replicated across another (torch's HYBRID_SHARDING_STRATEGIES)."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(enum.Enum):
    """When to start the next unit's re-gather in backward.

    BACKWARD_PRE:  as soon as the current unit's backward begins (more overlap, two units' worth of memory).
    BACKWARD_POST: once the current unit's gradient is computed (less memory, less overlap).
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


def coerce_enum(value, enum_cls, what: str):
    """Accept an enum member, its torch twin (same name) or its name; reject anything else by name."""
    if value is None or isinstance(value, enum_cls):
        return value
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in enum_cls.__members__:
        return enum_cls[name.upper()]
    known = ", ".join(enum_cls.__members__)
    raise ValueError(f"unknown {what} {value!r}; expected one of: {known}")
