"""FSDP1 against FSDP2 on the same model: fsdp_lab's two front ends and torch's own `fully_shard`, side by side.

`compare_front_ends` launches the ranks once and runs, on each, the FSDP1 script and the FSDP2 script below
(the FSDP2 one twice: with fsdp_lab's import and with torch's). Each run is traced (fsdp_lab's two front ends:
the lifecycle trace the potluck replays) and profiled (all three: torch.profiler's ranges and ops, from which
the copy-in and copy-out time is read). Then it reads who owns which slice of one weight in each layout, how
much each rank holds, and how many collectives a `state_dict()` call issues.

The two scripts are the chapter's side-by-side diff (`script_diff`): their source is what the learner reads.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import os
import sys

import torch
import torch.distributed as dist

from fsdp_lab.lessons.experiments.common import unit_table
from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.runtime.core.observed import is_fully_shard, units_of
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import Block, batch_for_step, build_gpt, rank_slice

STEPS = 2
WEIGHT = "blocks.0.attn.qkv.weight"  # the weight whose owners the chapter shows
FRONT_ENDS = ("fsdp_lab FSDP", "fsdp_lab fully_shard", "torch fully_shard")
# The ops of an all-gather's copies in a profile ([Note: copy-in, copy-out] in runtime/fsdp2/param_group.py). torch's
# fully_shard runs the same two (inside its fsdp::all_gather_copy_in and FSDP::all_gather_copy_out); the flat
# layout runs neither. The training step itself issues neither on CPU (AdamW's default there is not foreach).
COPY_OPS = {"copy-in": "aten::_foreach_copy_", "copy-out": "aten::split_with_sizes_copy"}


def _local(tensor):
    """This rank's piece of a DTensor (the tensor itself otherwise), read without an autograd op."""
    return tensor.to_local().detach() if hasattr(tensor, "to_local") else tensor


def _fully_shard_unit_table(model) -> list[dict]:
    """common.unit_table's columns for a fsdp_lab fully_shard model, root last. shard_numel is what this rank
    holds: unlike a flat shard, no padding is stored (it exists only in the send buffer)."""
    rows = []
    for unit in sorted(units_of(model), key=lambda u: u.is_root):
        for group in unit.flats:
            rows.append({"unit": unit.name, "is_root": unit.is_root, "requires_grad": group.requires_grad,
                         "numel": sum(s.numel for s in group.slots), "padded_numel": group.full.numel(),
                         "shard_numel": sum(t.numel() for t in group.local_shards()),
                         "full_bytes": group.full.numel() * group.full.element_size(),
                         "full_dtype": str(group.full.dtype).replace("torch.", "")})
    return rows


def _batch(cfg, step: int, rank: int, world_size: int):
    x, y = batch_for_step(cfg, step, global_batch=4, seq_len=32)
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


