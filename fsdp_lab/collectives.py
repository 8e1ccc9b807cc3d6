"""The three collectives FSDP needs, each split into copy-in → communication → copy-out, with the bytes each
rank puts on the wire reported for the trace.

[Note: ring byte counts] We report what a ring algorithm moves per rank, the convention the article's formulas
use: an all-gather or reduce-scatter of a T-byte buffer sends (N-1)/N·T bytes per rank (and receives as much);
an all-reduce sends 2·(N-1)/N·T. World size 1 moves nothing and skips the collective.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommBytes:
    sent: int
    received: int


NO_COMM = CommBytes(0, 0)

# torch 2.13 renamed the flat collectives (the old names still work but warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ring_bytes(kind: str, total_bytes: int, world_size: int) -> CommBytes:
    if world_size == 1:
        return NO_COMM
    one_pass = total_bytes * (world_size - 1) // world_size
    factor = 2 if kind == "all_reduce" else 1
    return CommBytes(one_pass * factor, one_pass * factor)


class PendingWork:
    """A collective in flight plus what to do once it lands (copy-out). `wait()` is idempotent.

    `work` is a torch.distributed work handle (or another PendingWork); `event` a CUDA event recorded on the side
    stream after the work was queued there; `keep` holds tensors that must outlive the work (see [Note: memory
    across streams] in fsdp_lab/streams.py). On CUDA, `wait()` makes the *current* stream wait, so call it on
    the stream that will use the result; on CPU it blocks until the data is there."""

    __slots__ = ("_work", "_finish", "_event", "_keep", "done")

    def __init__(self, work=None, finish=None, event=None, keep=()):
        self._work, self._finish, self._event, self._keep, self.done = work, finish, event, keep, False

    def wait(self):
        if self.done:
            return None
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.wait()  # the current stream waits for the side stream; the host does not block
        self.done = True
        self._work, self._event, self._keep = None, None, ()
        if self._finish is not None:
            return self._finish()
        return None


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, world_size: int,
                    async_op: bool = False) -> tuple[PendingWork, CommBytes]:
    """Fill `output` (length N·len(shard)) with every rank's shard. `shard` must already be in the output
    dtype: the caller casts on copy-in, so a bf16 policy sends bf16."""
    if output.numel() != shard.numel() * world_size:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected "
                         f"{shard.numel()} x {world_size} = {shard.numel() * world_size}")
    nbytes = ring_bytes("all_gather", output.numel() * output.element_size(), world_size)
    if world_size == 1:
        output.copy_(shard)
        return PendingWork(None), nbytes
    work = _all_gather(output, shard, group=group, async_op=async_op)
    return PendingWork(work if async_op else None), nbytes


def all_gather_cast(output: torch.Tensor, master_shard: torch.Tensor, group, world_size: int,
                    async_op: bool = False) -> tuple[PendingWork, CommBytes]:
    """Copy-in (cast the fp32 master shard to output's dtype) → all-gather into `output`. At world size 1 this
    is a single cast-copy; otherwise the cast buffer is kept alive until the work is waited for."""
    if world_size == 1:
        return all_gather_flat(output, master_shard, group, world_size)  # copy_ casts as it copies
    send = master_shard if master_shard.dtype == output.dtype else master_shard.to(output.dtype)
    work, nbytes = all_gather_flat(output, send, group, world_size, async_op)
    return PendingWork(work, keep=(send,)), nbytes


def reduce_scatter_mean(full_grad: torch.Tensor, group, world_size: int, reduce_dtype: torch.dtype,
                        async_op: bool = False) -> tuple[PendingWork, CommBytes, torch.Tensor]:
    """Sum every rank's full gradient and keep this rank's chunk, divided by N (gloo has no AVG op).
    Returns (work, bytes, output); `output` is valid after `work.wait()`."""
    send = full_grad if full_grad.dtype == reduce_dtype else full_grad.to(reduce_dtype)
    nbytes = ring_bytes("reduce_scatter", send.numel() * send.element_size(), world_size)
    if world_size == 1:  # the (cast) gradient is already this rank's whole shard: no copy
        return PendingWork(None), nbytes, send
    out = torch.empty(send.numel() // world_size, dtype=reduce_dtype, device=send.device)
    work = _reduce_scatter(out, send, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return PendingWork(work if async_op else None, lambda: out.div_(world_size), keep=(send,)), nbytes, out


def all_reduce_mean(grad: torch.Tensor, group, world_size: int, reduce_dtype: torch.dtype,
                    async_op: bool = False) -> tuple[PendingWork, CommBytes, torch.Tensor]:
    """DDP's gradient sync: sum over ranks, divide by N. Works on a copy when the dtypes differ."""
    buf = grad if grad.dtype == reduce_dtype else grad.to(reduce_dtype)
    nbytes = ring_bytes("all_reduce", buf.numel() * buf.element_size(), world_size)
    if world_size == 1:
        return PendingWork(None), nbytes, buf
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return PendingWork(work if async_op else None, lambda: buf.div_(world_size)), nbytes, buf
