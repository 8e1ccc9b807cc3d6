"""The article's lifecycle, recorded on N ranks: shard → gather → compute → free → re-gather → reduce-scatter.

`run_lifecycle` is what the lifecycle chapter animates and what the trace tests check; `trace_on_off` shows
that tracing observes without changing anything (same losses, no events while detached).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from fsdp_lab.lessons.experiments.common import (RunSpec, build_model, config_for, merge_events, mixed_precision_for,
                                                 train)
from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import GPTConfig, batch_for_step, rank_slice

# [Note: event order of one unit] Under FULL_SHARD, per unit and step, a rank records
#   forward:  gather_start, gather_end, forward_start, forward_end, free        (no free for the root)
#   backward: regather_start, regather_end, backward_start, reduce_scatter, free
# The root keeps its parameters from forward to backward (as torch's root does), so it is neither freed after
# forward nor re-gathered: its backward starts straight away.
FULL_SHARD_UNIT_EVENTS = ("gather_start", "gather_end", "forward_start", "forward_end", "free",
                          "regather_start", "regather_end", "backward_start", "grad_ready", "reduce_scatter", "free")
FULL_SHARD_ROOT_EVENTS = ("gather_start", "gather_end", "forward_start", "forward_end",
                          "backward_start", "grad_ready", "reduce_scatter", "free")


def run_lifecycle(world_size: int = 2, strategy: str = "FULL_SHARD", steps: int = 1,
                  preset: Union[str, GPTConfig] = "tiny", mixed_precision=None, trace_dir: Optional[str] = None,
                  forward_prefetch: bool = False, backward_prefetch: Optional[str] = None,
                  step_sleep_s: float = 0.0, timeout_s: float = 120.0, **spec_fields) -> list[dict]:
    """Train `steps` steps on `world_size` ranks with tracing on; return every rank's events in one timeline.

    Backward prefetch is off by default here, unlike torch's FSDP (BACKWARD_PRE): the lifecycle chapter shows
    the article's table, one block at a time. Pass backward_prefetch="BACKWARD_PRE" for torch's default, which
    re-gathers the next block while this one's backward runs (a second block on the table in backward).

    mixed_precision: None/"fp32", "bf16" or a MixedPrecision. trace_dir: also write rank{r}.jsonl there, line
    by line, so fsdp_lab.observe.follow.follow can watch the run live (step_sleep_s slows it down for a demo).
    """
    spec = RunSpec(strategy=strategy, preset=preset, mixed_precision=mixed_precision_for(mixed_precision),
                   steps=steps, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                   trace=True, trace_dir=None if trace_dir is None else str(trace_dir), step_sleep_s=step_sleep_s,
                   **spec_fields)
    results = run_on_ranks(train, world_size, spec, timeout_s=timeout_s)
    return merge_events([r["events"] for r in results])


def unit_event_sequences(events: list[dict], rank: int = 0) -> dict[tuple[int, str], list[str]]:
    """{(step, unit): [event names in order]} for one rank (the optimizer step is left out: it is not a unit's)."""
    seqs: dict[tuple[int, str], list[str]] = {}
    for e in sorted((e for e in events if e["rank"] == rank), key=lambda e: e["t"]):
        if e["phase"] in ("forward", "backward") and e["event"] != "backward_end":
            seqs.setdefault((e["step"], e["unit"]), []).append(e["event"])
    return seqs


def _trace_on_off_rank(rank: int, world_size: int, spec: RunSpec) -> dict:
    """Same run twice on this rank: untraced, then traced; plus a tracer detached mid-run must see nothing.

    The memory count behind each event is the tracer's only real cost, so it is counted: none may run while
    tracing is off."""
    calls = {"n": 0}
    real_report = trace_mod.memory_report

    def counting_report(*args, **kwargs):
        calls["n"] += 1
        return real_report(*args, **kwargs)

    trace_mod.memory_report = counting_report
    try:
        untraced = train(rank, world_size, spec.with_(trace=False))
        reports_untraced = calls["n"]
        traced = train(rank, world_size, spec.with_(trace=True))
        reports_traced = calls["n"] - reports_untraced
    finally:
        trace_mod.memory_report = real_report
    model = build_model(spec)
    cfg = config_for(spec.preset)
    x, y = batch_for_step(cfg, 0, spec.global_batch, spec.seq_len)
    with trace_mod.record(model) as tracer:
        model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    while_attached = len(tracer.events)
    model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    with torch.no_grad():
        model(rank_slice(x, rank, world_size))
    return {"rank": rank, "losses_untraced": untraced["losses"], "losses_traced": traced["losses"],
            "memory_reports_untraced": reports_untraced, "memory_reports_traced": reports_traced,
            "events_traced": len(traced["events"]),
            "events_while_attached": while_attached, "events_after_detach": len(tracer.events)}


def trace_on_off(world_size: int = 2, steps: int = 2, preset: Union[str, GPTConfig] = "tiny",
                 strategy: str = "FULL_SHARD", timeout_s: float = 120.0) -> list[dict]:
    """Per rank: losses with and without tracing, and event counts showing a detached tracer records nothing."""
    spec = RunSpec(strategy=strategy, preset=preset, steps=steps)
    return run_on_ranks(_trace_on_off_rank, world_size, spec, timeout_s=timeout_s)
