"""The peak bytes of floating-point storage a process holds while a block of code runs, counted op by op.

    with StoragePeak() as counter:
        model = FSDP(meta_model, param_init_fn=init_fn, auto_wrap_policy=...)
    counter.peak, counter.settled()            # the most bytes alive at once, and what is alive at the end

[Note: counting storages, not allocations] A dispatch mode sees the output of every op run under it. It keeps a weak
reference to each CPU floating-point storage it has seen, so a storage that is freed stops counting, and one
resized to 0 bytes (an FSDP unit's unsharded buffer after it is freed) counts 0. After every op it adds up the live
storages; a new peak is counted again after a garbage collection, so that tensors kept alive only by a reference
cycle do not make the peak depend on when the collector last ran. Storages made before the block are not seen:
the count is what the block itself made and still holds. tests/test_deferred_init.py measures wrapping with this
counter, for torch's FSDP and ours alike.

[Note: a collection of the block's objects only] With torch imported a full collection walks every object of the
process and took about a second on a loaded machine, once per new peak. On entry the mode freezes what already
exists (gc.freeze: those objects are not scanned again until unfreeze, on exit), so each collection scans only what
the block made, which is all that can hold the storages it counts.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StoragePeak(TorchDispatchMode):
    """[Note: counting storages, not allocations]."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0

    def __enter__(self):
        gc.freeze()  # [Note: a collection of the block's objects only]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            gc.unfreeze()

    def live(self) -> int:
        total = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
            else:
                total += storage.nbytes()
        return total

    def settled(self) -> int:
        """Live bytes once garbage that only a collection frees is gone."""
        gc.collect()
        return self.live()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch.distributed.tensor import DTensor

        for t in tree_flatten(out)[0]:
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point():
                storage = t.untyped_storage()
                self.storages.setdefault(id(storage), weakref.ref(storage))
        if self.live() > self.peak:
            self.peak = max(self.peak, self.settled())
        return out
