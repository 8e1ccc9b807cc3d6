"""`fsdp-lab demo`: train the course GPT on CPU ranks and watch FSDP match a single process."""
from __future__ import annotations

NAME = "demo"
HELP = "train the small GPT on 2 CPU ranks (gloo) beside a single-process reference"


def add_arguments(p):
    p.add_argument("--world-size", type=int, default=2, help="number of CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--preset", default="tiny", help="model preset from fsdp_lab.training.models.PRESETS")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--strategy", default="FULL_SHARD",
                   choices=["FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD"])


def _kib(n: int) -> str:
    return f"{n / 1024:8.1f}"


def run(args) -> int:
    from fsdp_lab.training.demo import run_demo
    from fsdp_lab.training.models import PRESETS

    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}")
        return 2
    if args.world_size < 1 or args.steps < 1 or args.global_batch % args.world_size:
        print(f"error: need world size >= 1, steps >= 1 and a global batch ({args.global_batch}) that divides "
              f"by the world size ({args.world_size})")
        return 2
    print(f"fsdp_lab {args.strategy} on {args.world_size} CPU ranks (gloo), GPT preset '{args.preset}', "
          f"global batch {args.global_batch}")
    print("live bytes per rank after each optimizer step, in KiB: P = params, G = grads, O = optimizer state")
    rank_cols = "".join(f" | rank{r}: P        G        O     " for r in range(args.world_size))
    print(f"step   loss (fsdp_lab)  loss (1 process)   diff{rank_cols}")
    steps = run_demo(args.world_size, args.preset, args.steps, args.global_batch, args.strategy)
    worst = 0.0
    for s in steps:
        diff = s.loss - s.reference_loss
        worst = max(worst, abs(diff))
        cols = "".join(f" | {_kib(p)} {_kib(g)} {_kib(o)}" for p, g, o in s.per_rank)
        print(f"{s.step:4d}   {s.loss:15.6f}  {s.reference_loss:16.6f}  {diff:+.1e}{cols}")
    print(f"largest loss difference: {worst:.2e} ({'match' if worst < 1e-4 else 'MISMATCH'})")
    return 0 if worst < 1e-4 else 1
