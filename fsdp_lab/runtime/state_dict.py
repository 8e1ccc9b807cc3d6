"""`model.state_dict()` and `model.load_state_dict()` as torch FSDP1 gives them by default: the full state dict.

Scripts written for torch FSDP1 save a model as

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = model.state_dict()          # every rank calls it; rank 0 gets the plain module's state dict
    if rank == 0:
        torch.save(state, "model.pt")       # loads into the unwrapped module

and that works here unchanged (torch's own StateDictType and FullStateDictConfig are accepted too). The state dict
is gathered through summon_full_params, so it holds the whole fp32 model on every rank for a moment: for models
that do not fit that way, save sharded with fsdp_lab.checkpoint, which is also where the optimizer state goes.
SHARDED_STATE_DICT and LOCAL_STATE_DICT are refused with a ValueError that says so, rather than giving a dict
that looks like another one.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict

from fsdp_lab.runtime.strategy import coerce_enum
from fsdp_lab.runtime.summon import summon_full_params


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
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: FullStateDictConfig


DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig())


def coerce_settings(state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> StateDictSettings:
    """Check what FSDP.state_dict_type / set_state_dict_type were given; torch's enum and config are accepted."""
    kind = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    if kind is not StateDictType.FULL_STATE_DICT:
        raise ValueError(f"state_dict_type={kind.name} is not supported by fsdp_lab: model.state_dict() gives the "
                         f"full state dict (FULL_STATE_DICT). For a sharded save use fsdp_lab.checkpoint.save/load")
    if optim_state_dict_config is not None:
        raise ValueError(f"optim_state_dict_config={optim_state_dict_config!r} is not supported by fsdp_lab: it has "
                         f"no FSDP.optim_state_dict; fsdp_lab.checkpoint.save/load keeps the optimizer state")
    if state_dict_config is None:
        return StateDictSettings(kind, FullStateDictConfig())
    if not (hasattr(state_dict_config, "offload_to_cpu") and hasattr(state_dict_config, "rank0_only")):
        raise ValueError(f"state_dict_config={state_dict_config!r} does not go with FULL_STATE_DICT: pass a "
                         f"FullStateDictConfig(offload_to_cpu=..., rank0_only=...)")
    return StateDictSettings(kind, FullStateDictConfig(bool(state_dict_config.offload_to_cpu),
                                                       bool(state_dict_config.rank0_only)))


def full_state_dict(model, settings: StateDictSettings, destination=None, prefix: str = "") -> dict:
    """Collective: gather every unit, copy the plain module's state dict out (the gathered buffers are freed when
    summon_full_params exits), then drop it where the config says only rank 0 keeps it."""
    config = settings.state_dict_config
    keep = not config.rank0_only or model._ctx.rank == 0
    out = destination if destination is not None else OrderedDict()
    with summon_full_params(model, writeback=False):
        full = model.module.state_dict(prefix=prefix)
        if keep:
            for name, tensor in full.items():
                tensor = tensor.detach()
                out[name] = tensor.to("cpu", copy=True) if config.offload_to_cpu else tensor.clone()
    if destination is None:
        out._metadata = OrderedDict()
    if keep and hasattr(out, "_metadata"):  # module versions, which load_state_dict passes to each module
        out._metadata.update(full._metadata)
    return out


def load_full_state_dict(model, state_dict, strict: bool, assign: bool):
    """Collective: every rank passes the full state dict; each keeps its own chunk of the masters."""
    if assign:
        raise ValueError("FSDP.load_state_dict option assign=True is not supported by fsdp_lab: the masters are "
                         "shards of flat buffers, so loaded tensors are copied in, never put in their place")
    with summon_full_params(model, writeback=True):
        return model.module.load_state_dict(state_dict, strict=strict)
