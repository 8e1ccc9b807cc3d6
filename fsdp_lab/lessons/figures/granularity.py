"""Figures of how a model is cut into units: one unit's flat buffer and who owns which chunk (chapter 02), and
what the unit size trades, peak against collectives and time (02, 06, 09)."""
from __future__ import annotations

import statistics

import matplotlib.pyplot as plt

from fsdp_lab.lessons.figures.common import show

KiB = 1024
RANK_COLOURS = ("#60a5fa", "#f97316", "#34d399", "#a855f7")


def _flat_buffer(ax, unit: dict, world: int, lo: float, hi: float) -> None:
    slots, size, padded = unit["slots"], unit["shard_numel"], unit["padded_numel"]
    palette = plt.get_cmap("tab10")
    prefix = unit.get("name", "blocks.0") + "."
    for i, s in enumerate(slots):  # parameters, end to end
        ax.barh(1, s["numel"], left=s["offset"], color=palette(i), edgecolor="white",
                label=s["name"].removeprefix(prefix))
    ax.barh(1, padded - unit["numel"], left=unit["numel"], color="lightgrey", hatch="xx", edgecolor="grey",
            label="padding (zeros)")
    for r in range(world):  # chunks
        ax.barh(0, size, left=r * size, color=RANK_COLOURS[r % len(RANK_COLOURS)], edgecolor="black")
        if lo <= r * size + size / 2 <= hi:
            ax.text(r * size + size / 2, 0, f"rank {r}", ha="center", va="center")
    ax.set_xlim(lo, hi)
    ax.set_yticks([0, 1], ["chunks\n(owner)", "parameters\n(flat buffer)"])
    ax.set_xlabel("position in the flat buffer of blocks.0 (elements)")


def flat_buffer_layout(unit: dict, world: int) -> None:
    """Chapter 02: a unit's parameters end to end in its flat buffer, the padding, and the N chunks; with a zoom
    on the last 8 elements, where the padding sits. `unit`: a row of the layout the ranks reported."""
    padded = unit["padded_numel"]
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    _flat_buffer(whole, unit, world, 0, padded)
    whole.set_ylabel("row (what it shows)")
    whole.set_title(f"blocks.0: {unit['numel']:,} parameters padded to {padded:,}, cut into {world} chunks of "
                    f"{unit['shard_numel']:,}")
    _flat_buffer(tail, unit, world, padded - 8, padded)
    tail.xaxis.set_major_locator(plt.FixedLocator([padded - 8, padded - 4, unit["numel"], padded]))
    tail.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _pos: f"{x:,.0f}"))
    tail.tick_params(axis="x", labelrotation=30)
    tail.set_title("zoom: the last 8 elements")
    handles, labels = whole.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, title="parameter (colour)")
    show(fig, rect=(0, 0.2, 1, 1))


def granularity_bars(rows: dict, labels: dict, world: int) -> None:
    """Chapter 02: all-gathers per step and the peak of gathered parameters for each wrapping."""
    names = [labels[n] for n in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
    left.bar(names, [r["all_gathers"] for r in rows.values()], color="#60a5fa")
    left.set_ylabel("all-gathers per step (count)")
    left.set_xlabel("wrapping (unit size)")
    left.set_title("trips to the long table")
    right.bar(names, [r["peak_gathered_bytes"] / KiB for r in rows.values()], color="#f97316")
    right.set_ylabel("peak gathered parameters (KiB)")
    right.set_xlabel("wrapping (unit size)")
    right.set_title("the fullest the table gets")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Granularity on the tiny GPT, rank 0 of {world}, one step, no prefetch")
    show(fig)


def units_tradeoff(gran: dict, labels: dict) -> None:
    """Chapter 06: peak gathered parameters against collectives per step, one point per wrapping."""
    xs = [s["collectives"] for s in gran.values()]
    ys = [s["peak_unsharded"] / KiB for s in gran.values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, "o-", color="tab:blue")
    for w, x, y in zip(gran, xs, ys):
        ax.annotate(f"{labels[w]}\n{gran[w]['units']} units", (x, y), textcoords="offset points", xytext=(8, 4),
                    fontsize=8)
    ax.set_xlabel("collectives per step (count, rank 0)")
    ax.set_ylabel("peak gathered parameters (KiB)")
    ax.set_title("Unit size: fewer collectives ⇄ lower peak (GPT 'small', 2 ranks, fp32, measured)")
    ax.set_xlim(0, max(xs) * 1.35)
    ax.set_ylim(0, max(ys) * 1.15)
    show(fig)


def wrapping_bill(gran: dict, times: list) -> None:
    """Chapter 09: collectives and step time against the number of units (`times`: per wrapping, each rank's
    median step time in ms)."""
    units = [s["units"] for s in gran.values()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(units, [s["collectives"] for s in gran.values()], "o-", color="tab:red")
    ax1.set_xlabel("units (count)")
    ax1.set_ylabel("collectives per step (count)")
    ax1.set_title("Messages grow with the units")
    ax2.plot(units, [statistics.mean(t) for t in times], "o-", color="tab:blue")
    ax2.set_xlabel("units (count)")
    ax2.set_ylabel("median step time, mean of 2 ranks (ms)")
    ax2.set_title("Step time (measured; noisy on a shared CPU)")
    ax2.set_ylim(0, None)
    fig.suptitle("One model, four wrappings (GPT 'small', 2 CPU ranks, measured)")
    show(fig)
