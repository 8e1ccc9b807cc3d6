"""Rank function for tests/test_gather_paths.py: fsdp_lab's fully_shard beside torch's on one small model whose
blocks have dims that divide by the world size and a head that does not, so one launch runs both copy-in paths
([Note: one master buffer] in fsdp_lab/runtime/fsdp2/param_group.py) and the views cut once per forward ([Note: views
cut once per forward] in fsdp_lab/runtime/core/layout.py) through training, evaluation forwards and swapped
parameters."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

D, OUT, BATCH = 8, 9, 8  # 8 rows divide by 2 and 4; the head's 9 rows do not


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _groups(model):
    from fsdp_lab.runtime.core.observed import units_of

    return {unit.name: unit.flats[0] for unit in units_of(model)}


def run(rank: int, world_size: int, lib: str) -> dict:
    if lib == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_lab import fully_shard
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward_views, backward_views = [], []  # what the block's attribute is in each training forward, backward
    fc = model.blocks[0].fc
    fc.register_forward_pre_hook(lambda m, args: forward_views.append(m.weight) if torch.is_grad_enabled() else None)
    fc.register_full_backward_pre_hook(lambda m, grad: backward_views.append(m.weight))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH * world_size, D, generator=gen), torch.randn(BATCH * world_size, OUT, generator=gen))
               for _ in range(6)]
    out = {"losses": [], "evals": []}

    def step(i):
        x, y = (t.chunk(world_size)[rank] for t in batches[i])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world_size)

    def evaluate():
        x, _y = batches[0]
        with torch.no_grad():
            out["evals"].append(model(x.chunk(world_size)[rank]).sum().item())
        with torch.inference_mode():
            out["evals"].append(model(x.chunk(world_size)[rank]).sum().item())

    for i in range(2):
        step(i)
    if lib == "fsdp_lab":
        groups = _groups(model)
        out["fast_before"] = {name: g.copies_master() for name, g in groups.items()}
        g = groups["blocks.0"]
        # End to end in the master, each at offset 0 of a storage of its own ([Note: a piece's own storage])
        shards = g.local_shards()
        ends = [t.data_ptr() + t.numel() * t.element_size() for t in shards]
        out["locals_share_one_buffer"] = shards[0].data_ptr() == g._master.data_ptr() and all(
            t.data_ptr() == end for t, end in zip(shards[1:], ends))
        out["locals_at_offset_0"] = all(t.storage_offset() == 0 for t in shards)
    evaluate()  # the views first made under grad mode serve no_grad and inference_mode forwards unchanged
    step(2)
    # Give one block new parameters (load_state_dict(assign=True) replaces them): copy-in must notice
    block = model.blocks[1]
    block.load_state_dict({k: v.detach().clone() for k, v in block.state_dict().items()}, assign=True)
    for i in range(3, 6):
        step(i)
    evaluate()
    if lib == "fsdp_lab":
        out["fast_after"] = {name: g.copies_master() for name, g in _groups(model).items()}
    out["views"] = {"forwards": len(forward_views), "backwards": len(backward_views),
                    "backward_reuses_forward": all(b is f for f, b in zip(forward_views, backward_views)),
                    "fresh_each_forward": len({id(v) for v in forward_views}) == len(forward_views)}
    model.reshard()  # the root keeps its parameters unsharded after forward; torch's then registers those
    out["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    out["rank"] = rank
    return out
