"""`fsdp-lab bench`: fsdp_lab against torch FSDP2 and plain single-device training on the same GPT.

    fsdp-lab bench --device cpu --nproc-per-node 2 --preset tiny       # CI: gloo, about half a minute
    fsdp-lab bench --device cuda --preset 369m                         # one GPU, NCCL, world size 1
    fsdp-lab bench --device cuda --preset 369m --backend gloo --nproc-per-node 2    # memory only (gloo)

A table first, then one JSON object on the last line (what fsdp_lab.bench.run.summarize returns; the ratios are
fsdp_lab's figure over the other setup's). Exit codes: 0 ok, 2 bad options or no such device, 1 a rank failed
or --trace / --json-out could not be written, 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import json
import re
import sys

from fsdp_lab.commands._argtypes import number, path_text, positive_float, positive_int
from fsdp_lab.commands._paths import first_problem, output_file_problem, replaced_file_problem
from fsdp_lab.commands import _exit_codes as exit_codes
from fsdp_lab.commands._ranks import (add_low_memory_flag, add_oversubscribe_flag, low_memory_problem,
                                     oversubscribe_problem)

NAME = "bench"
HELP = "Time fsdp_lab against torch FSDP2 and plain training (step time, tokens/s, TFLOP/s, peak memory)."


def add_arguments(p) -> None:
    from fsdp_lab.bench.setups import MODES, OPTIMIZERS
    from fsdp_lab.training.models import PRESETS

    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks compute")
    p.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="ranks to spawn (default: 2 on CPU, 1 on CUDA)")
    add_oversubscribe_flag(p)
    add_low_memory_flag(p)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl on CUDA with one rank per GPU, gloo otherwise")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per rank and step (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default: the preset's block)")
    p.add_argument("--warmup", type=number(int, 2, "an integer >= 2 (optimizer state exists from the second step)"),
                   default=5, help="untimed steps per setup before the rounds")
    p.add_argument("--rounds", type=positive_int, default=15, help="timed rounds, each setup once per round")
    p.add_argument("--steps-per-round", type=positive_int, default=4, help="timed steps of a setup per round")
    p.add_argument("--memory-steps", type=positive_int, default=3,
                   help="CUDA: steps of each setup alone for its peak")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="AdamW implementation for all setups (default: fused on CUDA, foreach on CPU)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--memory-only", action="store_true",
                   help="measure memory only (always so for CUDA over gloo: several ranks sharing one GPU)")
    p.add_argument("--trace", type=path_text, default=None, metavar="PATH.json.gz",
                   help="also write a profiler trace of one fsdp_lab step (Chrome trace, gzipped)")
    p.add_argument("--json-out", type=path_text, default=None, metavar="PATH",
                   help="also write the JSON result to PATH")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds before all ranks are killed")


def _flag_names(message: str) -> str:
    """BenchConfig speaks in its field names ("bench: seq_len=999 is not valid"); say the flag instead."""
    message = re.sub(r"^bench: ", "", message)
    return re.sub(r"\b(nproc|batch|seq_len|warmup|rounds|steps_per_round|memory_steps|modes|preset|backend|"
                  r"optimizer|device)=", lambda m: "--" + ("nproc-per-node" if m.group(1) == "nproc"
                                                           else m.group(1).replace("_", "-")) + " ", message)


def run(args) -> int:
    from fsdp_lab.bench.report import format_table
    from fsdp_lab.bench.run import BenchConfig, run_bench
    from fsdp_lab.training.launch import RankFailed
    from fsdp_lab.user_files import replace_text

    nproc = args.nproc_per_node or (2 if args.device == "cpu" else 1)
    problem = first_problem(output_file_problem("--trace", args.trace),
                            replaced_file_problem("--json-out", args.json_out),
                            oversubscribe_problem(nproc, args.allow_oversubscribe))
    if problem:
        print(f"fsdp-lab bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = BenchConfig(preset=args.preset, device=args.device, nproc=nproc, backend=args.backend,
                          batch=args.batch, seq_len=args.seq_len, warmup=args.warmup, rounds=args.rounds,
                          steps_per_round=args.steps_per_round, memory_steps=args.memory_steps,
                          optimizer=args.optimizer, modes=tuple(m.strip() for m in args.modes.split(",") if m),
                          memory_only=args.memory_only, trace=args.trace, timeout_s=args.timeout)
        if cfg.device == "cpu":  # [Note: no more memory than is free] in fsdp_lab/commands/_ranks.py
            from fsdp_lab.training.host_memory import bench_need, process_baseline

            problem = low_memory_problem(bench_need(cfg, process_baseline()), args.allow_low_memory)
            if problem:
                print(f"fsdp-lab bench: error: {problem}", file=sys.stderr)
                return exit_codes.USAGE
        result = run_bench(cfg)
    except (RankFailed, TimeoutError) as exc:  # a rank raised, died or hung
        print(f"fsdp-lab bench: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:  # bad options, or no such device here
        print(f"fsdp-lab bench: error: {_flag_names(str(exc))}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    print(format_table(result))
    print(line, flush=True)
    failed = []
    if args.json_out:
        try:
            replace_text(args.json_out, line + "\n")
        except OSError as exc:
            failed.append(f"--json-out {args.json_out}: {exc.strerror or exc}")
    trace = result.get("trace")
    if args.trace and (not isinstance(trace, dict) or "error" in trace):
        why = trace.get("error") if isinstance(trace, dict) else "no fsdp_lab setup ran to trace"
        failed.append(f"--trace {args.trace} was not written: {why}")
    for problem in failed:
        print(f"fsdp-lab bench: error: {problem}", file=sys.stderr)
    return 1 if failed else 0
