#!/usr/bin/env python3
"""What the collective log costs a training step, measured with the log on: 2 gloo ranks, both front ends.

    PYTHONPATH=. python3 benchmarks/collective_log_cost.py
    PYTHONPATH=. python3 benchmarks/collective_log_cost.py --steps 20 --records 50000

[Note: the log's cost, and bar 11] Bar `11-host-overhead` (benchmarks/host_overhead.py) runs at world size 1,
where no collective is issued and so nothing is logged; the log only works where there are peers. Its cost is
therefore measured where it is on: on 2 ranks, each front end's steps of the host-overhead model (24 blocks of
width 16) are counted in records (the log's sequence number before and after), and the time one record takes
(`issue`, then its state set to done, as the lifecycle does) is timed in the same process over many records. The
log's time per step is records x that, and reported beside the step's own time and beside plain training's step
at world size 1 (what bar 11 divides by): the last is what the log adds to bar 11's ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FRONT_ENDS = ("fsdp_lab", "fsdp_lab_fully_shard")


def measure(rank: int, world_size: int, steps: int, records: int) -> dict:
    import torch
    import torch.distributed as dist

    from fsdp_lab.bench.setups import build_runner
    from fsdp_lab.runtime.core import collective_log
    from fsdp_lab.training.models import GPTConfig, batch_for_step

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=24, n_head=2, n_embd=16)
    x, y = batch_for_step(cfg, 0, 2, 32)
    log = collective_log.log_of(dist.group.WORLD)
    out = {}
    for mode in (*FRONT_ENDS, "plain"):
        runner = build_runner(mode, cfg, torch.device("cpu"), "foreach", 1e-3)
        for _ in range(3):
            runner.step(x, y)
        before, times = log.seq, []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
        out[mode] = {"step_s": statistics.median(times), "records_per_step": (log.seq - before) / steps}
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
    p.add_argument("--steps", type=int, default=10, help="timed steps per setup and rank")
    p.add_argument("--records", type=int, default=20000, help="records per timing of one record")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from fsdp_lab.training.launch import run_on_ranks

    ranks = run_on_ranks(measure, 2, args.steps, args.records, timeout_s=args.timeout, threads_per_rank=1)
    r0 = ranks[0]
    plain_s, record_s = r0["plain"]["step_s"], r0["per_record_s"]
    print(f"one record: {record_s * 1e9:.0f} ns; plain training's step: {plain_s * 1e3:.2f} ms (rank 0)")
    result = {"what": "the collective log's time per step on 2 gloo ranks ([Note: the log's cost, and bar 11])",
              "per_record_ns": round(record_s * 1e9, 1), "plain_step_ms": round(plain_s * 1e3, 3),
              "load_average_1min": round(__import__("os").getloadavg()[0], 2), "front_ends": {}}
    for mode in FRONT_ENDS:
        m = r0[mode]
        log_s = m["records_per_step"] * record_s
        row = {"records_per_step": m["records_per_step"], "step_ms": round(m["step_s"] * 1e3, 3),
               "log_us_per_step": round(log_s * 1e6, 2), "share_of_step": log_s / m["step_s"],
               "added_to_bar_11_ratio": log_s / plain_s}
        result["front_ends"][mode] = row
        print(f"{mode:22} {m['records_per_step']:5.0f} records/step x {record_s * 1e9:.0f} ns = "
              f"{log_s * 1e6:7.1f} us: {100 * row['share_of_step']:.3f} % of its {m['step_s'] * 1e3:.1f} ms step; "
              f"adds x{row['added_to_bar_11_ratio']:.4f} to bar 11's ratio")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
