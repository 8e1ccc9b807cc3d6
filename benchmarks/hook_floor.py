"""fully_shard's four hooks cut down to the tensor operations they cannot skip at world size 1: a floor for what
any hooks over this layout cost on the host, measured beside the real ones by host_overhead.py (`--setup
fully_shard_floor`).

[Note: the hooks' floor] At world size 1 no collective runs, so a step's host addition over plain training is
the optimizer stepping DTensors plus whatever the hooks do. `install(model)` swaps, on one fully_shard model
whose first step has run, each unit's hooks for these bare ones:
    pre-forward    give `full` its storage back and copy the group's master into it, cast (the gather at world
                   size 1); cut the views (one split) and set them on the modules; cast the inputs
    post-forward   hook the output for backward; free `full` and drop the views (not the root's); cast the output
    pre-backward   once per unit: gather again if freed, set the forward's views again
    gradient ready cast the gradient to the reduce dtype, cut it into one DTensor gradient per parameter (or
                   add to the one there), free `full`, drop the views
Left out is everything else a complete runtime runs every step: the state machine and its misuse checks, the
trace and the collective log, per-unit options (reshard, prefetch, gradient sync, divide factors, hooks),
prefetch, the end-of-backward callback's work, tied and replaced parameters, offload, frozen groups. What stays
is what fsdp_lab's layout must do whatever is built around it, so a real fully_shard's host addition cannot go
below this one's; the probe trains to the real one's losses (tests/test_hook_floor.py). It models world size 1,
one module per fully_shard call, trainable groups over fully_shard's own master buffers, fully_shard's defaults
(no FSDPModule.set_* setting that changes a reduction, a free or the re-gather) and units that return one tensor:
install() and the hooks refuse anything else by name.
"""
from __future__ import annotations

import types

import torch
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from fsdp_lab.runtime.core.misuse import eager_hook
from fsdp_lab.runtime.core.reduction import ReduceOptions
from fsdp_lab.runtime.core.unit import UnitState
from fsdp_lab.runtime.fsdp2.fully_shard import FSDPModule


def install(model: torch.nn.Module) -> None:
    """Replace the hooks of every fully_shard unit of `model` (after its first step) with the bare ones."""
    states = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            states.setdefault(id(module._fsdp_lab_state), (module, module._fsdp_lab_state))
    for module, state in states.values():
        _check(state)
        unit = state.unit
        pre, post = unit.hook_handles[0].id, unit.hook_handles[1].id
        module._forward_pre_hooks[pre] = eager_hook(types.MethodType(_pre_forward, state))
        module._forward_hooks[post] = eager_hook(types.MethodType(_post_forward, state))
        unit._pre_backward_hook = types.MethodType(_pre_backward, unit)  # an instance attribute: the unit's
        unit._on_grad_ready = types.MethodType(_on_grad_ready, unit)     # own hooks look these up per call


def _check(state) -> None:
    unit, ctx = state.unit, state.ctx
    if state.root is None:
        raise ValueError("hook_floor.install: run one step first (the root is found at the first forward)")
    if ctx.world_size != 1 or len(unit.hook_handles) != 2 or ctx.tracer is not None or \
            unit.post_forward_group is not None:
        raise ValueError(f"hook_floor.install: world size 1, one module per fully_shard call, no tracer and a "
                         f"boolean reshard_after_forward only (world size {ctx.world_size}, "
                         f"{len(unit.hook_handles)} hooks on unit {unit.name!r})")
    if not (unit.reshard_after_backward and unit.requires_gradient_sync and unit.unshard_in_backward
            and unit.reduce_options == ReduceOptions()):
        raise ValueError(f"hook_floor.install: unit {unit.name!r} has FSDPModule.set_* settings the floor does not "
                         f"model")
    for group in unit.flats:
        if not group.requires_grad or not group.copies_master():
            raise ValueError(f"hook_floor.install: unit {unit.name!r} has a frozen group or replaced parameters")


def _gather(unit) -> None:
    for group in unit.flats:
        group.alloc_full()
        torch._foreach_copy_([group.full.data], [group._master])
    unit.state = UnitState.UNSHARDED


def _install_views(unit, reuse: bool) -> None:
    for group in unit.flats:
        for slot, view in zip(group.slots, group.unsharded_views(reuse)):
            for module, attr, _name in slot.aliases:
                module.__dict__[attr] = view


def _free(unit) -> None:
    for group in unit.flats:
        group.free_full()
        group.uninstall_views()
    unit.state = UnitState.SHARDED


def _pre_forward(state, module, args, kwargs):
    unit, ctx = state.unit, state.ctx
    if state.root is state:
        ctx.in_backward = ctx.final_callback_queued = False
    if unit.state is not UnitState.UNSHARDED:
        _gather(unit)
    _install_views(unit, reuse=False)
    return state.cast_inputs(args, kwargs)


def _post_forward(state, module, args, output):
    unit = state.unit
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"hook_floor: unit {unit.name!r} returned {type(output).__name__}, not one tensor")
    output.register_hook(unit._pre_backward_hook)
    unit._backward_started = False
    if unit.frees_after_forward:
        _free(unit)
    return state.cast_output(output)


def _pre_backward(unit, grad):
    ctx = unit.ctx
    if not ctx.final_callback_queued:  # the real root queues its end-of-backward work here
        ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(lambda: None)
    if not unit._backward_started:
        unit._backward_started = True
        if unit.state is not UnitState.UNSHARDED:
            _gather(unit)
        _install_views(unit, reuse=True)
    return grad


def _on_grad_ready(unit, group) -> None:
    grad, group.full.grad = group.full.grad, None
    parts = torch.split_with_sizes(grad.to(group.reduce_dtype), group._send_sizes)
    for slot, shape, pick in group._grad_plan:
        local = parts[pick] if len(shape) == 1 else parts[pick].view(shape)
        param = slot.registered()
        if param.grad is None:
            param.grad = DTensor.__new__(DTensor, local, slot.spec, requires_grad=False)
        else:
            param.grad._local_tensor.add_(local)
    _free(unit)
