"""Ranks for tests/test_interop.py: checkpoints move between torch's FSDP and fsdp_lab's, both ways, for both front
ends, through torch.distributed.checkpoint (sharded) and through a full state dict in one torch.save file, and
resume on another world size.

Every writer trains the first 2 of 4 steps and saves model and optimizer; every reader is a fresh model with
other weights that loads the other library's checkpoint and trains steps 3 and 4. The saving and loading code is
the existing one of each front end's own tests, run with `lib` set to the writer or the reader:
- FSDP1, sharded: ranks_fsdp1_resharded_optim (SHARDED_STATE_DICT, FSDP.optim_state_dict, dcp.save; then
  dcp.load, load_sharded_optimizer_state_dict, FSDP.optim_state_dict_to_load);
- FSDP1, full: ranks_optim_state.resume (FULL_STATE_DICT with rank0_only, torch.save on rank 0; rank 0 loads,
  the model state is broadcast, FSDP.optim_state_dict_to_load scatters the optimizer state);
- fully_shard, sharded: get_state_dict(model, optim), dcp.save; get_state_dict, dcp.load, set_state_dict;
- fully_shard, full: get_state_dict with StateDictOptions(full_state_dict=True, cpu_offload=True), torch.save on
  rank 0; set_model_state_dict and set_optimizer_state_dict with full_state_dict=True, broadcast_from_rank0=True
  (only rank 0 reads the file).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks_fsdp1_resharded_optim import load as fsdp1_dcp_load
from ranks_fsdp1_resharded_optim import save as fsdp1_dcp_save
from ranks_fsdp1_resharded_optim import straight as fsdp1_straight
from ranks_fully_shard import full_params, train
from ranks_fully_shard_save import _build as fsdp2_build
from ranks_optim_state import resume as fsdp1_resume
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

LIBS = ("torch", "fsdp_lab")
KINDS = ("dcp", "full")
FRONTS = ("fsdp1", "fsdp2")
HALF, STEPS = 2, 4
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _where(folder: str, saved_on: int, front: str, lib: str, kind: str) -> str:
    path = f"{folder}/on{saved_on}/{front}/{lib}/{kind}"
    os.makedirs(path, exist_ok=True)
    return path


def _fsdp1_params(result: dict) -> dict:
    """The full parameters by name of an FSDP1 run, in either helper's shape."""
    return result["params"] if "params" in result else {k: v.float() for k, v in result["final"]["model"].items()}


# -- fully_shard ---------------------------------------------------------------------------------------------------
def fsdp2_save(rank, world_size, lib: str, kind: str, path: str) -> list:
    model, opt = fsdp2_build(lib, world_size, 0)
    losses = train(model, opt, rank, world_size, HALF)[0]
    if kind == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:
        msd, osd = get_state_dict(model, opt, options=FULL)
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, f"{path}/full.pt")
        dist.barrier()
    return losses


def fsdp2_load(rank, world_size, lib: str, kind: str, path: str) -> dict:
    model, opt = fsdp2_build(lib, world_size, 3)  # other weights: the checkpoint must replace them all
    if kind == "dcp":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = torch.load(f"{path}/full.pt", weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
        # One call each: set_state_dict(model, optim, ...) would take rank 1's empty model dict as "optimizer
        # only" and leave rank 0 alone in the model's broadcasts.
        set_model_state_dict(model, state["model"], options=FULL_LOAD)
        set_optimizer_state_dict(model, opt, state["optim"], options=FULL_LOAD)
    losses = train(model, opt, rank, world_size, STEPS - HALF, first_step=HALF)[0]
    return {"losses": losses, "params": full_params(model)}


def fsdp2_straight(rank, world_size, lib: str) -> dict:
    model, opt = fsdp2_build(lib, world_size, 0)
    return {"losses": train(model, opt, rank, world_size, STEPS)[0], "params": full_params(model)}


# -- one launch: load what was saved on another world size, save for the next -----------------------------------
def phase(rank, world_size, folder: str, load_from: int | None, save: bool) -> dict:
    """Load every checkpoint saved on `load_from` ranks into the other library (writer -> reader), then (save)
    write each library's checkpoints on this world size; rank 0's view, with an uninterrupted torch run of each
    front end when this launch saves."""
    out = {"loaded": {}, "saved": {}, "straight": {}}
    if load_from is not None:
        for front in FRONTS:
            for writer in LIBS:
                reader = LIBS[1 - LIBS.index(writer)]
                for kind in KINDS:
                    path = _where(folder, load_from, front, writer, kind)
                    if front == "fsdp2":
                        got = fsdp2_load(rank, world_size, reader, kind, path)
                    elif kind == "dcp":
                        got = fsdp1_dcp_load(rank, world_size, reader, path)
                    else:
                        got = fsdp1_resume(rank, world_size, "load", "full", path, {}, STEPS, lib=reader)
                    out["loaded"][front, writer, kind] = {"losses": got["losses"],
                                                          "params": got["params"] if front == "fsdp2"
                                                          else _fsdp1_params(got)}
    if save:
        for front in FRONTS:
            for lib in LIBS:
                for kind in KINDS:
                    path = _where(folder, world_size, front, lib, kind)
                    if front == "fsdp2":
                        losses = fsdp2_save(rank, world_size, lib, kind, path)
                    elif kind == "dcp":
                        losses = fsdp1_dcp_save(rank, world_size, lib, path)["losses"]
                    else:
                        losses = fsdp1_resume(rank, world_size, "save", "full", path, {}, STEPS, lib=lib)["losses"]
                    out["saved"][front, lib, kind] = losses
        fsdp1 = fsdp1_straight(rank, world_size, "torch")
        out["straight"]["fsdp1"] = {"losses": fsdp1["losses"], "params": fsdp1["params"]}
        out["straight"]["fsdp2"] = fsdp2_straight(rank, world_size, "torch")
    dist.barrier()
    return out if rank == 0 else {}
