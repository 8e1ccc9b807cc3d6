"""Rank functions for test_comm_path.py (spawned ranks import them by module path)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab import FSDP, MixedPrecision, ShardingStrategy
from fsdp_lab.checkpoint.sharded import full_state_dict, load, save
from fsdp_lab.runtime.core.collectives import all_reduce_mean, reduce_scatter_mean
from fsdp_lab.wrap import ModuleWrapPolicy

SIZES = (7, 13, 5, 3)  # odd widths: every unit's flat buffer needs padding, shards split parameters unevenly
GLOBAL_BATCH, STEPS, LR = 6, 3, 0.05


def uneven_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(SIZES) - 2 else [])
    return nn.Sequential(*layers)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, SIZES[0], generator=g), torch.randn(GLOBAL_BATCH, SIZES[-1], generator=g)


def make_step(kind: str, params):
    """An optimizer step of one kind: AdamW fused / foreach / for-loop, or a hand-written SGD through `.data`
    (which bumps no version counter)."""
    if kind == "data":
        def step():
            for p in params:
                p.data.add_(p.grad, alpha=-LR)
                p.grad = None
        return step
    opt = torch.optim.AdamW(params, lr=LR, **{"fused": {"fused": True}, "foreach": {"foreach": True},
                                              "forloop": {"foreach": False}}[kind])

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def reference(kind: str) -> list[dict]:
    """Single-process training on the whole batch: the state dict after each step."""
    model = uneven_mlp()
    step = make_step(kind, list(model.parameters()))
    states = []
    for i in range(STEPS):
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def zero1_training(rank: int, world_size: int, kind: str) -> dict:
    """ZERO1 on uneven ranks' slices; after every optimizer step (before the next forward) the exported state dict
    is compared on rank 0 with single-process training. Also which collectives ran."""
    model = FSDP(uneven_mlp(), sharding_strategy=ShardingStrategy.ZERO1, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    kinds = set()
    model.set_tracer(type("T", (), {"emit": lambda self, e, **k: kinds.update(c.kind for c in k["collectives"]),
                                    "on_backward_end": lambda self: None})())
    step = make_step(kind, list(model.parameters()))
    per = GLOBAL_BATCH // world_size
    exported = []
    for i in range(STEPS):
        x, y = batch(i)
        nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        step()
        exported.append(full_state_dict(model))
    # and the replicas the next forward computes with
    with torch.no_grad():
        out = model(batch(STEPS)[0])
    if rank != 0:
        return {}
    ref = reference(kind)
    diffs = [max((exported[i][k] - ref[i][k]).abs().max().item() for k in ref[i]) for i in range(STEPS)]
    ref_model = uneven_mlp()
    ref_model.load_state_dict(ref[-1])
    with torch.no_grad():
        forward_diff = (out - ref_model(batch(STEPS)[0])).abs().max().item()
    return {"export_diffs": diffs, "forward_diff": forward_diff, "collectives": sorted(kinds)}


def fp16_mean(rank: int, world_size: int, value: float) -> dict:
    """Every rank holds `value` everywhere in float16; the mean over ranks must be `value`, not inf."""
    grad = torch.full((4 * world_size,), value, dtype=torch.float16)
    _, scattered = reduce_scatter_mean(grad, dist.group.WORLD, world_size, torch.float16)
    _, reduced = all_reduce_mean(grad.clone(), dist.group.WORLD, world_size, torch.float16)
    return {"reduce_scatter": scattered.float().tolist(), "all_reduce": reduced.float().tolist()}


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (`.item()`, `bool(t)`, `float(t)`, Python `max`
    over tensors): on CUDA each one is a host sync."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def clip_host_reads(rank: int, world_size: int, norm_type: float) -> dict:
    """clip_grad_norm_ under a dispatch mode that counts host reads; plus the norm to compare with torch's."""
    model = FSDP(uneven_mlp(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    per = GLOBAL_BATCH // world_size
    x, y = batch(0)
    nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
    with HostReads() as mode:
        total = model.clip_grad_norm_(0.01, norm_type=norm_type)
    return {"host_reads": mode.reads, "norm": total.item()}


def clip_reference(norm_type: float) -> float:
    model = uneven_mlp()
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type).item()


def aligned_layout(rank: int, world_size: int, dtype_name: str) -> dict:
    """Offsets, view addresses, the padding left zero by training, and the memory count, for odd-sized layers."""
    mp = MixedPrecision(param_dtype=torch.bfloat16) if dtype_name == "bf16" else None
    model = FSDP(uneven_mlp(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    addresses = []
    hook = model.module[0].register_forward_hook(lambda m, i, o: addresses.extend(
        (m.weight.data_ptr(), m.bias.data_ptr())))
    for i in range(2):
        x, y = batch(i)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    hook.remove()
    flats = [flat for unit in model.units for flat in unit.flats]
    gaps_nonzero = 0
    for flat in flats:
        full = torch.empty(flat.padded_numel)
        dist.all_gather_into_tensor(full, flat.shard.detach().clone())
        used = torch.zeros(flat.padded_numel, dtype=torch.bool)
        for slot in flat.slots:
            used[slot.offset:slot.offset + slot.numel] = True
        gaps_nonzero += int((full[~used] != 0).sum())
    return {"offsets": [(s.offset, flat.full.element_size()) for flat in flats for s in flat.slots],
            "addresses": addresses, "gaps_nonzero": gaps_nonzero,
            "numel_padded_total": sum(f.padded_numel for f in flats),
            "numel_total": sum(f.numel for f in flats), "params": sum(p.numel() for p in uneven_mlp().parameters()),
            "memory": model.memory_report(opt).as_dict()}


def resume_fused(rank: int, world_size: int, directory: str) -> dict:
    """Train 2 steps with fused AdamW, save, load into a fresh model and optimizer, train 1 more; against 3
    uninterrupted steps. Also how the state was restored."""
    def build():
        model = FSDP(uneven_mlp(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def train(model, opt, steps):
        per = GLOBAL_BATCH // world_size
        for i in steps:
            x, y = batch(i)
            nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model, opt = build()
    train(model, opt, range(2))
    save(model, opt, directory, step=2)
    train(model, opt, range(2, 3))
    straight = full_state_dict(model)
    model2, opt2 = build()
    hooks = []
    opt2.register_load_state_dict_post_hook(lambda o: hooks.append("load_state_dict"))
    load(model2, opt2, directory)
    restored = [(str(v.device), str(v.dtype), str(p.device), str(p.dtype), name)
                for p, state in opt2.state.items() for name, v in state.items()]
    train(model2, opt2, range(2, 3))
    resumed = full_state_dict(model2)
    diff = max((resumed[k] - straight[k]).abs().max().item() for k in straight) if rank == 0 else 0.0
    return {"hooks": hooks, "restored": restored, "diff": diff}
