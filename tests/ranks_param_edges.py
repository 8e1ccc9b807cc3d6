"""Ranks for tests/test_param_edges.py: fully_shard scripts where only the import differs (torch or fsdp_lab).

- frozen: `requires_grad_(False)` on a parameter after fully_shard: no gradient, the weight stays put.
- no_rows: a group of which some rank holds none of a parameter's rows (Linear(16, 1) at the root on 2 ranks,
  Linear(16, 5) on 4): trains as torch does, and its sharded state dict loads back into a fresh model."""
from __future__ import annotations

import torch
from ranks_fully_shard import api, full, full_params, mesh, reshard_all
from torch import nn

STEPS = 3


def _batch(step: int, rank: int, world_size: int, width: int, outputs: int):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(4 * world_size, width, generator=g), torch.randn(4 * world_size, outputs, generator=g)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def _model(lib: str, world_size: int, outputs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, outputs))
    fsdp = api(lib)
    fsdp.fully_shard(model[0], mesh=mesh(world_size))
    fsdp.fully_shard(model[2], mesh=mesh(world_size))
    fsdp.fully_shard(model, mesh=mesh(world_size))  # the root holds Linear(16, outputs): few rows
    return model


def _train(model, rank, world_size, outputs, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank, world_size, 16, outputs)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        torch.distributed.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses


def case_frozen(rank, world_size, lib):
    model = _model(lib, world_size, 4)
    frozen = model[2].weight
    before = full(frozen)
    frozen.requires_grad_(False)
    losses = _train(model, rank, world_size, 4, 2)
    refused = ""
    if lib == "fsdp_lab":  # the other way: unfrozen after fully_shard grouped it as frozen
        torch.manual_seed(0)
        other = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        other[2].weight.requires_grad_(False)
        api(lib).fully_shard(other, mesh=mesh(world_size))
        other[2].weight.requires_grad_(True)
        try:
            other(torch.randn(2, 16))
        except RuntimeError as err:
            refused = str(err)
    return {"losses": losses, "params": full_params(model), "frozen_change": (full(frozen) - before).abs().max().item(),
            "frozen_grad": frozen.grad is None, "refused": refused}


def case_no_rows(rank, world_size, lib):
    outputs = 1 if world_size == 2 else 5
    model = _model(lib, world_size, outputs)
    losses = _train(model, rank, world_size, outputs, STEPS)
    state = model.state_dict()
    fresh = _model(lib, world_size, outputs, seed=1)
    fresh.load_state_dict(state)
    x, _y = _batch(99, rank, world_size, 16, outputs)
    with torch.no_grad():
        same_output = torch.equal(model(x), fresh(x))
    reshard_all(model)
    return {"losses": losses, "params": full_params(model), "loaded": full_params(fresh), "same_output": same_output,
            "weight_rows": model[4].weight.to_local().shape[0]}


class LoRAQuantLinear(nn.Module):
    """A PEFT-style layer: an int8 frozen base with a bf16 frozen scale and bias, and fp32 trainable adapters:
    four dtypes in one fully_shard group."""

    def __init__(self, d: int, rank: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(d)
        self.qweight = nn.Parameter(torch.randint(-8, 8, (d, d), generator=g, dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.full((d,), 0.05, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(d, generator=g).to(torch.bfloat16), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d, generator=g) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d, rank, generator=g) * 0.1)

    def forward(self, x):
        base = x @ (self.qweight.float() * self.scale.float()[:, None]).t() + self.bias.float()
        return base + (x @ self.lora_a.t()) @ self.lora_b.t()


def case_dtypes(rank, world_size, lib):
    """Frozen int8 and bf16 parameters beside trainable fp32 ones in each group, as torch takes them."""
    torch.manual_seed(0)
    model = nn.Sequential(LoRAQuantLinear(16), nn.ReLU(), LoRAQuantLinear(16), nn.Linear(16, 4))
    fsdp = api(lib)
    fsdp.fully_shard(model[0], mesh=mesh(world_size))
    fsdp.fully_shard(model[2], mesh=mesh(world_size))
    fsdp.fully_shard(model, mesh=mesh(world_size))
    losses = _train(model, rank, world_size, 4, STEPS)
    reshard_all(model)
    dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
    return {"losses": losses, "params": {n: full(p) for n, p in model.named_parameters()}, "dtypes": dtypes}


CASES = {"frozen": case_frozen, "no_rows": case_no_rows, "dtypes": case_dtypes}


def run_cases(rank, world_size, lib, names):
    return {name: CASES[name](rank, world_size, lib) for name in names}
