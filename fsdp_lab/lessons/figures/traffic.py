"""Figures of bytes on the wire: by beat (chapter 04), by strategy and collective (05), the FSDP/DDP ratio as a
model deepens (05), and what one all-gather costs each rank (02)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from fsdp_lab.lessons.figures.common import show
from fsdp_lab.theory import formulas

KiB = 1024


def bytes_by_beat(sent: dict, beats: dict, title: str) -> None:
    """Chapter 04: bytes each beat sent per rank, one bar per run (`sent`: run → beat → bytes)."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = np.arange(len(beats))
    width = 0.76 / len(sent)
    for i, ((run, by_beat), colour) in enumerate(zip(sent.items(), ("#f97316", "#2563eb", "#34d399"))):
        ax.bar(x + (i - (len(sent) - 1) / 2) * width, [by_beat[b] / KiB for b in beats], width, label=f"{run} run",
               color=colour)
    ax.set_xticks(x, list(beats.values()))
    ax.set_xlabel("collective (beat of the step)")
    ax.set_ylabel("bytes sent per rank (KiB)")
    ax.set_title(title)
    ax.legend()
    show(fig)


def strategy_traffic(mine: dict, strategies, stage: dict, predicted: list, one_pass: float, title: str) -> None:
    """Chapter 05: bytes one step sent, stacked by collective, per strategy; the formula as dashed ticks,
    labelled with its number of passes."""
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(strategies))
    bottom = np.zeros(len(strategies))
    for coll, colour in (("all_gather", "#2563eb"), ("reduce_scatter", "#f97316"), ("all_reduce", "#a855f7")):
        values = np.array([mine[s]["comm_per_collective"].get(coll, 0) / KiB for s in strategies])
        ax.bar(x, values, 0.55, bottom=bottom, color=colour, label=coll.replace("_", "-"))
        bottom += values
    ax.hlines([b / KiB for b in predicted], x - 0.3, x + 0.3, colors="black", linestyles="--",
              label=f"formula ({', '.join(f'{b / one_pass:.0f}' for b in predicted)} passes)")
    ax.set_xticks(x, [f"{stage[s]}\n{s}" for s in strategies])
    ax.set_xlabel("sharding strategy (ZeRO stage)")
    ax.set_ylabel("bytes sent per rank per step (KiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    show(fig)


def ratio_by_depth(depth_rows: list, world: int) -> None:
    """Chapter 05: measured FSDP/DDP bytes against 1.5 - Φ_root/2Φ and the article's 1.5, by model depth."""
    depths = [r["depth"] for r in depth_rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(depths, [r["ratio"] for r in depth_rows], "s", markersize=9, color="crimson", label="measured")
    ax.plot(depths, [1.5 - r["root_share"] / 2 for r in depth_rows], "-", color="black",
            label="1.5 - Φ_root / 2Φ (root never re-gathered)")
    ax.axhline(formulas.comm_ratio_fsdp_vs_ddp(world), color="grey", ls="--", label="the article: 3Φ / 2Φ = 1.5")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("transformer blocks in the model (count)")
    ax.set_ylabel("FSDP / DDP bytes per step (ratio)")
    ax.set_title("FULL_SHARD vs NO_SHARD traffic approaches 1.5 as blocks dominate Φ")
    ax.legend()
    show(fig)


def gather_share(measured: list, world: int, max_n: int = 16) -> None:
    """Chapter 02: the share of a unit each rank fetches in one all-gather, (N-1)/N, against the measurement
    (`measured`: bytes sent / bytes of the padded unit, one value per gathered unit)."""
    ns = list(range(1, max_n + 1))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(ns, [formulas.c_gather(1, n) for n in ns], "o-", label="formula: (N-1)/N")
    ax.plot([world] * len(measured), measured, "s", color="crimson", markersize=10,
            label=f"measured, N = {world} (each unit)")
    ax.axhline(1, color="grey", ls="--", label="the article's ≈ 1")
    ax.set_xlabel("number of ranks N (count)")
    ax.set_ylabel("share of Φ_layer each rank fetches (fraction)")
    ax.set_title("C_gather / Φ_layer: what one all-gather costs each rank")
    ax.legend()
    show(fig)
