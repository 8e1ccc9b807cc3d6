"""The runtime's own exact count of live bytes, by kind: the CPU stand-in for torch.cuda.memory_allocated.

Storage is counted once however many views share it (a ZeRO-1 shard is a window onto its replica, a tied weight
is one slot), so the totals are what the allocator really holds for FSDP's state.

Each byte is also counted where it lives, `host` or `device` ([Note: host and device] in
fsdp_lab/runtime/features/offload.py): a shard and its gradient in their layout's home, unsharded buffers on the compute
device, optimizer state with its parameter (or on the host when it is a CPU tensor beside a device parameter, as
Adam's `step` is). On a CPU-only machine both places are host memory; the split says where a GPU run keeps them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor

from fsdp_lab.runtime.core.misuse import FLAT_OF
from fsdp_lab.runtime.core.observed import shards_params, shared_state, units_of
from fsdp_lab.runtime.core.placement import Home

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
        if isinstance(tensor, DTensor):  # fully_shard's optimizer state: the bytes are the local tensor's
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()
        self.where[home.value] += storage.nbytes()


def memory_report(model, optimizer=None) -> MemoryBytes:
    """Live bytes by kind on this rank, of a model wrapped by FSDP or the root of a fully_shard model, read through
    the layout seam (fsdp_lab/runtime/core/layout.py): the same count for flat and per-parameter shards."""
    counter = _Counter()
    sharded = shards_params(model)
    homes = {}  # id(parameter the optimizer may hold) -> where that parameter lives
    for unit in units_of(model):
        for flat in unit.flats:
            home = flat.placement.home
            if flat.shard is not None:  # FlatParam: the optimizer holds the flat shard, or the original parameters
                homes[id(flat.shard)] = home
                homes.update((id(p), home) for p in flat.orig_params or ())
            else:  # ParamGroup: the optimizer holds the DTensor parameters
                homes.update((id(slot.registered()), home) for slot in flat.slots)
            for shard in flat.local_shards():
                counter.add("params_sharded" if sharded else "params_unsharded", shard, home)
            counter.add("params_unsharded", flat.replica)
            counter.add("params_unsharded", flat.full)
            counter.add("params_unsharded", flat.post_forward_shard)
            for grad in flat.local_grads():
                counter.add("grads_sharded" if sharded else "grads_unsharded", grad, home)
            counter.add("grads_unsharded", flat.replica_grad)
            counter.add("grads_unsharded", flat.grad_stash)
            if flat.full is not flat.shard:
                counter.add("grads_unsharded", flat.full.grad)
    for param in model.parameters():  # an ignored module's parameters (ignored.py): whole, on every rank
        if not hasattr(param, FLAT_OF):
            counter.add("params_unsharded", param)
            counter.add("grads_unsharded", param.grad)
    if optimizer is not None:
        compute_on_cpu = shared_state(model).device.type == "cpu"
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    on_host = value.device.type == "cpu" and not compute_on_cpu
                    counter.add("optimizer_state", value, Home.HOST if on_host else homes.get(id(param), Home.DEVICE))
    return MemoryBytes(**counter.bytes, **counter.where)
