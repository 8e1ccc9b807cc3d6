"""Ranks for tests/test_fully_shard_save.py: a fully_shard model's own state dict written with torch.save and
torch.distributed.checkpoint, as a script does it, with only the import different (torch or fsdp_lab).

Every value of `model.state_dict()` must be a DTensor torch.save can write, and must still be the parameter's
memory: loading into it in place (dcp.load, no load_state_dict after) has to reach the model."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from ranks_fully_shard import TiedLM, full_params, shard, train
from torch.distributed.tensor import DTensor


def _build(lib: str, world_size: int, seed: int):
    torch.manual_seed(seed)
    model = shard(TiedLM(), lib, world_size)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _locals(state: dict) -> dict:
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def run(rank, world_size, lib, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    model, opt = _build(lib, world_size, 0)
    train(model, opt, rank, world_size, 2)
    os.makedirs(f"{folder}/{lib}", exist_ok=True)
    path = f"{folder}/{lib}/rank{rank}.pt"
    torch.save({"earlier": torch.ones(3)}, path)  # a good file from before, which the save replaces
    state = model.state_dict()
    torch.save(state, path)
    loaded = torch.load(path, weights_only=False)
    out["live"], out["saved"] = _locals(state), _locals(loaded)
    out["trained"] = full_params(model)

    fresh, _opt = _build(lib, world_size, 1)
    fresh.load_state_dict(loaded)  # from the torch.load file
    out["from_file"] = full_params(fresh)

    dcp.save(model.state_dict(), checkpoint_id=f"{folder}/{lib}-dcp")
    other, _opt = _build(lib, world_size, 2)
    target = other.state_dict()
    dcp.load(target, checkpoint_id=f"{folder}/{lib}-dcp")  # in place: nothing loads target afterwards
    out["in_place"] = full_params(other)

    msd, osd = get_state_dict(model, opt)
    future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{folder}/{lib}-async")
    future.result(timeout=120)
    out["continued"] = train(model, opt, rank, world_size, 2, first_step=2)[0]

    resumed, resumed_opt = _build(lib, world_size, 3)
    msd, osd = get_state_dict(resumed, resumed_opt)
    both = {"model": msd, "optim": osd}
    dcp.load(both, checkpoint_id=f"{folder}/{lib}-async")
    set_state_dict(resumed, resumed_opt, model_state_dict=both["model"], optim_state_dict=both["optim"])
    out["from_async"] = train(resumed, resumed_opt, rank, world_size, 2, first_step=2)[0]
    dist.barrier()
    return out
