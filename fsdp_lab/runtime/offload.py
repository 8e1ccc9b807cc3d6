"""fully_shard's offload policies, named and shaped as in torch.distributed.fsdp, so FSDP2 scripts import.

`OffloadPolicy()` (no offloading) is what fully_shard does. `CPUOffloadPolicy` (parameters, gradients and the
optimizer step on the host) exists so a script that names it imports, but fully_shard refuses it by name: CPU
offload is not built yet.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state stay on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients on the host and step there (torch's semantics); `pin_memory` as in torch."""

    pin_memory: bool = True


def check_offload_policy(policy) -> None:
    """Accept only "no offloading" (ours or torch's OffloadPolicy); refuse CPU offload by name."""
    if type(policy).__name__ == "OffloadPolicy" and not vars(policy):
        return
    raise ValueError(f"fully_shard option offload_policy={policy!r} is not supported by fsdp_lab (CPU offload is "
                     f"not built yet); pass OffloadPolicy() or leave it out")
