"""Ranks for tests/test_fully_shard_options.py: fully_shard of a list of modules as one group
([Note: one group over several modules] in fsdp_lab/runtime/fsdp2/module_group.py), in a script where only the
import differs (torch or fsdp_lab): an untied embedding and output head share one group, each block has its own."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from ranks_fully_shard import BATCH, D, SEQ, VOCAB, Block, api, full, mesh, reshard_all
from torch import nn


class TwoEnds(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(D) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, skip_head: bool = False):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) if skip_head else self.head(self.norm(x))


def _batch(step, rank, world_size):
    g = torch.Generator().manual_seed(7 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    n = BATCH // world_size
    return idx[rank * n:(rank + 1) * n], ((idx * 5 + 2) % VOCAB)[rank * n:(rank + 1) * n]


def _train(model, rank, world_size, steps: int, count_gathers_of: str = "") -> tuple[list, list]:
    """AdamW steps; returns the losses averaged over ranks and, given a lib, each step's all-gathers."""
    from ranks_fsdp_module_methods import Counter

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gathers = [], []
    for step in range(steps):
        idx, y = _batch(step, rank, world_size)
        counter = Counter(count_gathers_of) if count_gathers_of else None
        with counter or contextlib.nullcontext():
            loss = nn.functional.cross_entropy(model(idx).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
        gathers.append(counter.count if counter else None)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses, gathers


def run_list_group(rank, world_size, lib):
    torch.manual_seed(0)
    model = TwoEnds()
    fsdp = api(lib)
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh(world_size))
    returned = fsdp.fully_shard([model.embed, model.head], mesh=mesh(world_size))
    fsdp.fully_shard(model, mesh=mesh(world_size))
    classes = [type(m).__name__ for m in (model.embed, model.head, model)]
    same_state = model.embed._get_fsdp_state() is model.head._get_fsdp_state() if lib == "torch" else \
        model.embed.__dict__["_fsdp_lab_state"] is model.head.__dict__["_fsdp_lab_state"]
    losses, _gathers = _train(model, rank, world_size, 3)
    with torch.no_grad():  # a pass where the head never runs: the root completes the group
        idx, _y = _batch(9, rank, world_size)
        skipped = model(idx, skip_head=True).float().sum().item()
        group_state = None
        if lib == "fsdp_lab":  # the root's post-forward closed the pass and freed the group
            state = model.embed.__dict__["_fsdp_lab_state"]
            group_state = (state.group_hooks.open, state.unit.state.name)
        after = model(idx).float().sum().item()
    reshard_all(model)
    return {"returned_list": returned == [model.embed, model.head], "classes": classes, "same_state": same_state,
            "losses": losses, "skipped": skipped, "after": after, "group_state": group_state,
            "params": {n: full(p) for n, p in model.named_parameters()},
            "keys": sorted(model.state_dict())}


def run_checkpoint_wrapper(rank, world_size, lib):
    """torchtitan's apply_ac then apply_fsdp: each block wrapped by checkpoint_wrapper, then fully_shard on the
    wrappers and the root. Returns losses, parameters and all-gathers per step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    torch.manual_seed(0)
    model = TwoEnds()
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    fsdp = api(lib)
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh(world_size))
    fsdp.fully_shard(model, mesh=mesh(world_size))
    losses, gathers = _train(model, rank, world_size, 3, count_gathers_of=lib)
    reshard_all(model)
    return {"losses": losses, "gathers": gathers, "keys": sorted(model.state_dict()),
            "params": {n: full(p) for n, p in model.named_parameters()}}


def run_compile(rank, world_size, lib):
    """torchtitan's apply_compile: each block compiled on its own, before fully_shard (fullgraph=True) and after
    it. The aot_eager backend traces with Dynamo and AOTAutograd as inductor does, without a C++ toolchain."""
    fsdp = api(lib)
    out = {}
    for when in ("before", "after"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TwoEnds()
        for layer in model.layers:
            if when == "before":
                layer.compile(fullgraph=True, backend="aot_eager")
            fsdp.fully_shard(layer, mesh=mesh(world_size))
            if when == "after":
                layer.compile(backend="aot_eager")
        fsdp.fully_shard(model, mesh=mesh(world_size))
        losses, _gathers = _train(model, rank, world_size, 2)
        reshard_all(model)
        out[when] = {"losses": losses, "params": {n: full(p) for n, p in model.named_parameters()}}
    return out
