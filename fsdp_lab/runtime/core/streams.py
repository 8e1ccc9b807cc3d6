"""The gather path of one shard layout, the side streams both paths run on, and what keeps memory safe.

`gather_flat_param` is one layout's all-gather (a FlatParam or a ParamGroup: [Note: two layouts] in
fsdp_lab/runtime/core/layout.py), per strategy, placed on the right stream; its counterpart, the gradient
reduction, is fsdp_lab/runtime/core/reduction.py. The unit (fsdp_lab/runtime/core/unit.py) decides *when* they
run. Here too: the queue of reduces the compute stream has not yet waited for (`ReduceQueue`), and the
`FreeQueue`: freed unsharded buffers held until their readers on the compute stream are done.

[Note: three streams] On CUDA the runtime uses three streams. torch FSDP2 splits the work the same way, and adds a
stream for the all-gather's copy-in and one for HSDP's all-reduce; it also gives its reduce-scatter stream high
priority, where here only the gather stream has it:
    compute  the stream the forward runs on (the current stream when the root's forward starts)
    gather   high priority: copy-in (fp32 shard → bf16) and all-gather into the unit's unsharded buffer `full`
    reduce   copy-in (bf16 gradient → fp32), reduce-scatter, divide by N, accumulate into shard.grad
Each collective is issued *synchronously* inside its side stream, so NCCL runs it on that stream: a prefetched
all-gather does not queue behind the previous unit's reduce-scatter on NCCL's one internal stream, and nothing
waits on the host. The gather stream waits for the compute stream once per iteration, when the root's forward
starts (`CommStreams.begin_iteration`): after that nothing writes a shard until the next optimizer step, so no
gather of the iteration, forward or backward re-gather, has any compute to wait for except the readers of a
buffer it is about to reuse ([Note: memory across streams]). That is torch's implicit forward prefetching,
always on: the host queues unit i's compute and moves on to unit i+1's pre-forward, whose all-gather the GPU
then runs while unit i computes. forward_prefetch and backward_prefetch only move the issue earlier still. The
reduce stream waits for everything queued on the compute stream before each reduce: it reads a gradient that is
still being produced there. The compute stream waits for a gather's event right before the unit computes and for
every reduce's event at the end of backward. Every wait names the stream that waits (`event.wait(stream)`,
`stream.wait_stream(other)`): a bare `event.wait()` would order whatever stream is current on whatever device is
current. On CPU there are no streams: `CommStreams` is null, every event is None (a prefetched gather's is the
collective in flight, [Note: a prefetch on CPU]), and the very same functions run, so CI exercises the code path
a GPU takes.

[Note: memory across streams] The caching allocator gives a freed block to the next allocation *on the stream
that allocated it*, without looking at other streams. Four rules keep that safe here:
1. `full` is (re)allocated on the gather stream. Only gather-stream allocations can get its block, and the
   gather stream never waits for compute mid-iteration, so what decides safety is when a block is given back.
2. A unit's free (state SHARDED, views gone) records an event on the compute stream after the unit's last
   reader, and hands `full` to the `FreeQueue`, which keeps its storage. The storage is resized to 0 only after
   the gather stream has waited for that event (or for the whole compute stream, at the next iteration's start):
   so the next gather-stream allocation that reuses the block is ordered after the readers. A unit gathered again
   while its buffer is held reuses it, after the same wait. limit_all_gathers=True bounds what is held, as torch
   FSDP1's rate limiter bounds in-flight all-gathers: before a gather allocates, at most one freed buffer is held
   (the one the compute stream may be reading right now), so in forward at most two blocks' buffers are
   allocated: FSDP2's two-group bound. The gather of unit i+1 waits for unit i-1's readers, never for unit i's.
   With limit_all_gathers=False nothing bounds it: a held buffer is released once its event has completed
   (checked without waiting), and memory grows as far as the host runs ahead. Every buffer still held is
   released at the end of backward and of an eval forward. On CPU, with no events, the free is immediate.
3. The gradient given to the reduce stream was allocated on the compute stream. We do not call record_stream
   (it releases the block only when the allocator next polls its events, so memory use drifts from run to run).
   We keep a reference until the compute stream has waited on the reduce's event: at most
   `max_reduces_in_flight` are held, the oldest released when a new reduce is queued, all at the end of backward.
4. The other buffers allocated on a side stream (the bf16 send buffer, the reduce-scatter output that becomes
   shard.grad) are used there, or by compute after it waited for that stream; the reduce stream waits for compute
   before each new use, and the send buffer is read by the gather stream alone, so reusing their blocks on their
   stream is ordered after every read.

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
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.autograd import profiler as _autograd_profiler

from fsdp_lab.runtime.core.collectives import Collective, PendingCollective, all_gather_flat, start_all_gather_flat
from fsdp_lab.runtime.core.strategy import ShardingStrategy


_NOTHING = contextlib.nullcontext()  # stateless and reentrant: one serves every block that needs no context


class GradOff:
    """torch.no_grad() for the gather and reduce paths, which enter it for every unit every step: the same
    switch (torch._C._set_grad_enabled, restored on exit) without no_grad's layers of Python calls."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.prev)


