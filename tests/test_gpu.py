"""Checks that only a GPU can answer (fsdp_lab/bench/gpu_checks.py): parity with FSDP2 in bf16 and fp32 on CUDA (world
size 1 on NCCL, and two ranks over gloo on one GPU), no host sync in a steady-state step, unsharded memory released
between units as seen by torch.cuda.memory_allocated, gather kernels overlapping compute in a profile, resuming
fused AdamW from a checkpoint, ZeRO-1 with fused AdamW against one process, and the collective log naming a
forward one rank runs alone with CUDA tensors, under each front end.
Without pytest, benchmarks/gpu_checks.py runs the same checks."""
from __future__ import annotations

import pytest
import torch

from fsdp_lab.bench.gpu_checks import MULTI_RANK_CHECKS, WORLD1_CHECKS, run_checks
from fsdp_lab.training.launch import run_on_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _check(names, world_size=1, backend="nccl"):
    results = run_on_ranks(run_checks, world_size, names, backend=backend, timeout_s=240)[0]
    for r in results:
        assert r["ok"], f"{r['name']}: {r['detail']}"
    return results


@pytest.mark.parametrize("name", list(WORLD1_CHECKS))
def test_world1_nccl(name):
    _check([name])


@pytest.mark.parametrize("name", MULTI_RANK_CHECKS)
def test_two_gloo_ranks_on_one_gpu(name):
    _check([name], world_size=2, backend="gloo")
