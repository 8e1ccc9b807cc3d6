"""The gather and reduce paths of one shard layout, the side streams they run on, and what keeps memory safe.

`gather_flat_param` and `reduce_flat_param` are one layout's all-gather and gradient reduction (a FlatParam or a
ParamGroup: [Note: two layouts] in fsdp_lab/runtime/layout.py), per strategy, placed
on the right stream; the unit (fsdp_lab/runtime/unit.py) decides *when* they run. The whole reduce path is here:
copy-in and collective (fsdp_lab/runtime/collectives.py), copy-out (`store_grad`), and the queue of reduces the
compute stream has not yet waited for (`ReduceQueue`).

[Note: three streams] On CUDA the runtime uses three streams, as torch FSDP2 does:
    compute  the stream the forward runs on (the current stream when the root's forward starts)
    gather   high priority: copy-in (fp32 shard → bf16) and all-gather into the unit's unsharded buffer `full`
    reduce   copy-in (bf16 gradient → fp32), reduce-scatter, divide by N, accumulate into shard.grad
Each collective is issued *synchronously* inside its side stream, so NCCL runs it on that stream: a prefetched
all-gather does not queue behind the previous unit's reduce-scatter on NCCL's one internal stream, and nothing
waits on the host. Each side stream first waits for everything queued on the compute stream so far
(`CommStreams.side`): the gather must not read a shard the optimizer is still updating, the reduce must not read
a gradient still being produced. The compute stream waits for a gather's event right before the unit computes and
for every reduce's event at the end of backward. Every wait names the stream that waits (`event.wait(stream)`,
`stream.wait_stream(other)`): a bare `event.wait()` would order whatever stream is current on whatever device is
current. On CPU there are no streams: `CommStreams` is null, every event is None, and the very same functions
run, so CI exercises the code path a GPU takes.

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

[Note: ZeRO-1 replicas] Under ZERO1 every rank keeps a full fp32 replica of the parameters, and its shard (the
master the optimizer updates) is a window onto it. After an optimizer step the other ranks' chunks of the replica
are stale. Whether a step happened cannot be told reliably from the tensors: fused and foreach optimizers and
writes through `.data` do not all bump version counters, and the user's optimizer is not registered with FSDP.
But an optimizer step needs reduced gradients: so every gradient reduction marks the masters as possibly
changed, the next root pre-forward then starts a new `FSDPState.param_epoch`, and a unit's first gather of the
epoch all-gathers every rank's shard into the replica (the ZeRO paper's all-gather of updated parameters). That is
once per optimizer step whatever the optimizer, including none under no_sync() micro-batches. A checkpoint load
marks the replica stale itself; summon_full_params(writeback=True) writes the whole replica. Gradients take the
other half of the paper's two passes: a reduce-scatter, whose chunk is all this rank's optimizer reads. The
replicated fp32 gradient (4Φ, the stage's defining cost) is the local gradient as backward produced it, with
this rank's chunk replaced by the reduced mean. Exports and state dicts gather the shards, never the replica, so
they are current even between `optimizer.step()` and the next forward.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Optional

import torch
from torch.autograd import profiler as _autograd_profiler

from fsdp_lab.runtime.collectives import Collective, all_gather_flat, all_reduce_mean, reduce_scatter_mean
from fsdp_lab.runtime.strategy import ShardingStrategy


def label(name: str):
    """A profiler range (visible in torch.profiler / Perfetto traces), free when no profiler is running."""
    if _autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class CommStreams:
    """The compute, gather and reduce streams of one FSDP model (on CPU: null, every method a no-op).

    `cuda` is the module that provides Stream/stream/current_stream (torch.cuda); tests pass a stand-in that
    records every wait and event, so the ordering rules can be checked on a machine without a GPU."""

    def __init__(self, device: torch.device, cuda=None):
        self.enabled = cuda is not None or (device.type == "cuda" and torch.cuda.is_available())
        self.cuda = (cuda or torch.cuda) if self.enabled else None
        self.device = device
        self.compute = None
        # Lower number = higher priority; -1 is the highest CUDA offers on every GPU torch supports.
        self.gather = self.cuda.Stream(device=device, priority=-1) if self.enabled else None
        self.reduce = self.cuda.Stream(device=device) if self.enabled else None

    def begin_forward(self) -> None:
        """Remember the stream the forward runs on: backward and its hooks use the same one."""
        if self.enabled:
            self.compute = self.cuda.current_stream(self.device)

    def compute_stream(self):
        return self.compute if self.compute is not None else self.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on_compute(self):
        """Make the compute stream current (autograd hooks may run with another stream current)."""
        if not self.enabled:
            yield
            return
        compute = self.compute_stream()
        if self.cuda.current_stream(self.device) == compute:  # the usual case: nothing to switch
            yield
            return
        with self.cuda.stream(compute):
            yield

    @contextlib.contextmanager
    def side(self, name: str):
        """Run the block on the 'gather' or 'reduce' stream, ordered after the compute stream's queued work."""
        if not self.enabled:
            yield
            return
        stream = self.gather if name == "gather" else self.reduce
        stream.wait_stream(self.compute_stream())
        with self.cuda.stream(stream):
            yield

    def record(self, name: str):
        """An event at the current end of a side stream's queue (None on CPU)."""
        if not self.enabled:
            return None
        return (self.gather if name == "gather" else self.reduce).record_event()

    def compute_waits(self, event) -> None:
        """The compute stream (named: never whatever stream is current) waits for a side stream's event."""
        if event is not None:
            event.wait(self.compute_stream())


