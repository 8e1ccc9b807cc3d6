"""Bytes on the wire against the ring formula: each strategy's training step on 2 gloo ranks in a private network
namespace, the loopback counter read around every step ([Note: counting real bytes] in fsdp_lab/observe/wire.py).

    rows = measure_wire_bytes()   # [{strategy, step, wire_bytes, counted_bytes, counted_by_collective, ...}]

`counted_bytes` is what the trace's ring formula says all ranks sent in that step (fsdp_lab/observe/traffic.py);
`wire_bytes` is what the loopback interface carried, with the bracketing barriers' own bytes subtracted. Run as
`python -m fsdp_lab.lessons.experiments.wire` inside the namespace, it prints the rows as JSON.
"""
from __future__ import annotations

import json
import sys
from typing import Iterable

import torch
import torch.distributed as dist

from fsdp_lab.lessons.experiments.common import RunSpec, build_model, config_for
from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.observe.wire import bring_loopback_up, isolation_problem, loopback_tx_bytes, run_isolated
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import batch_for_step, rank_slice

BARRIER_SAMPLES = 5


def _bracketed(rank: int, fn) -> int:
    """Loopback bytes sent while `fn` runs on every rank (rank 0 reads; 0 elsewhere), bracketed by barriers."""
    dist.barrier()
    before = loopback_tx_bytes() if rank == 0 else 0
    dist.barrier()
    fn()
    dist.barrier()
    return loopback_tx_bytes() - before if rank == 0 else 0


def _wire_rank(rank: int, world_size: int, spec: RunSpec, strategies: tuple) -> dict:
    out = {}
    cfg = config_for(spec.preset)
    barrier = min(_bracketed(rank, lambda: None) for _ in range(BARRIER_SAMPLES))
    for strategy in strategies:
        model = build_model(spec.with_(strategy=strategy))
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        tracer = trace_mod.Tracer(None, rank=rank, model=model, optimizer=opt)
        model.set_tracer(tracer)
        wire = []
        for step in range(spec.steps):
            x, y = batch_for_step(cfg, step, spec.global_batch, spec.seq_len)
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)

            def one_step():
                model(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            wire.append(_bracketed(rank, one_step))
        model.set_tracer(None)
        tracer.close()
        comm = comm_summary(tracer.events)
        out[strategy] = {"wire": wire, "counted": comm.per_step(rank),
                         "by_collective": {s: comm.per_collective(rank, s) for s in range(spec.steps)}}
    return {"rank": rank, "barrier_bytes": barrier, "strategies": out}


def _rows(per_rank: list, strategies: tuple) -> list[dict]:
    rank0 = per_rank[0]
    rows = []
    for strategy in strategies:
        for step, wire in enumerate(rank0["strategies"][strategy]["wire"]):
            counted = sum(r["strategies"][strategy]["counted"].get(step, 0) for r in per_rank)
            by = {}
            for r in per_rank:
                for kind, b in r["strategies"][strategy]["by_collective"][step].items():
                    by[kind] = by.get(kind, 0) + b
            rows.append({"strategy": strategy, "step": step, "wire_bytes": wire - rank0["barrier_bytes"],
                         "counted_bytes": counted, "counted_by_collective": by,
                         "barrier_bytes": rank0["barrier_bytes"]})
    return rows


def _inside(strategies: tuple, world_size: int, preset: str, steps: int) -> list[dict]:
    bring_loopback_up()
    spec = RunSpec(preset=preset, steps=steps, trace=True)
    per_rank = run_on_ranks(_wire_rank, world_size, spec, strategies, timeout_s=240)
    return _rows(per_rank, strategies)


def measure_wire_bytes(strategies: Iterable[str] = ("FULL_SHARD", "NO_SHARD"), world_size: int = 2,
                       preset: str = "tiny", steps: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """Every step's bytes on the loopback wire and the ring formula's count, per strategy (see the module doc).
    Raises RuntimeError saying why where no private network namespace can be made."""
    strategies = tuple(strategies)
    problem = isolation_problem()
    if problem:
        raise RuntimeError(problem)
    args = ["--world-size", str(world_size), "--preset", preset, "--steps", str(steps), *strategies]
    return json.loads(run_isolated(__name__, args, timeout_s).strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_lab.lessons.experiments.wire")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("strategies", nargs="*", default=["FULL_SHARD", "NO_SHARD"])
    args = parser.parse_args(argv)
    print(json.dumps(_inside(tuple(args.strategies), args.world_size, args.preset, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
