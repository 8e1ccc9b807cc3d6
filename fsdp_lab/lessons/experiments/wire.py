"""Bytes on the wire against the ring formula: each strategy's training step on 2 gloo ranks in a private network
namespace, the loopback counter read around every step ([Note: counting real bytes] in fsdp_lab/observe/wire.py).

    rows = measure_wire_bytes()   # [{strategy, step, wire_bytes, counted_bytes, counted_by_collective, ...}]
    rows = measure_wire_bytes(micro_batches=(1, 2, 4), no_sync=(True, False))   # gradient accumulation

Each optimizer step runs K micro-batches, the first K-1 under no_sync() or not ([Note: accumulation and no_sync]
in fsdp_lab/lessons/experiments/common.py); every row names its `micro_batches` and `no_sync`.

`counted_bytes` is what the trace's ring formula says all ranks sent in that step (fsdp_lab/observe/traffic.py);
`wire_bytes` is what the loopback interface carried, with the bracketing barriers' own bytes subtracted, after one
uncounted warm-up step per model. Run as
`python -m fsdp_lab.lessons.experiments.wire` inside the namespace, it prints the rows as JSON.
"""
from __future__ import annotations

import functools
import gc
import json
import math
import sys
from typing import Iterable

import torch
import torch.distributed as dist

from fsdp_lab.lessons.experiments.common import RunSpec, accumulation_step, build_model, config_for, unit_table
from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.theory import formulas
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.observe.wire import bring_loopback_up, isolation_problem, loopback_tx_bytes, run_isolated
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import batch_for_step, build_gpt, rank_slice

BARRIER_SAMPLES = 5


def _bracketed(rank: int, fn) -> int:
    """Loopback bytes sent while `fn` runs on every rank (rank 0 reads; 0 elsewhere), bracketed by barriers."""
    dist.barrier()
    before = loopback_tx_bytes() if rank == 0 else 0
    dist.barrier()
    fn()
    dist.barrier()
    return loopback_tx_bytes() - before if rank == 0 else 0


def _variants(strategies: tuple, micro_batches: tuple, no_sync: tuple) -> list[tuple[str, int, bool]]:
    """(strategy, K, no_sync) to run. K = 1 puts no micro-batch under no_sync, so with both choices asked for it
    runs once, as no_sync=True."""
    return [(strategy, k, quiet) for strategy in strategies for k in micro_batches for quiet in no_sync
            if quiet or k > 1 or True not in no_sync]


TORCH_MODELS = ("torch_ddp", "torch_fsdp2")  # torch's own DistributedDataParallel and fully_shard, for comparison


def _build(strategy: str, spec: RunSpec):
    """fsdp_lab's FSDP for a sharding strategy; torch's DDP or FSDP2 (one fully_shard per Block, then the root) for
    a TORCH_MODELS name, on the same weights."""
    if strategy not in TORCH_MODELS:
        return build_model(spec.with_(strategy=strategy))
    model = build_gpt(config_for(spec.preset))
    if strategy == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _root_share(model) -> float:
    """The root unit's share of the parameters: fsdp_lab's from its unit table, torch's (unpadded) from the names."""
    if hasattr(model, "units"):
        units = unit_table(model)
        return sum(u["padded_numel"] for u in units if u["is_root"]) / sum(u["padded_numel"] for u in units)
    named = list((getattr(model, "module", model)).named_parameters())
    return sum(p.numel() for n, p in named if not n.startswith("blocks.")) / sum(p.numel() for _, p in named)


def _wire_rank(rank: int, world_size: int, spec: RunSpec, variants: list) -> dict:
    out = []
    cfg = config_for(spec.preset)
    barrier = min(_bracketed(rank, lambda: None) for _ in range(BARRIER_SAMPLES))
    for strategy, k, quiet in variants:
        model = _build(strategy, spec)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        x, y = batch_for_step(cfg, 0, spec.global_batch, spec.seq_len)  # a warm-up step, not counted: a fresh
        accumulation_step(model, opt, rank_slice(x, rank, world_size), rank_slice(y, rank, world_size), k, quiet)
        dist.barrier()  # model's first step can carry one-off traffic (lazy init, DDP's bucket rebuild)
        tracer = trace_mod.Tracer(None, rank=rank, model=model, optimizer=opt) if hasattr(model, "set_tracer") \
            else None
        if tracer:
            model.set_tracer(tracer)
        wire = []
        for step in range(spec.steps):
            x, y = batch_for_step(cfg, step, spec.global_batch, spec.seq_len)
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
            wire.append(_bracketed(rank, lambda: accumulation_step(model, opt, x, y, k, quiet)))
        comm = None
        if tracer:  # torch's models have no tracer: their rows carry wire bytes only
            model.set_tracer(None)
            tracer.close()
            comm = comm_summary(tracer.events)
        out.append({"wire": wire, "counted": comm.per_step(rank) if comm else {}, "root_share": _root_share(model),
                    "by_collective": {s: comm.per_collective(rank, s) if comm else {} for s in range(spec.steps)}})
        del model, opt  # its hooks and buffers go now, not during the next variant's step
        gc.collect()
    return {"rank": rank, "barrier_bytes": barrier, "variants": out}


