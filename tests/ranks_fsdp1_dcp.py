"""Ranks for tests/test_fsdp1_dcp.py: torch DCP's state_dict functions on an FSDP1 model, torch's and fsdp_lab's.

- model state: get_model_state_dict(model) (sharded, the default) and with full_state_dict=True, described key by
  key; a sharded one saved with dcp.save on 2 ranks by one library and loaded on 4 by either, through
  get_model_state_dict, dcp.load and set_model_state_dict;
- model and optimizer together: get_state_dict(model, optim) and set_state_dict(model, optim, ...), whose
  messages on fsdp_lab's FSDP must name what works.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from ranks_features import message_of
from ranks_optim_state import _steps
from ranks_offload import wrap_fsdp1
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)


def _described(sd: dict) -> dict:
    """Each value's kind, global shape and this rank's rows (the local piece), on the CPU."""
    out = {}
    for key, value in sd.items():
        if hasattr(value, "to_local"):  # DTensor
            kind, local = "DTensor", value.to_local()
        elif hasattr(value, "local_shards"):  # ShardedTensor
            shards = value.local_shards()
            kind, local = "ShardedTensor", shards[0].tensor if shards else torch.empty(0)
        else:
            kind, local = "Tensor", value
        out[key] = {"kind": kind, "shape": list(value.shape), "local": local.detach().cpu().clone()}
    return out


def _full_params(model, lib: str) -> dict:
    """The full parameters by their original names (FULL_STATE_DICT, every rank)."""
    from torch.distributed.fsdp import StateDictType

    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fsdp_lab import FSDP
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def model_state(rank, world_size, lib: str) -> dict:
    """After one step: get_model_state_dict sharded (the default), full, and (fsdp_lab's only: torch 2.13's FSDP1
    on the CPU fails with offload_to_cpu, see ranks_optim_state.resume) full with cpu_offload."""
    model = wrap_fsdp1(lib, False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, world_size, range(1))
    full = _full_params(model, lib)
    out = {"sharded": _described(get_model_state_dict(model)),
           "full": _described(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))),
           "reference": full}
    if lib != "torch":
        out["full_cpu"] = _described(get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    return out


def save(rank, world_size, lib: str, path: str) -> dict:
    """Train 2 steps; save get_model_state_dict(model) (sharded) with dcp.save; the full parameters saved."""
    model = wrap_fsdp1(lib, False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, world_size, range(2))
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    return _full_params(model, lib)


def load(rank, world_size, lib: str, path: str) -> dict:
    """A fresh model with other weights loads the checkpoint at `path`: its full parameters afterwards."""
    model = wrap_fsdp1(lib, False, {}, seed=1234)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return _full_params(model, lib)


def load_each(rank, world_size, cases: list) -> dict:
    """load() for each (writer, reader, path) in one launch."""
    return {(writer, reader): load(rank, world_size, reader, path) for writer, reader, path in cases}


def save_each(rank, world_size, cases: list) -> dict:
    return {lib: save(rank, world_size, lib, path) for lib, path in cases}


def with_optimizer(rank, world_size) -> dict:
    """get_state_dict(model, optim) and set_state_dict(model, optim, ...) on fsdp_lab's FSDP: the messages."""
    model = wrap_fsdp1("fsdp_lab", False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, world_size, range(1))
    msd = get_model_state_dict(model)
    return {"get_state_dict": message_of(lambda: get_state_dict(model, opt)),
            "set_state_dict": message_of(lambda: set_state_dict(model, opt, model_state_dict=msd,
                                                                optim_state_dict={"state": {}, "param_groups": []}))}


def on_two(rank, world_size, folder: str) -> dict:
    """One 2-rank launch: model_state for both libraries, the optimizer messages, and a checkpoint by each."""
    return {"state": {lib: model_state(rank, world_size, lib) for lib in LIBS},
            "with_optimizer": with_optimizer(rank, world_size),
            "saved": save_each(rank, world_size, [(lib, f"{folder}/{lib}") for lib in LIBS])}


LIBS = ("torch", "fsdp_lab")
READS = (("fsdp_lab", "fsdp_lab"), ("torch", "fsdp_lab"), ("fsdp_lab", "torch"))  # (writer, reader)