class ReduceQueue:
    """Reduces whose event the compute stream has not yet waited for, oldest first, each with the tensors that
    must stay allocated until it has ([Note: memory across streams], rule 3); at most `limit` of them."""

    def __init__(self, streams: CommStreams, limit: int = 2):
        if limit < 1:
            raise ValueError(f"max_reduces_in_flight must be at least 1, got {limit}")
        self.streams, self.limit = streams, limit
        self._pending: deque[tuple[Any, tuple]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, event, keep: tuple) -> None:
        while len(self._pending) >= self.limit:
            self.streams.compute_waits(self._pending.popleft()[0])
        self._pending.append((event, keep))

    def drain(self) -> None:
        while self._pending:
            self.streams.compute_waits(self._pending.popleft()[0])


# -- gather ----------------------------------------------------------------------------------------------------
def refresh_replica(ctx, flat) -> Optional[Collective]:
    """ZERO1: all-gather every rank's shard into the replica, once per epoch ([Note: ZeRO-1 replicas])."""
    if flat.replica_epoch == ctx.param_epoch:
        return None
    flat.replica_epoch = ctx.param_epoch
    # The shard is normally a window onto the replica: gather from a copy, never from the output itself.
    return all_gather_flat(flat.replica.data, flat.shard.detach().clone(), ctx.pg, ctx.world_size,
                           flat.unit_name)


def gather_flat_param(ctx, flat) -> tuple[Any, Optional[Collective]]:
    """Issue one flat's gather into its unsharded buffer on the gather stream. Returns (event, what moved): the
    buffer is usable once the compute stream waited for the event (`CommStreams.compute_waits`)."""
    strategy, streams = ctx.strategy, ctx.streams
    with torch.no_grad():
        with streams.on_compute():  # [Note: memory across streams], rule 1
            full = None if flat.persistent_full else flat.alloc_full()
        with streams.side("gather"):
            comm = None
            if strategy is ShardingStrategy.NO_SHARD:
                if full is not None:
                    full.copy_(flat.shard.detach())
            elif strategy is ShardingStrategy.ZERO1:
                comm = refresh_replica(ctx, flat)
                if full is not None:
                    full.copy_(flat.replica.data)
            else:  # the layout's copy-in (casting to the compute dtype: a bf16 policy sends bf16), the
                # all-gather, the layout's copy-out ([Note: two layouts] in fsdp_lab/runtime/layout.py)
                output = flat.gather_output(full)
                comm = all_gather_flat(output, flat.copy_in(), ctx.pg, ctx.world_size, flat.unit_name)
                flat.copy_out(output, full)
            return streams.record("gather"), comm


# -- reduce ----------------------------------------------------------------------------------------------------
def reduce_flat_param(ctx, flat, grad: torch.Tensor, unit_name: str) -> None:
    """Reduce one flat's unsharded gradient on the reduce stream and put this rank's part on shard.grad:
    reduce-scatter for the sharded strategies and ZERO1, all-reduce for NO_SHARD. The compute stream waits for
    it through the ReduceQueue, at the latest at the end of backward."""
    streams = ctx.streams
    scatter = ctx.strategy is not ShardingStrategy.NO_SHARD
    with label(f"fsdp_lab::reduce {unit_name}"), torch.no_grad(), streams.side("reduce"):
        if scatter:
            comm, out = reduce_scatter_mean(flat.reduce_input(grad), ctx.pg, ctx.world_size, flat.reduce_dtype,
                                            unit_name)
        else:
            comm, out = all_reduce_mean(grad, ctx.pg, ctx.world_size, flat.reduce_dtype, unit_name)
        store_grad(ctx, flat, grad, out)
        event = streams.record("reduce")
    ctx.grads_reduced = True  # the optimizer may step now ([Note: ZeRO-1 replicas])
    ctx.reduces.push(event, keep=(grad,) if streams.enabled else ())  # CPU: nothing runs later, nothing to keep
    ctx.emit("reduce_scatter" if scatter else "all_reduce", unit_name, "backward", (comm,))


def store_grad(ctx, flat, grad: torch.Tensor, out: torch.Tensor) -> None:
    """Copy-out: put the reduced gradient on the fp32 shard (accumulating if one is already there); how it lands
    on the shard is the layout's (`store_shard_grad`)."""
    if ctx.strategy is ShardingStrategy.ZERO1 and flat.shard.grad is None:  # [Note: ZeRO-1 replicas]
        local = grad if grad.dtype == flat.shard.dtype else grad.to(flat.shard.dtype)
        chunk = flat.my_chunk(local)
        chunk.copy_(out)
        flat.replica_grad, flat.shard.grad = local, chunk
    else:
        flat.store_shard_grad(out)
