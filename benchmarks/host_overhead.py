#!/usr/bin/env python3
"""Host overhead of fsdp_lab's front ends over plain training at world size 1, side by side in one process.

    PYTHONPATH=. python3 benchmarks/host_overhead.py                        # both front ends against plain
    PYTHONPATH=. python3 benchmarks/host_overhead.py --rounds 30 --steps 8
    PYTHONPATH=. python3 benchmarks/host_overhead.py --baseline 1d4fc31     # and the same at an earlier commit
    PYTHONPATH=. python3 benchmarks/host_overhead.py --setup fsdp_lab_fully_shard fully_shard_floor fsdp2

World size 1 on CPU (gloo), 24 GPT blocks of width 16: compute is negligible, so a step's time is host time
(Python, hooks, dispatch). What a step is, and each setup, is fsdp_lab/bench/setups.py's (`--setup` picks
them: fsdp_lab is the FSDP1 wrapper, fsdp_lab_fully_shard the FSDP2 front end, fsdp2 torch's own;
fully_shard_floor is fsdp_lab_fully_shard with its hooks cut to the bare tensor operations of
benchmarks/hook_floor.py, [Note: the hooks' floor] there).

[Note: the host-overhead ratio] One worker process builds every setup and plain training on the same weights and
batch. A round runs `--steps` cycles of one step of every setup (so the steps compared are neighbours in time,
the order rotating every cycle); per round and setup the median step time is taken. The ratio of a setup is its
median divided by plain training's median *in the same round*, so a change of machine load between rounds
cancels out; reported is the median over rounds of that per-round ratio, with wall time (the bar's measure) and,
as a cross-check, the thread's CPU time, which other processes on a shared machine disturb less. The bar: at
most BAR (1.2) for each fsdp_lab front end.

[Note: the host addition against torch's] When torch's fsdp2 is among the setups, each front end's host addition
(its step time minus plain's) is also reported as a fraction of fsdp2's addition, per round and then the median
over rounds, like the ratio: (ours - plain) / (fsdp2 - plain). It says how much of the host work torch's
fully_shard adds over plain training ours adds, whatever plain itself costs on the machine. The bar
ADDITION_BAR (0.25) holds for fully_shard's fraction. With `--baseline REV` a second worker imports fsdp_lab from that
commit (`git archive`) and runs its rounds alternating with the first's, so "before" and "after" come from one
run.

[Note: the optimizer's share] Each step is also timed from the end of backward to the end of `zero_grad` (the
optimizer's part), so the report can say how much of a setup's ratio its optimizer step alone takes: the
`floor` is the ratio the setup would have if its hooks and collectives cost nothing, (plain − plain's optimizer
part + the setup's optimizer part) / plain, per round. Beside fsdp2, the host addition is split the same way:
(the setup's optimizer part − plain's) / (fsdp2 − plain) is the optimizer step's share of it, and the rest is the
hooks' (with the autograd nodes they add; at world size 1 no collective runs). fully_shard's parameters are
DTensors, one per parameter as torch's are, so AdamW dispatches every foreach op through DTensor; the flat layout
steps one tensor per unit.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BAR = 1.2
ADDITION_BAR = 0.25  # fully_shard's host addition / torch fsdp2's ([Note: the host addition against torch's])
ADDITION_BARRED = ("fsdp_lab_fully_shard",)
FRONT_ENDS = ("fsdp_lab", "fsdp_lab_fully_shard")
FLOOR = "fully_shard_floor"  # fully_shard with bare hooks ([Note: the hooks' floor] in hook_floor.py): no bar
ADDED = (*FRONT_ENDS, FLOOR)  # the setups whose host addition is compared with fsdp2's


def worker(setups: list[str]) -> None:
    """Build the setups and plain, then for each stdin line `MODE N` run N steps of MODE and print their wall
    and thread-CPU times."""
    import torch
    import torch.distributed as dist

    from fsdp_lab.bench.setups import build_runner
    from fsdp_lab.training.launch import free_port
    from fsdp_lab.training.models import GPTConfig, batch_for_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=24, n_head=2, n_embd=16)
    device = torch.device("cpu")
    runners = {mode: build_runner("fsdp_lab_fully_shard" if mode == FLOOR else mode, cfg, device, "foreach", 1e-3)
               for mode in (*setups, "plain")}
    x, y = batch_for_step(cfg, 0, 2, 32)
    if FLOOR in runners:
        runners[FLOOR].step(x, y)  # the first step finds the root; then the hooks are swapped
        _hook_floor().install(runners[FLOOR].model)
    for runner in runners.values():
        for _ in range(3):
            runner.step(x, y)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    modes = list(runners)
    for line in sys.stdin:
        n = int(line)
        times = {mode: {"wall": [], "cpu": [], "optimizer": []} for mode in modes}
        backward_done = [0.0]

        def stamp(_runner):
            backward_done[0] = time.perf_counter()

        for i in range(n):  # one step of every setup, then again: neighbours in time, the order rotating
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                w0, c0 = time.perf_counter(), time.thread_time()
                runners[mode].step(x, y, after_backward=stamp)
                times[mode]["cpu"].append(time.thread_time() - c0)
                w1 = time.perf_counter()
                times[mode]["wall"].append(w1 - w0)
                times[mode]["optimizer"].append(w1 - backward_done[0])
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def _hook_floor():
    spec = importlib.util.spec_from_file_location("hook_floor", Path(__file__).with_name("hook_floor.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start(pythonpath: str, setups: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--setup", *setups], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
    hello = json.loads(proc.stdout.readline() or "{}")
    if hello.get("ready") is not True:
        raise RuntimeError(f"worker with PYTHONPATH={pythonpath} did not start")
    return proc, hello["torch"]


def ask(proc: subprocess.Popen, steps: int) -> dict:
    """One round: {mode: {"wall", "cpu", "optimizer": medians}} over `steps` interleaved steps of every setup."""
    proc.stdin.write(f"{steps}\n")
    proc.stdin.flush()
    times = json.loads(proc.stdout.readline())
    return {mode: {k: statistics.median(v) for k, v in t.items()} for mode, t in times.items()}


def summarize(per_round: dict, setups: list[str], version: str) -> dict:
    """per_round[(version, mode)]: one {"wall", "cpu"} median per round."""
    out = {}
    plain = per_round[(version, "plain")]
    out["plain_step_ms"] = round(1e3 * statistics.median(r["wall"] for r in plain), 2)
    out["plain_optimizer_ms"] = round(1e3 * statistics.median(r["optimizer"] for r in plain), 2)
    for mode in setups:
        rows = per_round[(version, mode)]
        ratio = {k: statistics.median(r[k] / p[k] for r, p in zip(rows, plain)) for k in ("wall", "cpu")}
        floor = statistics.median((p["wall"] - p["optimizer"] + r["optimizer"]) / p["wall"]  # [Note: the
                                  for r, p in zip(rows, plain))                                  # optimizer's share]
        out[mode] = {"step_ms": round(1e3 * statistics.median(r["wall"] for r in rows), 2),
                     "ratio_vs_plain": round(ratio["wall"], 3), "cpu_ratio_vs_plain": round(ratio["cpu"], 3),
                     "optimizer_ms": round(1e3 * statistics.median(r["optimizer"] for r in rows), 2),
                     "floor_ratio_vs_plain": round(floor, 3),
                     "per_round_ratios": [round(r["wall"] / p["wall"], 3) for r, p in zip(rows, plain)]}
    if "fsdp2" in setups:  # [Note: the host addition against torch's]
        theirs = per_round[(version, "fsdp2")]
        for mode in setups:
            if mode in ADDED:
                fractions = {k: [(r[k] - p[k]) / (t[k] - p[k]) for r, t, p in
                                 zip(per_round[(version, mode)], theirs, plain)] for k in ("wall", "cpu")}
                out[mode]["addition_vs_fsdp2"] = round(statistics.median(fractions["wall"]), 3)
                out[mode]["cpu_addition_vs_fsdp2"] = round(statistics.median(fractions["cpu"]), 3)
                out[mode]["per_round_additions_vs_fsdp2"] = [round(f, 3) for f in fractions["wall"]]
        for mode in setups:  # [Note: the optimizer's share]: of the addition, the optimizer step's part
            out[mode]["optimizer_addition_vs_fsdp2"] = round(statistics.median(
                (r["optimizer"] - p["optimizer"]) / (t["wall"] - p["wall"])
                for r, t, p in zip(per_round[(version, mode)], theirs, plain)), 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", nargs="+", default=list(FRONT_ENDS),
                   help="setups timed against plain (default: both fsdp_lab front ends)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=8, help="steps of each setup per round, interleaved")
    p.add_argument("--baseline", default=None, help="also measure fsdp_lab at this git revision, in the same rounds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.setup)
        return 0
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be positive")
    started = time.time()
    with tempfile.TemporaryDirectory() as base_dir:
        workers = {"new": start(str(REPO), args.setup)}
        if args.baseline:
            archive = subprocess.run(["git", "archive", args.baseline, "fsdp_lab"], cwd=REPO, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", base_dir], input=archive, check=True)
            workers["baseline"] = start(base_dir, args.setup)
        versions = list(workers)
        per_round = {(v, m): [] for v in versions for m in (*args.setup, "plain")}
        try:
            for r in range(args.rounds):
                for version in versions[r % len(versions):] + versions[:r % len(versions)]:
                    for mode, medians in ask(workers[version][0], args.steps).items():
                        per_round[(version, mode)].append(medians)
        finally:
            for proc, _torch in workers.values():
                proc.stdin.close()
                proc.wait(timeout=60)
    result = {"what": "step time of each setup / plain training's, world size 1, CPU, 24 blocks x width 16; "
                      "median over rounds of the per-round ratio ([Note: the host-overhead ratio])",
              "rounds": args.rounds, "steps_per_round": args.steps, "torch": workers["new"][1],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "load_average_1min": round(os.getloadavg()[0], 2), "bar": BAR,
              "addition_bar": {"fraction_of_fsdp2_addition_at_most": ADDITION_BAR, "setups": list(ADDITION_BARRED),
                               "what": "(setup - plain) / (fsdp2 - plain) step time, median over rounds"},
              "this_checkout": summarize(per_round, args.setup, "new")}
    if args.baseline:
        result["baseline"] = {"revision": args.baseline, **summarize(per_round, args.setup, "baseline")}
    result["bars"] = {mode: result["this_checkout"][mode]["ratio_vs_plain"] <= BAR
                      for mode in args.setup if mode in FRONT_ENDS}
    if "fsdp2" in args.setup:
        result["addition_bars"] = {mode: result["this_checkout"][mode]["addition_vs_fsdp2"] <= ADDITION_BAR
                                   for mode in args.setup if mode in ADDITION_BARRED}
    for mode in args.setup:
        row = result["this_checkout"][mode]
        verdict = ("holds" if row["ratio_vs_plain"] <= BAR else "MISSED") if mode in FRONT_ENDS else "no bar"
        base = f", at {args.baseline}: {result['baseline'][mode]['ratio_vs_plain']:.3f}" if args.baseline else ""
        print(f"{mode:<22} {row['step_ms']:7.2f} ms  x{row['ratio_vs_plain']:.3f} plain (CPU time "
              f"x{row['cpu_ratio_vs_plain']:.3f}){base}  bar <= {BAR}: {verdict}", file=sys.stderr)
        print(f"{'':<22} optimizer step + zero_grad {row['optimizer_ms']:.2f} ms: with free hooks the ratio would "
              f"be x{row['floor_ratio_vs_plain']:.3f}", file=sys.stderr)
    for mode in (m for m in args.setup if m in ADDED and "fsdp2" in args.setup):
        row = result["this_checkout"][mode]
        bar = (f"  bar <= {ADDITION_BAR}: {'holds' if row['addition_vs_fsdp2'] <= ADDITION_BAR else 'MISSED'}"
               if mode in ADDITION_BARRED else "  no bar")
        if mode == FLOOR:
            bar = "  (fully_shard's hooks as bare tensor operations, benchmarks/hook_floor.py)"
        base = (f", at {args.baseline}: {result['baseline'][mode]['addition_vs_fsdp2']:.3f}"
                if args.baseline else "")
        print(f"{mode:<22} host addition {row['addition_vs_fsdp2']:.3f} of fsdp2's (CPU time "
              f"{row['cpu_addition_vs_fsdp2']:.3f}){base}{bar}", file=sys.stderr)
        theirs = result["this_checkout"]["fsdp2"]["optimizer_addition_vs_fsdp2"]
        print(f"{'':<22} of which the optimizer step {row['optimizer_addition_vs_fsdp2']:.3f} (fsdp2's own: "
              f"{theirs:.3f}), the hooks and what they add to autograd "
              f"{row['addition_vs_fsdp2'] - row['optimizer_addition_vs_fsdp2']:.3f}", file=sys.stderr)
    print(f"{'plain':<22} {result['this_checkout']['plain_step_ms']:7.2f} ms, optimizer step + zero_grad "
          f"{result['this_checkout']['plain_optimizer_ms']:.2f} ms", file=sys.stderr)
    print(f"load average (1 min) at the end: {result['load_average_1min']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
