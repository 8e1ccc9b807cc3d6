"""Ranks for tests/test_shard_placement.py: fully_shard(..., shard_placement_fn=...) in a script where only the
import differs (torch, fsdp_lab, or "plain": one process, no sharding). One launch per library runs every case
([Note: sharding on another dim] in fsdp_lab/runtime/fsdp2/shard_dim.py):

    fp32     2-D weights on Shard(1) (one block asks for Shard(-1)), the rest on the default Shard(0), a frozen
             weight on Shard(1) in a trainable block; AdamW, each step two micro-batches, the first under
             set_requires_gradient_sync(False); then the model's state dict saved with DCP
    bf16     the same under MixedPrecisionPolicy(bf16 parameters, fp32 reduction)
    offload  the same under CPUOffloadPolicy(pin_memory=False)
    hsdp     the same on a (1, 2) HSDP mesh: placements (Replicate(), Shard(1))
    load     each library's Shard(1) checkpoint loaded with DCP into Shard(0) models of both libraries
    refused  an uneven Shard(1) (torch refuses it too), and, fsdp_lab only, a Shard(1) of a tensor parallel weight
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from ranks_fully_shard import api, full, mean_over_ranks, reshard_all
from torch import nn
from torch.distributed.tensor import DTensor, Shard

D, VOCAB, SEQ, BATCH = 8, 11, 5, 8  # dim 1 of every weight (8, 10) divides by 2; 11 and 10 rows need not
STEPS = 3


class Block(nn.Module):
    def __init__(self, frozen_gate: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, D + 2)
        self.down = nn.Linear(D + 2, D)
        self.gate = nn.Linear(D, D, bias=False)
        if frozen_gate:
            self.gate.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.tanh(self.up(h))) * torch.sigmoid(self.gate(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(), Block(frozen_gate=True)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)  # 11 rows: its bias stays on an uneven Shard(0)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def columns(p):
    return Shard(1) if p.ndim == 2 else None


def last_dim(p):
    return Shard(-1) if p.ndim == 2 else None


def build(lib: str, world_size: int, mesh=None, shard_dim: int = 1, **kwargs) -> Model:
    torch.manual_seed(0)
    model = Model()
    if lib == "plain":
        return model
    fsdp = api(lib)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
    fns = (columns, last_dim, columns) if shard_dim else (None, None, None)
    for layer, fn in zip(model.layers, fns):
        fsdp.fully_shard(layer, mesh=mesh, shard_placement_fn=fn, **kwargs)
    fsdp.fully_shard(model, mesh=mesh, shard_placement_fn=fns[2], **kwargs)
    return model


def _batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(30 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    n = BATCH // world_size
    return idx[rank * n:(rank + 1) * n], ((idx * 3 + 1) % VOCAB)[rank * n:(rank + 1) * n]


def _loss(model, idx, y):
    return nn.functional.cross_entropy(model(idx).float().reshape(-1, VOCAB), y.reshape(-1))


def train(model, lib: str, rank: int, world_size: int, steps: int = STEPS) -> list:
    """AdamW steps of two micro-batches (one process: the whole batch at once), the first without gradient
    sync; returns the losses averaged over ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        idx, y = _batch(step, rank, world_size)
        if lib == "plain":
            loss = _loss(model, idx, y)
            loss.backward()
            losses.append(loss.item())
        else:
            half, total = idx.shape[0] // 2, 0.0
            for i, sync in enumerate((False, True)):
                model.set_requires_gradient_sync(sync)
                loss = _loss(model, idx[i * half:(i + 1) * half], y[i * half:(i + 1) * half]) / 2
                loss.backward()
                total += mean_over_ranks(loss, world_size)
            losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses


def layout(model) -> dict:
    """Each parameter's placements and local shape, and what state_dict() holds for it."""
    out = {}
    state = model.state_dict()
    for name, p in model.named_parameters():
        value = state[name]
        out[name] = {"placements": [str(pl) for pl in p.placements] if isinstance(p, DTensor) else None,
                     "local": tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
                     "global": tuple(p.shape),
                     "state_dict": ([str(pl) for pl in value.placements] if isinstance(value, DTensor) else None)}
    return out


def full_params(model) -> dict:
    reshard_all(model)
    return {name: full(p) for name, p in model.named_parameters()}


def trained(lib, rank, world_size, mesh=None, **kwargs) -> dict:
    model = build(lib, world_size, mesh, **kwargs)
    before = layout(model) if lib != "plain" else None
    losses = train(model, lib, rank, world_size)
    return {"layout": before, "losses": losses, "params": full_params(model), "model": model,
            "grads": {n: p.grad is not None for n, p in model.named_parameters()}}


def error(fn) -> str | None:
    try:
        fn()
    except (ValueError, NotImplementedError, AssertionError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def run(rank, world_size, lib, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    fp32 = trained(lib, rank, world_size)
    model = fp32.pop("model")
    out["fp32"] = fp32
    if lib == "plain":
        return out
    dcp.save(model.state_dict(), checkpoint_id=f"{folder}/{lib}")
    mp = api(lib).MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases = {"bf16": {"mp_policy": mp}, "offload": {"offload_policy": api(lib).CPUOffloadPolicy(pin_memory=False)},
             "hsdp": {"mesh": init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))}}
    for case, kwargs in cases.items():
        result = trained(lib, rank, world_size, **kwargs)
        result.pop("model")
        out[case] = result
    dist.barrier()  # every rank has saved before any loads
    loads = {}
    for saved in ("torch", "fsdp_lab") if lib == "fsdp_lab" else ("torch",):
        for into in ("torch", "fsdp_lab"):
            target = build(into, world_size, shard_dim=0)
            state = target.state_dict()
            dcp.load(state, checkpoint_id=f"{folder}/{saved}")
            loads[f"{saved}->{into}"] = {"params": full_params(target), "layout": layout(target)}
    out["loads"] = loads
    out["saved"] = fp32["params"]
    out["refused"] = {"uneven": error(lambda: api(lib).fully_shard(nn.Linear(3, 4), shard_placement_fn=columns))}
    if lib == "fsdp_lab":
        from torch.distributed.tensor import distribute_tensor

        two_d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
        tp_placed = nn.Linear(4, 4)
        tp_placed.weight = nn.Parameter(distribute_tensor(tp_placed.weight.detach(), two_d["tp"], [Shard(0)]))
        out["refused"]["tp"] = error(lambda: api(lib).fully_shard(tp_placed, mesh=two_d["dp"],
                                                                 shard_placement_fn=columns))
    return out
