"""Figures the chapters draw from their measurements, so a learner's cell stays about FSDP: it calls one of
these in a line and reads the picture. Each function takes plain data (what the ranks returned) and draws with
pyplot into the notebook; none of them computes a number the chapter reports.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

UNIT_COLOURS = ("#60a5fa", "#f97316", "#a855f7", "#facc15", "#34d399")
ROOT_COLOUR = "#34d399"
TIMELINE_COLOURS = {"gather": "0.55", "regather": "0.55", "forward": "tab:blue", "backward": "tab:orange"}


def potluck_picture(shards: dict, world_size: int, served: str = "blocks.0", title: str = "") -> None:
    """Each household's fridge (its shard of every unit) and the long table with the root and one block served,
    assembled from every household's share. `shards`: unit → elements of one rank's shard."""
    colours = {name: ROOT_COLOUR if name == "<root>" else UNIT_COLOURS[i % len(UNIT_COLOURS)]
               for i, name in enumerate(shards)}
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for y in range(world_size):
        left = 0
        for name, size in shards.items():
            ax.barh(y, size / 1e3, left=left / 1e3, color=colours[name], edgecolor="white",
                    label=name if y == 0 else None)
            left += size
    left = 0
    for name in ("<root>", served):
        for r in range(world_size):  # each household brings its share to the table
            ax.barh(world_size, shards[name] / 1e3, left=left / 1e3, color=colours[name], edgecolor="white",
                    hatch="//" if r else None)
            left += shards[name]
    rows = [f"household {r}'s fridge\n(rank {r}'s shard)" for r in range(world_size)]
    ax.set_yticks(range(world_size + 1), rows + [f"long table\n({served} served)"])
    ax.invert_yaxis()
    ax.set_xlabel("parameters (thousands)")
    ax.set_ylabel("place (fridge or table)")
    ax.barh(0, 0, color="white", edgecolor="grey", hatch="//", label="brought by the other households")
    ax.set_title(title or f"The potluck on {world_size} ranks")
    ax.legend(title="unit (dish)", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    plt.show()
    plt.close(fig)


def draw_timeline(ax, rows: list, title: str) -> None:
    """One row per unit (root last): grey bars are all-gathers in flight, coloured bars compute
    (rows from fsdp_lab.lessons.experiments.engineering.spans)."""
    units = list(dict.fromkeys(r["unit"] for r in rows if r["unit"] != "<root>")) + ["<root>"]
    for r in rows:
        y = units.index(r["unit"])
        comm = r["beat"] in ("gather", "regather")
        ax.barh(y + (0.22 if comm else -0.12), r["end_ms"] - r["start_ms"], left=r["start_ms"],
                height=0.36 if comm else 0.5, color=TIMELINE_COLOURS[r["beat"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(units)), units)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event of the step (ms)")
    ax.set_ylabel("unit (rank 0)")
    ax.set_title(title, fontsize=10)


def prefetch_timelines(runs: dict, spans) -> None:
    """The last step of each run ({name: run with "events" and "step_times"}) as a timeline, one panel each."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.25 * len(runs)), sharex=True)
    for ax, (name, run) in zip(axes, runs.items()):
        draw_timeline(ax, spans(run["events"]), f"{name}: step {run['events'][0]['step']}, "
                      f"step time {run['step_times'][-1] * 1e3:.0f} ms")
    for ax in axes[:-1]:
        ax.set_xlabel("")
    handles = [plt.Rectangle((0, 0), 1, 1, color=TIMELINE_COLOURS[b]) for b in ("gather", "forward", "backward")]
    fig.legend(handles, ["all-gather in flight", "forward compute", "backward compute + reduce-scatter"],
               loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("Prefetch timeline, GPT 'small' on 2 CPU ranks (measured)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    plt.show()
    plt.close(fig)


def use_case_peaks(plans: dict, labels: list, top_gb: float = 125) -> None:
    """Chapter 07: each use case's ZeRO-3 peak per GPU, without and with recompute, split into the planner's
    terms (fsdp_lab.theory.planner.Plan), against the card. Bars taller than `top_gb` are cut and labelled."""
    from fsdp_lab.theory.formulas import GB

    parts = (("16Φ/N sharded state", lambda p: p.zero3_bytes, "tab:blue"),
             ("unit working copies", lambda p: p.working_bytes, "tab:purple"),
             ("activations kept for backward", lambda p: p.activation_bytes, "tab:orange"),
             ("the layer being recomputed", lambda p: p.recompute_layer_bytes, "tab:red"),
             ("logits + fp32 loss copy", lambda p: p.logits_bytes, "gold"))
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    ticks, x = [], 0
    for short, (plain, ac) in zip(labels, plans.values()):
        for tag, p in (("", plain), ("\n+AC", ac)):
            bottom = 0.0
            for _label, value, colour in parts:
                part = value(p) / GB
                ax.bar(x, min(part, top_gb - bottom), bottom=bottom, color=colour, width=0.7)
                bottom = min(bottom + part, top_gb)
            total = p.peak_bytes("ZeRO-3") / GB
            ax.annotate(f"{total:.0f}", (x, min(total, top_gb)), ha="center", va="bottom", fontsize=8)
            ax.hlines(p.gpu_mem_bytes / GB, x - 0.42, x + 0.42, colors="black", linewidth=2)
            ax.hlines(p.gpu_mem_bytes * (1 - p.reserve_fraction) / GB, x - 0.42, x + 0.42, colors="black",
                      linewidth=1, linestyles=":")
            ticks.append(short + tag)
            x += 1
    ax.set_xticks(range(x), ticks, fontsize=8)
    ax.set_ylim(0, top_gb + 12)
    ax.set_ylabel("per-GPU memory (GB = 1e9 bytes)")
    ax.set_xlabel("use case (ZeRO-3; +AC: with activation checkpointing; b: micro-batch)")
    ax.set_title("The planner's peak, term by term, against the card (solid) and its 20 % reserve (dotted)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _l, _v, c in parts]
    handles += [plt.Line2D([0], [0], color="black", linewidth=2), plt.Line2D([0], [0], color="black", ls=":")]
    ax.legend(handles, [label for label, _v, _c in parts] + ["GPU memory", "keeping 20 % free"], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    plt.show()
    plt.close(fig)
