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
        # the _fsdp_wrapped_module levels stay in the names outside summon_full_params, as in torch
        "named_parameters": [n for n, _ in model.named_parameters()],
        "inner_named_parameters": [[n for n, _ in m.named_parameters()] for m in instances[1:]],
        "raw_parameter_names": [n for n, _ in nn.Module.named_parameters(model)],
        "summoned_names": summoned_names(lib, model, instances[1]),
        "layer_types": [type(layer).__name__.replace("FullyShardedDataParallel", "FSDP")
                        for layer in model.module.layers],
    }


def summoned_names(lib: str, model, inner) -> dict:
    """Which instances strip the levels from their names: those a summon_full_params covers, and only those."""
    FSDP = fsdp_class(lib)
    facts = {}

    def names(m):
        return [n for n, _ in m.named_parameters()]

    for label, target, options in (("root", model, {}), ("inner", inner, {}), ("root_recurse_false", model,
                                   {"recurse": False}), ("root_rank0_only", model, {"rank0_only": True,
                                                                                    "writeback": False})):
        with FSDP.summon_full_params(target, **options):
            facts[label] = {"root": names(model), "inner": names(inner)}
    return facts


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
    if world_size == 4:  # on 2 ranks run_gaps has them
        out["inner_state_dicts"] = inner_state_dicts(lib, rank, world_size)
        out["inner_loads"] = inner_loads(lib, rank, world_size)
    return out


def first_line_raised(fn) -> tuple | None:
    """(type, first line of the message) of what `fn` raises, or None."""
    try:
        fn()
    except Exception as exc:  # the type and the words are the facts compared with torch
        return type(exc).__name__, str(exc).splitlines()[0], str(exc)
    return None


def local_piece(value) -> torch.Tensor:
    """A state-dict value as this rank holds it: a plain tensor, or the local piece of torch's ShardedTensor or of
    fsdp_lab's DTensor ([Note: SHARDED_STATE_DICT] in fsdp_lab/runtime/fsdp1/state_dict.py)."""
    if hasattr(value, "to_local"):
        value = value.to_local()
    elif hasattr(value, "local_shards"):  # ShardedTensor: a rank past the last row holds no shard at all
        shards = value.local_shards()
        value = shards[0].tensor if shards else torch.empty((0, *value.shape[1:]), dtype=value.dtype)
    return value.detach().float().clone()


def inner_state_dicts(lib: str, rank: int, world_size: int) -> dict:
    """state_dict() called on an inner instance (a Stage holding wrapped blocks, and a block), before the first
    forward and after a training step, full, full on rank 0 only, and sharded."""
    from torch.distributed.fsdp import ShardedStateDictConfig
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    FSDP = fsdp_class(lib)
    opts = {"device_id": torch.device("cpu")} if lib == "torch" else {}
    configs = {"full": (StateDictType.FULL_STATE_DICT, FullStateDictConfig()),
               "full_rank0_only": (StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)),
               "sharded": (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())}
    facts = {}
    for when in ("before_forward", "after_step"):
        for label, (kind, config) in configs.items():
            if when == "before_forward" and lib == "torch" and label != "full":
                continue  # torch's inner state_dict() before a forward makes that instance a root: once per model
            torch.manual_seed(0)
            model = FSDP(DeepLM(), auto_wrap_policy=ModuleWrapPolicy({Stage, Block}), **opts)
            if when == "after_step":
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                loss_of(model, *batch(0, rank, world_size)).backward()
                opt.step()
            stage, block = FSDP.fsdp_modules(model)[1:3]
            with FSDP.state_dict_type(model, kind, config):
                for name, inner in (("stage", stage), ("block", block)):
                    state = inner.state_dict()
                    facts[(when, label, name)] = {k: (tuple(v.shape), local_piece(v)) for k, v in state.items()}
    return facts


