"""`model.state_dict()` and `model.load_state_dict()` as torch FSDP1 gives them by default: the full state dict.

Scripts written for torch FSDP1 save a model as

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = model.state_dict()          # every rank calls it; rank 0 gets the plain module's state dict
    if rank == 0:
        torch.save(state, "model.pt")       # loads into the unwrapped module

and that works here unchanged (torch's own StateDictType and FullStateDictConfig are accepted too). The state dict
is gathered one unit at a time ([Note: one unit at a time] below), but the result is the whole model (in its parameters'
own dtype) on each rank that keeps it.

[Note: SHARDED_STATE_DICT] Under StateDictType.SHARDED_STATE_DICT each parameter comes out under its original name
as a DTensor sharded on dim 0 over the model's process group (rank r holds torch.chunk's piece r), the layout
torch FSDP1 gives, so torch.distributed.checkpoint saves each rank's piece and loads it on any world size.
Buffers are replicated plain tensors. torch FSDP1 gives ShardedTensor unless ShardedStateDictConfig._use_dtensor;
ShardedTensor is deprecated and DCP treats both alike, so here it is DTensor either way. load_state_dict takes
such a dict back (each DTensor is gathered to its full tensor, then loaded as a full state dict). The optimizer
state follows the same settings through FSDP.optim_state_dict (fsdp_lab/runtime/fsdp1/optim_state_dict.py).
LOCAL_STATE_DICT (the flat shards themselves) is refused with a ValueError that says so, rather than giving a dict
that looks like another one.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from collections import OrderedDict

import torch

from fsdp_lab.runtime.core.strategy import coerce_enum
from fsdp_lab.runtime.fsdp1.nesting import plain_name
from fsdp_lab.runtime.fsdp1.not_provided import DCP_STATE_DICT
from fsdp_lab.runtime.fsdp1.summon import gather_master, put_back, register_full_params, settle, summon_full_params


class StateDictType(enum.Enum):
    FULL_STATE_DICT = "FULL_STATE_DICT"
    LOCAL_STATE_DICT = "LOCAL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"


@dataclasses.dataclass(frozen=True)
class FullStateDictConfig:
    """offload_to_cpu: the tensors come back on the CPU. rank0_only: ranks other than 0 get an empty dict (they
    still take part in the gathers)."""
    offload_to_cpu: bool = False
    rank0_only: bool = False


@dataclasses.dataclass(frozen=True)
class ShardedStateDictConfig:
    """offload_to_cpu: each rank's pieces come back on the CPU. _use_dtensor: accepted for torch's sake; the
    pieces are DTensors either way ([Note: SHARDED_STATE_DICT])."""
    offload_to_cpu: bool = False
    _use_dtensor: bool = False


@dataclasses.dataclass(frozen=True)
class FullOptimStateDictConfig:
    """What FSDP.optim_state_dict gives under FULL_STATE_DICT (fsdp_lab/runtime/fsdp1/optim_state_dict.py): full
    tensors, on the CPU by default as in torch; rank0_only: ranks other than 0 get an empty dict."""
    offload_to_cpu: bool = True
    rank0_only: bool = False


@dataclasses.dataclass(frozen=True)
class ShardedOptimStateDictConfig:
    """Under SHARDED_STATE_DICT: each rank's dim-0 piece of every state tensor as a DTensor, on the CPU by
    default as in torch; _use_dtensor as in ShardedStateDictConfig."""
    offload_to_cpu: bool = True
    _use_dtensor: bool = False


@dataclasses.dataclass(frozen=True)
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: object  # FullStateDictConfig or ShardedStateDictConfig
    optim_state_dict_config: object  # FullOptimStateDictConfig or ShardedOptimStateDictConfig


DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def coerce_settings(state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> StateDictSettings:
    """Check what FSDP.state_dict_type / set_state_dict_type were given; torch's enum and configs are accepted."""
    kind = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    if kind is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(f"state_dict_type={kind.name} is not supported by fsdp_lab: model.state_dict() gives the "
                         f"full state dict (FULL_STATE_DICT) or per-parameter DTensors (SHARDED_STATE_DICT)")
    full = kind is StateDictType.FULL_STATE_DICT
    config = _coerce_config(kind, "state_dict_config", state_dict_config,
                            FullStateDictConfig if full else ShardedStateDictConfig)
    optim_config = _coerce_config(kind, "optim_state_dict_config", optim_state_dict_config,
                                  FullOptimStateDictConfig if full else ShardedOptimStateDictConfig)
    return StateDictSettings(kind, config, optim_config)


def _coerce_config(kind: StateDictType, option: str, config, config_type: type):
    """`config` as our `config_type` (ours or torch's twin, by name and fields); None gives its defaults."""
    if config is None:
        return config_type()
    fields = [f.name for f in dataclasses.fields(config_type)]
    if getattr(type(config), "__name__", "") != config_type.__name__ or not all(hasattr(config, f) for f in fields):
        raise ValueError(f"{option}={config!r} does not go with {kind.name}: pass a "
                         f"{config_type.__name__}({', '.join(f'{f}=...' for f in fields if not f.startswith('_'))})")
    return config_type(*(bool(getattr(config, f)) for f in fields))


