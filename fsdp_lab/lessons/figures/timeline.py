"""Chapter 06's timelines: when each unit's all-gather was issued and waited on, and when it computed, from a
trace. A grey bar runs from the issue to the wait: on CPU ranks the collective itself finished at the issue."""
from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.lessons.figures.common import show

TIMELINE_COLOURS = {"gather": "0.55", "regather": "0.55", "forward": "tab:blue", "backward": "tab:orange"}


def draw_timeline(ax, rows: list, title: str) -> None:
    """One row per unit (root last): grey bars run from an all-gather's issue to its wait, coloured bars compute
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


def _legend(fig) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=TIMELINE_COLOURS[b]) for b in ("gather", "forward", "backward")]
    fig.legend(handles, ["all-gather, issued → waited on", "forward compute", "backward compute + reduce-scatter"],
               loc="lower center", ncol=3, fontsize=8)


def prefetch_timelines(runs: dict, spans, options: dict = None) -> None:
    """The last step of each run ({name: run with "events"}) as a timeline, one panel each, titled with the run's
    options ({name: "backward_prefetch=..."}). No step time in the titles: on CPU ranks it is noise."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.25 * len(runs)), sharex=True)
    for ax, (name, run) in zip(axes, runs.items()):
        opts = f" ({options[name]})" if options and name in options else ""
        draw_timeline(ax, spans(run["events"]), f"{name}{opts}: step {run['events'][0]['step']}")
    for ax in axes[:-1]:
        ax.set_xlabel("")
    _legend(fig)
    fig.suptitle("Order of issue and use, GPT 'small' on 2 CPU ranks (measured; only prefetched gathers overlap)")
    show(fig, rect=(0, 0.04, 1, 1))


def trace_timeline(events: list, spans, title: str) -> None:
    """One trace's last step on rank 0 (e.g. a GPU trace shipped with the course)."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    draw_timeline(ax, spans(events, rank=0), title)
    _legend(fig)
    show(fig, rect=(0, 0.08, 1, 1))
