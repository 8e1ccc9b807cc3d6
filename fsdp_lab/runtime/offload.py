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
(fsdp_lab/runtime/memory.py splits its count so). Pinned host memory (torch pins offloaded shards, and FSDP2
pins when pin_memory=True) needs an accelerator; without one the shards are plain host memory, since nothing
copies to a device asynchronously there.

[Note: accumulating offloaded gradients] torch FSDP1 copies each reduced gradient over the host gradient
(`_cpu_grad.copy_`), so two backwards without no_sync() and without zero_grad() in between keep only the second
one's gradient (torch's own TODO in `prepare_gradient_for_backward` says so). Here the second is added, as without
offload and as torch FSDP2 does: one backward per step gives torch's result exactly.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


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


class Home(enum.Enum):
    DEVICE = "device"
    """The shard, its gradient and the optimizer state live on the compute device."""
    HOST = "host"
    """They live in host memory; copies go to the compute device before each gather."""


HOST = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Where one layout's sharded state lives and where it is gathered and computed ([Note: host and device])."""

    home: Home
    compute_device: torch.device
    pin_memory: bool = False

    @property
    def offloaded(self) -> bool:
        return self.home is Home.HOST

    @property
    def home_device(self) -> torch.device:
        return HOST if self.offloaded else self.compute_device

    def to_home(self, tensor: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """A copy of `tensor` in the shard's home; pin=True (a shard, copied to the device every gather) pins it
        where the policy asks and an accelerator makes it possible. A gradient is copied once: not pinned."""
        if not self.offloaded:
            return tensor if tensor.device == self.compute_device else tensor.to(self.compute_device)
        out = tensor.to(HOST, copy=True)
        if pin and self.pin_memory and torch.cuda.is_available():
            out = out.pin_memory()
        return out

    def to_compute(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor` on the compute device in `dtype`; from the host always a new tensor (the copy-in)."""
        dtype = dtype or tensor.dtype
        if not self.offloaded:
            return tensor if tensor.dtype == dtype else tensor.to(dtype)
        return tensor.to(self.compute_device, dtype, non_blocking=tensor.is_pinned(), copy=True)


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
