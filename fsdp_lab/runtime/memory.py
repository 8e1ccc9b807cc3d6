"""The runtime's own exact count of live bytes, by kind: the CPU stand-in for torch.cuda.memory_allocated.

Storage is counted once however many views share it (a ZeRO-1 shard is a window onto its replica, a tied weight
is one slot), so the totals are what the allocator really holds for FSDP's state.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor

from fsdp_lab.runtime.observed import shards_params, units_of

from fsdp_lab.runtime.misuse import FLAT_OF

KINDS = ("params_sharded", "params_unsharded", "grads_sharded", "grads_unsharded", "optimizer_state")


@dataclass(frozen=True)
class MemoryBytes:
    params_sharded: int = 0
    params_unsharded: int = 0
    grads_sharded: int = 0
    grads_unsharded: int = 0
    optimizer_state: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in KINDS)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


class _Counter:
    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, tensor) -> None:
        if tensor is None:
            return
        if isinstance(tensor, DTensor):  # fully_shard's optimizer state: the bytes are the local tensor's
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()


def memory_report(model, optimizer=None) -> MemoryBytes:
    """Live bytes by kind on this rank, of a model wrapped by FSDP or the root of a fully_shard model, read through
    the layout seam (fsdp_lab/runtime/layout.py): the same count for flat and per-parameter shards."""
    counter = _Counter()
    sharded = shards_params(model)
    for unit in units_of(model):
        for flat in unit.flats:
            for shard in flat.local_shards():
                counter.add("params_sharded" if sharded else "params_unsharded", shard)
            counter.add("params_unsharded", flat.replica)
            counter.add("params_unsharded", flat.full)
            counter.add("params_unsharded", flat.post_forward_shard)
            for grad in flat.local_grads():
                counter.add("grads_sharded" if sharded else "grads_unsharded", grad)
            counter.add("grads_unsharded", flat.replica_grad)
            counter.add("grads_unsharded", flat.grad_stash)
            if flat.full is not flat.shard:
                counter.add("grads_unsharded", flat.full.grad)
    for param in model.parameters():  # an ignored module's parameters (ignored.py): whole, on every rank
        if not hasattr(param, FLAT_OF):
            counter.add("params_unsharded", param)
            counter.add("grads_unsharded", param.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    counter.add("optimizer_state", value)
    return MemoryBytes(**counter.bytes)
