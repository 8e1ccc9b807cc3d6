"""The options fsdp_lab accepts in torch's signature but does not support: each, given a non-default value, must
raise a ValueError naming it (tests/test_torch_signatures.py)."""
from __future__ import annotations

import torch
from ranks_features import message_of
from torch import nn
from torch.distributed.fsdp import FullOptimStateDictConfig

from fsdp_lab import FSDP, MixedPrecision, StateDictType


def _net():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _meta_net():
    with torch.device("meta"):
        return _net()


def _device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _under(state_dict_type, config=None, optim_config=None):
    model = FSDP(_net())
    with FSDP.state_dict_type(model, state_dict_type, config, optim_config):
        model.state_dict()


REFUSED = {
    "FSDP.ignored_modules": lambda: FSDP(_net(), ignored_modules=[nn.Linear(1, 1)]),
    "FSDP.ignored_states": lambda: FSDP(_net(), ignored_states=[nn.Parameter(torch.ones(1))]),
    "FSDP.device_mesh": lambda: FSDP(_net(), device_mesh=_device_mesh()),
    "FSDP.param_init_fn": lambda: FSDP(_meta_net(), param_init_fn=lambda m: m.to_empty(device="cpu")),
    "MixedPrecision._module_classes_to_ignore": lambda: FSDP(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
    "summon_full_params.rank0_only": lambda: FSDP.summon_full_params(FSDP(_net()), rank0_only=True).__enter__(),
    "state_dict_type.LOCAL_STATE_DICT": lambda: _under(StateDictType.LOCAL_STATE_DICT),
    "state_dict_type.optim_state_dict_config": lambda: _under(StateDictType.SHARDED_STATE_DICT, None,
                                                              FullOptimStateDictConfig()),
    "load_state_dict.assign": lambda: FSDP(_net()).load_state_dict(_net().state_dict(), assign=True),
}


def _all_defaults():
    """Every option passed with torch's default value is accepted."""
    model = FSDP(_net(), None, None, None, None, None, None, None, None, None, False, False, True, False, None, None)
    with FSDP.summon_full_params(model, True, True, False, False, False):
        pass
    model.load_state_dict(model.state_dict(), True, False)


def refused_messages(rank, world_size):
    messages = {name: message_of(fn) for name, fn in REFUSED.items()}
    messages["<defaults>"] = message_of(_all_defaults)
    return messages
