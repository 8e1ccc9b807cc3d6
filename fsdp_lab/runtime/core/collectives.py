"""The three collectives FSDP needs, each split into copy-in → communication → copy-out, each synchronous.

Synchronous on purpose: the caller issues them inside a side stream (fsdp_lab/runtime/core/streams.py), so on CUDA a
"synchronous" collective only orders that stream, never the host, and NCCL runs it there instead of queueing
every collective on one internal stream. On CPU the same calls simply run. The one exception is a gather issued
ahead of its unit on CPU (`start_all_gather_flat`, [Note: a prefetch on CPU] in streams.py): without streams
it can only overlap compute if the host does not wait, so it returns a `PendingCollective` to wait for later.

Each returns a `Collective` saying what it moved (kind, element count, dtype, world size, and the group it ran in:
"shard" or "replicate" with its global ranks, so traffic inside and across nodes can be told apart), which the
unit hands to an attached tracer with the event; the tracer turns it into bytes ([Note: ring byte counts] in
fsdp_lab/observe/traffic.py). World size 1 skips the communication.

Each collective issued is recorded first in its group's collective log (fsdp_lab/runtime/core/collective_log.py),
with the unit and the phase (forward, backward, state_dict, ...) the caller names, and marked done after; a
failure is reported with every rank's last records ([Note: reporting through the store] there). The collectives
off the lifecycle go through fsdp_lab/runtime/core/side_collectives.py into the same log.

[Note: dividing by N without overflow] gloo has no AVG for reduce-scatter, so the mean is a sum divided by N.
In float16 (largest value 65504) the sum of N large gradients can overflow before the division. As torch FSDP2
does, float16 gradients are divided by a power of two `pre` (about √N) before the sum and by N/pre after it.
Dividing by a power of two is exact only while the result stays in float16's normal range (above 6.1e-5): a
smaller gradient loses bits, and one below about 6e-8·pre becomes zero. The pre-divide trades that underflow of
tiny gradients for no overflow of large ones; loss scaling (torch's ShardedGradScaler) is what keeps float16
gradients away from both ends. float32 and bfloat16 have float32's range: there the sum is taken first and
divided once, the most exact order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core import collective_log
from fsdp_lab.runtime.core.collective_log import DONE, STATE, WAITED


@dataclass(frozen=True)
class Collective:
    """One collective as issued: `numel` elements of `dtype` in the unsharded buffer, over `world_size` ranks."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    numel: int
    dtype: torch.dtype
    world_size: int
    group: str = "shard"  # "shard" | "replicate" ([Note: hybrid sharding] in fsdp_lab/runtime/features/hybrid.py)
    ranks: tuple = ()  # the group's global ranks


@functools.lru_cache(maxsize=1024)
def _cached_collective(*fields) -> Collective:
    return Collective(*fields)


def collective(kind: str, numel: int, dtype: torch.dtype, world_size: int, group: tuple) -> Collective:
    """Collective(kind, numel, dtype, world_size, *group), one frozen instance per distinct value: a gather and a
    reduce of every unit make the same one every step."""
    try:
        return _cached_collective(kind, numel, dtype, world_size, *group)
    except TypeError:  # a group's ranks given as a list: not hashable, so not cached
        return Collective(kind, numel, dtype, world_size, *group)


class CollectiveFailed(getattr(dist, "DistError", RuntimeError)):
    """A collective that did not complete. The backend's error (a gloo or NCCL timeout, usually) says only that a
    peer did not answer; this one says what was issued and why peers stop answering. The backend's error is the
    `__cause__`, and its last line is this message's last line. A torch.distributed.DistError, as the backend's
    errors are, so code that catches those still does."""


def _logged(pg, kind: str, unit: str, phase: str, tensor: torch.Tensor):
    """(the group's log, this collective's record in it), or None outside torch.distributed."""
    log = collective_log.log_of(pg)
    return None if log is None else (log, log.issue(kind, unit, phase, tensor.shape, tensor.dtype, tensor.numel()))