def _rows(per_rank: list, variants: list) -> list[dict]:
    rank0 = per_rank[0]
    rows = []
    for i, (strategy, k, quiet) in enumerate(variants):
        for step, wire in enumerate(rank0["variants"][i]["wire"]):
            counted = sum(r["variants"][i]["counted"].get(step, 0) for r in per_rank)
            by = {}
            for r in per_rank:
                for kind, b in r["variants"][i]["by_collective"][step].items():
                    by[kind] = by.get(kind, 0) + b
            rows.append({"strategy": strategy, "micro_batches": k, "no_sync": quiet, "step": step,
                         "wire_bytes": wire - rank0["barrier_bytes"], "counted_bytes": counted,
                         "counted_by_collective": by, "barrier_bytes": rank0["barrier_bytes"],
                         "root_share": rank0["variants"][i]["root_share"]})
    return rows


def accumulation_table(rows: list[dict], world_size: int = 2, fsdp: str = "FULL_SHARD",
                       ddp: str = "NO_SHARD") -> list[dict]:
    """One row per (K, no_sync): FSDP's and DDP's bytes on the wire per optimizer step (the least over the steps
    measured: noise only adds bytes, as ACKs and smaller segments on a loaded machine), their ratio, and
    beside it `formulas.comm_bytes_ratio_fsdp_vs_ddp` three ways: the article's (2K+1)/2 (every parameter gathered
    twice, a ring reduce-scatter), with the root's share gathered once, and with gloo's two-pass reduce-scatter
    as well (what this run should show). `fsdp`, `ddp`: which rows (e.g. "torch_fsdp2" and "torch_ddp")."""
    def least(strategy, k, quiet, key="wire_bytes"):
        got = [r[key] for r in rows if (r["strategy"], r["micro_batches"], r["no_sync"]) == (strategy, k, quiet)]
        if not got:
            raise ValueError(f"no {strategy} rows with micro_batches={k}, no_sync={quiet}: measure both {fsdp} "
                             f"and {ddp}")
        return min(got)

    table = []
    for k, quiet in sorted({(r["micro_batches"], r["no_sync"]) for r in rows if r["strategy"] == fsdp},
                           key=lambda kq: (not kq[1], kq[0])):
        fsdp_bytes, ddp_bytes = least(fsdp, k, quiet), least(ddp, k, quiet)
        root = least(fsdp, k, quiet, "root_share")
        ratio = functools.partial(formulas.comm_bytes_ratio_fsdp_vs_ddp, world_size, micro_batches=k, no_sync=quiet)
        table.append({"micro_batches": k, "no_sync": quiet, "fsdp_wire_bytes": round(fsdp_bytes),
                      "ddp_wire_bytes": round(ddp_bytes), "measured_ratio": fsdp_bytes / ddp_bytes, "formula": ratio(),
                      "formula_root": ratio(root_share=root),
                      "formula_root_gloo": ratio(root_share=root, reduce_scatter_passes=2), "root_share": root})
    return table


def _inside(strategies: tuple, world_size: int, preset: str, steps: int, micro_batches: tuple = (1,),
            no_sync: tuple = (True,)) -> list[dict]:
    bring_loopback_up()
    # every rank's batch splits into each K (and is 2 sequences or more, as the default global batch of 4 gives)
    spec = RunSpec(preset=preset, steps=steps, trace=True, global_batch=world_size * math.lcm(2, *micro_batches))
    variants = _variants(strategies, micro_batches, no_sync)
    per_rank = run_on_ranks(_wire_rank, world_size, spec, variants, timeout_s=240)
    return _rows(per_rank, variants)


def measure_wire_bytes(strategies: Iterable[str] = ("FULL_SHARD", "NO_SHARD"), world_size: int = 2,
                       preset: str = "tiny", steps: int = 2, timeout_s: float = 300.0,
                       micro_batches: Iterable[int] = (1,), no_sync: Iterable[bool] = (True,)) -> list[dict]:
    """Every step's bytes on the loopback wire and the ring formula's count, for each strategy, number of
    accumulation micro-batches K and no_sync choice (see the module doc). Raises RuntimeError saying why where no
    private network namespace can be made."""
    strategies, micro_batches, no_sync = tuple(strategies), tuple(micro_batches), tuple(no_sync)
    for k in micro_batches:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"micro_batches must hold integers >= 1, got {k!r} in {micro_batches!r}")
    if not micro_batches or not no_sync or not all(isinstance(q, bool) for q in no_sync):
        raise ValueError(f"micro_batches and no_sync must be non-empty, no_sync of True/False: {micro_batches!r}, "
                         f"{no_sync!r}")
    problem = isolation_problem()
    if problem:
        raise RuntimeError(problem)
    args = ["--world-size", str(world_size), "--preset", preset, "--steps", str(steps),
            "--micro-batches", *map(str, micro_batches), "--no-sync", *("on" if q else "off" for q in no_sync),
            "--", *strategies]
    return json.loads(run_isolated(__name__, args, timeout_s).strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_lab.lessons.experiments.wire")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1])
    parser.add_argument("--no-sync", choices=("on", "off"), nargs="+", default=["on"])
    parser.add_argument("strategies", nargs="*", default=["FULL_SHARD", "NO_SHARD"])
    args = parser.parse_args(argv)
    rows = _inside(tuple(args.strategies), args.world_size, args.preset, args.steps, tuple(args.micro_batches),
                   tuple(q == "on" for q in args.no_sync))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
