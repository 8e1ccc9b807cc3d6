"""The runtime's own exact count of live bytes, by kind: the CPU stand-in for torch.cuda.memory_allocated.

Storage is counted once however many views share it (a ZeRO-1 shard is a window onto its replica, a tied weight
is one slot), so the totals are what the allocator really holds for FSDP's state.

Each byte is also counted where it lives, `host` or `device` ([Note: host and device] in
fsdp_lab/runtime/offload.py): a shard and its gradient in their layout's home, unsharded buffers on the compute
device, optimizer state with its parameter (or on the host when it is a CPU tensor beside a device parameter, as
Adam's `step` is). On a CPU-only machine both places are host memory; the split says where a GPU run keeps them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from fsdp_lab.runtime.offload import Home

KINDS = ("params_sharded", "params_unsharded", "grads_sharded", "grads_unsharded", "optimizer_state")


@dataclass(frozen=True)
class MemoryBytes:
    params_sharded: int = 0
    params_unsharded: int = 0
    grads_sharded: int = 0
    grads_unsharded: int = 0
    optimizer_state: int = 0
    host: int = 0  # of the total, the bytes in host memory
    device: int = 0  # of the total, the bytes on the compute device

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in KINDS)

    def as_dict(self) -> dict:
        """The bytes by kind and their total (what traces record); `host` and `device` split the same total."""
        return {**{k: v for k, v in asdict(self).items() if k in KINDS}, "total": self.total}


class _Counter:
    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(KINDS, 0)
        self.where = {"host": 0, "device": 0}

    def add(self, kind: str, tensor, home: Home = Home.DEVICE) -> None:
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()
        self.where[home.value] += storage.nbytes()


def memory_report(model, optimizer=None) -> MemoryBytes:
    counter = _Counter()
    sharded = model.sharding_strategy.shards_params
    homes = {}  # id(parameter the optimizer may hold) -> where that parameter lives
    for unit in model.units:
        for flat in unit.flats:
            home = flat.placement.home
            homes[id(flat.shard)] = home
            homes.update((id(p), home) for p in flat.orig_params or ())
            counter.add("params_sharded" if sharded else "params_unsharded", flat.shard, home)
            counter.add("params_unsharded", flat.replica)
            counter.add("params_unsharded", flat.full)
            counter.add("grads_sharded" if sharded else "grads_unsharded", flat.shard.grad, home)
            counter.add("grads_unsharded", flat.replica_grad)
            counter.add("grads_unsharded", flat.grad_stash)
            if flat.full is not flat.shard:
                counter.add("grads_unsharded", flat.full.grad)
    if optimizer is not None:
        compute_on_cpu = model._ctx.device.type == "cpu"
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    on_host = value.device.type == "cpu" and not compute_on_cpu
                    counter.add("optimizer_state", value, Home.HOST if on_host else homes.get(id(param), Home.DEVICE))
    return MemoryBytes(**counter.bytes, **counter.where)
