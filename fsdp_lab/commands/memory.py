"""`fsdp-lab memory`: the article's GPU planner (适用场景) in a terminal.

Every number printed comes from fsdp_lab.theory.planner.plan(), so the command, the notebooks and the tests cannot
drift apart. It prints the article's answer first (16Φ, 16Φ/N, N_min) and then what activations and an
allocator reserve do to it, because the article's N_min counts neither.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

from fsdp_lab.commands._argtypes import positive_float, positive_int
from fsdp_lab.theory import formulas, planner

NAME = "memory"
HELP = "Per-GPU memory of DDP and ZeRO-1/2/3 for a model, and how many GPUs it needs (the article's planner)."

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_STAGE_FORMULA = {"DDP": "16Φ", "ZeRO-1": "8Φ + 8Φ/N", "ZeRO-2": "4Φ + 12Φ/N", "ZeRO-3": "16Φ/N"}


def _param_count(text: str) -> float:
    """7e9, 7000000000, 7B, 350M, 1.3b → a parameter count (≥ 1)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 7e9 or 7B, got {text!r}")
    value = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if not math.isfinite(value) or value > formulas.LARGEST:
        raise argparse.ArgumentTypeError(f"the parameter count must be at most {formulas.LARGEST:.0e}, got "
                                         f"{text[:40]}{'…' if len(text) > 40 else ''}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"the parameter count must be at least 1, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=_param_count, default=7e9,
                        help="model parameters Φ, e.g. 7e9 or 7B (default: the article's 7B)")
    parser.add_argument("--gpus", type=positive_int, default=8, help="number of GPUs N (default 8)")
    parser.add_argument("--gpu-mem", type=positive_float, default=80.0,
                        help="memory per GPU in GB, 1 GB = 1e9 bytes (default 80)")
    parser.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per GPU (default 1)")
    parser.add_argument("--precision", choices=sorted(planner.PRECISION_BYTES), default="bf16",
                        help="compute dtype of working copies and activations (default bf16)")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute (checkpointing)")
    parser.add_argument("--attention", choices=planner.ATTENTION, default="fused",
                        help="fused: SDPA/FlashAttention, no stored s×s scores (default, as current models run); "
                             "materialized: the scores kept, Korthikanti's s·b·h·(34 + 5·a·s/h)")
    parser.add_argument("--vocab", type=positive_int, default=planner.LLAMA_VOCAB,
                        help=f"vocabulary size, for the logits (default {planner.LLAMA_VOCAB:,}; Qwen: 151,936)")
    parser.add_argument("--reserve", type=_fraction, default=0.2,
                        help="fraction of each card kept free for CUDA context, buffers, fragmentation (default 0.2)")
    for name in ("layers", "hidden", "heads"):
        parser.add_argument(f"--{name}", type=positive_int, default=None,
                            help=f"model {name} (default: derived from Φ, LLaMA-like)")


def _gb(nbytes, width: int = 0) -> str:
    """Bytes as GB (1e9). Padded to `width` for tables; trimmed (112 GB, 38.5 GB) for prose."""
    if width:
        return f"{nbytes / formulas.GB:{width}.2f} GB"
    return f"{nbytes / formulas.GB:.2f}".rstrip("0").rstrip(".") + " GB"


def _count(phi) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if phi >= scale:
            return f"{phi / scale:.3g}{suffix}"
    return f"{phi:g}"


def _gpus(n) -> str:
    return "none (one layer plus the activations already exceed a card)" if n is None else f"{n} GPU{'s' * (n != 1)}"


