"""Checks for the chapters' "Your turn" exercises: run on each live rank against the learner's own model, trace or
numbers, and say what is wrong, not only that something is.

Each returns a Verdict, which prints as "ok: ..." or "not yet: ...". [Note: one check, two callers] A check's
core takes plain numbers (`state_bytes_of`, `shard_range_of`, `beat_order_of`); the live form reads them from the
rank's own model or trace. The terminal exercises in course/exercises/ call the same cores with numbers recorded
from a run or computed by the runtime's own layout code (fsdp_lab/lessons/exercises.py runs them), so a wrong
answer gets the same explanation in a notebook and in a terminal. The Verdict and the model guard are in
.verdict, FSDP2's row checks (dim0_rows) in .rows; both are importable from here, as the notebooks call them.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from fsdp_lab.lessons.live.apply_order import apply_order  # noqa: F401
from fsdp_lab.lessons.live.hybrid_groups import hsdp_cases, hsdp_groups, hsdp_groups_of  # noqa: F401
from fsdp_lab.lessons.live.rows import UNEVEN_ROWS, dim0_cases, dim0_rows, dim0_rows_of, uneven_rows  # noqa: F401
from fsdp_lab.lessons.live.verdict import (FSDP1, FSDP2, Verdict, close_to, not_written, unwritten,  # noqa: F401
                                           unwritten_function, wrong_model)
from fsdp_lab.runtime.core.memory import memory_report
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.flat_param import padded_size

ROOT = "<root>"


def state_bytes_of(predicted: float, params: int, grads: int, optimizer_state: int, world_size: int,
                   rank: int = 0, full: Optional[tuple] = None, hints: Sequence[tuple] = ()) -> Verdict:
    """`predicted` against a rank's measured params + grads + optimizer state. `full`: the three unsharded (default:
    each times world_size); `hints`: more (value, why) pairs, tried first."""
    n, measured = world_size, params + grads + optimizer_state
    full = full or (params * n, grads * n, optimizer_state * n)
    parts = f"{params:,.0f} params + {grads:,.0f} grads + {optimizer_state:,.0f} AdamW"
    if close_to(predicted, measured):
        return Verdict(True, f"you predicted {predicted:,.0f} B; rank {rank} holds {measured:,.0f} B\n  = {parts}")
    sharded = [name for name, part, whole in zip(("parameters", "gradients", "AdamW state"),
                                                 (params, grads, optimizer_state), full) if part != whole]
    known = [*hints,
             (sum(full), f"that is the whole model's state: each of the {n} ranks keeps only 1/{n} of "
                         f"{', '.join(sharded) or 'nothing'}"),
             (params, "that is the parameters only: the gradients (4 B each) and AdamW's two moments (8 B) count "
                      "too"),
             (params + grads, "AdamW's two moments are missing: 8 B per parameter"),
             (params + optimizer_state, "the gradients are missing: 4 B per parameter, kept after the step"),
             (measured / 2, "half of what the rank holds: AdamW keeps two moments, 4 B each")]
    why = next((text for value, text in known if close_to(predicted, value) and not close_to(value, measured)), "")
    return Verdict(False, f"you predicted {predicted:,.0f} B but rank {rank} holds {measured:,.0f} B\n  = {parts}"
                          + (f"\n  {why}" if why else ""))


def state_bytes(predicted: float, model, optimizer) -> Verdict:
    """`predicted`: the bytes of parameters, gradients and optimizer state one rank holds after a step."""
    wrong = unwritten("your prediction", predicted) or wrong_model("state_bytes", model, FSDP1, FSDP2)
    if wrong:
        return wrong
    mem = memory_report(model, optimizer)
    if isinstance(model, FSDP):
        rank, world_size = model.rank, model.world_size
    else:  # the shard dimension of the root's mesh (HSDP: the replicas hold the same bytes)
        mesh = model._fsdp_lab_state.mesh
        rank, world_size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    return state_bytes_of(predicted, mem.params_sharded + mem.params_unsharded,
                          mem.grads_sharded + mem.grads_unsharded, mem.optimizer_state, world_size, rank)


@dataclass(frozen=True)
class Chunk:
    """Where one rank's shard of one unit's flat buffer lies: [shard_offset, shard_offset + shard_numel)."""

    unit: str
    numel: int
    world_size: int
    rank: int
    padded_numel: int
    shard_offset: int
    shard_numel: int


def chunks_of(unit: str, numel: int, world_size: int) -> list:
    """Every rank's Chunk of a `numel`-element flat buffer, padded as the runtime pads it (flat_param.padded_size)."""
    padded = padded_size(numel, world_size)
    size = padded // world_size
    return [Chunk(unit, numel, world_size, r, padded, r * size, size) for r in range(world_size)]


