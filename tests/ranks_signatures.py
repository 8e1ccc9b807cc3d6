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


def _under(state_dict_type, config=None, optim_config=None):
    model = FSDP(_net())
    with FSDP.state_dict_type(model, state_dict_type, config, optim_config):
        model.state_dict()


REFUSED = {
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
