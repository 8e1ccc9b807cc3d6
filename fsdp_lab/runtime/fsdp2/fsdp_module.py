"""`FSDPModule`: what a module becomes after fully_shard, with torch FSDP2's methods, and
`register_fsdp_forward_method`.

fully_shard replaces the module's class with `FSDP<Cls>(FSDPModule, Cls)`, so `isinstance(m, FSDPModule)` and
`isinstance(m, Cls)` both hold and these methods sit in front of the module's own. The state they act on is the
module's FullyShardState (fsdp_lab/runtime/fsdp2/fully_shard.py): a unit of the shared core.
"""
from __future__ import annotations

import functools
from typing import Optional

from torch import nn


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
        first backward with True reduces the sum."""
        for module in self._fsdp_modules(recurse):
            module.__dict__["_fsdp_lab_state"].unit.requires_gradient_sync = bool(requires_gradient_sync)

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
