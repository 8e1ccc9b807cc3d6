#!/usr/bin/env python3
"""Record the course's GPU lifecycle traces, so a learner without a GPU still sees real GPU memory.

    python scripts/record_gpu_traces.py                     # on a CUDA machine: writes fsdp_lab/data/gpu_traces/
    python scripts/record_gpu_traces.py --device cpu --smoke --out /tmp/t   # CPU smoke run (tests)

One run per world size, each in its own folder (nccl_1rank/, gloo_2ranks/, gloo_4ranks/) holding rank{r}.jsonl
(fsdp_lab.observe.trace format: every event with cuda_allocated/cuda_reserved) and provenance.json (GPU, torch, CUDA,
date, exact command, model, and a summary of what was measured). One rank runs on NCCL; two and four ranks share
the one GPU over gloo with CUDA tensors, since NCCL refuses two ranks on one device (DESIGN.md §7): every rank's
memory is real, its communication is slow. Needs no network. On an H200 the default set takes well under two
minutes.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "fsdp_lab" / "data" / "gpu_traces"
MAX_TOTAL_BYTES = 600_000  # the recorded traces ship with the package: keep them small


def gpu_config():
    """~59M parameters in 4 blocks of d=1024: large enough that the gathered unit, the sharded Adam state and the
    activations are visible in GiB-scale memory, small enough for 4 gloo ranks on one GPU in seconds a step."""
    from fsdp_lab.training.models import GPTConfig

    return GPTConfig(vocab_size=8192, block_size=512, n_layer=4, n_head=8, n_embd=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step, world sizes 1 and 2 (for tests)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--snapshot", type=Path, default=None, metavar="FILE",
                   help="also write a CUDA memory snapshot of the 1-rank run to FILE (a pickle for "
                        "pytorch.org/memory_viz; several MB, so keep it out of the shipped data folder)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for each launch")
    args = p.parse_args(argv)
    if args.out is None:
        if args.device != "cuda" or args.smoke:
            p.error(f"--device {args.device}{' --smoke' if args.smoke else ''} needs --out: only real GPU runs "
                    f"may write to {DEFAULT_OUT}")
        args.out = DEFAULT_OUT
    args.world_sizes = args.world_sizes or ([1, 2] if args.smoke else [1, 2, 4])
    args.steps = args.steps or (1 if args.smoke else 2)
    args.global_batch = args.global_batch or (4 if args.smoke else 8)
    args.seq_len = args.seq_len or (32 if args.smoke else 512)
    bad = [w for w in args.world_sizes if w < 1 or args.global_batch % w]
    if bad:
        p.error(f"world sizes {bad} must be >= 1 and divide --global-batch {args.global_batch}")
    return args


def environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": device, "gpu": None, "gpu_count": 0, "gpu_memory_bytes": None, "nccl": None}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   gpu_memory_bytes=props.total_memory)
        try:
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # a build without NCCL: the 1-rank run then fails with its own message
            pass
    return env


def summarize_run(results: list[dict]) -> dict:
    """What a reader of provenance.json wants at a glance; the full story is in the rank files."""
    from fsdp_lab.observe.traffic import comm_summary

    per_rank = []
    for r in results:
        comm = comm_summary(r["events"])
        mems = [e["mem"] for e in r["events"]]
        row = {"rank": r["rank"], "losses": [round(x, 5) for x in r["losses"]],
               "step_seconds": [round(t, 4) for t in r["step_times"]], "events": len(r["events"]),
               "bytes_sent_per_step": comm.per_step(r["rank"]),
               "peak_params_unsharded": max((m["params_unsharded"] for m in mems), default=0),
               "state_after_step": {k: v for k, v in mems[-1].items() if not k.startswith("cuda")} if mems else {}}
        if "cuda" in r:
            row["cuda_max_allocated"] = r["cuda"]["max_allocated"]
            row["cuda_max_reserved"] = r["cuda"]["max_reserved"]
            row["peak_cuda_allocated_at_events"] = max((m.get("cuda_allocated", 0) for m in mems), default=0)
        per_rank.append(row)
    return {"per_rank": per_rank, "params": sum(u["numel"] for u in results[0]["units"]),
            "units": [{k: u[k] for k in ("unit", "numel", "padded_numel", "full_bytes")} for u in results[0]["units"]]}


def record(args, world_size: int, env: dict, command: str) -> dict:
    from fsdp_lab.lessons.experiments.common import RunSpec, config_for, mixed_precision_for, train
    from fsdp_lab.training.launch import run_on_ranks
    from fsdp_lab.observe.trace import rank_file

    backend = "nccl" if (args.device == "cuda" and world_size == 1) else "gloo"
    name = f"{backend}_{world_size}rank{'s' if world_size > 1 else ''}"
    run_dir = args.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in range(8):  # tracer files are appended to: start clean
        rank_file(run_dir, r).unlink(missing_ok=True)
    (run_dir / "provenance.json").unlink(missing_ok=True)
    preset = "tiny" if args.smoke else gpu_config()
    snapshot = str(args.snapshot) if args.snapshot and args.device == "cuda" and world_size == 1 else None
    spec = RunSpec(strategy=args.strategy, preset=preset, mixed_precision=mixed_precision_for(args.dtype),
                   steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, trace=True,
                   trace_dir=str(run_dir), device=args.device, cuda_snapshot=snapshot)
    started = time.perf_counter()
    results = run_on_ranks(train, world_size, spec, timeout_s=args.timeout, backend=backend,
                           collective_timeout_s=min(args.timeout, 120.0))
    seconds = time.perf_counter() - started
    provenance = {
        "what": f"fsdp_lab lifecycle trace, {args.strategy}, {args.dtype}, {world_size} rank(s) on "
                f"{env['gpu'] or 'CPU'} over {backend}" + (" (smoke run: not GPU data)" if args.smoke else ""),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command, **env, "smoke": args.smoke, "backend": backend, "world_size": world_size,
        "strategy": args.strategy, "dtype": args.dtype, "steps": args.steps, "global_batch": args.global_batch,
        "seq_len": args.seq_len, "model": asdict(config_for(preset)), "launch_seconds": round(seconds, 2),
        "files": [rank_file(run_dir, r).name for r in range(world_size)], "snapshot": snapshot,
        "summary": summarize_run(results),
    }
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n", encoding="utf-8")
    return provenance


def print_summary(runs: list[dict]) -> None:
    gib = 2**30
    print(f"{'run':<14}{'step s':>9}{'sent/step MB':>14}{'peak unsharded MB':>19}{'CUDA max alloc GiB':>20}")
    for p in runs:
        for row in p["summary"]["per_rank"]:
            last = list(row["bytes_sent_per_step"].values())[-1] if row["bytes_sent_per_step"] else 0
            cuda = f"{row['cuda_max_allocated'] / gib:.3f}" if "cuda_max_allocated" in row else "-"
            print(f"{p['backend']}x{p['world_size']} r{row['rank']:<5}{row['step_seconds'][-1]:>9.3f}"
                  f"{last / 1e6:>14.2f}{row['peak_params_unsharded'] / 1e6:>19.2f}{cuda:>20}")


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["record_gpu_traces.py", *argv])
    if args.device == "cuda":
        from fsdp_lab.observe.cuda_memory import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason:
            print(f"error: --device cuda but {reason}; use --device cpu --smoke --out DIR for a CPU smoke run",
                  file=sys.stderr)
            return 2
    env = environment(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = [record(args, w, env, command) for w in args.world_sizes]
    index = {"runs": [{"folder": f"{p['backend']}_{p['world_size']}rank{'s' if p['world_size'] > 1 else ''}",
                       "world_size": p["world_size"], "backend": p["backend"], "what": p["what"]} for p in runs],
             "date_utc": runs[0]["date_utc"], "command": command, **env}
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    print_summary(runs)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {len(runs)} runs to {args.out} ({total / 1e3:.0f} kB) in {time.perf_counter() - started:.1f} s")
    if total > MAX_TOTAL_BYTES:
        print(f"warning: {total} bytes is over the {MAX_TOTAL_BYTES} bytes meant to ship with the package; "
              f"record fewer steps or world sizes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