def _issue(call: Collective, unit: str, logged, collective, *args, **kwargs):
    """Run `collective(*args, **kwargs)` (or a Work's wait), turning the backend's error into CollectiveFailed
    with the collective log's report; `logged` is (log, record) from `_logged`, marked done unless the call returns
    a Work (async_op=True: PendingCollective marks it at the wait)."""
    try:
        out = collective(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise  # a loop that catches OOM must still see one
    except RuntimeError as err:
        raise failure(f"{call.kind}", unit, f"{call.numel:,} {call.dtype} elements, {call.world_size} ranks",
                      logged, err) from err
    if logged is not None and not kwargs.get("async_op"):
        logged[1][STATE] = DONE
    return out


def failure(kind: str, unit: str, what: str, logged, err: BaseException) -> CollectiveFailed:
    """The CollectiveFailed for collective `kind` of `unit` (moving `what`) that raised `err`: the collective
    log's report first (posted and gathered here, collective_log.on_failure), the backend's last line last."""
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    of = f" of unit '{unit}'" if unit else ""
    seen, records, first = collective_log.on_failure(logged[0]) if logged is not None else ("", "", False)
    log_lines = f"\ncollective log: {seen}\n{records}" if seen else ""
    failed = CollectiveFailed(
        f"FSDP {kind}{of} ({what}) did not complete.{log_lines}\nEvery rank must run the same FSDP "
        f"units in the same order: a unit that runs on some ranks only (a data-dependent branch), a forward or "
        f"backward skipped on one rank, or a rank that died leaves the others waiting until the process "
        f"group's timeout.\n{last}")
    failed.collective_log, failed.prints_collective_log = seen, first
    return failed


# torch 2.13 renamed the flat collectives (the old names still work but warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OVERFLOW_PRONE = (torch.float16,)  # dtypes whose range a sum over ranks can exceed ([Note: dividing by N ...])


def divide_factors(world_size: int, dtype: torch.dtype) -> tuple[float, float]:
    """(divide before the sum, divide after it), whose product is N. float16 splits N as torch FSDP2 does:
    `pre` doubles from 1 while it divides N and is below N/pre (N=2: 2·1, N=3: 2·1.5, N=8: 4·2); other dtypes
    divide once, after the sum."""
    if dtype not in OVERFLOW_PRONE or world_size == 1:
        return 1.0, float(world_size)
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


class PendingCollective:
    """A collective issued with async_op=True, as a CPU prefetch issues its all-gather ([Note: a prefetch on
    CPU] in fsdp_lab/runtime/core/streams.py): `wait()` blocks until it is done (a failure raises CollectiveFailed
    then), then runs `then` (the copy-out). It keeps the tensors the backend reads and writes alive until then."""

    def __init__(self, call: Collective, unit: str, work, keep: tuple, then=None, logged=None):
        self.call, self.unit, self._work, self._keep, self.then = call, unit, work, keep, then
        self.logged = logged  # (log, record): [Note: a ring per process group] in collective_log.py

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        if self.logged is not None:
            self.logged[1][STATE] = WAITED
        _issue(self.call, self.unit, self.logged, work.wait)
        self._keep = ()
        if self.then is not None:
            then, self.then = self.then, None
            then()


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, pg, world_size: int,
                    unit: str = "", group: tuple = ("shard", ()), comm=None, phase: str = "") -> Collective:
    """Fill `output` (length N·len(shard)) with every rank's shard. `shard` must not alias `output`, except at
    world size 1, where it may be `output`'s memory itself (a layout that packed it there): then nothing moves.
    `unit` names the FSDP unit in the error a failed collective raises; `group` is (label, ranks) of `pg`, for the
    trace; `phase` (forward, backward, state_dict, ...) goes with `unit` into the collective log."""
    call, _ = start_all_gather_flat(output, shard, pg, world_size, unit, group, async_op=False, comm=comm,
                                    phase=phase)
    return call


def start_all_gather_flat(output: torch.Tensor, shard: torch.Tensor, pg, world_size: int, unit: str = "",
                          group: tuple = ("shard", ()), async_op: bool = True, comm=None, phase: str = ""
                          ) -> tuple[Collective, "PendingCollective | None"]:
    """all_gather_flat, issued and not waited for (async_op=True and world size > 1): `output` is filled once
    the returned PendingCollective is waited for (None: it already is). `comm`: the user's all-gather
    (FSDPModule.set_custom_all_gather, [Note: custom collectives]) in place of torch.distributed's."""
    if output.numel() != shard.numel() * world_size:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected "
                         f"{shard.numel()} x {world_size} = {shard.numel() * world_size}")
    call = collective("all_gather", output.numel(), output.dtype, world_size, group)
    if world_size == 1:
        if shard.data_ptr() != output.data_ptr() or shard.dtype != output.dtype:
            output.copy_(shard)  # copy_ casts as it copies
        return call, None
    send = shard if shard.dtype == output.dtype else shard.to(output.dtype)
    logged = _logged(pg, "all_gather", unit, phase, output)
    if comm is not None:
        work = _issue(call, unit, logged, comm, output_tensor=output, input_tensor=send, group=pg,
                      async_op=async_op)
    else:
        work = _issue(call, unit, logged, _all_gather, output, send, group=pg, async_op=async_op)
    if not async_op or work is None:
        if logged is not None:
            logged[1][STATE] = DONE
        return call, None
    return call, PendingCollective(call, unit, work, keep=(output, send), logged=logged)


