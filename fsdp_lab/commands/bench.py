"""`fsdp-lab bench`: fsdp_lab against torch FSDP2 and plain single-device training on the same GPT.

    fsdp-lab bench --device cpu --nproc-per-node 2 --preset tiny       # CI: gloo, about half a minute
    fsdp-lab bench --device cuda --preset 369m                         # one GPU, NCCL, world size 1
    fsdp-lab bench --device cuda --preset 369m --backend gloo --nproc-per-node 2    # memory only (gloo)

A table first, then one JSON object on the last line (what fsdp_lab.bench.run.summarize returns; the ratios are
fsdp_lab's figure over the other setup's). Exit codes: 0 ok, 2 bad options or no such device, 1 a rank failed.
"""
from __future__ import annotations

import json
import sys

NAME = "bench"
HELP = "Time fsdp_lab against torch FSDP2 and plain training (step time, tokens/s, TFLOP/s, peak memory)."


def add_arguments(p) -> None:
    from fsdp_lab.bench.setups import MODES, OPTIMIZERS
    from fsdp_lab.training.models import PRESETS

    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks to spawn (default: 2 on CPU, 1 on CUDA)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl on CUDA with one rank per GPU, gloo otherwise")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's block)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per setup before the rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--memory-steps", type=int, default=3, help="CUDA: steps of each setup alone for its peak")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="AdamW implementation for all setups (default: fused on CUDA, foreach on CPU)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--memory-only", action="store_true",
                   help="measure memory only (always so for CUDA over gloo: several ranks sharing one GPU)")
    p.add_argument("--trace", default=None, metavar="PATH.json.gz",
                   help="also write a profiler trace of one fsdp_lab step (Chrome trace, gzipped)")
    p.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before all ranks are killed")


def run(args) -> int:
    from fsdp_lab.bench.report import format_table
    from fsdp_lab.bench.run import BenchConfig, run_bench
    from fsdp_lab.training.launch import RankFailed

    nproc = args.nproc_per_node or (2 if args.device == "cpu" else 1)
    try:
        cfg = BenchConfig(preset=args.preset, device=args.device, nproc=nproc, backend=args.backend,
                          batch=args.batch, seq_len=args.seq_len, warmup=args.warmup, rounds=args.rounds,
                          steps_per_round=args.steps_per_round, memory_steps=args.memory_steps,
                          optimizer=args.optimizer, modes=tuple(m.strip() for m in args.modes.split(",") if m),
                          memory_only=args.memory_only, trace=args.trace, timeout_s=args.timeout)
        result = run_bench(cfg)
    except (RankFailed, TimeoutError) as exc:  # a rank raised, died or hung
        print(f"fsdp-lab bench: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:  # bad options, or no such device here
        print(f"fsdp-lab bench: {exc}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    print(format_table(result))
    print(line, flush=True)
    return 0