class ScaledBlock(Block):
    """A block with a float buffer of its own that bf16 cannot hold exactly (0.1 is not a bf16 number)."""

    def __init__(self):
        super().__init__(D)
        self.register_buffer("scale", torch.linspace(0.1, 0.9, D))

    def forward(self, x):
        return super().forward(x) * self.scale.to(x.dtype)


class BufferedLM(LM):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ScaledBlock(), ScaledBlock()])
        self.register_buffer("offset", torch.full((D,), 0.1))


def inner_loads(lib: str, rank: int, world_size: int) -> dict:
    """load_state_dict() on an inner instance with what state_dict() of the same instance in another model gave,
    full and sharded, under MixedPrecision(param_dtype=buffer_dtype=bf16): the whole model's full state dict
    afterwards (values and dtypes, buffers included) and the next step's loss."""
    from torch.distributed.fsdp import MixedPrecision, ShardedStateDictConfig
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    FSDP = fsdp_class(lib)
    opts = {"device_id": torch.device("cpu")} if lib == "torch" else {}
    policy = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    configs = {"full": (StateDictType.FULL_STATE_DICT, FullStateDictConfig()),
               "sharded": (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())}

    def trained(seed: int):
        torch.manual_seed(seed)
        model = FSDP(BufferedLM(), auto_wrap_policy=ModuleWrapPolicy({ScaledBlock}), mixed_precision=policy,
                     **opts)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_of(model, *batch(seed, rank, world_size)).backward()
        opt.step()
        return model

    def full_state(model) -> dict:
        with FSDP.state_dict_type(model, *configs["full"]):
            return {k: (str(v.dtype), v.detach().float().clone()) for k, v in model.state_dict().items()}

    facts = {}
    for label, (kind, config) in configs.items():
        source, target = trained(0), trained(1)
        inner, inner_target = FSDP.fsdp_modules(source)[2], FSDP.fsdp_modules(target)[2]
        with FSDP.state_dict_type(source, kind, config), FSDP.state_dict_type(target, kind, config):
            facts[(label, "result")] = str(inner_target.load_state_dict(inner.state_dict()))
        facts[(label, "source")], facts[(label, "target")] = full_state(source), full_state(target)
        with torch.no_grad():
            facts[(label, "next_loss")] = mean_over_ranks(loss_of(target, *batch(5, rank, world_size)), world_size)
    return facts


def run_gaps(rank, world_size, lib: str) -> dict:
    """FSDP(FSDP(block)) given directly, an auto_wrap_policy over a module already holding FSDP, and state_dict()
    of an inner instance: each as torch FSDP1 has it."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    FSDP = fsdp_class(lib)
    opts = {"device_id": torch.device("cpu")} if lib == "torch" else {}
    out = {}
    torch.manual_seed(0)
    model = FSDP(FSDP(LM(), **opts), **opts)
    instances = FSDP.fsdp_modules(model)
    out["double"] = {
        "named_modules": [(n, type(m).__name__.replace("FullyShardedDataParallel", "FSDP"))
                          for n, m in model.named_modules()],
        "named_parameters": [n for n, _ in model.named_parameters()],
        "is_root": [m.check_is_root() for m in instances],
        "inner_is_the_given": instances[1] is model.module}
    out["double"]["losses"] = train(model, rank, world_size)
    out["double"]["state"] = {k: v.detach().float().clone() for k, v in model.state_dict().items()}

    def double_with_policy():
        FSDP(FSDP(Block(D), **opts), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **opts)

    def prenested_with_policy():
        base = LM()
        base.layers[0] = FSDP(base.layers[0], **opts)
        FSDP(base, auto_wrap_policy=ModuleWrapPolicy({Block}), **opts)

    out["double_with_policy"] = first_line_raised(double_with_policy)
    out["prenested_with_policy"] = first_line_raised(prenested_with_policy)
    out["inner_state_dicts"] = inner_state_dicts(lib, rank, world_size)
    out["inner_loads"] = inner_loads(lib, rank, world_size)
    return out