# -- the two scripts (shown to the learner as a diff: keep them line for line alike) ---------------------------
def fsdp1_script(rank, world_size, watch=None):
    from fsdp_lab import FSDP, MixedPrecision
    from fsdp_lab.wrap import ModuleWrapPolicy

    model = build_gpt("tiny")
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if watch:  # the experiment attaches its tracer and profiler here
        watch(model, opt)
    losses = []
    for step in range(STEPS):
        loss = model(*_batch(model.cfg, step, rank, world_size))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def fsdp2_script(rank, world_size, watch=None, torch_api=False):
    from fsdp_lab import MixedPrecisionPolicy, fully_shard
    if torch_api:  # the only change for torch's FSDP2: the import
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_gpt("tiny")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if watch:  # the experiment attaches its tracer and profiler here
        watch(model, opt)
    losses = []
    for step in range(STEPS):
        loss = model(*_batch(model.cfg, step, rank, world_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def script_diff() -> list[tuple[str, str, str]]:
    """The two scripts side by side: (tag, FSDP1 line, FSDP2 line), tag "=" same, "~" changed, "-"/"+" one side."""
    old = inspect.getsource(fsdp1_script).splitlines()
    new = inspect.getsource(fsdp2_script).splitlines()
    rows = []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        left, right = old[a0:a1], new[b0:b1]
        tag = {"equal": "=", "replace": "~", "delete": "-", "insert": "+"}[op]
        for i in range(max(len(left), len(right))):
            rows.append((tag, left[i] if i < len(left) else "", right[i] if i < len(right) else ""))
    return rows


# -- what each rank measures ---------------------------------------------------------------------------------
class _Watch:
    """Attaches the tracer (fsdp_lab's front ends only) and starts the profiler once the script has its model."""

    def __init__(self, rank: int, world_size: int, traced: bool, original: torch.Tensor):
        self.rank, self.world_size, self.traced, self.original = rank, world_size, traced, original
        self.tracer, self.owned = None, None
        self.profile = _profiler()

    def __call__(self, model, opt) -> None:
        self.owned = _owned(model, self.rank, self.world_size, self.original)  # before any step changes it
        if self.traced:
            self.tracer = trace_mod.Tracer(None, rank=self.rank, model=model, optimizer=opt)
            trace_mod.attach(model, self.tracer)
        self.profile.__enter__()

    def stop(self, model) -> dict:
        self.profile.__exit__(None, None, None)
        if self.tracer is not None:
            trace_mod.attach(model, None)
            self.tracer.close()
        times = {side: 0.0 for side in COPY_OPS}
        calls = {side: 0 for side in COPY_OPS}
        for event in self.profile.function_events:
            for side, name in COPY_OPS.items():
                if event.name == name and not _inside(event, name):
                    times[side] += event.cpu_time_total / 1e3
                    calls[side] += 1
        return {"copy_ms": times, "copy_calls": calls, "events": self.tracer.events if self.tracer else []}


class _profiler:
    """torch's autograd profiler (the ops and their nesting are all we read), started and stopped with the rank's
    stdout and stderr pointed at /dev/null: the profiler's C++ side writes a line at every start and stop, which
    would land in the notebook cell that launched the ranks."""

    def __init__(self):
        self.profile = torch.autograd.profiler.profile(use_kineto=False)

    @property
    def function_events(self):
        return self.profile.function_events

    def __enter__(self):
        with _quiet_fds():
            self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        with _quiet_fds():
            self.profile.__exit__(*exc)


@contextlib.contextmanager
def _quiet_fds():
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [null]:
            os.close(fd)


def _inside(event, name: str) -> bool:
    """Whether a profiled op runs inside another of the same name (one dispatch level of it): count it once."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def _owned(model, rank: int, world_size: int, original: torch.Tensor) -> dict:
    """Which elements of WEIGHT this rank holds, read from the runtime's layout (or torch's DTensor), and
    whether the values there are the original weight's."""
    if hasattr(model, "units"):  # fsdp_lab FSDP: a slice of the unit's flat buffer
        unit = next(u for u in model.units if u.name == "blocks.0")
        flat = unit.flats[0]
        slot = next(s for s in flat.slots if s.name == WEIGHT)
        lo = max(flat.shard_offset, slot.offset)
        hi = min(flat.shard_offset + flat.shard_numel, slot.offset + slot.numel)
        start, stop = (lo - slot.offset, hi - slot.offset) if lo < hi else (0, 0)
        values = flat.shard.detach()[lo - flat.shard_offset:hi - flat.shard_offset] if lo < hi else None
        layout = "flat buffer slice"
    else:  # FSDP2: a block of rows of a DTensor
        param = model.blocks[0].attn.qkv.weight
        held = _local(param).detach()
        row_numel = param.shape[1:].numel()
        if is_fully_shard(model):  # fsdp_lab's: the ParamGroup's own row bookkeeping
            group = next(g for g in model.blocks[0]._fsdp_lab_state.unit.flats
                         if any(s.registered() is param for s in g.slots))
            slot = next(s for s in group.slots if s.registered() is param)
            rows_per_rank, local_rows = slot.rows, slot.local_rows
        else:  # torch's: Shard(0) cuts as torch.chunk does
            rows_per_rank, local_rows = math.ceil(param.shape[0] / world_size), held.shape[0]
        first = min(rank * rows_per_rank, param.shape[0])
        start, stop = first * row_numel, (first + local_rows) * row_numel
        values = held.reshape(-1) if held.numel() else None
        layout = f"{type(param).__name__} {tuple(param.placements)}"
    matches = values is None or torch.equal(values, original.reshape(-1)[start:stop])
    return {"start": start, "stop": stop, "numel": original.numel(), "shape": tuple(original.shape),
            "row_numel": original.shape[1:].numel(), "layout": layout, "values_match": bool(matches)}


def _state_bytes(model, opt) -> dict:
    """Live bytes this rank holds after the step: parameters, gradients and optimizer state (each storage once)."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = _local(t).untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": count(params), "grads": count(p.grad for p in params),
           "optimizer": count(v for s in opt.state.values() for v in s.values())}
    out["total"] = sum(out.values())
    return out


def _collectives_in_state_dict(model, fsdp1_full: bool) -> dict:
    """Collectives one `state_dict()` call issues (counted from the profiler's c10d ops), and what WEIGHT is in it."""
    with _profiler() as prof:
        sd = model.state_dict()
    value = sd[WEIGHT]
    collectives = sum(1 for e in prof.function_events if e.name.startswith("c10d::"))
    kind = type(value).__name__
    local = _local(value)
    return {"collectives": collectives, "type": kind, "global_shape": tuple(value.shape),
            "local_shape": tuple(local.shape), "placements": str(getattr(value, "placements", "")),
            "keys": len(sd), "fsdp1_full_state_dict": fsdp1_full}


def _front_end_rank(rank: int, world_size: int, _spec=None) -> dict:
    original = dict(build_gpt("tiny").named_parameters())[WEIGHT].detach()
    results = {}
    for name in FRONT_ENDS:
        watch = _Watch(rank, world_size, name.startswith("fsdp_lab"), original)
        if name == "fsdp_lab FSDP":
            model, opt, losses = fsdp1_script(rank, world_size, watch)
        else:
            model, opt, losses = fsdp2_script(rank, world_size, watch, torch_api=name.startswith("torch"))
        measured = watch.stop(model)
        units = (_fully_shard_unit_table(model) if is_fully_shard(model) else
                 unit_table(model) if hasattr(model, "units") else [])  # torch's: no unit table
        results[name] = {"losses": losses, **measured, "units": units, "owned": watch.owned,
                         "state_bytes": _state_bytes(model, opt),
                         "state_dict": _collectives_in_state_dict(model, name == "fsdp_lab FSDP")}
        dist.barrier()
    return {"rank": rank, "front_ends": results}


def compare_front_ends(world_size: int = 2, timeout_s: float = 150.0) -> list[dict]:
    """Per rank: for each of FRONT_ENDS, the losses, trace events (fsdp_lab's), copy-in/copy-out time, the unit
    table, who owns WEIGHT, state bytes after the steps and what one state_dict() call communicates."""
    return run_on_ranks(_front_end_rank, world_size, None, timeout_s=timeout_s)
