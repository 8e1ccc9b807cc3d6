"""The engineering chapter's runs: prefetch overlap, activation checkpointing, sharded checkpoints, and the
granularity sweep, all in one launch of real ranks (starting processes costs seconds; the runs, milliseconds).

    run_engineering(world_size=2, checkpoint_dir=...)  → per rank {"granularity", "prefetch",
                                                          "checkpointing", "checkpoint"}
    spans(events, rank, step)                          → one row per unit and beat, times in ms from the step start

Each piece is also a function of its own (prefetch_runs, checkpointing_runs, checkpoint_roundtrip) that a test or
a script can run on ranks by itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fsdp_lab.lessons.experiments.common import config_for
from fsdp_lab.lessons.experiments.granularity import (WRAPPINGS, WrapRun, _sweep_rank, build_wrapped, summarize_wrapped,
                                                      train_wrapped)
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import batch_for_step, rank_slice

# (start event, end event) of each beat drawn on the timeline. A unit's backward has no end event of its own:
# it ends when its gradient is ready and reduce-scattered.
BEATS = {"gather": ("gather_start", "gather_end"), "forward": ("forward_start", "forward_end"),
         "regather": ("regather_start", "regather_end"), "backward": ("backward_start", "reduce_scatter")}
# The prefetch runs, each named by its options: prefetch turned off (backward_prefetch=None is not torch's
# default), torch's defaults (BACKWARD_PRE, forward_prefetch=False, limit_all_gathers=True), and explicit forward
# prefetch on top. On CUDA every run's forward gathers overlap compute (implicit prefetching, always on,
# fsdp_lab/runtime/core/streams.py); on CPU ranks only a prefetched gather overlaps compute (gloo's thread moves it,
# [Note: a prefetch on CPU] in streams.py): the traces differ in the order gathers are issued and used.
PREFETCH = {"prefetch off": dict(backward_prefetch=None), "torch defaults": dict(),
            "+ forward_prefetch": dict(forward_prefetch=True)}
PREFETCH_OPTIONS = {"prefetch off": "backward_prefetch=None, forward_prefetch=False",
                    "torch defaults": "backward_prefetch=BACKWARD_PRE, forward_prefetch=False",
                    "+ forward_prefetch": "backward_prefetch=BACKWARD_PRE, forward_prefetch=True"}


def spans(events: list[dict], rank: int = 0, step: Optional[int] = None) -> list[dict]:
    """{unit, beat, start_ms, end_ms} for one rank and step (default: the last), from the step's first event."""
    mine = [e for e in events if e["rank"] == rank]
    if not mine:
        raise ValueError(f"no events for rank {rank} in this trace ({len(events)} events, ranks "
                         f"{sorted({e['rank'] for e in events})})")
    step = max(e["step"] for e in mine) if step is None else step
    mine = sorted((e for e in mine if e["step"] == step and e["phase"] != "optimizer"), key=lambda e: e["t"])
    if not mine:
        raise ValueError(f"no events for rank {rank} in step {step}")
    t0, out, open_ = mine[0]["t"], [], {}
    for e in mine:
        for beat, (start, end) in BEATS.items():
            if e["event"] == start:
                open_[(e["unit"], beat)] = e["t"]
            elif e["event"] == end and (e["unit"], beat) in open_:
                began = open_.pop((e["unit"], beat))
                out.append({"unit": e["unit"], "beat": beat, "start_ms": (began - t0) * 1e3,
                            "end_ms": (e["t"] - t0) * 1e3})
    return out


def overlaps(rows: list[dict]) -> list[dict]:
    """Every all-gather issued before *another* unit's compute ended and waited on after that compute began:
    {gathered, computing, beat, ms}, ms being how long the two spans share. On a GPU such a gather can run beside
    that compute; on CPU ranks it had already finished when its call returned, so the spans show the order of
    issue and use only. The root's compute span wraps the blocks' (its forward calls them), so it is left out as
    a computing unit."""
    comms = [r for r in rows if r["beat"] in ("gather", "regather")]
    computes = [r for r in rows if r["beat"] in ("forward", "backward") and r["unit"] != "<root>"]
    out = []
    for g in comms:
        for c in computes:
            ms = min(g["end_ms"], c["end_ms"]) - max(g["start_ms"], c["start_ms"])
            if g["unit"] != c["unit"] and ms > 0:
                out.append({"gathered": g["unit"], "computing": c["unit"], "beat": g["beat"], "ms": ms})
    return out