def shard_range_of(fn: Callable[[int, int, int], tuple], chunks: Sequence[Chunk]) -> Verdict:
    """`fn(numel, n, rank) -> (start, stop)` against each Chunk; the first wrong one is explained."""
    for c in chunks:
        want = (c.shard_offset, c.shard_offset + c.shard_numel)
        try:
            got = tuple(fn(c.numel, c.world_size, c.rank))
        except NotImplementedError as err:
            return not_written("shard_range", err)
        if got == want:
            continue
        where = f"unit {c.unit} ({c.numel:,} elements on {c.world_size} ranks)"
        if len(got) != 2:
            return Verdict(False, f"{where}: shard_range must return (start, stop), got {got!r}")
        if got[1] - got[0] != c.shard_numel:
            why = (f"every chunk has padded_size / n = {c.padded_numel:,} / {c.world_size} = {c.shard_numel:,} "
                   f"elements (the padding counts)")
        else:
            why = f"the chunk has the right size but starts at the wrong place: rank r starts at r · " \
                  f"{c.shard_numel:,}"
        return Verdict(False, f"{where}: you say rank {c.rank} holds [{got[0]:,}, {got[1]:,}), its shard "
                              f"is [{want[0]:,}, {want[1]:,}); {why}")
    units = ", ".join(dict.fromkeys(f"{c.unit} on {c.world_size}" for c in chunks))
    return Verdict(True, f"all {len(chunks)} chunks are where you said ({units})")


# Flat buffers whose length does not divide by n: without them a `numel // n` answer passes, since the tiny GPT's
# units (each parameter aligned to 16 bytes) all have even lengths.
UNEVEN_FLATS = ((10, 4), (7, 2), (5, 4))  # after the model's own units, which explain most mistakes first


def shard_range(fn: Callable[[int, int, int], tuple], model) -> Verdict:
    """`fn(numel, n, rank) -> (start, stop)`: where rank's chunk lies in a unit's padded flat buffer: first for
    lengths that do not divide by n (UNEVEN_FLATS), then for every unit of the learner's model."""
    wrong = unwritten_function("shard_range", fn, *UNEVEN_FLATS[0], 0) or wrong_model("shard_range", model, FSDP1)
    if wrong:
        return wrong
    chunks = [Chunk(unit.name, flat.numel, flat.world_size, flat.rank, flat.padded_numel, flat.shard_offset,
                    flat.shard_numel) for unit in model.units for flat in unit.flats]
    verdict = shard_range_of(fn, chunks + uneven_chunks())
    return Verdict(True, f"rank {model.rank}'s chunk of every unit is where you said it is") if verdict.ok else verdict


def uneven_chunks() -> list:
    """Every rank's Chunk of the UNEVEN_FLATS buffers."""
    return [c for numel, n in UNEVEN_FLATS for c in chunks_of(f"a {numel}-element unit", numel, n)]


_BEAT_EVENTS = {"gather_start": "gather", "regather_start": "regather", "free": "free",
                "reduce_scatter": "reduce_scatter"}


def beats_of_step(events: Sequence[dict], rank: int, step: int) -> list:
    """(event, unit) of `rank`'s gathers, re-gathers, frees and reduce-scatters in one step, in trace order."""
    return [(_BEAT_EVENTS[e["event"]], e["unit"]) for e in events
            if e["rank"] == rank and e["step"] == step and e["event"] in _BEAT_EVENTS]


def beat_order_of(fn: Callable[[list, str], list], want: Sequence[tuple], strategy: str, rank: int = 0,
                  step: int = 0) -> Verdict:
    """`fn(blocks, strategy)` against `want`, the (event, unit) beats of one step (from beats_of_step, or recorded);
    the first beat that differs is named."""
    want = [tuple(pair) for pair in want]
    blocks = list(dict.fromkeys(u for _e, u in want if u != ROOT))
    try:
        got = [tuple(pair) for pair in fn(blocks, strategy)]
    except NotImplementedError as err:
        return not_written("step_events", err)
    if got == want:
        return Verdict(True, f"{len(want)} beats of step {step} on rank {rank}, in the order the trace has them")
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    said = ":".join(got[k]) if k < len(got) else "nothing more"
    happened = ":".join(want[k]) if k < len(want) else "nothing more"
    order = textwrap.wrap(" ".join(f"{e}:{u}" for e, u in want), 90)
    return Verdict(False, f"beat {k + 1} of step {step}: you say {said}, rank {rank}'s trace has {happened}.\n"
                          f"The trace's order ({strategy}):\n  " + "\n  ".join(order))


