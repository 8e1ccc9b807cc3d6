"""CPU offload, both front ends: where each unit's sharded state lives (its home) and where it computes.

FSDP1's `CPUOffload(offload_params=True)` and FSDP2's `CPUOffloadPolicy(pin_memory=...)` mean the same thing in
torch, and here: the sharded fp32 parameters and their sharded gradients live on the host, so the optimizer's
state is created there and the optimizer steps there. `OffloadPolicy()` and `CPUOffload()` (the default,
offload_params=False) keep everything on the device.

[Note: host and device] Each layout (FlatParam, ParamGroup) carries a `Placement`: the home of its shard (HOST or
DEVICE) and its compute device. What moves, per unit and step:
    gather   copy-in copies the host shard to the compute device (cast to the compute dtype on the way, so a bf16
             policy moves bf16), then the all-gather runs there into the unsharded buffer, which lives on the
             device only while the unit is unsharded
    reduce   the reduce-scatter runs on the device; its output is copied to the host and stored (or added) on
             the host shard's .grad
    step     the optimizer sees host parameters with host gradients, so its state and its arithmetic are host
A rank's device then holds only unsharded units, their gradients until reduced, and activations. On a machine
without an accelerator the compute device is the CPU too: every "host to device" copy is still made (a host
copy), so the same code path runs and the tests can check, from the placement, where each byte would live
(fsdp_lab/runtime/core/memory.py splits its count so). Pinned host memory (torch pins offloaded shards, and FSDP2
pins when pin_memory=True) needs an accelerator; without one the shards are plain host memory, since nothing
copies to a device asynchronously there.

[Note: accumulating offloaded gradients] torch FSDP1 copies each reduced gradient over the host gradient
(`_cpu_grad.copy_`), so two backwards without no_sync() and without zero_grad() in between keep only the second
one's gradient (torch's own TODO in `prepare_gradient_for_backward` says so). Here the second is added, as without
offload and as torch FSDP2 does: one backward per step gives torch's result exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_lab.runtime.core.placement import Home, Placement


@dataclass
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state stay on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients on the host and step there (torch's semantics); `pin_memory` as in torch."""

    pin_memory: bool = True


@dataclass
class CPUOffload:
    """FSDP1's option, as torch.distributed.fsdp.CPUOffload: offload_params=True keeps the sharded parameters
    and gradients on the host ([Note: host and device])."""

    offload_params: bool = False


def fsdp1_placement(cpu_offload, compute_device: torch.device) -> Placement:
    """FSDP(cpu_offload=...): ours or torch's CPUOffload (by its one field), or None."""
    if cpu_offload is None:
        return Placement(Home.DEVICE, compute_device)
    if type(cpu_offload).__name__ != "CPUOffload" or not isinstance(getattr(cpu_offload, "offload_params", None),
                                                                      bool):
        raise ValueError(f"FSDP option cpu_offload={cpu_offload!r} should be CPUOffload(offload_params=True|False)")
    if not cpu_offload.offload_params:
        return Placement(Home.DEVICE, compute_device)
    return Placement(Home.HOST, compute_device, pin_memory=True)  # torch FSDP1 always pins


def fsdp2_placement(policy, compute_device: torch.device) -> Placement:
    """fully_shard(offload_policy=...): OffloadPolicy() or CPUOffloadPolicy(pin_memory), ours or torch's."""
    name = type(policy).__name__
    if name == "OffloadPolicy" and not vars(policy):
        return Placement(Home.DEVICE, compute_device)
    if name == "CPUOffloadPolicy" and set(vars(policy)) == {"pin_memory"}:
        return Placement(Home.HOST, compute_device, pin_memory=bool(policy.pin_memory))
    raise ValueError(f"fully_shard option offload_policy={policy!r} should be OffloadPolicy() or "
                     f"CPUOffloadPolicy(pin_memory=...)")