def report(p: planner.Plan) -> str:
    """The whole printout for one plan, as text (tests and notebooks can call it without the CLI)."""
    mem, n = p.gpu_mem_bytes, p.gpus
    ddp_verdict = "fits on one" if p.fits("DDP", with_activations=False) else "does not fit one"
    recompute = "full recompute" if p.recompute else "no recompute"
    per_layer = ("2·s·b·h (layer inputs only)" if p.recompute else
                 "(34·s·b·h + 4·a·s·b) (fused attention: no s×s scores stored)" if p.attention == "fused" else
                 "s·b·h·(34 + 5·a·s/h) (attention scores stored)")
    shape = p.assumptions.replace("; ", ";\n         ")
    lines = [
        f"Φ = {_count(p.params)} parameters on N = {_gpus(n)} of {_gb(mem)} each (1 GB = 1e9 bytes).",
        "fp32 params, grads and AdamW state: 16 bytes per parameter, as in the article.",
        "",
        f"DDP:    16Φ   = {_gb(p.ddp_bytes)} per GPU, which {ddp_verdict} {_gb(mem)} card.",
        f"ZeRO-3: 16Φ/N = {_gb(p.zero3_bytes)} per GPU on {_gpus(n)}.",
        f"N_min = ⌈16Φ / M_GPU⌉ = ⌈{p.ddp_bytes / formulas.GB:g} / {mem / formulas.GB:g}⌉ = "
        f"{_gpus(p.n_min)} (the article's count: state only).",
        "",
        f"Counting activations, {p.strategy} (FSDP) needs N_min = {_gpus(p.n_min_with_activations)}:",
        f"  activations: {_gb(p.activation_bytes)} per GPU = {p.layers} layers × {per_layer}"
        f"{' (Korthikanti et al. 2022)' if p.attention == 'materialized' else ''}",
        f"    with s = seq {p.seq_len}, b = micro-batch {p.micro_batch}, h = {p.hidden}, a = {p.heads}, "
        f"{p.precision}, {recompute};",
        f"  working copies of one layer (params + grads, {p.precision}): {_gb(p.working_bytes)};",
        *([f"  the layer being recomputed in backward (its full activations): {_gb(p.recompute_layer_bytes)};"]
          if p.recompute else []),
        f"  logits and their fp32 copy for the loss (vocab {p.vocab:,}): {_gb(p.logits_bytes)};",
        f"  shape: {shape}.",
        f"Keeping {p.reserve_fraction:.0%} of each card free for the allocator and fragmentation: "
        f"N_min = {_gpus(p.n_min_with_reserve)}.",
    ]
    low, high = p.n_min_with_activations, p.n_min_with_reserve
    if low is not None and high is not None:
        lines.append(f"Plan for {low}–{high} GPUs." if high > low else f"Plan for {_gpus(low)}.")
    rows = p.rows()
    # Columns as wide as their widest number, so a huge plan still reads as columns.
    state_w = max(9, *(len(f"{state / formulas.GB:.2f}") for _s, state, *_ in rows))
    peak_w = max(21, *(len(f"{peak / formulas.GB:.2f}") + 1 for _s, _b, peak, *_ in rows))  # + 1: a gap
    lines += ["", f"Per GPU on N = {n}:",
              f"  {'stage':<8}{'formula':<13}{'state':>{state_w + 3}}{'+ layer + activations':>{peak_w + 3}}"
              f"   fits {_gb(mem)}?"]
    for stage, state, peak, state_fits, peak_fits in rows:
        verdict = "yes" if peak_fits else ("state only" if state_fits else "no")
        lines.append(f"  {stage:<8}{_STAGE_FORMULA[stage]:<13}{_gb(state, state_w)}{_gb(peak, peak_w)}   {verdict}")
    if any(state_fits and not peak_fits for _s, _b, _p, state_fits, peak_fits in p.rows()):
        lines.append("  state only: the article's state fits, but not once a layer and the activations are added.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        p = planner.plan(args.params, args.gpus, args.gpu_mem, precision=args.precision, seq_len=args.seq_len,
                          micro_batch=args.micro_batch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          recompute=args.recompute, reserve_fraction=args.reserve, attention=args.attention,
                          vocab=args.vocab)
    except ValueError as err:
        print(f"fsdp-lab memory: error: {err}", file=sys.stderr)
        return 2
    print(report(p))
    return 0