def cast_buffers(module, mixed_precision, ignored_modules) -> dict:
    """MixedPrecision(buffer_dtype=...): cast `module`'s floating-point buffers (not those of ignored modules:
    [Note: ignored modules] in ignored.py); return {plain qualified name: dtype before}, the dtype state_dict()
    gives them back in."""
    dtypes = {}
    if mixed_precision is None or mixed_precision.buffer_dtype is None:
        return dtypes
    for module_name, buf_module in module.named_modules():
        if id(buf_module) in ignored_modules:
            continue
        for name, buf in buf_module._buffers.items():
            if buf is not None and buf.is_floating_point():
                dtypes[plain_name(f"{module_name}.{name}" if module_name else name)] = buf.dtype
                buf_module._buffers[name] = buf.to(mixed_precision.buffer_dtype)
    return dtypes


def shard_dim0(tensor: torch.Tensor, mesh, rank: int, world_size: int, offload: bool):
    """This rank's torch.chunk piece of `tensor` as a DTensor sharded on dim 0 ([Note: SHARDED_STATE_DICT])."""
    from torch.distributed.tensor import DTensor, Shard

    pieces = torch.chunk(tensor, world_size, dim=0)
    local = pieces[rank] if rank < len(pieces) else tensor.new_empty((0, *tensor.shape[1:]))
    local = local.to("cpu", copy=True) if offload else local.clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride())


def settings_for(instance, caller) -> StateDictSettings:
    """The settings instance.state_dict() follows when `caller` (its caller's frame) called it.

    [Note: DCP's get_model_state_dict] torch's get_model_state_dict / get_state_dict ask FSDP1 for a sharded state
    dict by default: _verify_options in torch/distributed/checkpoint/state_dict.py finds torch's own FSDP
    instances (FSDP.fsdp_modules(model)) and runs model.state_dict() inside FSDP.state_dict_type(model,
    SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=options.cpu_offload)), or FULL_STATE_DICT with
    FullStateDictConfig(offload_to_cpu=cpu_offload, rank0_only=cpu_offload) under full_state_dict=True. It finds
    none of ours, so it would call our state_dict() under whatever state_dict_type is set, by default full: every
    rank would hold the whole model while saving a "sharded" checkpoint. So when the caller is DCP's
    _get_model_state_dict, the options it holds (its `info`) choose the settings exactly as DCP chooses them for
    torch's FSDP: by default each parameter comes out as this rank's dim-0 piece, a DTensor ([Note:
    SHARDED_STATE_DICT]), where torch's FSDP1 gives a ShardedTensor with the same rows; dcp.save writes each
    rank's piece and dcp.load reshards to any world size. One exception: with a replicate group (HYBRID_SHARD,
    _HYBRID_SHARD_ZERO2) SHARDED_STATE_DICT is refused here, so DCP gets the full state dict there as before.
    set_model_state_dict needs nothing of this: load_state_dict takes DTensors and full tensors alike."""
    settings = instance._state_dict_settings
    if caller.f_code.co_name != "_get_model_state_dict" or caller.f_globals.get("__name__") != DCP_STATE_DICT:
        return settings
    info = caller.f_locals.get("info")
    if info is None or not hasattr(info, "full_state_dict"):
        return settings
    offload = bool(getattr(info, "cpu_offload", False))
    if info.full_state_dict:
        return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload, rank0_only=offload),
                                 settings.optim_state_dict_config)
    if instance._ctx.replicate_pg is not None:
        return settings
    return StateDictSettings(StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload),
                             settings.optim_state_dict_config)


def instance_state_dict(instance, destination, prefix: str, keep_vars: bool, caller=None) -> dict:
    """FSDP.state_dict() of the root or of an inner instance.

    [Note: an inner instance's state dict] In torch FSDP1 every instance's state_dict() gives its own module's
    state dict, under the state_dict_type set on it: the root's the whole model's, an inner one's its subtree's,
    keys relative to it (`norm.weight`, not `layers.0.norm.weight`), full (FULL_STATE_DICT) or sharded
    (SHARDED_STATE_DICT), and collective across the ranks either way. Here an inner instance gathers its own
    subtree's units the way the root gathers all of them (full_state_dict). While the root's own state_dict()
    walks the tree it reaches each inner instance's state_dict() with a destination; that call only hands the walk
    to its module with the same prefix (the root's hooks gather the unit). torch differs in one way we do not
    copy: an inner instance's state_dict() before the model's first forward takes that instance for a root, and
    the model's next forward then fails on an assertion; here the model trains on."""
    if instance._root._state_dict_walk:
        return instance._fsdp_wrapped_module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
    settings = instance._state_dict_settings if caller is None else settings_for(instance, caller)
    return full_state_dict(instance, settings, destination, prefix)


