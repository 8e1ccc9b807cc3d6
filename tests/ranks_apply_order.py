"""Ranks for tests/test_apply_order.py: chapter 06c's apply_order check fed the solution, the stub and the wrong
orders a learner types, on the chapter's model over 4 gloo ranks (a 2 × 2 mesh). Each case is (ok, todo, message)."""
from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor.parallel import parallelize_module

from fsdp_lab import fully_shard
from fsdp_lab.lessons.experiments.composing import tp_plan
from fsdp_lab.lessons.live import checks


def _tp(model, mesh):
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())


def _ac(model, mesh):
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def _compile(model, mesh):
    for block in model.layers:
        block.compile(fullgraph=True, backend="aot_eager")


def _fsdp(model, mesh, on=None, root=True):
    on = mesh["dp"] if on is None else on
    for block in model.layers:
        fully_shard(block, mesh=on)
    if root:
        fully_shard(model, mesh=on)


def solution(model, mesh):
    _tp(model, mesh)
    _ac(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh)


def stub(model, mesh):
    raise NotImplementedError("parallelize: apply_tp, apply_ac, apply_compile, apply_fsdp")


def fsdp_before_tp(model, mesh):
    _ac(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh)
    for block in model.layers:
        parallelize_module(block._checkpoint_wrapped_module, mesh["tp"], tp_plan())


def whole_mesh(model, mesh):
    _tp(model, mesh)
    _ac(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh, on=mesh)


def no_root(model, mesh):
    _tp(model, mesh)
    _ac(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh, root=False)


def ac_after_fsdp(model, mesh):
    _tp(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh)
    _ac(model, mesh)


def no_tp(model, mesh):
    _ac(model, mesh)
    _compile(model, mesh)
    _fsdp(model, mesh)


CASES = (solution, stub, fsdp_before_tp, whole_mesh, no_root, ac_after_fsdp, no_tp)


def run_cases(rank: int, world_size: int) -> dict:
    v = checks.apply_order(solution, world_size, eager=False)
    out = {"solution_compiled": (v.ok, v.todo, v.message)}
    for case in CASES:
        v = checks.apply_order(case, world_size)
        out[case.__name__] = (v.ok, v.todo, v.message)
    return out
