"""The root's duties around one iteration, shared by both front ends (FSDP and fully_shard).

The root is the outermost unit: its forward starts the iteration, the first backward hook that fires queues
the end-of-backward callback, and a backward that raised half-way is forgotten at the next forward.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable

from fsdp_lab.runtime.core.unit import UnitState


def drop_abandoned_backward(ctx, units) -> None:
    """[Note: per-iteration state is reset at the root's pre-forward] A backward that raised half-way (an
    OOM caught by the loop) never reaches the end-of-backward callback: autograd drops queued callbacks on
    error. Its units stay unsharded and its flags say "in backward". If no backward is running now, the next
    forward frees those units, waits for the reductions already issued (their gradients are already on the
    shards: reductions are synchronous on the reduce stream), drops gradients stashed by no_sync, and starts
    clean. The gradients already stored on the shards stay, as partial gradients stay in .grad in one process:
    the loop zeroes them (optimizer.zero_grad()) before retrying."""
    if not ctx.in_backward:
        return
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError("FSDP forward called while a backward is still running")
    reset_iteration(ctx, units)


def reset_iteration(ctx, units) -> None:
    """Forget the iteration in progress, whatever stage it failed in (fully_shard's reset_iter_state, and the
    next forward after an abandoned backward): wait for the reductions already issued, free every unit, drop
    what was not reduced yet (no_sync's local sums, HSDP's partial sums, half-built unsharded gradients), and
    clear the step's flags. [Note: reset_iter_state drops the failed iteration's gradients] as torch 2.13 says
    of its reset: the failed iteration's gradients that were not reduced are lost, and a gradient accumulation
    must restart its micro-batches. Gradients already reduced onto the shards stay there, as in torch (its
    completed reduce-scatters have accumulated into the sharded .grad): optimizer.zero_grad() clears them."""
    ctx.reduces.drain()
    for unit in units:
        unit.reset_abandoned_backward()
    ctx.frees.drain()
    ctx.in_backward = ctx.final_callback_queued = False


def queue_finish_backward(ctx, finish) -> None:
    """Called by every unit's first backward hook: queue `finish` once per backward, at its end."""
    if not ctx.final_callback_queued:
        ctx.final_callback_queued = True
        ctx.in_backward = True
        Variable._execution_engine.queue_callback(finish)


def finish_backward(ctx, units, after_unit=None, wait_reduces: bool = True) -> None:
    """The end-of-backward callback: every unit waits for its reductions (unless `wait_reduces` is False: more
    backwards follow) and frees what no hook could; each must then be SHARDED unless told to stay unsharded
    after backward. `after_unit(unit)` runs once a unit is done (FSDP1 points original parameters' .grad)."""
    try:
        for unit in units:
            unit.finish_backward(wait_reduces)
            if after_unit is not None:
                after_unit(unit)
        stuck = [u for u in units if u.state is not UnitState.SHARDED and u.reshard_after_backward]
        if stuck:
            raise RuntimeError(f"after backward these FSDP units are not SHARDED: {stuck}")
        ctx.emit("backward_end", "<root>", "backward")
        if ctx.tracer is not None:
            ctx.tracer.on_backward_end()
    finally:
        ctx.in_backward = False
        ctx.final_callback_queued = False
