"""Figures of what a rank holds: state by kind and strategy (chapters 01, 05), bytes through one step (04, 09),
and what activation checkpointing saves (06). Every number drawn comes from the ranks' own reports."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from fsdp_lab.lessons.figures.common import show

KiB = 1024
KINDS = (("params", "parameters (fp32)", "#60a5fa"), ("grads", "gradients (fp32)", "#f97316"),
         ("optimizer", "Adam state", "#34d399"))


def state_by_kind(runs: list, formula: dict, phi: int, strategies=("NO_SHARD", "FULL_SHARD")) -> None:
    """Chapter 01: each rank's parameters, gradients and optimizer state between steps under DDP and FSDP,
    with the formula's 4Φ, 4Φ, 8Φ (then /N) as black ticks. `formula`: strategy → kind → bytes."""
    kinds = [k for k, _l, _c in KINDS]
    world = len(runs)
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(kinds))
    width = 0.8 / (len(strategies) * world)
    colours = ["#fb923c", "#f97316", "#60a5fa", "#2563eb"]
    bars = [(s, r) for s in strategies for r in range(world)]
    for i, (strategy, r) in enumerate(bars):
        measured = [runs[r][strategy]["persistent"][k] / KiB for k in kinds]
        name = "DDP (NO_SHARD)" if strategy == "NO_SHARD" else "FSDP (FULL_SHARD)"
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, measured, width, label=f"{name}, rank {r}",
               color=colours[i % len(colours)])
    for j, kind in enumerate(kinds):
        for k, strategy in enumerate(strategies):
            centre = x[j] + (2 * k - 1) * width
            ax.hlines(formula[strategy][kind] / KiB, centre - width, centre + width, colors="black",
                      label="formula (4Φ, 4Φ, 8Φ, then /N)" if j == k == 0 else None)
    ax.set_xticks(x, ["parameters", "gradients", "optimizer state (Adam)"])
    ax.set_xlabel("what a rank keeps between steps (kind)")
    ax.set_ylabel("memory per rank (KiB)")
    ax.set_title(f"Tiny GPT (Φ = {phi:,}) on {world} ranks: DDP keeps 16Φ, FSDP 16Φ/N")
    ax.legend(fontsize=8)
    show(fig)


def live_bytes_by_kind(events: list, memory_kinds, lines: dict, title: str) -> None:
    """Chapter 04: one rank's bytes by kind after every event of one step, stacked, with the phases marked and
    horizontal reference lines (`lines`: label → bytes)."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    bottom = np.zeros(len(events))
    for key, label, colour in memory_kinds:
        values = np.array([e["mem"][key] / KiB for e in events])
        ax.fill_between(np.arange(len(events)), bottom, bottom + values, step="post", color=colour, label=label)
        bottom += values
    for (label, value), (colour, ls) in zip(lines.items(), (("black", "--"), ("crimson", ":"), ("grey", "-."))):
        ax.axhline(value / KiB, color=colour, ls=ls, label=label)
    starts = {}
    for i, e in enumerate(events):
        starts.setdefault(e["phase"], i)
    for phase, i in starts.items():
        ax.axvline(i, color="grey", lw=0.8)
        ax.text(i + 0.3, 20, phase, fontsize=8, color="dimgrey")
    ax.set_xlabel(f"trace event of step {events[0]['step']}, rank {events[0]['rank']} (index)")
    ax.set_ylabel("memory (KiB)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    show(fig)


def strategy_memory(mine: dict, strategies, stage: dict, formula: dict, world: int) -> None:
    """Chapter 05: what each strategy keeps between steps (stacked by kind) beside the most parameters it had
    gathered at once during the step; the ZeRO formulas as dashed ticks."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(strategies))
    bottom = np.zeros(len(strategies))
    for kind, label, colour in KINDS:
        values = np.array([mine[s]["persistent"][kind] / KiB for s in strategies])
        ax.bar(x - 0.2, values, 0.38, bottom=bottom, color=colour, label=f"between steps: {label}")
        bottom += values
    ax.bar(x + 0.2, [mine[s]["peak_unsharded"] / KiB for s in strategies], 0.38, color="#1d4ed8", hatch="//",
           edgecolor="white", label="during the step: most parameters gathered at once")
    ax.hlines([formula[s] / KiB for s in strategies], x - 0.4, x, colors="black", linestyles="--",
              label="16Φ and 16Φ/N (the article); 8Φ+8Φ/N, 4Φ+12Φ/N (the ZeRO paper)")
    ax.set_xticks(x, [f"{stage[s]}\n{s}" for s in strategies])
    ax.set_xlabel("sharding strategy (ZeRO stage)")
    ax.set_ylabel("bytes per rank (KiB)")
    ax.set_title(f"Tiny GPT on {world} ranks, AdamW: what each strategy keeps")
    ax.legend(fontsize=8)
    show(fig)


def step_memory_by_strategy(strategies: dict, names: dict) -> None:
    """Chapter 09: gathered parameters and all training state on rank 0 through one step, one panel per
    strategy, with a vertical line at each collective."""
    colours = {"gather_end": "tab:green", "regather_end": "tab:olive", "reduce_scatter": "tab:red",
               "all_reduce": "tab:purple"}
    names_of = {"gather_end": "all-gather (forward)", "regather_end": "re-gather (backward)",
                "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce"}
    top = max(e["total"] for r in strategies.values() for e in r["events"]) / KiB * 1.1
    fig, axes = plt.subplots(len(strategies), 1, figsize=(9, 2.75 * len(strategies)))
    for ax, (s, run) in zip(axes, strategies.items()):
        ev = run["events"]
        ts = [(e["t"] - ev[0]["t"]) * 1e3 for e in ev]
        ax.step(ts, [e["params_unsharded"] / KiB for e in ev], where="post", color="tab:blue",
                label="full (gathered) parameters")
        ax.step(ts, [e["total"] / KiB for e in ev], where="post", color="tab:gray", linestyle="--",
                label="all training state (params, grads, Adam)")
        seen = set()
        for e, t in zip(ev, ts):
            if e["bytes_sent"]:
                first = e["event"] not in seen
                seen.add(e["event"])
                ax.axvline(t, color=colours[e["event"]], linewidth=0.8, alpha=0.7,
                           label=names_of[e["event"]] if first else None)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
        ax.set_title(f"{names[s]}: one step on rank 0 (vertical lines: collectives)", fontsize=10)
        ax.set_xlabel("time in the step (ms)")
        ax.set_ylabel("bytes on rank 0 (KiB)")
        ax.set_ylim(0, top)
    show(fig)


def checkpointing_bars(ac: dict) -> None:
    """Chapter 06: bytes saved for backward and the median step time, activation checkpointing off and on."""
    names = ["off", "on"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
    ax1.bar(names, [ac[n]["saved_bytes"][-1] / KiB for n in names], color=["tab:blue", "tab:green"])
    ax1.set_xlabel("activation checkpointing (setting)")
    ax1.set_ylabel("saved for backward (KiB)")
    ax1.set_title("Activation memory per rank")
    ax2.bar(names, [sorted(ac[n]["step_times"])[len(ac[n]["step_times"]) // 2] * 1e3 for n in names],
            color=["tab:blue", "tab:green"])
    ax2.set_xlabel("activation checkpointing (setting)")
    ax2.set_ylabel("median step time (ms)")
    ax2.set_title("Time per step (noisy CPU)")
    show(fig)