def full_state_dict(model, settings: StateDictSettings, destination=None, prefix: str = "") -> dict:
    """Collective. [Note: one unit at a time] The plain module's own state_dict() walks the module tree; a pre-hook
    on each unit's module gathers that unit's fp32 masters and registers the original parameters, and a post-hook,
    which runs once the unit's submodules are done too, puts the shards back and copies the unit's entries out
    (to the CPU with offload_to_cpu; dropped on ranks other than 0 with rank0_only). So only one unit is gathered
    at a time beyond what is kept, as in torch FSDP1, and whatever the module's own state_dict adds (buffers,
    extra state, its hooks) is there. Tied names share one copy."""
    settle(model, "state_dict()")
    ctx, config = model._ctx, settings.state_dict_config
    keep = not getattr(config, "rank0_only", False) or ctx.rank == 0
    out = destination if destination is not None else OrderedDict()
    before, copies = set(out), set()  # keys a caller put there; ids of the copies made so far
    # names below an inner instance ([Note: an inner instance's state dict]) lose its path in the root's module
    base = "" if model._root is model else plain_name(model._units[-1].name + ".")
    buffer_dtypes = {prefix + name[len(base):]: dtype for name, dtype in model._root._buffer_dtypes.items()
                     if name.startswith(base)}
    if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        from torch.distributed.device_mesh import DeviceMesh

        if ctx.replicate_pg is not None:
            raise ValueError(f"state_dict_type SHARDED_STATE_DICT with sharding_strategy {ctx.strategy.name} is not "
                             f"supported by fsdp_lab; use FULL_STATE_DICT, or fsdp_lab.checkpoint.save/load")

        mesh = DeviceMesh.from_group(ctx.pg, ctx.device.type)
        param_names = {prefix + q[len(base):] for u in model.units for f in u.flats for s in f.slots
                       for _m, _a, q in s.aliases}

        def convert(key, value):
            if key in param_names:
                return shard_dim0(value, mesh, ctx.rank, ctx.world_size, config.offload_to_cpu)
            return value.to("cpu", copy=True) if config.offload_to_cpu else value.clone()
    else:
        def convert(_key, value):
            return value.to("cpu", copy=True) if config.offload_to_cpu else value.clone()

    def gather(unit, restore, _module, _prefix, _keep_vars):
        for flat in unit.flats:
            full = gather_master(unit, flat, "state_dict")
            if full.data_ptr() == flat.shard.data_ptr():  # NO_SHARD's master is the live parameter: copy it
                full = full.clone()
            restore.append((flat, register_full_params(unit, flat, full)))

    def copy_out(restore, _module, state, sub_prefix, _metadata):
        for flat, replaced in restore:
            put_back(flat, replaced)
        restore.clear()
        by_storage = {}
        for key in [k for k in state if k.startswith(sub_prefix) and k not in before]:
            value = state[key]
            if not keep:
                del state[key]
            elif id(value) not in copies:
                where = (value.data_ptr(), value.shape, value.stride(), value.dtype)
                if where not in by_storage:
                    by_storage[where] = convert(key, value)
                    # MixedPrecision.buffer_dtype: saved in the buffer's own dtype, as torch documents it.
                    # torch 2.13 keeps a nested root's own buffers in buffer_dtype (tests/test_fsdp1_instances.py)
                    if key in buffer_dtypes:
                        by_storage[where] = by_storage[where].to(buffer_dtypes[key])
                state[key] = by_storage[where]
                copies.add(id(state[key]))

    handles = []
    try:
        for unit in model.units:
            restore = []
            handles.append(unit.module.register_state_dict_pre_hook(functools.partial(gather, unit, restore)))
            handles.append(unit.module.register_state_dict_post_hook(functools.partial(copy_out, restore)))
        model._root._state_dict_walk = True
        with torch.no_grad():
            model.module.state_dict(destination=out, prefix=prefix)
    finally:
        model._root._state_dict_walk = False
        for handle in handles:
            handle.remove()
    return out


def load_full_state_dict(model, state_dict, strict: bool, assign: bool):
    """Collective: every rank passes the full state dict; each keeps its own chunk of the masters."""
    if assign:
        raise ValueError("FSDP.load_state_dict option assign=True is not supported by fsdp_lab: the masters are "
                         "shards of flat buffers, so loaded tensors are copied in, never put in their place")
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, DTensor) for v in state_dict.values()):  # [Note: SHARDED_STATE_DICT]
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = OrderedDict((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state_dict.items())
        if metadata is not None:
            state_dict._metadata = metadata
    with summon_full_params(model, writeback=True):
        result = model.module.load_state_dict(state_dict, strict=strict)
    # the keys under a unit's FSDP instance went in with its _fsdp_wrapped_module level (nesting.py): name them
    # as they were given
    return type(result)([plain_name(k) for k in result.missing_keys],
                        [plain_name(k) for k in result.unexpected_keys])
