"""`fsdp-lab bench`: fsdp_lab against torch FSDP2 and plain single-device training, on the same GPT and batches.

One run builds the setups of fsdp_lab.bench.setups on every rank and times them round-robin after a warm-up:
each round runs a few steps of each setup, the order rotating from round to round, so clock or thermal drift and
the load of a shared machine hit all setups alike. Reported per setup: the median step time (the slowest rank's),
tokens/s, TFLOP/s and peak memory; the last line of the command's output is one JSON object (see `summarize`).

[Note: step-time ratios] A ratio compares two setups *within each round*: per round, each setup's median step
(the slowest rank's), then ours / theirs; the reported ratio is the median of those per-round ratios. The
setups of one round run seconds apart, so a change of load between rounds (other jobs on a 2-core machine)
cancels out, where a ratio of two overall medians would carry it. The bars of issue 18 (fsdp_lab.bench.report.
BARS) are checked on these ratios and printed with them.

[Note: what is measured]
- Step: forward + backward + AdamW step + zero_grad(set_to_none). CUDA: time between CUDA events recorded after
  each step, with no host sync inside the timed steps. CPU: time.perf_counter around each step.
- FLOPs per step and rank = tokens · (6·Φ + 12·L·d·T): Φ the parameter count (tied weight once), L layers, d the
  width, T the sequence length (the attention term counts QKᵀ and AV forward and backward, no causal discount).
  TFLOP/s is per rank.
- Memory, CUDA: torch.cuda.max_memory_allocated() over `memory_steps` steps of one setup built alone (the other
  two not allocated), peak stats reset right after building it; max over ranks.
- Memory, CPU: the bytes of parameters, gradients and optimizer state a rank holds right after backward (before
  optimizer.step): fsdp_lab's memory_report, and the same count over local tensors (DTensor.to_local()) for FSDP2
  and plain. Activations are not included on CPU. Max over ranks.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_lab.bench.report import environment, summarize
from fsdp_lab.bench.setups import MODES, OPTIMIZERS, build_runner
from fsdp_lab.training.models import PRESETS, batch_for_step, rank_slice


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "tiny"
    device: str = "cpu"
    nproc: int = 1
    backend: str = "auto"  # auto: nccl on CUDA with one rank per GPU, gloo otherwise
    batch: int = 8  # sequences per rank
    seq_len: Optional[int] = None  # default: the preset's block size
    warmup: int = 5
    rounds: int = 15
    steps_per_round: int = 4
    memory_steps: int = 3
    optimizer: Optional[str] = None  # default: fused on CUDA, foreach on CPU (the same for all setups)
    lr: float = 3e-4
    modes: tuple = MODES
    memory_only: bool = False  # always on for CUDA over gloo (several ranks sharing one GPU)
    trace: Optional[str] = None  # write a profiler trace of one fsdp_lab step here (rank 0)
    timeout_s: float = 900.0

    def __post_init__(self):
        def bad(field, value, expected):
            raise ValueError(f"bench: {field}={value!r} is not valid; expected {expected}")

        if self.preset not in PRESETS:
            bad("preset", self.preset, f"one of {sorted(PRESETS)}")
        if self.device not in ("cpu", "cuda"):
            bad("device", self.device, "'cpu' or 'cuda'")
        if self.backend not in ("auto", "gloo", "nccl"):
            bad("backend", self.backend, "'auto', 'gloo' or 'nccl'")
        if self.backend == "nccl" and self.device != "cuda":
            bad("backend", self.backend, "gloo on CPU (nccl needs --device cuda)")
        for field in ("nproc", "batch", "rounds", "steps_per_round", "memory_steps"):
            if getattr(self, field) < 1:
                bad(field, getattr(self, field), "a positive integer")
        if self.warmup < 2:
            bad("warmup", self.warmup, "at least 2 (optimizer state exists from the second step)")
        cfg = PRESETS[self.preset]
        if self.seq_len is not None and not 1 <= self.seq_len <= cfg.block_size:
            bad("seq_len", self.seq_len, f"1..{cfg.block_size} (the preset's block size)")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            bad("optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            bad("modes", self.modes, f"a non-empty subset of {MODES}")
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))
        if self.device == "cuda" and self.resolved_backend == "gloo":
            # gloo moves CUDA tensors through host memory: its ranks' memory is real, their step times are not
            object.__setattr__(self, "memory_only", True)

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" and self.nproc <= max(1, _gpu_count()) else "gloo"

    @property
    def resolved_optimizer(self) -> str:
        return self.optimizer or ("fused" if self.device == "cuda" else "foreach")

    @property
    def resolved_seq_len(self) -> int:
        return self.seq_len or PRESETS[self.preset].block_size


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(cfg: BenchConfig, rank: int) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    index = rank % _gpu_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _batches(cfg: BenchConfig, rank: int, world_size: int, device: torch.device, n: int = 4) -> list:
    model_cfg, T = PRESETS[cfg.preset], cfg.resolved_seq_len
    out = []
    for step in range(n):
        x, y = batch_for_step(model_cfg, step, cfg.batch * world_size, T)
        out.append((rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)))
    return out


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _memory_phase(cfg, mode, batches, device) -> dict:
    """CUDA: build one setup alone, reset the peak, run the memory steps; report peak and state bytes."""
    runner = build_runner(mode, PRESETS[cfg.preset], device, cfg.resolved_optimizer, cfg.lr)
    probe, steps = {}, max(cfg.memory_steps, 2)  # optimizer state exists from the first step on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps):
        probe_now = (lambda r: probe.update(r.state_bytes())) if i == steps - 1 else None
        runner.step(*batches[i % len(batches)], after_backward=probe_now)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    _release(device)
    return {"peak_memory_bytes": peak, "state_bytes": probe}


def _timed_steps(runner, batches, start: int, n: int, device) -> tuple[list, torch.Tensor]:
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for i in range(n):
            loss = runner.step(*batches[(start + i) % len(batches)])
            events[i + 1].record()
        torch.cuda.synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)], loss
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        loss = runner.step(*batches[(start + i) % len(batches)])
        times.append(time.perf_counter() - t0)
    return times, loss


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    """What one rank measures (runs under fsdp_lab.training.launch.run_on_ranks)."""
    device = _device(cfg, rank)
    batches = _batches(cfg, rank, world_size, device)
    result = {mode: {} for mode in cfg.modes}
    say = _progress(rank)

    def guarded(mode, fn):
        """At world size 1 a setup that fails is reported and the others still run; with several ranks a
        failure inside a collective would leave the other ranks waiting, so it is raised."""
        try:
            return fn()
        except Exception as exc:
            if world_size > 1:
                raise
            result[mode]["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        say(f"{mode} failed: {result[mode]['error']}")
        _release(device)  # after the except block: the traceback no longer holds the failed setup's tensors
        return None

    if device.type == "cuda":
        for mode in cfg.modes:
            say(f"memory phase: {mode}")
            result[mode].update(guarded(mode, lambda m=mode: _memory_phase(cfg, m, batches, device)) or {})
            dist.barrier()
    if cfg.memory_only and device.type == "cuda":
        return result
    runners = {}
    for mode in cfg.modes:
        if "error" in result[mode]:
            continue
        say(f"build and warm up: {mode}")
        runner = guarded(mode, lambda m=mode: _warm(cfg, m, batches, device, result[m]))
        if runner is not None:
            runners[mode] = runner
    alive = tuple(runners)
    if not cfg.memory_only and alive:
        say(f"timing {cfg.rounds} rounds x {cfg.steps_per_round} steps of {', '.join(alive)}")
        for r in range(cfg.rounds):
            order = alive[r % len(alive):] + alive[:r % len(alive)]
            for mode in order:
                dist.barrier()
                times, loss = _timed_steps(runners[mode], batches, cfg.warmup + r * cfg.steps_per_round,
                                           cfg.steps_per_round, device)
                result[mode].setdefault("step_times_s", []).extend(times)
                result[mode].setdefault("round_medians_s", []).append(statistics.median(times))
                result[mode]["final_loss"] = float(loss)
    if cfg.trace and "fsdp_lab" in runners:
        from fsdp_lab.bench.profile import record_step_trace

        say(f"profiling one fsdp_lab step into {cfg.trace}")
        dist.barrier()
        try:
            result["trace"] = record_step_trace(runners["fsdp_lab"], batches[0], cfg.trace, write=rank == 0)
        except Exception as exc:  # the numbers above stay useful if only the trace fails
            result["trace"] = {"error": f"{type(exc).__name__}: {exc}"}
    del runners
    _release(device)
    say("done")
    return result


def _warm(cfg, mode, batches, device, row: dict):
    """Build a setup and run its warm-up steps; on CPU the last one also records the state bytes."""
    runner = build_runner(mode, PRESETS[cfg.preset], device, cfg.resolved_optimizer, cfg.lr)
    for i in range(cfg.warmup):
        probe = (lambda r: row.update(state_bytes=r.state_bytes())) \
            if i == cfg.warmup - 1 and device.type == "cpu" else None
        runner.step(*batches[i % len(batches)], after_backward=probe)
    if device.type == "cpu":
        row["peak_memory_bytes"] = row["state_bytes"]["total"]
    return runner


def _progress(rank: int):
    start = time.perf_counter()

    def say(message: str) -> None:
        if rank == 0:
            print(f"[bench {time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)
    return say


def run_bench(cfg: BenchConfig) -> dict:
    from fsdp_lab.training.launch import run_on_ranks

    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("bench --device cuda: torch.cuda.is_available() is False on this machine")
        if cfg.resolved_backend == "nccl" and cfg.nproc > _gpu_count():
            raise ValueError(f"bench: {cfg.nproc} ranks on {_gpu_count()} GPU(s) with nccl: NCCL refuses two ranks "
                             f"on one GPU. Use --backend gloo (memory only) or --nproc-per-node {_gpu_count()}")
    start = time.perf_counter()
    per_rank = run_on_ranks(bench_rank, cfg.nproc, cfg, timeout_s=cfg.timeout_s, backend=cfg.resolved_backend,
                            collective_timeout_s=max(60.0, cfg.timeout_s / 2))
    return summarize(cfg, per_rank, time.perf_counter() - start, environment(cfg.device))