def label(*parts: str):
    """A profiler range named by `parts` joined (visible in torch.profiler / Perfetto traces), free when no
    profiler is running: the name is only built then, since a hook calls this for every unit every step."""
    if _autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function("".join(parts))
    return _NOTHING


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

    def begin_iteration(self, post_optim_event=None) -> bool:
        """The root's forward starts: remember the stream it runs on (backward and its hooks use the same one),
        and let the gather stream wait for it, once per iteration ([Note: three streams]); or, given the event
        the user recorded after the optimizer step (FSDPModule.set_post_optim_event), for that event only, so
        unrelated work queued after the step does not hold the gathers back. True if the gather stream is now
        ordered after everything queued on compute so far."""
        if not self.enabled:
            return True
        self.compute = self.cuda.current_stream(self.device)
        if post_optim_event is not None:
            post_optim_event.wait(self.gather)
            return False
        self.gather.wait_stream(self.compute)
        return True

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

    def side(self, name: str):
        """Run the block on the 'gather' or 'reduce' stream. The reduce stream first waits for the compute
        queued so far; the gather stream does not ([Note: three streams]). On CPU: no context at all (this runs
        twice per unit per step)."""
        if not self.enabled:
            return _NOTHING
        stream = self.gather if name == "gather" else self.reduce
        if stream is self.reduce:
            stream.wait_stream(self.compute_stream())
        return self.cuda.stream(stream)

    def record(self, name: str):
        """An event at the current end of the 'gather', 'reduce' or 'compute' stream's queue (None on CPU)."""
        if not self.enabled:
            return None
        streams = {"gather": self.gather, "reduce": self.reduce, "compute": self.compute_stream()}
        return streams[name].record_event()

    def compute_waits(self, event) -> None:
        """The compute stream (named: never whatever stream is current) waits for a side stream's event; on CPU
        the host waits for a collective issued without waiting ([Note: a prefetch on CPU])."""
        if isinstance(event, PendingCollective):
            event.wait()
        elif event is not None:
            event.wait(self.compute_stream())

    def gather_waits(self, event) -> None:
        """The gather stream waits for a compute-stream event ([Note: memory across streams], rule 2)."""
        if event is not None:
            event.wait(self.gather)


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

    def push(self, event, keep: tuple, limit: Optional[int] = None) -> None:
        """Queue one reduce; `limit` (a unit's set_reduce_scatter_max_input_buffers) overrides the bound for
        this push."""
        while len(self._pending) >= (limit or self.limit):
            self.streams.compute_waits(self._pending.popleft()[0])
        self._pending.append((event, keep))

    def drain(self) -> None:
        while self._pending:
            self.streams.compute_waits(self._pending.popleft()[0])


@dataclass
class _Held:
    event: Any  # recorded on the compute stream after the last reader of these buffers
    flats: list  # whose `full` storage is still allocated
    waited: bool = False  # the gather stream has waited for `event`


class FreeQueue:
    """Unsharded buffers their unit has freed whose storage is kept until the gather stream has waited for their
    readers ([Note: memory across streams], rule 2), oldest first. `limit` (limit_all_gathers) bounds how many
    are held; None leaves it unbounded."""

    def __init__(self, streams: CommStreams, limit: Optional[int] = 2):
        if limit is not None and limit < 1:
            raise ValueError(f"the all-gather limit must be at least 1, got {limit}")
        self.streams, self.limit = streams, limit
        self._held: deque[_Held] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def push(self, flats: list) -> None:
        """A unit was freed: release its buffers once the compute stream's work queued so far has run."""
        flats = [f for f in flats if not f.persistent_full]
        if not flats:
            return
        event = self.streams.record("compute")
        if event is None:  # CPU: nothing is queued behind the host, the readers are done
            for flat in flats:
                flat.free_full()
            return
        while self.limit is not None and len(self._held) >= self.limit:
            self._release(self._held.popleft())
        self._held.append(_Held(event, flats))

    def reclaim(self, flat) -> bool:
        """`flat` is about to be gathered again: if its buffer is still held, the gather stream waits for its
        readers and the buffer is reused as it is. False if it was not held."""
        for held in self._held:
            if any(f is flat for f in held.flats):
                self._wait(held)
                held.flats = [f for f in held.flats if f is not flat]
                if not held.flats:
                    self._held.remove(held)
                return True
        return False

    def make_room(self) -> None:
        """Before a gather allocates a buffer: under the limit, keep at most limit-1 held, so at most `limit` are
        alive with the new one; unbounded, release the buffers whose readers are already done."""
        if self.limit is None:
            while self._held and self._held[0].event.query():
                self._release(self._held.popleft())
            return
        while len(self._held) > self.limit - 1:
            self._release(self._held.popleft())

    def drain(self, ordered: bool = False) -> None:
        """Release every held buffer. ordered=True: the gather stream has just waited for the whole compute
        stream, so no further wait is needed."""
        while self._held:
            self._release(self._held.popleft(), ordered)

    def _wait(self, held: _Held) -> None:
        if not held.waited:
            self.streams.gather_waits(held.event)
            held.waited = True

    def _release(self, held: _Held, ordered: bool = False) -> None:
        if not ordered:
            self._wait(held)
        for flat in held.flats:
            flat.free_full()


