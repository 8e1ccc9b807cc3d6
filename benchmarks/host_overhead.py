#!/usr/bin/env python3
"""Host overhead of fsdp_lab over plain training, this checkout against an earlier commit, in interleaved rounds.

    PYTHONPATH=. python3 benchmarks/host_overhead.py --baseline 469fa4b --rounds 40 --steps 10
    PYTHONPATH=. python3 benchmarks/host_overhead.py --setup fsdp_lab_fully_shard --baseline HEAD

`--setup` picks the front end (a bench setup of fsdp_lab/bench/setups.py: fsdp_lab, fsdp_lab_fully_shard, or
fsdp2 for torch's); the baseline must have it too.

World size 1 on CPU (gloo), 24 GPT blocks of width 16: compute is negligible, so a step's time is host time
(Python, hooks, dispatch). Two worker processes stay up for the whole run, one importing the baseline's fsdp_lab
(`git archive BASELINE fsdp_lab` into a temp dir) and one this checkout's. Each round runs `--steps` steps of
every (version, setup) pair, the order rotating every round, so machine load hits all four alike. Per round and
pair the median step time is taken; fsdp_lab's overhead is its median minus plain training's in the same worker.
Reported: the median over rounds of each version's overhead, and of the per-round ratio new/baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
def worker(setup: str) -> None:
    """Build both setups, then run `N` steps of the setup named on each stdin line; print the step times."""
    import torch
    import torch.distributed as dist

    from fsdp_lab.bench.setups import build_runner
    from fsdp_lab.training.launch import free_port
    from fsdp_lab.training.models import GPTConfig, batch_for_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=24, n_head=2, n_embd=16)
    device = torch.device("cpu")
    runners = {mode: build_runner(mode, cfg, device, "foreach", 1e-3) for mode in (setup, "plain")}
    x, y = batch_for_step(cfg, 0, 2, 32)
    for runner in runners.values():
        for _ in range(3):
            runner.step(x, y)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        mode, n = line.split()
        times = []
        for _ in range(int(n)):
            start = time.perf_counter()
            runners[mode].step(x, y)
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def start(pythonpath: str, setup: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": pythonpath, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--setup", setup], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
    if json.loads(proc.stdout.readline()).get("ready") is not True:
        raise RuntimeError(f"worker with PYTHONPATH={pythonpath} did not start")
    return proc


def ask(proc: subprocess.Popen, mode: str, steps: int) -> float:
    proc.stdin.write(f"{mode} {steps}\n")
    proc.stdin.flush()
    return statistics.median(json.loads(proc.stdout.readline()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="469fa4b", help="git revision to compare against (default 469fa4b)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=10, help="steps per (version, setup) per round")
    p.add_argument("--setup", default="fsdp_lab", help="the setup timed against plain (default fsdp_lab)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.setup)
        return 0
    with tempfile.TemporaryDirectory() as base_dir:
        archive = subprocess.run(["git", "archive", args.baseline, "fsdp_lab"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base_dir], input=archive, check=True)
        workers = {"baseline": start(base_dir, args.setup), "new": start(str(REPO), args.setup)}
        pairs = [(v, m) for v in workers for m in (args.setup, "plain")]
        medians = {pair: [] for pair in pairs}
        try:
            for r in range(args.rounds):
                order = pairs[r % len(pairs):] + pairs[:r % len(pairs)]
                for version, mode in order:
                    medians[(version, mode)].append(ask(workers[version], mode, args.steps))
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait(timeout=30)
    over = {v: [f - p for f, p in zip(medians[(v, args.setup)], medians[(v, "plain")])] for v in workers}
    vs_plain = [f / p for f, p in zip(medians[("new", args.setup)], medians[("new", "plain")])]
    ratios = [n / b for n, b in zip(over["new"], over["baseline"]) if b > 0]
    ms = {f"{v}_{m}_ms": round(1e3 * statistics.median(t), 3) for (v, m), t in medians.items()}
    result = {"setup": args.setup, "baseline": args.baseline, "rounds": args.rounds, "steps_per_round": args.steps,
              **ms,
              "overhead_baseline_ms": round(1e3 * statistics.median(over["baseline"]), 3),
              "overhead_new_ms": round(1e3 * statistics.median(over["new"]), 3),
              "ratio_of_median_overheads": round(statistics.median(over["new"])
                                                 / statistics.median(over["baseline"]), 3),
              "median_per_round_ratio": round(statistics.median(ratios), 3),
              "new_step_time_ratio_vs_plain": round(statistics.median(vs_plain), 3)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
