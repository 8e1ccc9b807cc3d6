"""Ranks for tests/test_fsdp1_bf16_params.py: a model whose parameters are already bf16 (what
`from_pretrained(torch_dtype=torch.bfloat16)` gives), wrapped with FSDP1 or fully_shard and no mixed-precision
policy, trained a few AdamW steps. Only the import differs between torch and fsdp_lab."""
from __future__ import annotations

import torch
from ranks_fully_shard import Block, batch, full_params, mean_over_ranks, mesh
from ranks_offload import LM, loss_of
from torch.distributed.fsdp import FullStateDictConfig, StateDictType

STEPS = 4
CLIP = 0.5  # below the first steps' norms: the clipping scales the gradients


def _bf16_model() -> LM:
    torch.manual_seed(0)
    return LM().to(torch.bfloat16)


def wrap(lib: str, front: str, world_size: int, options: dict | None = None):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = _bf16_model()
    if front == "fsdp2":
        import torch.distributed.fsdp as torch_fsdp

        import fsdp_lab
        fsdp = torch_fsdp if lib == "torch" else fsdp_lab
        for layer in model.layers:
            fsdp.fully_shard(layer, mesh=mesh(world_size))
        fsdp.fully_shard(model, mesh=mesh(world_size))
        return model
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                    **(options or {}))
    from fsdp_lab import FSDP
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **(options or {}))


def run(rank, world_size, lib: str, front: str, options: dict | None = None) -> dict:
    """`options`: FSDP1 constructor options (sharding_strategy, use_orig_params)."""
    model = wrap(lib, front, world_size, options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grad_dtypes, norms = [], set(), []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, rank, world_size))
        loss.backward()
        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        if front == "fsdp1":  # the norm is taken in fp32 and returned in the gradients' dtype, as torch does
            norm = model.clip_grad_norm_(CLIP)
            norms.append((str(norm.dtype), norm.float().item()))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss, world_size))
    state_dtypes = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
    out = {"losses": losses, "norms": norms, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "grad_dtypes": sorted(grad_dtypes), "state_dtypes": sorted(state_dtypes)}
    if front == "fsdp2":
        out["params"] = full_params(model)
        return out
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from fsdp_lab import FSDP
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        state = model.state_dict()
    out["state_dtypes_saved"] = sorted({str(v.dtype) for v in state.values()})
    out["params"] = {k: v.detach().float().clone() for k, v in state.items()}
    return out


def mixed_dtypes(rank, world_size, lib: str) -> str:
    """One unit holding a bf16 and an fp32 parameter: one flat parameter cannot hold both, refused as torch does."""
    from torch import nn
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].to(torch.bfloat16)
    try:
        if lib == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            FSDP(model, device_id=torch.device("cpu"))
        else:
            from fsdp_lab import FSDP
            FSDP(model)
    except ValueError as err:
        return str(err)
    return ""