# -- gather ----------------------------------------------------------------------------------------------------
def refresh_replica(ctx, flat, phase: str = "forward") -> Optional[Collective]:
    """ZERO1: all-gather every rank's shard into the replica, once per epoch ([Note: ZeRO-1 replicas])."""
    if flat.replica_epoch == ctx.param_epoch:
        return None
    flat.replica_epoch = ctx.param_epoch
    # The shard is normally a window onto the replica: gather from a copy, never from the output itself.
    return all_gather_flat(flat.replica.data, flat.shard.detach().clone(), ctx.pg, ctx.world_size,
                           flat.unit_name, ctx.shard_tag, phase=phase)


# [Note: a prefetch on CPU] On CPU there are no streams, so a collective can only overlap compute if the host
# does not wait for it. A gather issued ahead of its unit (forward_prefetch, backward prefetch, unshard(async_op=
# True)) is therefore issued with async_op=True: gloo runs it on its own thread while this one computes, and the
# unit waits for it (then copies out) where a GPU's compute stream would wait for the gather's event, right
# before the unit computes (Unit.wait_gathered). Nothing else changes: the unsharded buffer is allocated when the
# gather is issued, as on a GPU, so memory reports and the trace (gather_start at the issue, gather_end at the
# wait) read as before. A gather that is waited for at once, every reduce-scatter and every all-reduce stay
# synchronous. A failure shows at the wait, as CollectiveFailed naming the unit.
def gather_flat_param(ctx, flat, group=None, ahead: bool = False, phase: str = "forward"
                      ) -> tuple[Any, Optional[Collective]]:
    """Issue one flat's gather into its unsharded buffer on the gather stream; with `group`, from the shards kept
    after forward, within that group (fsdp_lab/runtime/fsdp2/post_forward.py). Returns (event, what moved): the
    buffer is usable once the compute stream waited for the event (`CommStreams.compute_waits`). ahead=True: a
    prefetch, which on CPU is not waited for here ([Note: a prefetch on CPU]). `phase` goes into the collective
    log."""
    strategy, streams = ctx.strategy, ctx.streams
    with GradOff(), streams.side("gather"):
        full = None
        if not flat.persistent_full:  # [Note: memory across streams], rules 1 and 2
            if not ctx.frees.reclaim(flat):
                ctx.frees.make_room()
            full = flat.alloc_full()
        comm = None
        if strategy is ShardingStrategy.NO_SHARD:
            if full is not None:
                full.copy_(flat.shard.detach())
        elif strategy is ShardingStrategy.ZERO1:
            comm = refresh_replica(ctx, flat, phase)
            if full is not None:
                full.copy_(flat.replica.data)
        elif group is not None:  # reshard_after_forward=int ([Note: the post-forward shard])
            comm = flat.gather_in_group(full, group)
        else:  # the layout's copy-in (casting to the compute dtype: a bf16 policy sends bf16), the all-gather,
            # the layout's copy-out ([Note: two layouts] in fsdp_lab/runtime/core/layout.py)
            output = flat.gather_output(full)
            if ahead and not streams.enabled:
                comm, pending = start_all_gather_flat(output, flat.copy_in(), ctx.pg, ctx.world_size,
                                                      flat.unit_name, ctx.shard_tag, comm=flat.all_gather_comm,
                                                      phase=phase)
                if pending is not None:
                    pending.then = lambda: _copy_out(flat, output, full)
                    return pending, comm
            else:
                comm = all_gather_flat(output, flat.copy_in(), ctx.pg, ctx.world_size, flat.unit_name,
                                       ctx.shard_tag, comm=flat.all_gather_comm, phase=phase)
            flat.copy_out(output, full)
        return streams.record("gather"), comm


def _copy_out(flat, output: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        flat.copy_out(output, full)
