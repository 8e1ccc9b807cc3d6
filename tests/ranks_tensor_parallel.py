"""Ranks for tests/test_tensor_parallel.py: tensor parallel on a 2-D mesh ("dp", "tp"), then fully_shard on
"dp", as torchtitan's apply_tp and apply_fsdp do, in a script where only the import differs (torch or fsdp_lab)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from ranks_fully_shard import api, full, reshard_all
from torch import nn
from torch.distributed.tensor import DTensor

D, HIDDEN, BATCH, SEQ = 8, 10, 8, 3  # HIDDEN/tp = 5 rows per tp rank: uneven on dp=2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mesh_2d(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def build(lib: str, dp: int, tp: int, seed: int = 0):
    """apply_tp then apply_fsdp: w1 column-wise, w2 row-wise on "tp"; fully_shard per block on "dp", then the
    root. lib="plain": one process, no parallelism."""
    torch.manual_seed(seed)
    model = Net()
    if lib == "plain":
        return model, None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = mesh_2d(dp, tp)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fsdp = api(lib)
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh["dp"])
    fsdp.fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def batch(step: int, dp_rank: int, dp: int):
    """The global batch of `step`, this dp rank's rows of it (tp ranks of one dp rank see the same rows)."""
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(BATCH, SEQ, D, generator=g)
    n = BATCH // dp
    return x[dp_rank * n:(dp_rank + 1) * n]


def train(model, opt, mesh, steps: int, first_step: int = 0, clip: bool = True) -> tuple[list, list]:
    """AdamW steps with clip_grad_norm_ over the gradients; returns the losses (mean over the global batch) and
    the gradient norms clip_grad_norm_ returned."""
    dp_rank, dp = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if mesh is not None else (0, 1)
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        x = batch(step, dp_rank, dp)
        loss = model(x).pow(2).mean()
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norms.append(full(norm).item())
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(value, group=mesh["dp"].get_group())
        losses.append(value.item() / dp)
    return losses, norms


def placements(t) -> tuple:
    return (tuple(str(p) for p in t.placements), t.device_mesh.mesh_dim_names) if isinstance(t, DTensor) else None


def run_train(rank, world_size, lib, dp=2, tp=2, steps=3):
    model, mesh = build(lib, dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = train(model, opt, mesh, steps)
    reshard_all(model)
    return {"losses": losses, "norms": norms,
            "params": {n: full(p) for n, p in model.named_parameters()},
            "placements": {n: placements(p) for n, p in model.named_parameters()},
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}}
