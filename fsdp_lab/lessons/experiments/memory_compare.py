"""How the bytes FSDP sends per step compare with DDP's as the model gets deeper (the article's 3Φ vs 2Φ).

[Note: why the tiny model sends less than 3Φ] Under FULL_SHARD the root unit (embeddings, final norm, tied
output head) is gathered once and kept until its backward, as in torch's FSDP, so it is never re-gathered:
C_step = 3Φ_blocks + 2Φ_root (times (N−1)/N). The ratio to DDP's 2Φ is then 1.5 − Φ_root/(2Φ), which tends to
the article's 1.5 as blocks make up more of Φ. `comm_by_depth` measures it on the same GPT with more and more
blocks, in one launch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Union

from fsdp_lab.lessons.experiments.common import RunSpec, config_for, train
from fsdp_lab.lessons.experiments.strategies import summarize
from fsdp_lab.lessons.experiments.together import Job
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import GPTConfig


def _depth_rank(rank: int, world_size: int, base: GPTConfig, depths: tuple, strategies: tuple, steps: int) -> list:
    rows = []
    for depth in depths:
        cfg = replace(base, n_layer=depth)
        for strategy in strategies:
            s = summarize(train(rank, world_size, RunSpec(strategy=strategy, preset=cfg, steps=steps)))
            last = max(s["comm_per_step"])
            rows.append({"depth": depth, "strategy": strategy, "numel_padded_total": s["numel_padded_total"],
                         "root_padded_numel": s["root_padded_numel"], "sent": s["comm_per_step"][last],
                         "per_collective": s["comm_per_collective"], "persistent": s["persistent"]})
    return rows


def depth_job(depths: Iterable[int] = (1, 2, 4, 8, 16), strategies: Iterable[str] = ("NO_SHARD", "FULL_SHARD"),
              preset: Union[str, GPTConfig] = "tiny", steps: int = 1) -> Job:
    """comm_by_depth's rank function and arguments, to run with others in one launch
    (fsdp_lab.lessons.experiments.together)."""
    depths, strategies = tuple(depths), tuple(str(getattr(s, "name", s)).upper() for s in strategies)
    if not depths or min(depths) < 1:
        raise ValueError(f"depths must be positive block counts, got {depths}")
    return Job(_depth_rank, (config_for(preset), depths, strategies, steps))


def comm_by_depth(world_size: int = 2, depths: Iterable[int] = (1, 2, 4, 8, 16),
                  strategies: Iterable[str] = ("NO_SHARD", "FULL_SHARD"), preset: Union[str, GPTConfig] = "tiny",
                  steps: int = 1, timeout_s: float = 120.0) -> list[list[dict]]:
    """Per rank, one row per (depth, strategy): bytes sent in the last step, by collective, and the padded
    element counts of the whole model and of its root unit. `preset` gives every size but the depth."""
    job = depth_job(depths, strategies, preset, steps)
    return run_on_ranks(job.fn, world_size, *job.args, timeout_s=timeout_s)


def ratio_rows(rows: Iterable[dict], numerator: str = "FULL_SHARD", denominator: str = "NO_SHARD") -> list[dict]:
    """One rank's rows → per depth: measured bytes of both strategies, their ratio, and the root's share of Φ."""
    by = {(r["depth"], r["strategy"]): r for r in rows}
    out = []
    for depth in sorted({r["depth"] for r in rows}):
        top, bottom = by.get((depth, numerator)), by.get((depth, denominator))
        if top is None or bottom is None:
            raise ValueError(f"depth {depth}: need both {numerator} and {denominator} rows, got "
                             f"{sorted(s for d, s in by if d == depth)}")
        if bottom["sent"] == 0:
            raise ValueError(f"depth {depth}: {denominator} sent 0 bytes (world size 1?)")
        out.append({"depth": depth, "numerator": top["sent"], "denominator": bottom["sent"],
                    "ratio": top["sent"] / bottom["sent"],
                    "root_share": top["root_padded_numel"] / top["numel_padded_total"]})
    return out
