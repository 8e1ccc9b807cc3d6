"""Ranks for tests/test_fully_shard_misuse.py: fully_shard used wrongly, as a learner would, on gloo ranks.
Each case returns the message of the error raised at the user's own call ("" if none was raised)."""
from __future__ import annotations

import torch
from ranks_fully_shard import mesh
from torch import nn

import fsdp_lab


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _error(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return ""


def case_root_first(rank, world_size):
    """fully_shard(root) before its blocks, then fully_shard(block)."""
    model = _model()
    fsdp_lab.fully_shard(model, mesh=mesh(world_size))
    return _error(lambda: fsdp_lab.fully_shard(model[0], mesh=mesh(world_size)))


def case_fsdp_then_fully_shard(rank, world_size):
    model = _model()
    wrapped = fsdp_lab.FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    return _error(lambda: fsdp_lab.fully_shard(wrapped, mesh=mesh(world_size)))


def case_fully_shard_then_fsdp(rank, world_size):
    model = _model()
    fsdp_lab.fully_shard(model[0], mesh=mesh(world_size))
    return _error(lambda: fsdp_lab.FSDP(model, device_id=torch.device("cpu")))


def case_stale_optimizer(rank, world_size):
    """An optimizer built before fully_shard holds the parameters fully_shard replaced."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp_lab.fully_shard(model[0], mesh=mesh(world_size))
    fsdp_lab.fully_shard(model, mesh=mesh(world_size))
    model(torch.randn(2, 8)).sum().backward()
    return _error(opt.step)


def case_meta_without_to_empty(rank, world_size):
    with torch.device("meta"):
        model = _model()
    fsdp_lab.fully_shard(model[0], mesh=mesh(world_size))
    fsdp_lab.fully_shard(model, mesh=mesh(world_size))
    return _error(lambda: model(torch.randn(2, 8)))


class _Odd(nn.Module):
    """A weight whose shape depends on the rank: same size, different shape (a config read differently)."""

    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return x @ self.weight.reshape(8, 16)


def case_shapes_differ(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Odd((16, 8) if rank == 0 else (8, 16)))
    fsdp_lab.fully_shard(model[1], mesh=mesh(world_size))
    fsdp_lab.fully_shard(model, mesh=mesh(world_size))
    return _error(lambda: model(torch.randn(2, 8)))


def case_models_differ(rank, world_size):
    torch.manual_seed(0)
    hidden = [module for _ in range(1 + rank) for module in (nn.Linear(8, 8), nn.ReLU())]  # rank 1: one more
    model = nn.Sequential(*hidden, nn.Linear(8, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp_lab.fully_shard(layer, mesh=mesh(world_size))
    fsdp_lab.fully_shard(model, mesh=mesh(world_size))
    return _error(lambda: model(torch.randn(2, 8)))


CASES = {"shapes_differ": case_shapes_differ, "models_differ": case_models_differ,
         "root_first": case_root_first, "fsdp_then_fully_shard": case_fsdp_then_fully_shard,
         "fully_shard_then_fsdp": case_fully_shard_then_fsdp, "stale_optimizer": case_stale_optimizer,
         "meta_without_to_empty": case_meta_without_to_empty}


def run_cases(rank, world_size, names):
    out = {}
    for name in names:
        out[name] = CASES[name](rank, world_size)
        torch.distributed.barrier()  # a case that failed on one rank only must not leave the other mid-collective
    return out
