"""Mistakes that would otherwise train nothing, or die in a collective, caught where they can be seen.

[Note: traps that train nothing] Wrapping replaces objects the user may still hold: the original parameters
leave the module (the flat shards, or new sharded parameters, stand in for them), and a module already inside an
FSDP holds flat shards rather than its parameters. Nothing fails afterwards: an optimizer built before wrapping
steps parameters that never get a gradient, a second FSDP over a wrapped module's inner module would shard the
shards. And a `requires_grad_()` after wrapping changes a flag that the flat buffers, split by requires_grad at
wrap time, no longer read. Each of these is detected once, where it first matters, and named:
- every object wrapping replaces is marked (`REPLACED_BY`); an optimizer's first step checks its parameters for
  the mark (torch's global step pre-hook, registered per model, removed with it; one look per optimizer);
- the flat shards carry the unit they belong to (`FLAT_OF`), so wrapping a module that holds one is refused;
- fully_shard marks the DTensor parameters it makes (`SHARDED_BY`) and FSDP its flat shards (`FLAT_OF`): a
  later wrap that meets either names the earlier call (a block after its root, FSDP(...) and fully_shard mixed);
- the root's forward compares each registered parameter's requires_grad with its flat buffer's (a few dozen
  flags, or one per parameter with use_orig_params).

[Note: every rank wraps the same model] Each collective assumes every rank's unit has the same sizes. Ranks that
built different models (a config read differently, a vocabulary padded on one rank) would otherwise abort in the
first all-gather with the backend's "data size doesn't match", or hang. So wrapping compares a hash of every
unit's parameter names and shapes across ranks (one small all-gather), and on a difference gathers the lists and
names the first unit and parameter that differ, with both shapes.
"""
from __future__ import annotations

import hashlib
import itertools
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn

from fsdp_lab.runtime.core.side_collectives import issue

REPLACED_BY = "_fsdp_lab_replaced_by"  # on a Parameter wrapping removed: the name it had in the model
FLAT_OF = "_fsdp_lab_flat_of"  # on a flat shard: the unit it is the shard of
SHARDED_BY = "_fsdp_lab_sharded_by"  # on a fully_shard DTensor parameter: (its module's type, its name there)
_CHECKED = "_fsdp_lab_checked"  # on an optimizer whose parameters were looked at


# What the optimizer check says each front end did: (what replaced the parameters, what to build it after)
_REPLACED_WHEN = {"FSDP": ("FSDP replaced when it wrapped the model", "wrapping"),
                  "fully_shard": ("fully_shard replaced when it sharded the model", "fully_shard")}


def mark_replaced(param: nn.Parameter, name: str, front_end: str = "FSDP") -> None:
    setattr(param, REPLACED_BY, (name, front_end))


def mark_sharded(param: nn.Parameter, owner_type: str, name: str) -> None:
    setattr(param, SHARDED_BY, (owner_type, name))


def refuse_wrapped_param(param: nn.Parameter, name: str, call: str) -> None:
    """`call` ("fully_shard(<block>)" or "FSDP(...)") meets `param`, reached as `name`: refused by name if an
    earlier wrap already sharded it ([Note: traps that train nothing])."""
    unit = getattr(param, FLAT_OF, None)
    if unit is not None:
        raise ValueError(f"{call}: parameter '{name}' is already sharded by FSDP(...) (it belongs to FSDP unit "
                         f"'{unit}'). A model is sharded by FSDP(...) or by fully_shard, not both: wrap the plain "
                         f"model with one of them")
    sharded = getattr(param, SHARDED_BY, None)
    if sharded is not None and call == "FSDP(...)":
        raise ValueError(f"FSDP(...): parameter '{name}' is already sharded by fully_shard (of a {sharded[0]}, "
                         f"as '{sharded[1]}'). A model is sharded by FSDP(...) or by fully_shard, not both: wrap "
                         f"the plain model with one of them")
    if sharded is not None:
        owner, qualified = sharded
        block = qualified[:-len(name) - 1] if qualified.endswith("." + name) else "?"
        raise ValueError(f"fully_shard({block}): its parameters are already sharded by the earlier "
                         f"fully_shard(<root>) (a {owner}), which holds '{qualified}': fully_shard takes every "
                         f"parameter below its module that no earlier call took, so call fully_shard on the "
                         f"blocks first, then the root: for block in model.blocks: fully_shard(block); then "
                         f"fully_shard(model)")


def refuse_wrapped_inside(module: nn.Module) -> None:
    """A module that holds a flat shard is already inside an FSDP: wrapping it again would shard the shards."""
    for name, param in module.named_parameters():
        if hasattr(param, SHARDED_BY):
            refuse_wrapped_param(param, name, "FSDP(...)")
        unit = getattr(param, FLAT_OF, None)
        if unit is not None:
            raise ValueError(f"module is already wrapped: its parameter '{name}' is the flat shard of FSDP unit "
                             f"'{unit}' of an existing FSDP. Wrap the plain module once (FSDP(model) with an "
                             f"auto_wrap_policy), or use the existing FSDP object; to change options, build the "
                             f"plain model again")


