"""Ranks for tests/test_fsdp_module_methods.py: torch 2.13's FSDPModule methods, in scripts where only the import
differs (torch or fsdp_lab). Each case returns what the test compares with torch: gradients, losses, and how many
collectives ran.

- divide: set_force_sum_reduction_for_comms + set_gradient_divide_factor; and a factor alone (fsdp_lab only:
  torch's PREMUL_SUM does not run on gloo).
- hook: set_all_reduce_hook doubling each reduced gradient, and the hook's calls.
- unused: set_reduce_scatter_unused_params with a tower skipped on every rank in step 2 and an expert used on one
  rank only.
- unshard_in_backward: an embedding that backward does not re-gather (one all-gather fewer).
- custom: set_custom_all_gather / set_custom_reduce_scatter with counting collectives.
- separate: set_separate_reduce_scatter_group.
- reset: a forward that raises in a block, reset_iter_state on the root, then training as if nothing failed.
- errors: what bad arguments raise (max input buffers, reset on a non-root, deprecated divide factor).
- hsdp (4 ranks, 2×2): set_requires_all_reduce(False) for the first of two micro-batches.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from ranks_fully_shard import api, full, mesh
from torch import nn

D = 8


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Experts(nn.Module):
    """Two experts in one group; expert 1 runs on rank 1 only (a parameter unused on one rank)."""

    def __init__(self):
        super().__init__()
        self.e0, self.e1 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, rank: int):
        return self.e0(x) + (self.e1(x) if rank == 1 else 0.0)


class Boom(RuntimeError):
    pass


class Net(nn.Module):
    def __init__(self, experts: bool = False):
        super().__init__()
        self.embed = nn.Embedding(13, D)
        self.blocks = nn.ModuleList(Tower() for _ in range(2))
        self.experts = Experts() if experts else None
        self.tower = Tower()
        self.head = nn.Linear(D, 1)
        self.fail_in_block = False

    def forward(self, idx, rank: int = 0, use_tower: bool = True, use_experts: bool = False):
        h = self.embed(idx).mean(1)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 0 and self.fail_in_block:
                raise Boom("a failure half-way through forward")
        if use_experts:
            h = self.experts(h, rank)
        if use_tower:
            h = h + self.tower(h)
        return self.head(h)


def build(lib: str, world_size: int, dp_mesh=None, experts: bool = False):
    torch.manual_seed(0)
    model = Net(experts)
    fsdp = api(lib)
    m = dp_mesh if dp_mesh is not None else mesh(world_size)
    fsdp.fully_shard(model.embed, mesh=m)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=m)
    fsdp.fully_shard(model.tower, mesh=m)
    if experts:
        fsdp.fully_shard(model.experts, mesh=m)
    fsdp.fully_shard(model, mesh=m)
    return model


def data(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(50 + step)
    idx, y = torch.randint(0, 13, (4 * world_size, 3), generator=g), torch.randn(4 * world_size, 1, generator=g)
    return idx[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def step(model, rank, world_size, i, **forward_kwargs):
    idx, y = data(i, rank, world_size)
    loss = nn.functional.mse_loss(model(idx, rank, **forward_kwargs), y)
    loss.backward()
    return loss.detach().item()


def grads(model) -> dict:
    return {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}


def fsdp_modules(model):
    return [m for m in model.modules() if type(m).__name__.startswith("FSDP")]


class Counter:
    """Counts all-gathers inside a `with`, for both libraries: torch 2.13's FSDP2 calls dist.all_gather_single;
    fsdp_lab calls its collectives module's `_all_gather`."""

    def __init__(self, lib: str):
        if lib == "torch":
            self.owner, self.name = dist, "all_gather_single"
        else:
            from fsdp_lab.runtime.core import collectives

            self.owner, self.name = collectives, "_all_gather"
        self.count = 0

    def __enter__(self):
        self.orig = getattr(self.owner, self.name)

        def counted(*args, **kwargs):
            self.count += 1
            return self.orig(*args, **kwargs)

        setattr(self.owner, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.orig)


