"""The seam between the one core (unit state machine, streams, collectives, trace) and the two shard layouts.

[Note: two layouts] A unit hands each of its layouts to the same gather and reduce paths
(fsdp_lab/runtime/core/streams.py); only how the shards are laid out differs:

    FlatParam (FSDP1, fsdp_lab/runtime/fsdp1/flat_param.py)
        every parameter of the unit end to end in one padded 1-D buffer; rank r keeps the r-th 1/N of it, cut
        wherever it falls (a weight can be split between two ranks mid-row). Copy-in and copy-out are free: the
        all-gather writes the unsharded buffer directly and the reduce-scatter reads the flat gradient.
    ParamGroup (FSDP2, fsdp_lab/runtime/fsdp2/param_group.py)
        every parameter sharded on dim 0 on its own (rows [r*c, (r+1)*c) with c = ceil(dim0/N)), each an
        nn.Parameter wrapping a DTensor with placement Shard(0), or on the dim shard_placement_fn chose
        (fsdp_lab/runtime/fsdp2/shard_dim.py). One all-gather per group still: copy-in packs
        this rank's shards into one send buffer, copy-out turns the rank-major gathered buffer into one
        contiguous unsharded tensor per parameter; the reduce-scatter's copy-in does the reverse for gradients.

Both keep the unsharded parameters as views of one autograd leaf `full` (see each class for why), so the unit's
rule for "this unit's gradients are complete" (a post-accumulate-grad hook on `full`) holds for both.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class ShardLayout(Protocol):
    """What a Unit and the gather/reduce paths use of a layout; FlatParam and ParamGroup both provide it."""

    unit_name: str
    requires_grad: bool
    compute_dtype: torch.dtype  # what the all-gather carries and compute sees
    reduce_dtype: torch.dtype  # what the reduce-scatter carries
    full: torch.Tensor  # the unsharded buffer (an autograd leaf when trainable); 0 bytes while freed
    shard: Optional[torch.Tensor]  # FlatParam: the fp32 master; ParamGroup: None (the masters are per parameter)
    persistent_full: bool  # the unsharded buffer is never freed (replicated strategies)
    replica: Optional[torch.Tensor]  # FlatParam under ZeRO-1: the replicated fp32 parameters; otherwise None
    post_forward_shard: Optional[torch.Tensor]  # ParamGroup, reshard_after_forward=int: kept after forward
    orig_params: Optional[list]  # FSDP1 use_orig_params only
    grad_stash: Optional[torch.Tensor]  # set by the Unit: no_sync's local gradient
    partial_reduce: Optional[torch.Tensor]  # set by the Unit: HSDP's reduce-scattered, not yet all-reduced sum
    replica_grad: Optional[torch.Tensor]
    all_gather_comm: object  # None, or the user's all-gather ([Note: custom collectives] in collectives.py)

    # what this rank holds (memory_report): the masters the optimizer steps, and their gradients
    def local_shards(self) -> list[torch.Tensor]: ...
    def local_grads(self) -> list[torch.Tensor]: ...

    # storage of the unsharded buffer
    def alloc_full(self) -> torch.Tensor: ...
    def free_full(self) -> None: ...
    def is_full_allocated(self) -> bool: ...

    # the module's attributes
    @property
    def views_dropped_when_freed(self) -> bool: ...
    def install_views(self, reuse: bool = False) -> None: ...
    def uninstall_views(self) -> None: ...

    # gather: copy-in → all_gather_flat(output, input) → copy-out
    def copy_in(self) -> torch.Tensor: ...
    def gather_output(self, full: torch.Tensor) -> torch.Tensor: ...
    def copy_out(self, output: torch.Tensor, full: torch.Tensor) -> None: ...

    # reduce: copy-in → reduce_scatter_mean → copy-out
    def reduce_input(self, grad: torch.Tensor) -> torch.Tensor: ...
    def store_shard_grad(self, out: torch.Tensor) -> None: ...


class UnshardedViews:
    """What both layouts do alike with their unsharded buffer `full` and the module attributes that view it.

    A subclass sets `full`, `persistent_full` and `slots` (each slot has `aliases`: (module, attribute, name)) and
    provides `views()`, one tensor per slot."""

    full: torch.Tensor
    persistent_full: bool
    slots: list
    all_gather_comm = None  # FSDPModule.set_custom_all_gather ([Note: custom collectives] in collectives.py)

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def is_full_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def alloc_full(self) -> torch.Tensor:
        """Give `full` its storage back and return a writable alias with its own version counter."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full_bytes)
        return self.full.data

    def free_full(self) -> None:
        if not self.persistent_full:
            self.full.untyped_storage().resize_(0)

    # [Note: views cut once per forward] A forward cuts fresh views of `full` for the module's attributes, and the
    # backward of the same iteration installs those same views again rather than cutting new ones (only a
    # recomputing forward reads them there; the graph already holds the forward's). Fresh per forward, not kept
    # across iterations: autograd runs ready nodes newest first, and a split node kept from an earlier step would
    # be older than everything else in the graph, so the gradient of `full` (and with it the unit's
    # reduce-scatter) would wait until the very end of backward. The cut itself is one split_with_sizes over
    # sizes worked out once. Reused only while `full` is the same tensor, with the same storage and an unchanged
    # version: a replicated strategy's `full` is the master the optimizer steps in place, and autograd refuses a
    # view cut by one split whose base was modified since. Views are cut with grad mode on and outside inference
    # mode, so a recomputing forward can backpropagate through them whatever mode the forward ran in.
    _views_cache: Optional[tuple] = None
    _view_plan: Optional[tuple] = None  # (split sizes, which piece each slot is, each slot's shape): set by views()

    def unsharded_views(self, reuse: bool = False) -> list:
        """views(); reuse=True: the views the last call cut, while still valid ([Note: views cut once per
        forward])."""
        full = self.full
        key = (id(full), full.untyped_storage()._cdata, full._version, full.dtype, full.requires_grad)
        cache = self._views_cache
        if not reuse or cache is None or cache[0] != key:
            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():  # the usual forward: no modes
                cache = self._views_cache = (key, self.views())                    # to enter
            else:
                with torch.inference_mode(False), torch.enable_grad():
                    cache = self._views_cache = (key, self.views())
        return cache[1]

    def _split_views(self, sizes: list, picks: list, shapes: list) -> list[torch.Tensor]:
        """The views of `full` a layout's views() returns: split by `sizes`, piece picks[i] viewed as shapes[i].
        A 1-D parameter is its piece as the split cut it: a second view of the same shape would cost one more
        autograd node per parameter per forward (a model's biases and norm weights are most of its parameters)."""
        parts = torch.split_with_sizes(self.full, sizes)
        return [parts[i] if len(shape) == 1 else parts[i].view(*shape) if shape else parts[i].view(shape)
                for i, shape in zip(picks, shapes)]

    def install_views(self, reuse: bool = False) -> None:
        """Point every original attribute at its view of `full`; while freed, at an empty placeholder.
        reuse=True (a unit's backward): the views its forward installed ([Note: views cut once per forward])."""
        if self.is_full_allocated():
            views = self.unsharded_views(reuse)
        else:
            views = [self.full.detach().new_empty(0)] * len(self.slots)
        for slot, view in zip(self.slots, views):
            for module, attr, _name in slot.aliases:
                # A plain instance attribute, which shadows the registered parameter (nn.Module.__getattr__ only
                # runs when normal lookup fails); writing the instance dict skips nn.Module.__setattr__'s checks,
                # which would run for every parameter every step.
                module.__dict__[attr] = view

    def uninstall_views(self) -> None:
        """Drop the unsharded views from the modules, so the attribute is the registered parameter again."""
        for slot in self.slots:
            for module, attr, _name in slot.aliases:
                module.__dict__.pop(attr, None)
