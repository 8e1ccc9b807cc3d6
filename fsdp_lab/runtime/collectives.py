"""The three collectives FSDP needs, each split into copy-in → communication → copy-out.

Each returns a `Collective` saying what it moved (kind, element count, dtype, world size), which the unit hands to
an attached tracer with the event; the tracer turns it into bytes ([Note: ring byte counts] in
fsdp_lab/observe/traffic.py). World size 1 skips the communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Collective:
    """One collective as issued: `numel` elements of `dtype` in the unsharded buffer, over `world_size` ranks."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    numel: int
    dtype: torch.dtype
    world_size: int

# torch 2.13 renamed the flat collectives (the old names still work but warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingWork:
    """A collective in flight plus what to do once it lands (copy-out). `wait()` is idempotent.

    `work` is a torch.distributed work handle (or another PendingWork); `event` a CUDA event recorded on the side
    stream after the work was queued there; `keep` holds tensors that must outlive the work (see [Note: memory
    across streams] in fsdp_lab/runtime/streams.py). On CUDA, `wait()` makes the *current* stream wait, so call it on
    the stream that will use the result; on CPU it blocks until the data is there."""

    __slots__ = ("_work", "_finish", "_event", "_keep", "done")

    def __init__(self, work=None, finish=None, event=None, keep=()):
        self._work, self._finish, self._event, self._keep, self.done = work, finish, event, keep, False

    def wait(self, copy_out: bool = True):
        """copy_out=False: let the collective finish but keep no result (an abandoned backward's reduction)."""
        if self.done:
            return None
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.wait()  # the current stream waits for the side stream; the host does not block
        self.done = True
        self._work, self._event, self._keep = None, None, ()
        if self._finish is not None and copy_out:
            return self._finish()
        return None


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, pg, world_size: int,
                    async_op: bool = False) -> tuple[PendingWork, Collective]:
    """Fill `output` (length N·len(shard)) with every rank's shard. `shard` must already be in the output
    dtype: the caller casts on copy-in, so a bf16 policy sends bf16."""
    if output.numel() != shard.numel() * world_size:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected "
                         f"{shard.numel()} x {world_size} = {shard.numel() * world_size}")
    call = Collective("all_gather", output.numel(), output.dtype, world_size)
    if world_size == 1:
        output.copy_(shard)
        return PendingWork(None), call
    work = _all_gather(output, shard, group=pg, async_op=async_op)
    return PendingWork(work if async_op else None), call


def all_gather_cast(output: torch.Tensor, master_shard: torch.Tensor, pg, world_size: int,
                    async_op: bool = False) -> tuple[PendingWork, Collective]:
    """Copy-in (cast the fp32 master shard to output's dtype) → all-gather into `output`. At world size 1 this
    is a single cast-copy; otherwise the cast buffer is kept alive until the work is waited for."""
    if world_size == 1:
        return all_gather_flat(output, master_shard, pg, world_size)  # copy_ casts as it copies
    send = master_shard if master_shard.dtype == output.dtype else master_shard.to(output.dtype)
    work, call = all_gather_flat(output, send, pg, world_size, async_op)
    return PendingWork(work, keep=(send,)), call


def reduce_scatter_mean(full_grad: torch.Tensor, pg, world_size: int, reduce_dtype: torch.dtype,
                        async_op: bool = False) -> tuple[PendingWork, Collective, torch.Tensor]:
    """Sum every rank's full gradient and keep this rank's chunk, divided by N (gloo has no AVG op).
    Returns (work, bytes, output); `output` is valid after `work.wait()`."""
    send = full_grad if full_grad.dtype == reduce_dtype else full_grad.to(reduce_dtype)
    call = Collective("reduce_scatter", send.numel(), send.dtype, world_size)
    if world_size == 1:  # the (cast) gradient is already this rank's whole shard: no copy
        return PendingWork(None), call, send
    out = torch.empty(send.numel() // world_size, dtype=reduce_dtype, device=send.device)
    work = _reduce_scatter(out, send, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)
    return PendingWork(work if async_op else None, lambda: out.div_(world_size), keep=(send,)), call, out


def all_reduce_mean(grad: torch.Tensor, pg, world_size: int, reduce_dtype: torch.dtype,
                    async_op: bool = False) -> tuple[PendingWork, Collective, torch.Tensor]:
    """DDP's gradient sync: sum over ranks, divide by N. Works on a copy when the dtypes differ."""
    buf = grad if grad.dtype == reduce_dtype else grad.to(reduce_dtype)
    call = Collective("all_reduce", buf.numel(), buf.dtype, world_size)
    if world_size == 1:
        return PendingWork(None), call, buf
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)
    return PendingWork(work if async_op else None, lambda: buf.div_(world_size)), call, buf
