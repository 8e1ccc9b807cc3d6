"""Rank function for test_hook_floor.py (spawned ranks import it by module path)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from fsdp_lab.runtime.core.unit import Unit

HOOK_FLOOR = Path(__file__).resolve().parent.parent / "benchmarks" / "hook_floor.py"


def hook_floor():
    spec = importlib.util.spec_from_file_location("hook_floor", HOOK_FLOOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floor_against_fully_shard(rank: int, world_size: int, steps: int) -> dict:
    """Two fully_shard GPTs on the same weights, one with its hooks swapped for hook_floor's after the first
    step: their losses and parameters after `steps` steps, and how often each called the real runtime's gather
    after the swap."""
    from fsdp_lab.bench.setups import build_runner
    from fsdp_lab.training.models import GPTConfig, batch_for_step

    floor = hook_floor()
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=16)
    real, bare = (build_runner("fsdp_lab_fully_shard", cfg, torch.device("cpu"), "foreach", 1e-2) for _ in "ab")
    x, y = batch_for_step(cfg, 0, 2, 32)
    losses = [[real.step(x, y).item()], [bare.step(x, y).item()]]
    floor.install(bare.model)
    gathers = {"real": 0, "bare": 0}
    original = Unit.gather
    for i in range(1, steps):
        x, y = batch_for_step(cfg, i, 2, 32)
        for which, runner, out in (("real", real, losses[0]), ("bare", bare, losses[1])):
            def counted(unit, *args, which=which, **kwargs):
                gathers[which] += 1
                return original(unit, *args, **kwargs)
            Unit.gather = counted
            try:
                out.append(runner.step(x, y).item())
            finally:
                Unit.gather = original
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(real.model.parameters(),
                                                                       bare.model.parameters()))
    refused = []
    fresh = build_runner("fsdp_lab_fully_shard", cfg, torch.device("cpu"), "foreach", 1e-2)
    for prepare in (lambda: None,  # no step yet: the root is not known
                    lambda: (fresh.step(x, y), fresh.model.set_requires_gradient_sync(False))):  # not modelled
        prepare()
        try:
            floor.install(fresh.model)
        except ValueError as err:
            refused.append(str(err))
    return {"losses": losses, "same_parameters": same, "gathers": gathers, "refused": refused}
