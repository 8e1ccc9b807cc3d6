"""Where FSDP's collectives run, and what keeps memory safe while they overlap with compute.

`gather_flat_param` and `reduce_flat_param` are one flat flat's all-gather and gradient reduction, per strategy, placed on
the right stream; the unit (fsdp_lab/runtime/unit.py) decides *when* they run.

[Note: three streams] On CUDA the runtime uses three streams:
    compute  the stream the forward runs on (the default stream, unless the caller chose another)
    gather   copy-in (fp32 shard → bf16) and all-gather into the unit's unsharded buffer `full`
    reduce   copy-in (bf16 gradient → fp32), reduce-scatter, divide by N, accumulate into shard.grad
Each side stream first waits for everything queued on the compute stream so far (`after_compute`): the gather
must not read a shard the optimizer is still updating, the reduce must not read a gradient still being
produced. The compute stream waits for a gather right before the unit computes (an event or the collective's
work handle) and for every reduce at the end of backward. None of this blocks the host: no step has a host sync.

On CPU there are no streams. With gloo, collectives can still run in the background: they are issued with
async_op=True and their work handles are waited for when the data is needed (`FSDPState.async_comm`).

[Note: memory across streams] The caching allocator gives a freed block to the next allocation *on the stream
that allocated it*, without looking at other streams. Four rules keep that safe here:
1. `full` is (re)allocated on the compute stream, and the gather stream waits for the compute stream before
   writing into it: the block may have been freed a moment ago by compute work that is still queued (the
   previous unit's buffer or activations).
2. `full` is freed (storage resized to 0) on the host once the unit's compute is queued. The compute stream has
   already waited for the gather, so a later compute allocation that reuses the block is ordered after the
   gather's writes and the compute's reads.
3. The gradient given to the reduce stream was allocated on the compute stream. We do not call record_stream
   (it releases the block only when the allocator next polls its events, so memory use drifts from run to run).
   We keep a reference until the compute stream has waited on the reduce's event: at most
   `max_reduces_in_flight` are held, the oldest released when a new reduce is queued, all at the end of backward.
4. Buffers allocated on a side stream (the bf16 send buffer, the reduce-scatter output that becomes shard.grad)
   are used there or by compute after it waited, and a side stream waits for compute before each new use, so
   reusing their blocks on the side stream is ordered after compute's last read.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Optional

import torch
from torch.autograd import profiler as _autograd_profiler

from fsdp_lab.runtime.collectives import (Collective, PendingWork, all_gather_cast, all_gather_flat, all_reduce_mean,
                                          reduce_scatter_mean)
from fsdp_lab.runtime.strategy import ShardingStrategy


def label(name: str):
    """A profiler range (visible in torch.profiler / Perfetto traces), free when no profiler is running."""
    if _autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class CommStreams:
    """The gather and reduce side streams of one FSDP model (on CPU: no streams, every method a no-op).

    `cuda` is the module that provides Stream/stream/current_stream (torch.cuda); tests pass a stand-in that
    records every wait and event, so the ordering rules can be checked on a machine without a GPU."""

    def __init__(self, device: torch.device, cuda=None):
        self.enabled = cuda is not None or (device.type == "cuda" and torch.cuda.is_available())
        self.cuda = (cuda or torch.cuda) if self.enabled else None
        self.device = device
        self.compute = None
        self.gather = self.cuda.Stream(device=device) if self.enabled else None
        self.reduce = self.cuda.Stream(device=device) if self.enabled else None

    def begin_forward(self) -> None:
        """Remember the stream the forward runs on: backward and its hooks use the same one."""
        if self.enabled:
            self.compute = self.cuda.current_stream(self.device)

    def _compute(self):
        return self.compute if self.compute is not None else self.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on_compute(self):
        """Make the compute stream current (autograd hooks may run with another stream current)."""
        if not self.enabled:
            yield
            return
        compute = self._compute()
        if self.cuda.current_stream(self.device) == compute:  # the usual case: nothing to switch
            yield
            return
        with self.cuda.stream(compute):
            yield

    @contextlib.contextmanager
    def after_compute(self, side: str):
        """Run the block on the 'gather' or 'reduce' stream, ordered after the compute stream's queued work."""
        if not self.enabled:
            yield
            return
        stream = self.gather if side == "gather" else self.reduce
        stream.wait_stream(self._compute())
        with self.cuda.stream(stream):
            yield

    def record(self, side: str):
        """An event at the current end of a side stream's queue (None on CPU)."""
        if not self.enabled:
            return None
        return (self.gather if side == "gather" else self.reduce).record_event()


