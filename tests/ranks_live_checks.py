"""Rank function for the exercise checks: each check given a right answer and the usual wrong ones, on a real
2-rank model, returns what it said."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab import FSDP, MixedPrecision, ShardingStrategy
from fsdp_lab.lessons.live import checks
from fsdp_lab.observe import trace
from fsdp_lab.training.models import Block, CausalSelfAttention, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy


def _step(model, rank, world_size, opt=None):
    x, y = batch_for_step(model.module.cfg, 0, 4, 32)
    loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
    loss.backward()
    if opt is not None:
        opt.step()
    return loss


def say_everything(rank: int, world_size: int) -> dict:
    out = {}
    phi = sum(p.numel() for p in build_gpt("tiny").parameters())
    model = FSDP(build_gpt("tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}), backward_prefetch=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with trace.record(model, optimizer=opt) as tr:
        _step(model, rank, world_size, opt)
    events = tr.events
    out["state"] = {name: str(checks.state_bytes(v, model, opt)) for name, v in
                    {"right": 16 * phi / world_size, "not divided": 16 * phi, "params only": 4 * phi / world_size,
                     "no adam": 8 * phi / world_size, "no grads": 12 * phi / world_size}.items()}

    def right(numel, n, r):
        size = -(-numel // n)
        return r * size, (r + 1) * size

    def unpadded(numel, n, r):
        return r * (numel // n), (r + 1) * (numel // n) - 1

    out["shard"] = {"right": str(checks.shard_range(right, model)), "wrong": str(checks.shard_range(unpadded, model))}

    def order(blocks, strategy):
        ev = [("gather", "<root>")]
        for b in blocks:
            ev += [("gather", b), ("free", b)]
        for b in reversed(blocks):
            ev += [("regather", b), ("reduce_scatter", b), ("free", b)]
        return ev + [("reduce_scatter", "<root>"), ("free", "<root>")]

    def no_free(blocks, strategy):
        return [p for p in order(blocks, strategy) if p != ("free", blocks[0])]

    out["beats"] = {"right": str(checks.beat_order(order, events, "FULL_SHARD")),
                    "wrong": str(checks.beat_order(no_free, events, "FULL_SHARD"))}
    out["mp"] = {"none": str(checks.mixed_precision(model))}
    policies = {"right": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "bf16 reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
    for name, policy in policies.items():
        out["mp"][name] = str(checks.mixed_precision(FSDP(build_gpt("tiny"), mixed_precision=policy)))
    zero2 = FSDP(build_gpt("tiny"), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                 auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, y = batch_for_step(zero2.module.cfg, 0, 4, 32)
    loss = zero2(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
    report = zero2.memory_report()
    loss.backward()
    padded = sum(f.padded_numel for u in zero2.units for f in u.flats)
    out["after_forward"] = {"right": str(checks.gathered_after_forward(4 * padded, report, zero2)),
                            "shard": str(checks.gathered_after_forward(4 * padded / world_size, report, zero2))}
    small = ModuleWrapPolicy({CausalSelfAttention})
    out["units"] = {"right": str(checks.wrapped_units(model, Block)),
                    "none": str(checks.wrapped_units(FSDP(build_gpt("tiny")), Block)),
                    "size": str(checks.wrapped_units(FSDP(build_gpt("tiny"), auto_wrap_policy=small), Block))}
    grads = [torch.arange(8.0) * (r + 1) for r in range(world_size)]
    summed = torch.empty(8 // world_size)
    dist.reduce_scatter(summed, list(grads[rank].chunk(world_size)))
    out["rs"] = {"right": str(checks.reduce_scatter_mean(summed / world_size, grads, rank)),
                 "sum": str(checks.reduce_scatter_mean(summed, grads, rank)),
                 "own": str(checks.reduce_scatter_mean(grads[rank][rank * 4:(rank + 1) * 4], grads, rank))}
    out["losses"] = {"right": str(checks.same_losses([1.0, 0.5], [1.0, 0.5])),
                     "wrong": str(checks.same_losses([1.0, 0.5], [1.0, 0.6]))}
    with trace.record(FSDP(build_gpt("tiny"), sharding_strategy=ShardingStrategy.NO_SHARD)) as ddp_tr:
        _step(ddp_tr.model, rank, world_size)
    f = sum(e["bytes_sent"] for e in events if e["step"] == 0)
    d = sum(e["bytes_sent"] for e in ddp_tr.events if e["step"] == 0)
    out["ratio"] = {"right": str(checks.comm_ratio(f / d, events, ddp_tr.events)),
                    "inverted": str(checks.comm_ratio(d / f, events, ddp_tr.events))}
    return out


def say_to_other_models(rank: int, world_size: int) -> dict:
    """Every check that reads a model, given a plain nn.Module and the other front end's model."""
    from fsdp_lab import fully_shard

    plain = build_gpt("tiny")
    fsdp1 = FSDP(build_gpt("tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}))
    fsdp2 = build_gpt("tiny")
    for block in fsdp2.blocks:
        fully_shard(block)
    fully_shard(fsdp2)

    def rows(dim0, n, r):
        size = -(-dim0 // n)
        return min(r * size, dim0), min((r + 1) * size, dim0)

    calls = {"state_bytes": lambda m: checks.state_bytes(1000.0, m, None),
             "shard_range": lambda m: checks.shard_range(rows, m),
             "mixed_precision": lambda m: checks.mixed_precision(m),
             "gathered_after_forward": lambda m: checks.gathered_after_forward(1000.0, None, m),
             "wrapped_units": lambda m: checks.wrapped_units(m, Block),
             "dim0_rows": lambda m: checks.dim0_rows(rows, m)}
    out = {}
    for name, call in calls.items():
        others = {"plain": plain, "fully_shard": fsdp2} if name != "dim0_rows" else {"plain": plain, "FSDP": fsdp1}
        for kind, model in others.items():
            try:
                out[name, kind] = str(call(model))
            except Exception as exc:  # noqa: BLE001 - a raise is what the test refuses
                out[name, kind] = f"raised {type(exc).__name__}: {exc}"
    out["dim0_rows", "fully_shard"] = str(checks.dim0_rows(rows, fsdp2))
    return out
