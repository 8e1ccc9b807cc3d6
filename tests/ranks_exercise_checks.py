"""Ranks for tests/test_exercise_checks.py: the live checks that read a wrapped model, fed the solution and the
wrong answers a learner types, on the tiny GPT over 2 gloo ranks. Each case is (ok, todo, message)."""
from __future__ import annotations

import torch

from fsdp_lab import FSDP, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy, fully_shard
from fsdp_lab.lessons.live import checks
from fsdp_lab.training.models import Block, CausalSelfAttention, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy


def _v(verdict) -> tuple:
    return verdict.ok, verdict.todo, verdict.message


def _wrapped(**kw) -> FSDP:
    return FSDP(build_gpt("tiny"), **kw)


def _batch(rank, world_size, cfg):
    x, y = batch_for_step(cfg, 0, global_batch=4, seq_len=32)
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


def run_cases(rank: int, world_size: int) -> dict:
    out = {}
    blocks = ModuleWrapPolicy({Block})

    # chapters 01 and 07: the state one rank holds after an AdamW step
    net = build_gpt("tiny")
    phi = sum(p.numel() for p in net.parameters())
    model = FSDP(net, auto_wrap_policy=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(rank, world_size, net.cfg)
    model(x, y).backward()
    opt.step()
    out["state"] = {name: _v(checks.state_bytes(value, model, opt)) for name, value in {
        "solution": 16 * phi / world_size, "undivided": 16 * phi, "params_only": 4 * phi / world_size,
        "no_adam": 8 * phi / world_size, "stub": None}.items()}

    # chapter 04: the mixed-precision policy
    policies = {"solution": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "bf16_reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                "no_param_dtype": MixedPrecision(reduce_dtype=torch.float32), "none": None}
    out["mixed"] = {name: _v(checks.mixed_precision(_wrapped(auto_wrap_policy=blocks, mixed_precision=p)))
                    for name, p in policies.items()}
    out["mixed"]["stub"] = _v(checks.mixed_precision(None))

    # chapter 05: gathered parameters after SHARD_GRAD_OP's forward
    model = _wrapped(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=blocks)
    padded = sum(flat.padded_numel for unit in model.units for flat in unit.flats)
    root = sum(flat.padded_numel for unit in model.units if unit.is_root for flat in unit.flats)
    loss = model(x, y)
    report = model.memory_report()
    loss.backward()
    out["gathered"] = {name: _v(checks.gathered_after_forward(value, report, model)) for name, value in {
        "solution": 4 * padded, "a_shard": 4 * padded / world_size, "root_only": 4 * root, "stub": None}.items()}

    # chapter 06: one unit per Block
    out["units"] = {name: _v(checks.wrapped_units(_wrapped(auto_wrap_policy=p), Block)) for name, p in {
        "solution": blocks, "attention": ModuleWrapPolicy({CausalSelfAttention}), "no_policy": None}.items()}

    # chapter 02 on the model, chapter 06a on a fully_shard model (the uneven cases come first in both)
    fsdp1 = _wrapped(auto_wrap_policy=blocks)
    out["shard_range_solution"] = _v(checks.shard_range(lambda numel, n, r: (r * -(-numel // n),
                                                                             (r + 1) * -(-numel // n)), fsdp1))
    net = build_gpt("tiny")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(net, mp_policy=mp)

    def dim0_rows(dim0, n, r):
        rows = -(-dim0 // n)
        start = min(r * rows, dim0)
        return start, min(start + rows, dim0)

    out["dim0_solution"] = _v(checks.dim0_rows(dim0_rows, net))
    out["dim0_on_fsdp1"] = _v(checks.dim0_rows(dim0_rows, fsdp1))

    def divided(size, n, r):  # plain division: every unit and parameter of the tiny GPT divides by 2
        return r * (size // n), (r + 1) * (size // n)

    def stub(*_args):
        raise NotImplementedError("the stub")

    out["shard_range_divided"] = _v(checks.shard_range(divided, fsdp1))
    out["dim0_divided"] = _v(checks.dim0_rows(divided, net))
    out["dim0_stub"] = _v(checks.dim0_rows(stub, net))

    # chapter 06b: the HSDP groups, on a HYBRID_SHARD model of 2 nodes x 1 rank (the live ranks' grid)
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = FSDP(build_gpt("tiny"), sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=blocks,
                device_mesh=init_device_mesh("cpu", (world_size, 1)))

    def groups(r, nodes, per_node):
        node, local = divmod(r, per_node)
        return ([node * per_node + i for i in range(per_node)], [n * per_node + local for n in range(nodes)])

    out["hsdp"] = {"solution": _v(checks.hsdp_groups(groups, hsdp, nodes=world_size)),
                   "swapped": _v(checks.hsdp_groups(lambda r, m, g: groups(r, m, g)[::-1], hsdp, nodes=world_size)),
                   "stub": _v(checks.hsdp_groups(stub, hsdp, nodes=world_size)),
                   "full_shard": _v(checks.hsdp_groups(groups, fsdp1, nodes=world_size)),
                   "fully_shard": _v(checks.hsdp_groups(groups, net, nodes=world_size))}
    return out
