"""Ranks for tests/test_fsdp1_instances.py: the FSDP instances an FSDP1 model is made of, as torch FSDP1 nests them
(one per auto-wrapped or hand-wrapped unit, around the original submodule), and the code accelerate and Lightning
run over them. Only the import differs between torch and fsdp_lab; every fact is a plain value to compare."""
from __future__ import annotations

import torch
from ranks_fully_shard import Block, D, batch, loss_of, mean_over_ranks
from ranks_offload import LM
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType

STEPS = 3
WRAPPED = "_fsdp_wrapped_module."


class Stage(nn.Module):
    """Two blocks and a projection of its own: wrapped around units that are wrapped too (two levels)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(D) for _ in range(2))
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


class DeepLM(LM):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Stage(), Block(D)])


def fsdp_class(lib: str):
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fsdp_lab import FSDP
    return FSDP


def wrap(lib: str, case: str):
    """case: "policy" (ModuleWrapPolicy({Block})), "orig" (the same, use_orig_params), "deep" (ModuleWrapPolicy
    ({Stage, Block}): units inside units), "manual" (FSDP(LM with each layer FSDP(layer)) by hand), "manual_deep"
    (FSDP(DeepLM) with Stage wrapped by hand around blocks wrapped by hand). Returns the model and the original
    submodules each inner instance should hold, in module order."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    FSDP = fsdp_class(lib)
    opts = {"device_id": torch.device("cpu")} if lib == "torch" else {}
    torch.manual_seed(0)
    base = DeepLM() if case in ("deep", "manual_deep") else LM()
    if case == "deep":
        stage = base.layers[0]
        originals = [stage, *stage.blocks, base.layers[1]]
    else:
        originals = list(base.layers)
    if case == "manual":
        for i, layer in enumerate(list(base.layers)):
            base.layers[i] = FSDP(layer, **opts)
        return FSDP(base, **opts), originals
    if case == "manual_deep":
        stage = base.layers[0]
        originals = [stage, *stage.blocks, base.layers[1]]
        for i, block in enumerate(list(stage.blocks)):
            stage.blocks[i] = FSDP(block, **opts)
        base.layers[0] = FSDP(stage, **opts)
        base.layers[1] = FSDP(base.layers[1], **opts)
        return FSDP(base, **opts), originals
    classes = {Stage, Block} if case == "deep" else {Block}
    return FSDP(base, auto_wrap_policy=ModuleWrapPolicy(classes), use_orig_params=case == "orig", **opts), originals


def raises(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the type is the fact compared with torch
        return type(exc).__name__
    return None


def structure(lib: str, model, originals) -> dict:
    FSDP = fsdp_class(lib)
    instances = FSDP.fsdp_modules(model)
    return {
        "count": len(instances),
        "all_fsdp": all(isinstance(m, FSDP) for m in instances),
        "first_is_model": instances[0] is model,
        "module_types": [type(m.module).__name__ for m in instances],
        "inner_modules_are_the_originals": [m.module is o for m, o in zip(instances[1:], originals)],
        "module_is_wrapped_module": all(m.module is m._fsdp_wrapped_module for m in instances),
        "root_only": [m is model for m in FSDP.fsdp_modules(model, root_only=True)],
        "holder_root_only": len(FSDP.fsdp_modules(nn.ModuleDict({"policy": model}), root_only=True)),
        "is_root": [m.check_is_root() for m in instances],
        "named_modules": [(n, type(m).__name__.replace("FullyShardedDataParallel", "FSDP"))
                          for n, m in model.named_modules()],
        # torch keeps the _fsdp_wrapped_module levels outside summon_full_params, fsdp_lab strips them
        # ([Note: one FSDP instance per unit]): compared level-free, and what fsdp_lab gives is level-free
        "named_parameters": [n.replace(WRAPPED, "") for n, _ in model.named_parameters()],
        "inner_named_parameters": [[n.replace(WRAPPED, "") for n, _ in m.named_parameters()] for m in instances[1:]],
        "raw_parameter_names": [n for n, _ in nn.Module.named_parameters(model)],
        "layer_types": [type(layer).__name__.replace("FullyShardedDataParallel", "FSDP")
                        for layer in model.module.layers],
    }


def accelerate_walk(lib: str, model) -> dict:
    """What accelerate and Lightning do with the instances: read `.module`, set the state-dict type on the model,
    summon each instance's own parameters (recurse=False) and read them through `.module`."""
    FSDP = fsdp_class(lib)
    facts = {"own_params": [], "own_sums": []}
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True))
    facts["types_after_set"] = [FSDP.get_state_dict_type(m).state_dict_type.name for m in FSDP.fsdp_modules(model)]
    for m in FSDP.fsdp_modules(model):
        with FSDP.summon_full_params(m, recurse=False, writeback=False):
            own = [(n, tuple(p.shape)) for n, p in m.module.named_parameters() if "_flat_param" not in n]
            facts["own_params"].append(own)
            facts["own_sums"].append(sum(p.detach().double().sum().item() for n, p in m.module.named_parameters()
                                         if "_flat_param" not in n))
    inner = FSDP.fsdp_modules(model)[1]
    with FSDP.summon_full_params(inner):  # recurse=True on an inner instance: its subtree
        facts["inner_summoned"] = sorted(n for n, _ in inner.named_parameters())
    facts["inner_clip_raises"] = raises(lambda: inner.clip_grad_norm_(1.0))
    facts["inner_no_sync_raises"] = raises(lambda: inner.no_sync().__enter__())
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        facts["type_inside"] = FSDP.get_state_dict_type(inner).state_dict_type.name
    return facts


def train(model, rank: int, world_size: int) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, rank, world_size))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss, world_size))
    return losses


def run(rank, world_size, lib: str, cases: tuple) -> dict:
    out = {}
    for case in cases:
        model, originals = wrap(lib, case)
        facts = {"structure": structure(lib, model, originals)}
        facts["losses"] = train(model, rank, world_size)
        state = model.state_dict()
        facts["state_keys"] = list(state)
        facts["params"] = {k: v.detach().float().clone() for k, v in state.items()}
        facts["walk"] = accelerate_walk(lib, model)
        facts["after_training"] = structure(lib, model, originals)
        out[case] = facts
    return out
