"""`fsdp-lab demo`: train the course GPT on CPU ranks and watch FSDP match a single process.

Steps are numbered 1..N, as in `fsdp-lab train`: step s trains on the same global batch in both commands."""
from __future__ import annotations

import sys

from fsdp_lab.commands._argtypes import positive_int
from fsdp_lab.commands import _exit_codes as exit_codes
from fsdp_lab.commands._ranks import (add_low_memory_flag, add_oversubscribe_flag, low_memory_problem,
                                     oversubscribe_problem)

NAME = "demo"
HELP = "train the small GPT on 2 CPU ranks (gloo) beside a single-process reference"


def add_arguments(p):
    from fsdp_lab.training.models import PRESETS

    p.add_argument("--nproc-per-node", "--world-size", dest="nproc_per_node", type=positive_int, default=2,
                   help="number of CPU ranks, as in train and bench (--world-size: the old spelling) (default 2)")
    add_oversubscribe_flag(p)
    add_low_memory_flag(p)
    p.add_argument("--steps", type=positive_int, default=5, help="optimizer steps, numbered 1..N")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size")
    p.add_argument("--global-batch", type=positive_int, default=8,
                   help="sequences per step over all ranks; must divide by --nproc-per-node")
    p.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD"],
                   help="how parameters, gradients and optimizer state are split over the ranks")


def _kib(n: int) -> str:
    return f"{n / 1024:8.1f}"


def _memory_need(args):
    """The demo's ranks: the course GPT in fp32, one unit per Block, as fsdp_lab.training.demo wraps it."""
    from fsdp_lab.training.host_memory import HostMemoryNeed, gpt_model_need, process_baseline
    from fsdp_lab.training.models import PRESETS

    gpt, world = PRESETS[args.preset], args.nproc_per_node
    return HostMemoryNeed(world, process_baseline(), *gpt_model_need(gpt, args.strategy, world,
                                                                     args.global_batch // world, gpt.block_size))


def run(args) -> int:
    from fsdp_lab.training.demo import run_demo

    world = args.nproc_per_node
    if args.global_batch % world:
        print(f"fsdp-lab demo: error: --global-batch {args.global_batch} does not divide by --nproc-per-node "
              f"{world}; each rank needs equal rows", file=sys.stderr)
        return 2
    problem = oversubscribe_problem(world, args.allow_oversubscribe) or \
        low_memory_problem(_memory_need(args), args.allow_low_memory)
    if problem:
        print(f"fsdp-lab demo: error: {problem}", file=sys.stderr)
        return exit_codes.USAGE
    print(f"fsdp_lab {args.strategy} on {world} CPU ranks (gloo), GPT preset '{args.preset}', "
          f"global batch {args.global_batch}")
    print("live bytes per rank after each optimizer step, in KiB: P = params, G = grads, O = optimizer state")
    rank_cols = "".join(f" | rank{r}: P        G        O     " for r in range(world))
    print(f"step   loss (fsdp_lab)  loss (1 process)   diff{rank_cols}", flush=True)
    steps = run_demo(world, args.preset, args.steps, args.global_batch, args.strategy)
    worst = 0.0
    for s in steps:
        diff = s.loss - s.reference_loss
        worst = max(worst, abs(diff))
        cols = "".join(f" | {_kib(p)} {_kib(g)} {_kib(o)}" for p, g, o in s.per_rank)
        print(f"{s.step:4d}   {s.loss:15.6f}  {s.reference_loss:16.6f}  {diff:+.1e}{cols}")
    print(f"largest loss difference: {worst:.2e} ({'match' if worst < 1e-4 else 'MISMATCH'})")
    return 0 if worst < 1e-4 else 1