def _trimmed(result: dict) -> dict:
    """A run's summary plus its last step's events, without memory dicts (small enough to send back)."""
    last = result["run"].steps - 1
    keep = ("t", "rank", "step", "unit", "phase", "event")
    return {**summarize_wrapped(result), "step_times": result["step_times"], "saved_bytes": result["saved_bytes"],
            "events": [{k: e[k] for k in keep} for e in result["events"] if e["step"] == last]}


def prefetch_runs(rank: int, world_size: int, base: WrapRun) -> dict:
    """The same steps under each of PREFETCH's options."""
    return {name: _trimmed(train_wrapped(rank, world_size, base.with_(**opts))) for name, opts in PREFETCH.items()}


def checkpointing_runs(rank: int, world_size: int, base: WrapRun) -> dict:
    """The same steps without and with activation checkpointing, counting the bytes saved for backward."""
    return {name: _trimmed(train_wrapped(rank, world_size, base.with_(activation_checkpointing=on, count_saved=True)))
            for name, on in (("off", False), ("on", True))}


def checkpoint_roundtrip(rank: int, world_size: int, directory: str, preset: str = "tiny") -> dict:
    """Train a step, save a sharded checkpoint, load it into a fresh model and optimizer, compare, and export the
    full state dict (rank 0 gets it). Collective: every rank calls it."""
    from fsdp_lab import checkpoint

    run = WrapRun(wrapping="block", preset=preset, steps=1)
    cfg = config_for(preset)
    model = build_wrapped(run)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    x, y = (rank_slice(t, rank, world_size) for t in batch_for_step(cfg, 0, run.global_batch, run.seq_len))
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    path = checkpoint.save(model, opt, directory, step=1)
    fresh = build_wrapped(run)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=run.lr)
    meta = checkpoint.load(fresh, fresh_opt, path)
    same_params = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    same_optim = all(torch.equal(opt.state[a][k], fresh_opt.state[b][k])
                     for a, b in zip(model.parameters(), fresh.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    x1, y1 = (rank_slice(t, rank, world_size) for t in batch_for_step(cfg, 1, run.global_batch, run.seq_len))
    with torch.no_grad():
        loss_saved, loss_loaded = model(x1, y1).item(), fresh(x1, y1).item()
    full = checkpoint.full_state_dict(fresh)
    return {"rank": rank, "path": str(path), "step": meta["step"], "world_size": meta["world_size"],
            "shard_elements": [p.numel() for p in fresh.parameters()], "same_params": same_params,
            "same_optim": same_optim, "loss_saved_model": loss_saved, "loss_loaded_model": loss_loaded,
            "full_state_dict": full}


def _engineering_rank(rank: int, world_size: int, sweep: WrapRun, wrappings: tuple, timeline: WrapRun,
                      checkpoint_dir: Optional[str]) -> dict:
    out = {"granularity": _sweep_rank(rank, world_size, sweep, wrappings),
           "prefetch": prefetch_runs(rank, world_size, timeline),
           "checkpointing": checkpointing_runs(rank, world_size, timeline)}
    if checkpoint_dir is not None:
        out["checkpoint"] = checkpoint_roundtrip(rank, world_size, checkpoint_dir)
    return out


def run_engineering(world_size: int = 2, checkpoint_dir: Optional[str | Path] = None, preset: str = "small",
                    wrappings=WRAPPINGS, steps: int = 3, timeout_s: float = 150.0) -> list[dict]:
    """Every measurement of the engineering chapter on `world_size` ranks in one launch; results by rank."""
    sweep = WrapRun(preset=preset, steps=steps)
    timeline = WrapRun(wrapping="block", preset=preset, steps=steps, global_batch=8, seq_len=64)
    return run_on_ranks(_engineering_rank, world_size, sweep, tuple(wrappings), timeline,
                        None if checkpoint_dir is None else str(checkpoint_dir), timeout_s=timeout_s)
