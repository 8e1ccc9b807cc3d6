"""A model of either front end as an observer sees it: its units, its shared state, the rank and device.

fsdp_lab.observe (the tracer, `trace.record`) and `memory_report` take a model wrapped by `FSDP` or a module
`fully_shard` was applied to (the root of the model), through these functions: the units and their layouts
(fsdp_lab/runtime/core/layout.py) are the same core under both, only how to reach them differs. FSDP keeps its units
and state on the wrapper; fully_shard keeps one unit on each FSDPModule and the shared state on the root, which
the first forward decides ([Note: the root of a fully_shard model] in fsdp_lab/runtime/fsdp2/fully_shard.py).

Duck-typed on purpose: this module sits in the core, under both front ends (fsdp_lab/runtime/fsdp1/api.py, the
FSDP wrapper, imports memory_report), so it imports neither. It knows each by the state it keeps: the wrapper's
`_ctx` (an FSDPState) and the `_fsdp_lab_state` that fully_shard puts on every module it turns into an FSDPModule.
"""
from __future__ import annotations

from torch import nn

from fsdp_lab.runtime.core.state import FSDPState

FULLY_SHARD_STATE = "_fsdp_lab_state"  # fully_shard's per-module state, a plain attribute of each FSDPModule


def is_fully_shard(model) -> bool:
    """Whether fully_shard was applied to `model` (it is an FSDPModule)."""
    return isinstance(model, nn.Module) and FULLY_SHARD_STATE in model.__dict__


def is_fsdp_wrapper(model) -> bool:
    """Whether `model` is an FSDP (FSDP1) wrapper, outer or nested."""
    return isinstance(model, nn.Module) and isinstance(model.__dict__.get("_ctx"), FSDPState)


def _check(model) -> None:
    if is_fully_shard(model):
        return
    if not is_fsdp_wrapper(model):
        raise TypeError(f"expected a model wrapped by fsdp_lab.FSDP or a module fsdp_lab.fully_shard was applied to, "
                        f"got {type(model).__name__}")


def units_of(model) -> list:
    """Every unit of the model. fully_shard: the groups of `model` and the fully_shard modules below it."""
    _check(model)
    if is_fully_shard(model):
        return [m.__dict__[FULLY_SHARD_STATE].unit for m in model.modules() if is_fully_shard(m)]
    return model.units


def shards_params(model) -> bool:
    """Whether a rank keeps only its part of the parameters between steps (fully_shard always does)."""
    _check(model)
    return True if is_fully_shard(model) else model.sharding_strategy.shards_params


def shared_state(model) -> FSDPState:
    """The FSDPState every unit of the model shares. For fully_shard this decides the root now, as torch's
    FSDPModule methods do: `model` becomes the root, so pass the outermost fully_shard module."""
    _check(model)
    if is_fully_shard(model):
        state = model.__dict__[FULLY_SHARD_STATE]
        state.lazy_init()
        if state.root is not state:
            raise ValueError(f"this {type(model).__name__} is not the root of its fully_shard model (the root is a "
                             f"{type(state.root.module).__name__}): observe the root")
        return state.ctx
    return model._ctx


def set_tracer(model, tracer) -> None:
    """Attach (or with None, detach) a tracer: every unit's lifecycle events go to `tracer.emit`."""
    shared_state(model).tracer = tracer


def data_parallel_mesh(model):
    """The DeviceMesh fully_shard was given (None for an FSDP wrapper, which keeps process groups)."""
    _check(model)
    if is_fully_shard(model):
        return model.__dict__[FULLY_SHARD_STATE].mesh
    return None
