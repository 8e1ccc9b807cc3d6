"""`fsdp-lab check`: what this machine can run live, and where a chapter can only show its saved outputs.

A course that silently falls back to recorded data confuses learners ("why is my chart identical to the
instructor's?"), so the fallback is decided here, once, from facts: the GPUs torch sees, and an actual 2-rank
gloo run on 127.0.0.1. Import-time code touches nothing; every probe runs only when asked.

Every line says what was actually checked. With --no-gloo the multi-rank chapters are "unchecked", not
replayed: nothing was tried, so nothing failed. Exit codes: 0 every probe that ran passed, 1 the gloo probe
failed (the course will replay), 2 bad flags, 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue as queue_module
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Optional

from fsdp_lab.commands._argtypes import positive_float
from fsdp_lab.lessons.widgets.sources import list_gpu_traces

NAME = "check"
HELP = "Report GPUs, CUDA/NCCL/torch versions and whether 2-rank gloo works; say which chapters run live here."

# (chapter, title, has live multi-rank runs, shows GPU memory). Mirrors the notebooks' order (DESIGN §5).
CHAPTERS = (  # (number, title, launches multi-rank runs, shows GPU memory (replays shipped GPU traces off-GPU))
    ("00", "Welcome and setup", True, False),
    ("01", "Core idea", True, False),
    ("02", "Sharding", True, False),
    ("03", "Forward and backward lifecycle", True, True),
    ("04", "Mixed precision", True, False),
    ("05", "ZeRO comparison", True, False),
    ("06", "Engineering practice", True, True),
    ("06a", "FSDP2: fully_shard", True, False),
    ("06b", "Beyond one node: meta init, HSDP, offload, resharding", True, False),
    ("06c", "Composing: tensor parallel, checkpointing, compile", True, False),
    ("07", "When to use it: GPU planner", False, False),
    ("08", "Python demo", True, False),
    ("09", "Misconceptions", True, False),
    ("09a", "The bug zoo", True, False),
    ("10", "Interview quiz", False, False),
)


@dataclass(frozen=True)
class Chapter:
    chapter: str
    title: str
    status: str     # "live": all of it runs here; "mixed": runs here, GPU memory replayed; "replay";
                    # "unchecked": depends on the gloo probe, which was skipped (--no-gloo)
    how: str        # one line: what runs, where, or what is replayed and why


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; there is a small race until someone binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, results, pg_timeout_s: float) -> None:
    """One rank of the probe: join a gloo group on 127.0.0.1, all_reduce (rank+1), check the sum."""
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        tensor = torch.full((4,), float(rank + 1))
        dist.all_reduce(tensor)
        expected = world_size * (world_size + 1) / 2
        ok = bool(torch.all(tensor == expected))
        results.put((rank, ok, None if ok else f"rank {rank}: all_reduce gave {tensor.tolist()}, "
                                               f"expected {expected}"))
    except Exception as err:  # reported to the parent, which prints it
        results.put((rank, False, f"rank {rank}: {type(err).__name__}: {err}"))
    except KeyboardInterrupt:  # the parent reports the interruption; a rank has nothing to add
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def probe_gloo(world_size: int = 2, timeout_s: float = 60.0, pg_timeout_s: float = 30.0):
    """Spawn `world_size` processes that form a gloo group on 127.0.0.1 and all_reduce once.

    Returns (ok, seconds, error). `timeout_s` bounds the whole probe, spawn and imports included; on expiry
    the children are killed, so a hung rendezvous never outlives the call."""
    import torch.multiprocessing as mp

    if world_size < 1 or timeout_s <= 0:
        raise ValueError(f"need world_size >= 1 and timeout_s > 0, got world_size={world_size}, "
                         f"timeout_s={timeout_s}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    start = time.monotonic()
    procs = [ctx.Process(target=_gloo_worker, args=(rank, world_size, port, results, pg_timeout_s), daemon=True)
             for rank in range(world_size)]
    reports: dict[int, tuple] = {}
    error = None
    from fsdp_lab.training.launch import children_ignore_sigint

    try:
        with children_ignore_sigint():  # Ctrl-C reaches this process only; it stops the children below
            for proc in procs:
                proc.start()
        while len(reports) < world_size:
            remaining = start + timeout_s - time.monotonic()
            if remaining <= 0:
                error = f"timed out after {timeout_s:g} s with {len(reports)} of {world_size} ranks reporting"
                break
            try:
                rank, ok, err = results.get(timeout=min(remaining, 0.5))
                reports[rank] = (ok, err)
                if not ok:  # the other ranks would only wait out the rendezvous timeout
                    break
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    error = f"a rank exited with code {dead[0]} before reporting"
                    break
    finally:
        for proc in procs:
            if proc.pid is None:  # never started (start() of an earlier rank raised)
                continue
            proc.join(timeout=max(0.0, min(5.0, start + timeout_s - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    seconds = time.monotonic() - start
    failures = [err for ok, err in reports.values() if not ok]
    error = error or (failures[0] if failures else None)
    return error is None, seconds, error


def _gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory)})
    return out


def _nccl_version():
    try:
        import torch.cuda.nccl as nccl

        version = nccl.version()
    except Exception:  # CPU builds have no NCCL; torch raises different errors across versions
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def chapter_plan(gpu_count: int, gloo_ok: Optional[bool], gpu_traces_ship: bool = False) -> tuple[Chapter, ...]:
    """Which chapters run live here, and which can only show recorded data: their saved outputs, or GPU traces
    where the package ships them. Pure, so every machine kind is testable. gloo_ok None: the gloo probe did not
    run, so chapters that depend on it are "unchecked"."""
    if gloo_ok is None:
        return _unchecked_plan(gpu_count)
    # One GPU hosts several ranks only over gloo (NCCL refuses two ranks on one device, DESIGN §7).
    gpu_live = gpu_count >= 2 or (gpu_count == 1 and gloo_ok)
    if gpu_count >= 2:
        gpu_runs = f"GPU memory measured live on {gpu_count} GPUs (NCCL)"
    else:
        why = "ranks sharing the one GPU need gloo, which failed" if gpu_count == 1 else "no CUDA device here"
        recorded = ("GPU memory replays the shipped GPU traces" if gpu_traces_ship else
                    "GPU memory not shown: no GPU traces ship yet, the chart shows CPU memory")
        gpu_runs = ("GPU memory measured live on 1 GPU (ranks share it over gloo with CUDA tensors)"
                    if gpu_count == 1 and gloo_ok else f"{recorded} ({why})")
    chapters = []
    for number, title, multi_rank, gpu_memory in CHAPTERS:
        parts, live, replayed = [], 0, 0
        if multi_rank:
            parts.append("2-rank runs live on CPU/gloo" if gloo_ok else
                         "multi-rank runs cannot start (2-rank gloo failed here): only the saved outputs show")
            live, replayed = live + gloo_ok, replayed + (not gloo_ok)
        if gpu_memory:
            parts.append(gpu_runs)
            live, replayed = live + gpu_live, replayed + (not gpu_live)
        status = "replay" if replayed and not live else ("mixed" if replayed else "live")
        chapters.append(Chapter(number, title, status, "; ".join(parts) or "runs here (single process)"))
    return tuple(chapters)


def _unchecked_plan(gpu_count: int) -> tuple[Chapter, ...]:
    gpu_live = gpu_count >= 2
    chapters = []
    for number, title, multi_rank, gpu_memory in CHAPTERS:
        if not multi_rank and not gpu_memory:
            chapters.append(Chapter(number, title, "live", "runs here (single process)"))
            continue
        how = "multi-rank runs need 2-rank gloo, not checked (--no-gloo)"
        if gpu_memory and gpu_live:
            how += f"; GPU memory measured live on {gpu_count} GPUs (NCCL)"
        chapters.append(Chapter(number, title, "unchecked", how))
    return tuple(chapters)


def collect(run_gloo: bool = True, timeout_s: float = 60.0) -> dict:
    """Everything `check` reports, as one JSON-ready dict."""
    import torch

    gpus = _gpus()
    if run_gloo:
        ok, seconds, error = probe_gloo(2, timeout_s)
    else:
        ok, seconds, error = None, 0.0, None
    chapters = chapter_plan(len(gpus), ok, gpu_traces_ship=bool(list_gpu_traces()))
    verdict = {status: [c.chapter for c in chapters if c.status == status]
               for status in ("live", "mixed", "replay", "unchecked")}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "cpu_cores": os.cpu_count(),
        "gpus": gpus,
        "free_port": free_port(),
        "gloo": {"ok": ok, "seconds": round(seconds, 2), "error": error},
        "chapters": [asdict(c) for c in chapters],
        "verdict": verdict,
    }


def render(info: dict) -> str:
    gpus = info["gpus"]
    gpu_lines = [f"  GPU {g['index']}: {g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB" for g in gpus]
    gloo = info["gloo"]
    if gloo["ok"] is None:
        gloo_line = "not checked (--no-gloo); run `fsdp-lab check` without it to try"
    elif gloo["ok"]:
        gloo_line = (f"works: 2 processes spawned, joined a gloo group and all_reduced once in "
                     f"{gloo['seconds']:.1f} s")
    else:
        gloo_line = f"FAILED: {gloo['error']}"
    lines = [
        f"Python {info['python']}, torch {info['torch']}, CUDA {info['cuda'] or 'none (CPU build)'}, "
        f"NCCL {info['nccl'] or 'none'} (versions as torch reports them)",
        f"CPU cores (os.cpu_count): {info['cpu_cores']}",
        f"GPUs torch can use (torch.cuda): {len(gpus) or 'none'}", *gpu_lines,
        f"TCP port on 127.0.0.1 bound and released: {info['free_port']}",
        f"2-rank gloo on 127.0.0.1: {gloo_line}",
        "",
        "Chapters:",
        *(f"  {c['chapter']} {c['title']:<31} {c['status']:<6} {c['how']}" for c in info["chapters"]),
        "",
        "Verdict:",
    ]
    verdict, on_gpu = info["verdict"], " (GPU memory measured on this machine's GPU)" if gpus else ""
    for status, label in (("live", f"run live here{on_gpu}"),
                          ("mixed", "run live here, but not their GPU memory charts"),
                          ("replay", "show saved outputs only"),
                          ("unchecked", "not checked (need the gloo probe; run without --no-gloo)")):
        if status == "unchecked" and not verdict[status]:
            continue
        lines.append(f"  {label}: {', '.join(verdict[status]) or 'none'}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--no-gloo", action="store_true", help="skip the 2-rank gloo probe (it takes seconds)")
    parser.add_argument("--timeout", type=positive_float, default=60.0,
                        help="wall-clock limit for the gloo probe in seconds (default 60)")


def run(args: argparse.Namespace) -> int:
    info = collect(run_gloo=not args.no_gloo, timeout_s=args.timeout)
    print(json.dumps(info) if args.json else render(info))
    if info["gloo"]["ok"] is False:
        print(f"fsdp-lab check: the 2-rank gloo probe failed: {info['gloo']['error']}", file=sys.stderr)
        return 1
    return 0