def beat_order(fn: Callable[[list, str], list], events: Sequence[dict], strategy: str) -> Verdict:
    """`fn(blocks, strategy) -> [(event, unit), ...]`: one step's beats, compared with the learner's own trace."""
    if not events:
        return Verdict(False, "the trace is empty: attach the tracer before the training step")
    rank, step = events[0]["rank"], max(e["step"] for e in events if e["event"] != "optimizer_step")
    return beat_order_of(fn, beats_of_step(events, rank, step), strategy, rank, step)


def mixed_precision(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32) -> Verdict:
    """The chapter's policy: gather and compute in `param_dtype`, reduce in `reduce_dtype`, fp32 master shards."""
    wrong = wrong_model("mixed_precision", model, FSDP1)
    if wrong:
        return wrong
    ctx = model._ctx
    masters = {flat.shard.dtype for unit in model.units for flat in unit.flats}
    if ctx.mixed_precision is None:
        return Verdict(False, "no mixed_precision was passed: the all-gather carries float32, 4 B per element")
    gathered = {flat.compute_dtype for unit in model.units for flat in unit.flats}
    reduced = {flat.reduce_dtype for unit in model.units for flat in unit.flats}
    if gathered != {param_dtype}:
        return Verdict(False, f"the gathered parameters are {', '.join(sorted(map(str, gathered)))}, not "
                              f"{param_dtype}: set MixedPrecision(param_dtype={param_dtype})")
    if reduced != {reduce_dtype}:
        return Verdict(False, f"gradients are reduced in {', '.join(sorted(map(str, reduced)))}, not "
                              f"{reduce_dtype}: set "
                              f"reduce_dtype={reduce_dtype}")
    if masters != {torch.float32}:
        return Verdict(False, f"the shards (the master weights) are {sorted(map(str, masters))}: keep them in "
                              f"float32 and let the policy cast the copy it gathers")
    return Verdict(True, f"rank {model.rank} gathers {param_dtype}, reduces in {reduce_dtype}, keeps fp32 shards")


def gathered_after_forward(predicted: float, report, model) -> Verdict:
    """`predicted`: params_unsharded bytes right after the forward (`report`: memory_report then)."""
    wrong = unwritten("your prediction", predicted) or wrong_model("gathered_after_forward", model, FSDP1)
    if wrong:
        return wrong
    measured = report.params_unsharded
    if close_to(predicted, measured):
        return Verdict(True, f"{measured:,} B of gathered parameters wait for the backward under "
                             f"{model.sharding_strategy.name}")
    full = sum(4 * flat.padded_numel for unit in model.units for flat in unit.flats)
    root = sum(4 * flat.padded_numel for unit in model.units if unit.is_root for flat in unit.flats)
    hints = [(full / model.world_size, "that is a shard: the gathered copy is the whole unit, every rank's chunk"),
             (root, "that is the root alone, what FULL_SHARD keeps; this strategy frees nothing after forward"),
             (full, "that is every unit gathered, which is what SHARD_GRAD_OP keeps; is this model FULL_SHARD?")]
    why = next((text for value, text in hints if close_to(predicted, value) and not close_to(value, measured)), "")
    return Verdict(False, f"you predicted {predicted:,.0f} B but {measured:,} B are gathered after the forward "
                          f"under {model.sharding_strategy.name}" + (f": {why}" if why else ""))


def wrapped_units(model, block_cls: type) -> Verdict:
    """One unit per `block_cls` plus the root: the granularity the chapter asks for."""
    wrong = wrong_model("wrapped_units", model, FSDP1)
    if wrong:
        return wrong
    names = [u.name for u in model.units]
    blocks = [name.replace("._fsdp_wrapped_module", "") for name, m in model.module.named_modules()
              if isinstance(m, block_cls)]  # a unit's module sits inside its FSDP instance
    if names == [ROOT]:
        return Verdict(False, f"one unit holds the whole model, so forward gathers all of it at once: pass an "
                              f"auto_wrap_policy that wraps each {block_cls.__name__}")
    if sorted(n for n in names if n != ROOT) == sorted(blocks):
        return Verdict(True, f"{len(blocks)} {block_cls.__name__} units and the root: {', '.join(names)}")
    inside = [n for n in names if n != ROOT and n not in blocks]
    return Verdict(False, f"the units are {', '.join(names)}, not one per {block_cls.__name__}"
                          + (f"\n  {', '.join(inside)}: not {block_cls.__name__}s, so each block's forward gathers "
                             f"more than once" if inside else ""))