class ReduceQueue:
    """Reductions queued but not yet waited for, oldest first; at most `limit` of them ([Note: memory across
    streams], rule 3). Waiting happens on the compute stream."""

    def __init__(self, streams: CommStreams, limit: int = 2):
        if limit < 1:
            raise ValueError(f"max_reduces_in_flight must be at least 1, got {limit}")
        self.streams, self.limit = streams, limit
        self._pending: deque[PendingWork] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, work: PendingWork) -> None:
        with self.streams.on_compute():
            while len(self._pending) >= self.limit:
                self._pending.popleft().wait()
        self._pending.append(work)

    def drain(self) -> None:
        with self.streams.on_compute():
            while self._pending:
                self._pending.popleft().wait()

    def discard(self) -> None:
        """An abandoned backward's reductions: every rank issued them, so let them finish, but store nothing."""
        with self.streams.on_compute():
            while self._pending:
                self._pending.popleft().wait(copy_out=False)


def gather_flat_param(ctx, flat) -> tuple[PendingWork, Optional[Collective]]:
    """Issue one flat's gather into its unsharded buffer; the result is usable once the returned work is
    waited for (on the compute stream)."""
    strategy, streams = ctx.strategy, ctx.streams
    with torch.no_grad():
        with streams.on_compute():  # [Note: memory across streams], rule 1
            full = None if flat.persistent_full else flat.alloc_full()
        with streams.after_compute("gather"):
            if strategy is ShardingStrategy.NO_SHARD:
                work, comm = PendingWork(), None
                if full is not None:
                    full.copy_(flat.shard.detach())
            elif strategy is ShardingStrategy.ZERO1:
                # Replicas are stale only after the optimizer changed the shards (bumping their version).
                work, comm = PendingWork(), None
                if flat.shard._version != flat.replica_version:
                    flat.replica_version = flat.shard._version
                    work, comm = all_gather_flat(flat.replica.data, flat.shard.detach().clone(), ctx.pg,
                                                 ctx.world_size, ctx.async_comm and full is None)
                if full is not None:
                    work.wait()
                    full.copy_(flat.replica.data)
            else:
                work, comm = all_gather_cast(full, flat.shard.detach(), ctx.pg, ctx.world_size, ctx.async_comm)
            return PendingWork(work, event=streams.record("gather")), comm


def reduce_flat_param(ctx, flat, grad: torch.Tensor, unit_name: str) -> None:
    """Reduce one flat's unsharded gradient (reduce-scatter, or all-reduce for replicated strategies) and put
    this rank's part on shard.grad. CUDA: on the reduce stream. CPU with async_comm: in gloo's threads, the
    copy-out runs when the work is waited for. The ReduceQueue holds what is still in flight."""
    streams = ctx.streams
    background = ctx.async_comm and not streams.enabled
    with label(f"fsdp_lab::reduce {unit_name}"), streams.after_compute("reduce"):
        if ctx.strategy.shards_params:
            work, comm, out = reduce_scatter_mean(grad, ctx.pg, ctx.world_size, ctx.reduce_dtype,
                                                  ctx.async_comm)
            event = "reduce_scatter"
        else:
            work, comm, out = all_reduce_mean(grad, ctx.pg, ctx.world_size, ctx.reduce_dtype, ctx.async_comm)
            event = "all_reduce"
        if background:
            ctx.reduces.push(PendingWork(work, finish=lambda: store_grad(ctx, flat, out), keep=(grad,)))
        else:  # on CUDA this only orders the reduce stream (copy-out, accumulation) after the collective
            work.wait()
            store_grad(ctx, flat, out)
    if streams.enabled:  # the compute stream waits for it later; until then `grad` must stay allocated
        ctx.reduces.push(PendingWork(event=streams.record("reduce"), keep=(grad,)))
    ctx.emit(event, unit_name, "backward", (comm,))


def store_grad(ctx, flat, out: torch.Tensor) -> None:
    """Copy-out: put the reduced gradient on the fp32 shard (accumulating if one is already there)."""
    with torch.no_grad():
        if ctx.strategy is ShardingStrategy.ZERO1:
            if flat.replica_grad is None:
                flat.replica_grad = torch.zeros_like(flat.replica)
            if flat.shard.grad is None:
                flat.replica_grad.copy_(out)
            else:
                flat.replica_grad.add_(out)
            flat.shard.grad = flat.my_chunk(flat.replica_grad)
        elif flat.shard.grad is None:
            flat.shard.grad = out.to(flat.shard.dtype)
        else:
            flat.shard.grad.add_(out)