# [Note: custom collectives] FSDPModule.set_custom_all_gather / set_custom_reduce_scatter hand in an object with
# torch's AllGather / ReduceScatter interface (torch.distributed.fsdp's _fsdp_api): `allocate(size, *, dtype,
# device)` makes the buffers the collective reads and writes, and calling it runs the collective,
# `comm(output_tensor=, input_tensor=, group=, async_op=)` (the reduce-scatter also takes `op`). As in torch, it is
# used for the buffers torch would allocate with it (the all-gather's staging output, the reduce-scatter's input
# and output) and for the collective itself; world size 1 calls neither collective. What it returns when issued
# with async_op=True is waited for like a torch Work; None means it already completed.
def reduce_scatter_sum(send: torch.Tensor, pg, world_size: int, unit: str = "", group: tuple = ("shard", ()),
                       comm=None, phase: str = "backward") -> tuple[Collective, torch.Tensor]:
    """This rank's chunk of the sum over ranks of every rank's `send` (N·chunk elements, already in the reduce
    dtype). At world size 1 the chunk is `send` itself. `comm`: [Note: custom collectives]."""
    call = collective("reduce_scatter", send.numel(), send.dtype, world_size, group)
    if world_size == 1:
        return call, send
    shape, kw = (send.numel() // world_size,), {"dtype": send.dtype, "device": send.device}
    logged = _logged(pg, "reduce_scatter", unit, phase, send)
    if comm is None:
        out = torch.empty(shape, **kw)
        _issue(call, unit, logged, _reduce_scatter, out, send, op=dist.ReduceOp.SUM, group=pg)
        return call, out
    staged = comm.allocate(send.shape, **kw)
    staged.copy_(send)
    out = comm.allocate(shape, **kw)
    work = _issue(call, unit, logged, comm, output_tensor=out, input_tensor=staged, group=pg,
                  op=dist.ReduceOp.SUM, async_op=False)
    if work is not None:
        _issue(call, unit, logged, work.wait)
    return call, out


def all_reduce_sum(buf: torch.Tensor, pg, world_size: int, unit: str = "", group: tuple = ("shard", ()),
                   phase: str = "backward", op=dist.ReduceOp.SUM) -> tuple[Collective, torch.Tensor]:
    """The sum over ranks (or `op`: MAX for a flag any rank may raise), in place on `buf`."""
    call = Collective("all_reduce", buf.numel(), buf.dtype, world_size, *group)
    if world_size > 1:
        _issue(call, unit, _logged(pg, "all_reduce", unit, phase, buf), dist.all_reduce, buf, op=op, group=pg)
    return call, buf


def reduce_scatter_mean(full_grad: torch.Tensor, pg, world_size: int, reduce_dtype: torch.dtype,
                        unit: str = "", group: tuple = ("shard", ())) -> tuple[Collective, torch.Tensor]:
    """Copy-in (cast to `reduce_dtype`, pre-divide), reduce-scatter (sum), copy-out (post-divide): this rank's
    chunk of the mean over ranks of every rank's `full_grad`. Returns (what moved, the chunk)."""
    pre, post = divide_factors(world_size, reduce_dtype)
    send = full_grad if full_grad.dtype == reduce_dtype else full_grad.to(reduce_dtype)
    if world_size == 1:  # the (cast) gradient is already this rank's whole shard: no copy
        return reduce_scatter_sum(send, pg, world_size, unit, group)
    call, out = reduce_scatter_sum(torch.div(send, pre) if pre != 1.0 else send, pg, world_size, unit, group)
    return call, out.div_(post)


def all_reduce_mean(grad: torch.Tensor, pg, world_size: int, reduce_dtype: torch.dtype,
                    unit: str = "", group: tuple = ("shard", ())) -> tuple[Collective, torch.Tensor]:
    """DDP's gradient sync: the mean over ranks, in place on `grad` when it already has `reduce_dtype`."""
    pre, post = divide_factors(world_size, reduce_dtype)
    buf = grad if grad.dtype == reduce_dtype else grad.to(reduce_dtype)
    if world_size == 1:
        return all_reduce_sum(buf, pg, world_size, unit, group)
    call, buf = all_reduce_sum(buf.div_(pre) if pre != 1.0 else buf, pg, world_size, unit, group)
    return call, buf.div_(post)
