"""Several experiments on the same ranks in one launch: one process start instead of one per experiment.

    job = strategy_matrix_job(("FULL_SHARD", "NO_SHARD"), ("fp32",))     # what measure_strategy_matrix runs
    matrix, depths = run_together(2, job, depth_job(depths=(1, 2)))      # per job: its list of per-rank results

[Note: why one launch] Every launch starts `world_size` fresh processes, and each imports torch and fsdp_lab
before it trains anything: on a loaded 2-core machine that start costs more than the tiny model's runs. A
chapter that measures several things in a row runs them as jobs of one launch. Each job is the same rank
function, with the same arguments, that the experiment's own function launches alone, so what comes back is
what that function returns (tests/test_experiments_ch.py compares the two).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fsdp_lab.training.launch import run_on_ranks


@dataclass(frozen=True)
class Job:
    """One experiment's rank function fn(rank, world_size, *args), picklable (a module-level function)."""
    fn: Callable
    args: tuple = ()


def _together_rank(rank: int, world_size: int, jobs: tuple) -> list:
    return [job.fn(rank, world_size, *job.args) for job in jobs]


def run_together(world_size: int, *jobs: Job, timeout_s: float = 300.0) -> list[list]:
    """Run the jobs one after another on the same `world_size` ranks; per job, the per-rank results in rank
    order (what run_on_ranks gives for that job alone)."""
    if not jobs or not all(isinstance(j, Job) for j in jobs):
        raise ValueError(f"run_together needs one or more Job, got {jobs!r}")
    per_rank = run_on_ranks(_together_rank, world_size, tuple(jobs), timeout_s=timeout_s)
    return [[results[i] for results in per_rank] for i in range(len(jobs))]