def _shown(t: torch.Tensor) -> str:
    values = [round(v, 3) for v in t[:8].tolist()]
    return f"{values}" if t.numel() <= 8 else f"{values[:4]} ... ({t.numel():,} values)"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding (the ranks reduce in float32; a reference may sum in another order)."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def reduce_scatter_mean(mine: torch.Tensor, grads: Sequence[torch.Tensor], rank: int) -> Verdict:
    """`mine`: this rank's chunk of the average of every rank's gradient (`grads`: each rank's full gradient),
    the gradient padded with zeros to a multiple of the world size first, as the runtime pads it."""
    if mine is None:
        return not_written("your chunk (mine)")
    n = len(grads)
    numel = grads[0].numel()
    total = torch.zeros(padded_size(numel, n), dtype=torch.float64)
    total[:numel] = torch.stack([g.double().flatten() for g in grads]).sum(0)
    size = total.numel() // n
    want = total[rank * size:(rank + 1) * size] / n
    mine = mine.double().flatten()
    if mine.numel() != size:
        pad = f" ({numel:,} padded to {total.numel():,})" if total.numel() != numel else ""
        return Verdict(False, f"your chunk has {mine.numel()} elements; each rank keeps 1/{n}{pad}: {size}")
    if _same(mine, want):
        return Verdict(True, f"rank {rank} holds the mean of chunk {rank}: {_shown(want)}")
    if _same(mine, want * n):
        return Verdict(False, f"that is the sum of the ranks' chunks: divide by world_size={n} (gloo's "
                              f"reduce-scatter has no AVG)")
    own = torch.zeros(total.numel(), dtype=torch.float64)
    own[:numel] = grads[rank].double().flatten()
    own = own[rank * size:(rank + 1) * size]
    if _same(mine, own):
        return Verdict(False, "that is your own gradient's slice: no rank's contribution was added (call "
                              "dist.reduce_scatter)")
    for k in range(n):
        if k != rank and _same(mine, total[k * size:(k + 1) * size] / n):
            return Verdict(False, f"that is chunk {k}'s mean: rank {rank} keeps chunk {rank}")
    return Verdict(False, f"rank {rank} should hold {_shown(want)}, you have {_shown(mine)}")


def same_losses(a: Sequence[float], b: Sequence[float], what: str = "FULL_SHARD and NO_SHARD") -> Verdict:
    """Two runs of the same model on the same batches: the losses agree to float32 rounding."""
    if a is None or b is None:
        return not_written("your losses")
    if len(a) != len(b) or not a:
        return Verdict(False, f"{len(a)} losses against {len(b)}: train both for the same number of steps")
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]))
    gap = abs(a[worst] - b[worst])
    if gap <= 1e-5 * max(1.0, abs(a[worst])):
        return Verdict(True, f"{what} agree on all {len(a)} losses (largest gap {gap:.1e})")
    return Verdict(False, f"{what} differ at step {worst}: {a[worst]:.6f} against {b[worst]:.6f}; did both start "
                          f"from build_gpt's seeded weights and train on the same batches?")


def comm_ratio(ratio: float, fsdp_events: Sequence[dict], ddp_events: Sequence[dict]) -> Verdict:
    """`ratio`: bytes one rank sent in a FULL_SHARD step over those it sent in a NO_SHARD step (traces of step 0)."""
    def sent(events):
        return sum(e["bytes_sent"] for e in events if e["step"] == 0)

    if ratio is None:
        return not_written("your ratio")
    f, d = sent(fsdp_events), sent(ddp_events)
    if not f or not d:
        return Verdict(False, "a trace has no bytes for step 0: trace one step of each model")
    measured = f / d
    if close_to(ratio, measured, 1e-3):
        gathered = {e["unit"] for e in fsdp_events if e["event"] == "gather_end" and e["step"] == 0}
        regathered = {e["unit"] for e in fsdp_events if e["event"] == "regather_end" and e["step"] == 0}
        why = (f"\n  not 1.5: {len(regathered)} of the {len(gathered)} gathered units were re-gathered in backward "
               f"({', '.join(sorted(gathered - regathered))} stayed gathered)" if gathered - regathered else "")
        return Verdict(True, f"FULL_SHARD sent {f:,} B, NO_SHARD {d:,} B: {measured:.3f}×{why}")
    if close_to(ratio, 1 / measured, 1e-3):
        return Verdict(False, f"that is NO_SHARD over FULL_SHARD: {d:,} / {f:,}")
    return Verdict(False, f"rank's trace says {f:,} / {d:,} = {measured:.3f}, you have {ratio:.3f}")
