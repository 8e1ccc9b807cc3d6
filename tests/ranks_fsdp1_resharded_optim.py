"""Ranks for tests/test_fsdp1_resharded_optim.py: the sharded checkpoint of torch's FSDP1 documentation, written
as a torch FSDP1 user writes it, with only the import differing between torch and fsdp_lab.

Save (2 ranks): under SHARDED_STATE_DICT, {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model,
optim)} goes to torch.distributed.checkpoint. Load (4 ranks): dcp.load fills the model's own sharded state
dict, then `load_sharded_optimizer_state_dict(model_state_dict, "optim", FileSystemReader)` reads the optimizer
state (as ShardedTensors over the world), `FSDP.optim_state_dict_to_load` turns it into this rank's flat state,
and `optim.load_state_dict` takes it."""
from __future__ import annotations

import torch
from ranks_offload import wrap_fsdp1
from ranks_optim_state import _fsdp, _steps
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

STEPS = 4  # the save runs the first half, the load the second


def _full(model, opt, lib: str) -> dict:
    """Model and optimizer state in full, by parameter name, on every rank (for the comparisons)."""
    FSDP = _fsdp(lib)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig(offload_to_cpu=True)):
        params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        osd = FSDP.optim_state_dict(model, opt)
    state = {name: {k: v.detach().float().clone() for k, v in s.items()} for name, s in osd["state"].items()}
    return {"params": params, "optim": state}


def straight(rank, world_size, lib: str) -> dict:
    model = wrap_fsdp1(lib, False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"losses": _steps(model, opt, rank, world_size, range(STEPS)), **_full(model, opt, lib)}


def save(rank, world_size, lib: str, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    FSDP = _fsdp(lib)
    model = wrap_fsdp1(lib, False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _steps(model, opt, rank, world_size, range(STEPS // 2))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(folder))
    return {"losses": losses, **_full(model, opt, lib)}


def load(rank, world_size, lib: str, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    FSDP = _fsdp(lib)
    model = wrap_fsdp1(lib, False, {}, seed=1234)  # other weights: the checkpoint must replace them all
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model_state_dict = model.state_dict()
        checkpoint = {"model": model_state_dict}
        dcp.load(checkpoint, storage_reader=dcp.FileSystemReader(folder))
        model.load_state_dict(checkpoint["model"])
        optim_state = load_sharded_optimizer_state_dict(model_state_dict=model_state_dict, optimizer_key="optim",
                                                        storage_reader=dcp.FileSystemReader(folder))
        flattened_osd = FSDP.optim_state_dict_to_load(model, opt, optim_state["optim"])
        opt.load_state_dict(flattened_osd)
    loaded = _full(model, opt, lib)
    losses = _steps(model, opt, rank, world_size, range(STEPS // 2, STEPS))
    return {"losses": losses, "loaded": loaded, **_full(model, opt, lib)}
