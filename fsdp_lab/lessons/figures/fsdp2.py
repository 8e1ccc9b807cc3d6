"""Figures of FSDP1 against FSDP2 (chapter 06a): who owns which part of one weight in each layout, and what
the per-parameter layout's copies cost. Each draws what the ranks returned (fsdp_lab.lessons.experiments.fsdp2)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from fsdp_lab.lessons.figures.common import show
from fsdp_lab.lessons.figures.granularity import RANK_COLOURS


def weight_owners(ranks: list, weight: str) -> None:
    """One panel per front end: the weight as a (rows, columns) grid, each element coloured by the rank that
    keeps it in its shard; white where no rank keeps it as a shard of this unit."""
    names = list(ranks[0]["front_ends"])
    first = ranks[0]["front_ends"][names[0]]["owned"]
    rows, cols = first["shape"][0], first["row_numel"]
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 4.2), sharey=True)
    colours = np.array([[1.0, 1.0, 1.0]] + [plt.matplotlib.colors.to_rgb(c) for c in RANK_COLOURS])
    for ax, name in zip(np.atleast_1d(axes), names):
        owner = np.zeros(rows * cols, dtype=int)
        for r in ranks:
            o = r["front_ends"][name]["owned"]
            owner[o["start"]:o["stop"]] = r["rank"] + 1
        ax.imshow(colours[owner.reshape(rows, cols)], aspect="auto", interpolation="nearest")
        ax.set_title(f"{name}\n{first['shape'][0]}×{cols}: {ranks[0]['front_ends'][name]['owned']['layout']}",
                     fontsize=9)
        ax.set_xlabel("column (element index)")
    np.atleast_1d(axes)[0].set_ylabel(f"row of {weight} (index)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLOURS[r["rank"]]) for r in ranks]
    fig.legend(handles, [f"rank {r['rank']} keeps it" for r in ranks], loc="lower center", ncol=len(ranks))
    show(fig, rect=(0, 0.08, 1, 1))


def copy_cost(ranks: list, steps: int) -> None:
    """Copy-in and copy-out CPU time per training step on each rank, by front end (from the profiler)."""
    names = list(ranks[0]["front_ends"])
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(ranks)
    x = np.arange(len(names))
    for i, r in enumerate(ranks):
        fe = r["front_ends"]
        cin = [fe[n]["copy_ms"]["copy-in"] / steps for n in names]
        cout = [fe[n]["copy_ms"]["copy-out"] / steps for n in names]
        ax.bar(x + i * width, cin, width, color=RANK_COLOURS[i], label=f"rank {r['rank']} copy-in")
        ax.bar(x + i * width, cout, width, bottom=cin, color=RANK_COLOURS[i], alpha=0.45, hatch="//",
               label=f"rank {r['rank']} copy-out")
    ax.set_xticks(x + width * (len(ranks) - 1) / 2, names)
    ax.set_ylabel("CPU time per step (ms)")
    ax.set_title("the all-gathers' copies, per step (torch.profiler)")
    ax.legend(fontsize=8, ncol=2)
    show(fig)


def side_by_side(rows: list, left: str = "FSDP1", right: str = "FSDP2"):
    """Two scripts as a two-column table (fsdp_lab.lessons.experiments.fsdp2.script_diff's rows): changed lines
    shaded, a line only one side has left blank on the other."""
    from html import escape

    from IPython.display import HTML

    shade = {"=": "", "~": "background:#fef3c7", "-": "background:#fee2e2", "+": "background:#dcfce7"}
    cell = "padding:0 8px;font-family:monospace;font-size:12px;white-space:pre;text-align:left;vertical-align:top"
    body = "".join(f"<tr style='{shade[tag]}'><td style='{cell};color:#6b7280'>{tag}</td>"
                   f"<td style='{cell}'>{escape(a)}</td><td style='{cell}'>{escape(b)}</td></tr>"
                   for tag, a, b in rows)
    head = f"<tr><th></th><th style='{cell}'>{escape(left)}</th><th style='{cell}'>{escape(right)}</th></tr>"
    return HTML(f"<table style='border-collapse:collapse'>{head}{body}</table>")
