"""Where one layout's sharded state lives (its home: host or device) and where it is gathered and computed.

Every layout carries one, offloaded or not, so both front ends and the memory count read it from the core; the
options that choose it (FSDP1's `CPUOffload`, FSDP2's `CPUOffloadPolicy`) are the offload feature's
([Note: host and device] in fsdp_lab/runtime/features/offload.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


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
