"""Rank functions for FSDP.optim_state_dict / optim_state_dict_to_load (tests/test_optim_state_dict.py): the same
FSDP1 model as the offload tests, with torch's FSDP1 or fsdp_lab's, saved and resumed."""
from __future__ import annotations

import torch
from ranks_fully_shard import batch, mean_over_ranks
from ranks_offload import loss_of, torch_offload_on_cpu, wrap_fsdp1
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType


def _fsdp(lib: str):
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fsdp_lab import FSDP
    return FSDP


def _steps(model, opt, rank, world_size, steps) -> list:
    losses = []
    for step in steps:
        loss = loss_of(model, *batch(step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss, world_size))
    return losses


def _plain(osd: dict) -> dict:
    """Tensors cloned to the CPU, for the queue back to the test."""
    state = {name: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for name, s in osd.get("state", {}).items()}
    return {"state": state, "param_groups": osd.get("param_groups")} if osd else {}


def against_torch(rank, world_size, lib: str, options: dict) -> dict:
    """Train 2 steps, then the full optimizer state dict under the default settings and under rank0_only."""
    with torch_offload_on_cpu() if lib == "torch" else _nothing():
        model = wrap_fsdp1(lib, False, dict(options))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _steps(model, opt, rank, world_size, range(2))
        FSDP = _fsdp(lib)
        out = {"default": _plain(FSDP.optim_state_dict(model, opt))}
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            out["rank0_only"] = _plain(FSDP.optim_state_dict(model, opt))
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def resume_all(rank, world_size, phase: str, kinds: tuple, folder: str, options: dict) -> dict:
    """resume() for each kind in one process (each with its own model); "straight" once."""
    if phase == "straight":
        return resume(rank, world_size, phase, None, folder, options)
    return {kind: resume(rank, world_size, phase, kind, folder, options) for kind in kinds}


def resume(rank, world_size, phase: str, kind: str, folder: str, options: dict, steps: int = 4,
           lib: str = "fsdp_lab") -> dict:
    """phase "straight": `steps` steps. "save": steps//2, then save model and optimizer under `kind` (FULL: rank 0
    writes one torch.save file; SHARDED: torch.distributed.checkpoint). "load": a fresh model with other weights
    loads it and runs the remaining steps. Also returns the loaded state re-exported in full ("exported") and,
    after a load, the state after the remaining steps ("final"). `lib`: whose FSDP1 (torch or fsdp_lab), so a
    file one writes can be loaded by the other (tests/test_interop.py)."""
    import torch.distributed.checkpoint as dcp

    FSDP = _fsdp(lib)
    half = steps // 2
    model = wrap_fsdp1(lib, False, dict(options), seed=1234 if phase == "load" else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if phase == "straight":
        return {"losses": _steps(model, opt, rank, world_size, range(steps))}
    # torch 2.13's FSDP1 on the CPU fails with offload_to_cpu=True ("setStorage: ... out of bounds for storage of
    # size 0": it frees the flat storage the CPU copy still views); on the CPU there is nowhere to offload to.
    offload = lib != "torch"
    full_type = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                 FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True))
    sharded_type = (StateDictType.SHARDED_STATE_DICT,)
    settings = full_type if kind == "full" else sharded_type
    if phase == "save":
        losses = _steps(model, opt, rank, world_size, range(half))
        with FSDP.state_dict_type(model, *settings):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        if kind == "full":
            if rank == 0:
                torch.save(state, f"{folder}/full.pt")
        else:
            dcp.save(state, checkpoint_id=f"{folder}/sharded")
        return {"losses": losses, "exported": _export(model, opt, lib)}
    if kind == "full":
        state = torch.load(f"{folder}/full.pt", weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
        with FSDP.state_dict_type(model, *settings):
            model.load_state_dict(_broadcast(state["model"], rank))  # rank 0 only: every rank needs the model
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
    else:
        _steps(model, opt, rank, world_size, [99])  # the optimizer's state must exist for dcp.load to fill it
        with FSDP.state_dict_type(model, *settings):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=f"{folder}/sharded")
            model.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(model, opt, state["optim"], load_directly=True)
    exported = _export(model, opt, lib)
    losses = _steps(model, opt, rank, world_size, range(half, steps))
    return {"losses": losses, "exported": exported, "final": _export(model, opt, lib)}


def _broadcast(obj, rank):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _export(model, opt, lib: str = "fsdp_lab") -> dict:
    FSDP = _fsdp(lib)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": _plain(FSDP.optim_state_dict(model, opt))}


def dcp_get_state_dict(rank, world_size) -> str:
    from ranks_features import message_of
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = wrap_fsdp1("fsdp_lab", False, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, world_size, range(1))
    return message_of(lambda: get_state_dict(model, opt))
