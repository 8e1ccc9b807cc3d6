"""Figures computed from the formulas alone: state per GPU against N (chapter 01), the planner's use cases
(chapter 07) and MiniFSDP's per-rank peak (chapter 08)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.lessons.figures.common import show
from fsdp_lab.theory import formulas
from fsdp_lab.theory.formulas import GB


def state_per_gpu(phi: float, gpu_gb: float, max_n: int = 16) -> None:
    """DDP's 16Φ against ZeRO-3's 16Φ/N (and its 4Φ/N of parameters) for N = 1..max_n, beside one card."""
    ns = list(range(1, max_n + 1))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(ns, [formulas.m_ddp(phi) / GB] * len(ns), "o-", color="#f97316", label="DDP: 16Φ on every GPU")
    ax.plot(ns, [formulas.m_zero3(phi, n) / GB for n in ns], "o-", color="#2563eb", label="FSDP / ZeRO-3: 16Φ/N")
    ax.plot(ns, [formulas.m_param(phi, n) / GB for n in ns], "--", color="#2563eb",
            label="of which fp32 parameters: 4Φ/N")
    ax.axhline(gpu_gb, color="crimson", ls=":", label=f"one {gpu_gb} GB GPU")
    ax.set_xlabel("number of GPUs N (count)")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_title(f"{phi / 1e9:g}B parameters, Adam, fp32: persistent state per GPU")
    ax.legend()
    show(fig)


def use_case_peaks(plans: dict, labels: list, top_gb: float = 125) -> None:
    """Chapter 07: each use case's ZeRO-3 peak per GPU, without and with recompute, split into the planner's
    terms (fsdp_lab.theory.planner.Plan), against the card. Bars taller than `top_gb` are cut and labelled."""
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
    show(fig)


def minifsdp_peaks(rows: list, layer_sizes: list) -> None:
    """Chapter 08: (N, fridge, simulated peak, _, article's estimate) rows against the world size."""
    ns = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ns, [r[2] / 1e3 for r in rows], "o-", label="simulated peak (fridge + table)")
    ax.plot(ns, [r[4] / 1e3 for r in rows], "s--", label="article's peak_params estimate")
    ax.plot(ns, [r[1] / 1e3 for r in rows], "^:", label="fridge alone: 1/N of every layer")
    ax.axhline(sum(layer_sizes) / 1e3, color="grey", linewidth=1, label="the whole model, unsharded")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("parameters one rank holds (thousands of elements)")
    ax.set_title("MiniFSDP: per-rank peak against world size")
    ax.legend(fontsize=8)
    show(fig)
