#!/usr/bin/env python3
"""What the collective log costs a training step, measured with the log on and off: 2 gloo ranks, both front ends.

    PYTHONPATH=. python3 benchmarks/collective_log_cost.py
    PYTHONPATH=. python3 benchmarks/collective_log_cost.py --steps 30 --records 50000

[Note: the log's cost, and bar 11] Bar `11-host-overhead` (benchmarks/host_overhead.py) runs at world size 1,
where no collective is issued and so nothing is logged; the log only works where there are peers. Its cost is
therefore measured where it is on: on 2 ranks, each front end's steps of the host-overhead model (24 blocks of
width 16), two ways.

- Side by side: the same model's steps with the log on and with it off (`log_switched_off`: the group's log
  lookup answers None, as outside torch.distributed, so no record is made), alternating step by step so that a
  change of machine load falls on both; the median of each, and the median and quartiles of the per-pair
  differences (on - off), in wall time and in the thread's CPU time (the log runs on this thread; other
  processes on a shared machine disturb CPU time less). A difference inside its quartiles is a cost the step's
  own noise hides.
- Counted: the records a step makes (the log's sequence number before and after) times the time one record
  takes (`issue`, then its state set to done, as the lifecycle does), timed in the same process over many
  records. That is the log's time per step, too small for the side-by-side to resolve, reported beside the
  step's own time and beside plain training's step at world size 1 (what bar 11 divides by): the last is what
  the log adds to bar 11's ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FRONT_ENDS = ("fsdp_lab", "fsdp_lab_fully_shard")


@contextmanager
def log_switched_off():
    """Inside: collectives run without the collective log (its lookup answers None, so nothing is recorded and
    a failure carries no report); the log is back on the way out, whatever happened inside."""
    from fsdp_lab.runtime.core import collective_log

    lookup = collective_log.log_of
    collective_log.log_of = lambda pg: None
    try:
        yield
    finally:
        collective_log.log_of = lookup


def _quartiles(values: list) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def measure(rank: int, world_size: int, steps: int, records: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    from fsdp_lab.bench.setups import build_runner
    from fsdp_lab.runtime.core import collective_log
    from fsdp_lab.training.models import GPTConfig, batch_for_step

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=2, n_embd=16)
    x, y = batch_for_step(cfg, 0, 2, 32)
    log = collective_log.log_of(dist.group.WORLD)
    out = {}
    for mode in (*FRONT_ENDS, "plain"):
        runner = build_runner(mode, cfg, torch.device("cpu"), "foreach", 1e-3)
        for _ in range(3):
            runner.step(x, y)
        times = {"on": [], "off": []}
        cpu = {"on": [], "off": []}  # this thread's CPU time: where the log runs, less disturbed by other load
        counted = {"on": 0, "off": 0}
        pair = ("on", "off") if mode in FRONT_ENDS else ("on",)  # plain issues no collective
        for i in range(steps):  # on then off, then off then on: neighbours in time, each first half the time
            for state in (pair if i % 2 == 0 else pair[::-1]):
                before = log.seq
                t0, c0 = time.perf_counter(), time.thread_time()
                if state == "on":
                    runner.step(x, y)
                else:
                    with log_switched_off():
                        runner.step(x, y)
                times[state].append(time.perf_counter() - t0)
                cpu[state].append(time.thread_time() - c0)
                counted[state] += log.seq - before
        out[mode] = {"step_s": statistics.median(times["on"]), "records_per_step": counted["on"] / steps}
        if times["off"]:
            diffs = [a - b for a, b in zip(times["on"], times["off"])]
            cpu_diffs = [a - b for a, b in zip(cpu["on"], cpu["off"])]
            out[mode].update(off_step_s=statistics.median(times["off"]), diff_s=statistics.median(diffs),
                             diff_quartiles_s=_quartiles(diffs), records_per_step_off=counted["off"] / steps,
                             cpu_s=statistics.median(cpu["on"]), off_cpu_s=statistics.median(cpu["off"]),
                             cpu_diff_s=statistics.median(cpu_diffs), cpu_diff_quartiles_s=_quartiles(cpu_diffs))
    scratch = collective_log.CollectiveLog("cost", rank, tuple(range(world_size)))
    shape, dtype = torch.Size([1234]), torch.bfloat16
    per_record = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(records):
            rec = scratch.issue("all_gather", "blocks.3", "forward", shape, dtype, 1234)
            rec[collective_log.STATE] = collective_log.DONE
        per_record.append((time.perf_counter() - t0) / records)
    out["per_record_s"] = statistics.median(per_record)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per setup, rank and log state (on, off)")
    p.add_argument("--records", type=int, default=20000, help="records per timing of one record")
    p.add_argument("--layers", type=int, default=24, help="GPT blocks (24: the host-overhead model)")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.records < 1 or args.layers < 1:
        p.error("--steps, --records and --layers must be positive")
    sys.path.insert(0, str(REPO))
    from fsdp_lab.training.launch import run_on_ranks

    ranks = run_on_ranks(measure, 2, args.steps, args.records, args.layers, timeout_s=args.timeout,
                         threads_per_rank=1)
    r0 = ranks[0]
    plain_s, record_s = r0["plain"]["step_s"], r0["per_record_s"]
    print(f"one record: {record_s * 1e9:.0f} ns; plain training's step: {plain_s * 1e3:.2f} ms (rank 0, "
          f"{args.layers} blocks, {args.steps} steps each way)")
    result = {"what": "the collective log's time per step on 2 gloo ranks, on against off and counted "
                      "([Note: the log's cost, and bar 11])",
              "layers": args.layers, "steps": args.steps, "per_record_ns": round(record_s * 1e9, 1),
              "plain_step_ms": round(plain_s * 1e3, 3), "load_average_1min": round(os.getloadavg()[0], 2),
              "front_ends": {}}
    for mode in FRONT_ENDS:
        m = r0[mode]
        log_s = m["records_per_step"] * record_s
        low, high = m["diff_quartiles_s"]
        row = {"records_per_step": m["records_per_step"], "records_per_step_off": m["records_per_step_off"],
               "step_ms": round(m["step_s"] * 1e3, 3), "log_off_step_ms": round(m["off_step_s"] * 1e3, 3),
               "on_minus_off_ms": round(m["diff_s"] * 1e3, 3),
               "on_minus_off_quartiles_ms": [round(low * 1e3, 3), round(high * 1e3, 3)],
               "cpu_ms": round(m["cpu_s"] * 1e3, 3), "log_off_cpu_ms": round(m["off_cpu_s"] * 1e3, 3),
               "cpu_on_minus_off_ms": round(m["cpu_diff_s"] * 1e3, 3),
               "cpu_on_minus_off_quartiles_ms": [round(q * 1e3, 3) for q in m["cpu_diff_quartiles_s"]],
               "log_us_per_step": round(log_s * 1e6, 2), "share_of_step": log_s / m["step_s"],
               "added_to_bar_11_ratio": log_s / plain_s}
        result["front_ends"][mode] = row
        print(f"{mode:22} log on {m['step_s'] * 1e3:7.1f} ms, off {m['off_step_s'] * 1e3:7.1f} ms a step: "
              f"on - off {m['diff_s'] * 1e3:+.2f} ms (quartiles {low * 1e3:+.2f} to {high * 1e3:+.2f} ms)")
        c_low, c_high = m["cpu_diff_quartiles_s"]
        print(f"{'':22} thread CPU time: on {m['cpu_s'] * 1e3:7.1f} ms, off {m['off_cpu_s'] * 1e3:7.1f} ms: on - off "
              f"{m['cpu_diff_s'] * 1e3:+.2f} ms (quartiles {c_low * 1e3:+.2f} to {c_high * 1e3:+.2f} ms)")
        print(f"{'':22} counted: {m['records_per_step']:.0f} records/step x {record_s * 1e9:.0f} ns = "
              f"{log_s * 1e6:.1f} us, {100 * row['share_of_step']:.3f} % of the step; adds "
              f"x{row['added_to_bar_11_ratio']:.4f} to bar 11's ratio")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