def _check_optimizer(optimizer, _args, _kwargs) -> None:
    if getattr(optimizer, _CHECKED, False):
        return
    stale = [getattr(p, REPLACED_BY) for group in optimizer.param_groups for p in group["params"]
             if hasattr(p, REPLACED_BY)]
    if stale:
        replaced, after = _REPLACED_WHEN[stale[0][1]]
        raise RuntimeError(f"{type(optimizer).__name__}.step(): the optimizer holds {len(stale)} parameter(s) that "
                           f"{replaced} (first: '{stale[0][0]}'). They are no longer the "
                           f"model's and never get a gradient, so this step trains nothing. Build the optimizer "
                           f"after {after}: torch.optim.AdamW(model.parameters(), ...)")
    setattr(optimizer, _CHECKED, True)


def watch_optimizers(model: nn.Module) -> None:
    """Check every optimizer's first step ([Note: traps that train nothing]); the hook goes when `model` does."""
    handle = register_optimizer_step_pre_hook(_check_optimizer)
    weakref.finalize(model, handle.remove)


def check_requires_grad(units) -> None:
    """Refuse a requires_grad changed after wrapping ([Note: traps that train nothing])."""
    for unit in units:
        for flat in unit.flats:
            params = flat.orig_params if flat.orig_params is not None else [flat.shard]
            for param, slot in zip(params, flat.slots):
                if param.requires_grad != flat.requires_grad:
                    name = slot.name if flat.orig_params is not None else \
                        f"{', '.join(s.name for s in flat.slots[:3])}{', ...' if len(flat.slots) > 3 else ''}"
                    raise RuntimeError(
                        f"requires_grad of '{name}' (FSDP unit '{unit.name}') was set to {param.requires_grad} "
                        f"after wrapping; it was {flat.requires_grad} when FSDP split the unit's parameters into "
                        f"frozen and trainable flat buffers, and that split decides what trains. Call "
                        f"requires_grad_() on the plain module before FSDP(...)")


def _digest(signature) -> int:
    return int.from_bytes(hashlib.sha256(repr(signature).encode()).digest()[:8], "little", signed=True)


def check_same_model(signature: list, pg, rank: int, world_size: int, device: torch.device) -> None:
    """Collective ([Note: every rank wraps the same model]). `signature` is, per unit in order, (unit name,
    [(parameter name, shape, requires_grad), ...]). The digests travel as tensors on the model's device (what
    NCCL needs); only a difference, which ends the run anyway, sends the lists as objects. Patient ([Note: patient
    collectives] in side_collectives.py): it follows each rank's imports and model building."""
    if world_size == 1:
        return
    digest = torch.tensor([_digest(signature)], dtype=torch.int64, device=device)
    digests = [torch.empty_like(digest) for _ in range(world_size)]
    issue(dist.all_gather, digests, digest, group=pg, phase="init", like=digest, patient=True)
    if len({int(d.item()) for d in digests}) == 1:
        return
    everyone = [None] * world_size
    issue(dist.all_gather_object, everyone, signature, group=pg, phase="init", patient=True)
    other = next(r for r in range(world_size) if everyone[r] != signature)
    mine = signature
    for i in range(max(len(mine), len(everyone[other]))):
        a = mine[i] if i < len(mine) else None
        b = everyone[other][i] if i < len(everyone[other]) else None
        if a == b:
            continue
        unit = (a or b)[0] or "<root>"
        if a is None or b is None or a[0] != b[0]:
            raise ValueError(f"ranks wrap different models: FSDP unit {i} is "
                             f"'{a[0] if a else None}' on rank {rank} but '{b[0] if b else None}' on rank {other}; "
                             f"every rank must build the same model and wrap it with the same policy")
        for pa, pb in itertools.zip_longest(a[1], b[1]):
            if pa != pb:
                raise ValueError(f"ranks wrap different models: FSDP unit '{unit}' has "
                                 f"{_describe(pa)} on rank {rank} but {_describe(pb)} on rank {other}; every rank "
                                 f"must build the same model (same config, same sizes) before wrapping")


def _describe(entry) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, requires_grad = entry
    return f"'{name}' of shape {tuple(shape)}{'' if requires_grad else ' (frozen)'}"


# [Note: hooks outside compiled graphs] `block.compile(fullgraph=True)` before fully_shard compiles the block's
# __call__, hooks included, and torch.compile(FSDP(model, use_orig_params=True)) compiles the wrapper's forward
# with every unit's hooks inside it. The hooks issue collectives, resize storage and swap module attributes,
# which a graph cannot hold, so, as torch marks its own FSDP hooks, Dynamo runs them eagerly (a graph break at
# each) and compiles the computation between them.
def eager_hook(hook):
    """`hook` as a function Dynamo never traces (torch's marker needs a plain function, not a bound method)."""
    return torch._disable_dynamo(lambda *args, **kwargs: hook(*args, **kwargs))
