"""The start banner of `fsdp-lab train`: what is about to run and, when a step will be slow, about how slow.

A step costs about 6·Φ·t FLOPs per rank (forward 2Φ, backward 4Φ per token; t = tokens per rank and step).
The rate is measured here, not assumed: a float32 matmul timed on this machine with the threads one rank
gets. The estimate leaves out attention, communication and the optimizer, so it is a lower bound; it is shown
only when it reaches ESTIMATE_FROM_S, so that a 369M model on CPU announces minutes per step up front instead
of looking hung.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from fsdp_lab.training.models import PRESETS, build_gpt, count_params

ESTIMATE_FROM_S = 10.0        # below this a step's time is visible soon enough on its own
MEASURE_ABOVE_FLOPS = 1e11    # cheaper steps cannot reach ESTIMATE_FROM_S on any CPU: skip the measurement


@dataclass(frozen=True)
class StepEstimate:
    params: int
    flops_per_rank: float
    flops_per_s: float | None  # measured matmul rate of one rank; None when not measured
    seconds: float | None


def parameter_count(preset: str) -> int:
    with torch.device("meta"):
        return count_params(build_gpt(preset))


def matmul_flops_per_s(threads: int, size: int = 1024, budget_s: float = 0.3) -> float:
    """FLOP/s of a float32 size×size matmul on `threads` CPU threads, best of the repeats in `budget_s`."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm up
        best, deadline = float("inf"), time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * size ** 3 / best
    finally:
        torch.set_num_threads(before)


def estimate_step(preset: str, global_batch: int, world_size: int, device: str = "cpu",
                  threads_per_rank: int | None = None) -> StepEstimate:
    params = parameter_count(preset)
    tokens_per_rank = global_batch // world_size * PRESETS[preset].block_size
    flops = 6.0 * params * tokens_per_rank
    if device != "cpu" or flops < MEASURE_ABOVE_FLOPS:
        return StepEstimate(params, flops, None, None)
    threads = threads_per_rank or int(os.environ.get("OMP_NUM_THREADS") or 0) or \
        max(1, (os.cpu_count() or 1) // world_size)
    rate = matmul_flops_per_s(threads)
    return StepEstimate(params, flops, rate, flops / rate)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def banner(cfg, world_size: int) -> str:
    """One line (two when a step is slow): model, ranks, strategy, steps, and the estimate."""
    est = estimate_step(cfg.preset, cfg.global_batch, world_size, cfg.device)
    line = (f"fsdp-lab train: GPT '{cfg.preset}' ({est.params / 1e6:,.1f}M parameters), {world_size} rank(s) on "
            f"{cfg.device}, {cfg.strategy}, {cfg.mixed_precision}, steps to {cfg.steps}, global batch "
            f"{cfg.global_batch}")
    if est.seconds is None or est.seconds < ESTIMATE_FROM_S:
        return line
    return (f"{line}\nestimate: about {_duration(est.seconds)} per step, at least (6·Φ·tokens = "
            f"{est.flops_per_rank / 1e12:,.1f} TFLOP per rank at {est.flops_per_s / 1e9:,.0f} GFLOP/s, the rate of "
            f"a float32 matmul measured here on one rank's threads); the first step line appears after it")