class CountingAllGather:
    """torch's AllGather interface (torch.distributed.fsdp's _fsdp_api), counting its calls and allocations."""

    def __init__(self):
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _as_torch_comm(comm, base: str):
    """Make the counting comm an instance of torch's abstract class as well (torch checks nothing, but a user's
    comm subclasses it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    cls = type(f"Torch{type(comm).__name__}", (type(comm), getattr(_fsdp_api, base)), {})
    comm.__class__ = cls
    return comm


def case_divide(lib, rank, world_size):
    model = build(lib, world_size)
    for m in fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(4.0)
    step(model, rank, world_size, 0)
    out = {"force_sum": grads(model)}
    if lib == "fsdp_lab":  # without force-sum torch needs PREMUL_SUM, which gloo lacks
        plain, scaled = build(lib, world_size), build(lib, world_size)
        for m in fsdp_modules(scaled):
            m.set_gradient_divide_factor(4.0)
        step(plain, rank, world_size, 0)
        step(scaled, rank, world_size, 0)
        out["default"], out["factor"] = grads(plain), grads(scaled)
    return out


def case_hook(lib, rank, world_size):
    model = build(lib, world_size)
    seen = []

    def double(reduced: torch.Tensor) -> None:
        seen.append(reduced.numel())
        reduced.mul_(2)

    for m in fsdp_modules(model):
        m.set_all_reduce_hook(double)
    step(model, rank, world_size, 0)
    return {"grads": grads(model), "hook_calls": len(seen), "hook_numel": sorted(seen)}


def case_unused(lib, rank, world_size):
    model = build(lib, world_size, experts=True)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [step(model, rank, world_size, 0, use_experts=True)]
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(step(model, rank, world_size, 1, use_tower=False, use_experts=True))
    return {"grads": grads(model), "losses": losses}


def case_unshard_in_backward(lib, rank, world_size):
    counts = {}
    for setting in (True, False):
        model = build(lib, world_size)
        model.embed.set_unshard_in_backward(setting)
        with Counter(lib) as counter:
            step(model, rank, world_size, 0)
        counts[setting] = (counter.count, grads(model))
    return {"gathers_on": counts[True][0], "gathers_off": counts[False][0], "grads_on": counts[True][1],
            "grads_off": counts[False][1]}


def case_custom(lib, rank, world_size):
    model = build(lib, world_size)
    gather, scatter = _as_torch_comm(CountingAllGather(), "AllGather"), \
        _as_torch_comm(CountingReduceScatter(), "ReduceScatter")
    for block in model.blocks:
        block.set_custom_all_gather(gather)
        block.set_custom_reduce_scatter(scatter)
        block.set_force_sum_reduction_for_comms(True)  # torch's default op (AVG) does not run on gloo
    loss = step(model, rank, world_size, 0)
    return {"grads": grads(model), "loss": loss, "gather_calls": gather.calls, "scatter_calls": scatter.calls,
            "scatter_allocations": scatter.allocations}


def case_separate(lib, rank, world_size):
    model = build(lib, world_size)
    model.set_separate_reduce_scatter_group()
    step(model, rank, world_size, 0)
    out = {"grads": grads(model)}
    if lib == "fsdp_lab":
        state = model.__dict__["_fsdp_lab_state"]
        groups = {id(s.unit.reduce_options.reduce_scatter_pg) for s in state.states}
        out["own_groups"] = len(groups)
        out["shares_shard_group"] = any(s.unit.reduce_options.reduce_scatter_pg is state.ctx.pg for s in state.states)
    return out


def case_reset(lib, rank, world_size):
    model = build(lib, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = [step(model, rank, world_size, 0)]
    opt.step()
    opt.zero_grad()
    model.fail_in_block = True
    try:
        step(model, rank, world_size, 1)
        raised = False
    except Boom:
        raised = True
    model.fail_in_block = False
    model.reset_iter_state()
    for i in (1, 2):
        losses.append(step(model, rank, world_size, i))
        opt.step()
        opt.zero_grad()
    try:
        model.blocks[0].reset_iter_state()
        non_root = None
    except RuntimeError as err:
        non_root = str(err)
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"raised": raised, "losses": losses, "params": params, "non_root": non_root}


def case_errors(lib, rank, world_size):
    model = build(lib, world_size)
    out = {}
    for bad in (True, 1.5, 0):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
            out[repr(bad)] = None
        except (TypeError, ValueError) as err:
            out[repr(bad)] = (type(err).__name__, str(err))
    model.set_reduce_scatter_max_input_buffers(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(2.0)
    out["deprecation"] = sorted({(w.category.__name__, str(w.message)) for w in caught})
    step(model, rank, world_size, 0)
    return out


def case_hsdp(lib, rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(lib, world_size, dp_mesh=dp_mesh)
    try:
        model.set_all_reduce_hook(lambda t: None, stream=object())
        stream_error = None
    except ValueError as err:
        stream_error = str(err)
    model.set_requires_all_reduce(False)
    step(model, rank, world_size, 0)
    after_first = {n: g is None for n, g in grads(model).items()}
    model.set_requires_all_reduce(True)
    step(model, rank, world_size, 1)
    return {"stream_error": stream_error, "none_after_first": after_first, "grads": grads(model)}


CASES_2 = ("divide", "hook", "unused", "unshard_in_backward", "custom", "separate", "reset", "errors")


def run_cases(rank: int, world_size: int, lib: str, names: tuple) -> dict:
    return {name: globals()[f"case_{name}"](lib, rank, world_size) for name in names}
