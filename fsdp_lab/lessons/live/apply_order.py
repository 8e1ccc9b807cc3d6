"""The check of chapter 06c's exercise: torchtitan's order, apply_tp → apply_ac → apply_compile → apply_fsdp.

[Note: reading the order off the model] The learner writes `parallelize(model, mesh)`. The check calls it on a
fresh chapter model and the rank's own 2-D mesh, then reads what each step leaves behind, which is different
for each wrong order:
    tensor parallel   each block weight a DTensor whose mesh names ("dp", "tp"): tp placed it first, then
                      fully_shard sharded its local slice on "dp". A weight on ("dp",) alone means fully_shard
                      ran first (or tp never did): parallelize_module then meets DTensors it did not place.
    mesh["dp"]        fsdp_lab refuses fully_shard over tp's DTensors on the whole 2-D mesh by name (an HSDP
                      mesh); the ValueError is caught and explained.
    checkpointing     each entry of model.layers a CheckpointWrapper that is itself the fully_shard module:
                      a wrapper *around* the FSDPModule means fully_shard ran first, and then the recomputation
                      would run outside the group's hooks.
    compile           each block's compiled call set (module.compile()), or an OptimizedModule.
    the root          the model itself an FSDPModule: without it each block is a root of its own, and the
                      root's own parameters (none here; a GPT's embedding and head) stay whole on every rank.
Then one forward and backward must give the single-process loss of the same model, to float32 rounding. By
default that step runs under torch.compiler.set_stance("force_eager"): the order is read off the model either
way, and compiling a tp block on four ranks sharing two cores takes longer than a notebook cell should;
eager=False runs it compiled (tests/test_apply_order.py does, for the solution).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from fsdp_lab.lessons.live.verdict import Verdict, not_written
from fsdp_lab.runtime.fsdp2.fsdp_module import FSDPModule


def _is_compiled(module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule"


def _layout_problem(model, mesh) -> str:
    """What the model says about the order ([Note: reading the order off the model]); "" when it is right."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.tensor import DTensor

    for i, layer in enumerate(model.layers):
        inner = getattr(layer, "_orig_mod", layer)
        if isinstance(inner, CheckpointWrapper) and isinstance(inner._checkpoint_wrapped_module, FSDPModule):
            return (f"layers.{i} is a checkpoint_wrapper around the fully_shard module: apply_ac goes before "
                    f"apply_fsdp, so that fully_shard's hooks sit outside the recomputed region")
        if not isinstance(inner, FSDPModule):
            return f"layers.{i} has no fully_shard of its own: apply_fsdp calls fully_shard on each block"
        if not isinstance(inner, CheckpointWrapper):
            return f"layers.{i} is not checkpointed: apply_ac wraps each block in checkpoint_wrapper"
        for name in ("w1.weight", "w2.weight"):
            p = inner.get_parameter(f"_checkpoint_wrapped_module.{name}")
            dims = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
            if dims == ("dp",):
                return (f"layers.{i}.{name} is sharded on 'dp' only: fully_shard ran before tensor parallel (or "
                        f"parallelize_module never ran); apply_tp comes first, then fully_shard shards each tp "
                        f"slice on mesh['dp']")
            if dims != ("dp", "tp"):
                return f"layers.{i}.{name} is not on the ('dp', 'tp') mesh (its mesh: {dims or 'none'})"
        if not (_is_compiled(layer) or _is_compiled(inner)):
            return f"layers.{i} is not compiled: apply_compile calls block.compile(...) on each block"
    if not isinstance(model, FSDPModule):
        return ("the root is not wrapped: finish with fully_shard(model, mesh=mesh['dp']); without it each block is "
                "a root of its own, and the root's own parameters (a GPT's embedding and head) stay whole")
    return ""


def _explained(err: Exception) -> str:
    text = str(err)
    if "2-D (HSDP) mesh" in text:
        return ("fully_shard got the whole 2-D mesh: tensor parallel already cut the weights on 'tp', so "
                "fully_shard shards them on the data-parallel dimension only, mesh=mesh['dp']\n  (fsdp_lab said: "
                + text.split(':')[0] + ")")
    return f"parallelize raised {type(err).__name__}: {text[:300]}"


def apply_order(fn: Callable, world_size: int, eager: bool = True) -> Verdict:
    """`fn(model, mesh)` applies tp, ac, compile and fsdp to the chapter's model on a fresh ("dp", "tp") mesh of
    `world_size` ranks; the order is read off the result, then one step is compared with one process (the
    compiled blocks run eagerly unless eager=False)."""
    from fsdp_lab.lessons.experiments.composing import batch, build, mesh_2d

    mesh = mesh_2d(world_size)
    model = build(seed=3)
    try:
        returned = fn(model, mesh)
    except NotImplementedError as err:
        return not_written("parallelize", err)
    except Exception as err:  # noqa: BLE001 - a wrong order fails inside torch or fsdp_lab: say which
        problem = _layout_problem(model, mesh) if "HSDP" not in str(err) else ""
        if problem.startswith("layers.0.w1.weight is sharded on 'dp' only"):
            return Verdict(False, problem + f"\n  (parallelize_module said: {type(err).__name__})")
        return Verdict(False, _explained(err))
    model = returned if isinstance(returned, torch.nn.Module) else model
    problem = _layout_problem(model, mesh)
    if problem:
        return Verdict(False, problem)
    x = batch(mesh)
    with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
        loss = model(x).pow(2).mean()
        loss.backward()
    plain = build(seed=3)
    want = plain(x).pow(2).mean()
    if abs(loss.item() - want.item()) > 1e-5 * max(1.0, abs(want.item())):
        return Verdict(False, f"the order is right but one step's loss is {loss.item():.6f}, one process gives "
                              f"{want.item():.6f}")
    how = "run eagerly" if eager else "compiled"
    return Verdict(True, f"torchtitan's order on the {tuple(mesh.shape)} mesh; one step ({how}): loss "
                         f"{loss.item():.6f}, as one process")
