"""Ranks for tests/test_empty_root.py: an FSDP1 root that owns no parameter of its own (nn.Sequential of Linear
blocks, every Linear auto-wrapped), run on torch FSDP1 (device_id=cpu) and on fsdp_lab with only the import
different: summon_full_params again and again, load_state_dict, and training in between."""
from __future__ import annotations

import torch
from torch import nn

STEPS = 2


def _wrap(lib: str, seed: int):
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        extra = {"device_id": torch.device("cpu")}
    else:
        from fsdp_lab import FSDP
        from fsdp_lab.wrap import ModuleWrapPolicy
        extra = {}
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return FSDP, FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **extra)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def _train(model, opt, rank, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        torch.distributed.all_reduce(value)
        losses.append(value.item() / 2)
    return losses


def _summoned(fsdp, model) -> dict:
    with fsdp.summon_full_params(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def run(rank, world_size, lib):
    fsdp, model = _wrap(lib, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = _summoned(fsdp, model)
    with fsdp.summon_full_params(model):  # an edit inside a second summon reaches the shards
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    second = _summoned(fsdp, model)
    losses = _train(model, opt, rank, range(STEPS))
    trained = _summoned(fsdp, model)
    state = model.state_dict()
    _fsdp, fresh = _wrap(lib, seed=1)
    fresh.load_state_dict(state)
    loaded = _summoned(fsdp, fresh)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    resumed = _train(fresh, fresh_opt, rank, range(STEPS, 2 * STEPS))
    continued = _train(model, opt, rank, range(STEPS, 2 * STEPS))
    return {"first": first, "second": second, "losses": losses, "trained": trained, "loaded": loaded,
            "state": {k: v.detach().clone() for k, v in state.items()}, "resumed": resumed,
            "continued": continued, "final": _summoned(fsdp, fresh)}
