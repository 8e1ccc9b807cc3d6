"""`FSDPModule`: what a module becomes after fully_shard, with torch FSDP2's methods, and
`register_fsdp_forward_method`.

fully_shard replaces the module's class with `FSDP<Cls>(FSDPModule, Cls)`, so `isinstance(m, FSDPModule)` and
`isinstance(m, Cls)` both hold and these methods sit in front of the module's own. The state they act on is the
module's FullyShardState (fsdp_lab/runtime/fsdp2/fully_shard.py): a unit of the shared core.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import deprecated

from fsdp_lab.runtime.core.root import reset_iteration
from fsdp_lab.runtime.features.hybrid import mesh_groups


class UnshardHandle:
    """What unshard(async_op=True) returns, as torch's: wait() makes the unsharded parameters usable. The public
    class takes no arguments, as torch's does; _UnitUnshardHandle is the one unshard() builds."""

    def wait(self) -> None:
        return


class _UnitUnshardHandle(UnshardHandle):
    def __init__(self, state):
        self._state = state

    def wait(self) -> None:
        unit = self._state.unit
        unit.wait_gathered()
        for layout in unit.flats:
            layout.install_views()


class FSDPModule:
    def __new__(cls, *args, **kwargs):
        """Building an FSDP<Cls> directly (nn.Sequential slicing does, via self.__class__) builds a plain Cls."""
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self):
        state = self.__dict__["_fsdp_lab_state"]
        state.lazy_init()
        return state

    def _fsdp_modules(self, recurse: bool) -> list:
        return [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]

    def reshard(self) -> None:
        """Free the unsharded parameters; the registered (sharded DTensor) parameters are the attributes again."""
        state = self.__dict__["_fsdp_lab_state"]
        if state.ctx is not None:  # never gathered before the first forward: nothing to free
            state.unit.free("reshard")

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather the parameters now (a forward then finds them gathered). With async_op=True, return a handle
        whose wait() must be called before they are used."""
        state = self._fsdp_state()
        state.unit.gather("forward", wait=False)
        handle = _UnitUnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer: only then does its end wait for every
        pending gradient reduction."""
        self._fsdp_state().root.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally without communicating (FSDP2's no_sync); the
        first backward with True reduces the sum. Under HSDP it sets the all-reduce too, as torch does."""
        for module in self._fsdp_modules(recurse):
            unit = module._own_state().unit
            unit.requires_gradient_sync = bool(requires_gradient_sync)
            unit.reduce_options.requires_all_reduce = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"expects a bool for reshard_after_forward but got {reshard_after_forward!r}")
        for module in self._fsdp_modules(recurse):
            state = module.__dict__["_fsdp_lab_state"]
            state.unit.reshard_after_forward, state.auto_reshard = reshard_after_forward, False
            state.post_forward_size = state.unit.post_forward_group = None  # a bool replaces an int, as in torch

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters unsharded after backward (micro-batches without a re-gather); set it back
        to True for the last micro-batch, since the optimizer steps on the shards."""
        for module in self._fsdp_modules(recurse):
            module.__dict__["_fsdp_lab_state"].unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Issue these modules' all-gathers when this module's forward starts (instead of the recorded order's
        next one)."""
        self.__dict__["_fsdp_lab_state"].unit.forward_prefetch_units = _units_of(modules,
                                                                                "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Issue these modules' re-gathers when this module's backward starts."""
        self.__dict__["_fsdp_lab_state"].unit.backward_prefetch_units = _units_of(modules,
                                                                                 "set_modules_to_backward_prefetch")

    def reset_iter_state(self) -> None:
        """After forward or backward raised mid-way: free every unit, drop the failed iteration's unreduced
        gradients and flags ([Note: reset_iter_state drops the failed iteration's gradients] in
        fsdp_lab/runtime/core/root.py). Only on the root, as in torch."""
        state = self._own_state()
        if state.root is None:  # never run: nothing to reset
            return
        if state.root is not state:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        reset_iteration(state.ctx, state.units)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters within the shard group but skips the all-reduce across replicas, keeping
        the sum until a backward with True (accumulation that crosses nodes once). No effect on a 1-D mesh."""
        for module in self._fsdp_modules(recurse):
            module._own_state().unit.reduce_options.requires_all_reduce = requires_all_reduce

    def set_custom_all_gather(self, comm) -> None:
        """Use `comm` (torch's AllGather interface) for this module's all-gathers and their staging buffers
        ([Note: custom collectives] in fsdp_lab/runtime/core/collectives.py)."""
        for layout in self._own_state().unit.flats:
            layout.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """Use `comm` (torch's ReduceScatter interface) for this module's reduce-scatters and their buffers."""
        self._own_state().unit.reduce_options.custom_reduce_scatter = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None):
        """Call `hook(reduce_output)` on each reduced gradient of this module, before it is stored: the
        reduce-scatter output on a 1-D mesh, the all-reduce output under HSDP (when it sees the mean and when the
        sum: [Note: where the division happens] in fsdp_lab/runtime/core/reduction.py)."""
        state = self._own_state()
        options = state.unit.reduce_options
        options.all_reduce_hook = hook
        if stream is not None:
            if state.mesh.ndim > 1:
                raise ValueError("stream cannot be set when using native HSDP")
            options.hook_stream = stream

    def set_post_optim_event(self, event) -> None:
        """The next iteration's all-gathers wait for `event` (recorded after the optimizer step) instead of for
        everything queued on the current stream; used once."""
        self._fsdp_state().ctx.post_optim_event = event

    @deprecated("Use `set_gradient_divide_factor` instead")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Use set_gradient_divide_factor instead."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by `factor` instead of by the data-parallel size."""
        self._own_state().unit.reduce_options.divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Collectives only ever sum; the division runs as its own step after them."""
        self._own_state().unit.reduce_options.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True
                                         ) -> None:
        """Reduce zeros for a unit that got no gradient on this rank, so that ranks that did use it are not left
        waiting ([Note: unused parameters] in fsdp_lab/runtime/core/unit.py)."""
        for module in self._fsdp_modules(recurse):
            module._own_state().unit.reduce_options.reduce_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduces may be queued before the compute stream waits for the oldest (CUDA; on CPU every
        reduce completes at once)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for module in self._fsdp_modules(recurse):
            module._own_state().unit.reduce_options.max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run reduce-scatters on a process group of their own over the shard ranks (one per distinct set of
        ranks), so that on NCCL they need not queue behind all-gathers; False goes back to the shared group.
        Collective over the shard ranks: call it on every rank."""
        made: dict = {}
        for module in self._fsdp_modules(recurse):
            state = module._own_state()
            group = None
            if enable:
                ranks = tuple(mesh_groups(state.mesh).shard_ranks)
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                group = made[ranks]
            state.unit.reduce_options.reduce_scatter_pg = group

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not re-gather this module (its backward reads no parameter, e.g. an embedding)."""
        self._own_state().unit.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise NotImplementedError("set_allocate_memory_from_process_group_for_comm is not supported by fsdp_lab: it "
                                  "lets NCCL allocate the staging buffers (zero-copy over SHARP), which gloo and "
                                  "fsdp_lab's buffers do not have")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(f"set_symm_mem_for_comm(backend={backend!r}) is not supported by fsdp_lab: "
                                  f"symmetric-memory all-gathers need NCCL's symmetric memory")

    def _own_state(self):
        """This module's FullyShardState, without making it a root (torch's setters do not initialise either)."""
        return self.__dict__["_fsdp_lab_state"]

    def _apply(self, *args, **kwargs):
        """to_empty, .to(), ...: reshard first, so that what gets converted is the registered sharded
        parameters, never the unsharded views."""
        self.reshard()
        return super()._apply(*args, **kwargs)


def _units_of(modules: list, method: str) -> list:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"{method} expects fully_shard modules, got {bad}")
    return [m.__dict__["_fsdp_lab_state"].unit for m in modules]  # no lazy init: the root is not known yet


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. generate) gather and free like forward does. A no-op for a module that
    is not an FSDPModule, as in torch, so one script serves both."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig_method = getattr(module, method_name)

    @functools.wraps(orig_method)
    def wrapped(self, *args, **kwargs):
        state = self.__dict__["_fsdp_lab_state"]
        args, kwargs = state.pre_forward(self, args, kwargs)
        return state.post_forward(self, args, orig_method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
