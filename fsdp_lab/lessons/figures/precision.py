"""Figures of number formats: which weights a bf16 update leaves unchanged, and the loss it costs (chapters 04
and 09)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.lessons.figures.common import show

STALL_STYLES = {"fp32": ("#111827", "-"), "bf16 compute, fp32 masters": ("#2563eb", "--"),
                "bf16 only": ("#dc2626", "-")}


def update_stall_curves(stall: dict, lr: float) -> None:
    """Chapter 04: loss and the share of stored weights each step moved, per precision variant."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for variant, result in stall.items():
        colour, ls = STALL_STYLES.get(variant, ("grey", ":"))
        left.plot(result["losses"], ls, color=colour, label=variant)
        right.plot([100 * m for m in result["moved"]], ls, color=colour, label=variant)
    left.set_xlabel("optimizer step (count)")
    left.set_ylabel("training loss (nats)")
    left.set_title(f"Same batch, AdamW, lr = {lr:g}")
    right.set_xlabel("optimizer step (count)")
    right.set_ylabel("weights changed by the step (%)")
    right.set_ylim(0, 105)
    right.set_title("How many stored weights actually moved")
    for ax in (left, right):
        ax.legend()
    show(fig)


def master_precision_curves(runs: dict) -> None:
    """Chapter 09: weights a step left unchanged and the loss, fp32 against bf16 masters, per learning rate."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for (lr, res), style in zip(runs.items(), ("-", "--", ":")):
        for name, colour in (("fp32 masters", "tab:blue"), ("bf16 masters", "tab:red")):
            r = res[name]
            ax1.plot(range(1, len(r["frozen"]) + 1), [f * 100 for f in r["frozen"]], style, color=colour,
                     label=f"{name}, lr {lr:g}")
            ax2.plot(range(1, len(r["losses"]) + 1), r["losses"], style, color=colour, label=f"{name}, lr {lr:g}")
    ax1.set_xlabel("optimizer step (count)")
    ax1.set_ylabel("weights a step left unchanged (%)")
    ax1.set_title("Updates lost to rounding")
    ax2.set_xlabel("optimizer step (count)")
    ax2.set_ylabel("training loss (nats)")
    ax2.set_title("Loss")
    ax1.legend(fontsize=7)
    show(fig)
