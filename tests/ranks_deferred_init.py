"""Rank functions for tests/test_deferred_init.py: a model built on the meta device, sync_module_states and ignored
modules, each run on fsdp_lab and on torch (FSDP1 with device_id=cpu over gloo, or fully_shard) with the same
seeds, plus the bytes of parameter storage each rank holds while it wraps."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_lab import FSDP
from fsdp_lab.observe.storage_peak import StoragePeak  # [Note: counting storages, not allocations]
from fsdp_lab.training.models import GPT, Block, GPTConfig, batch_for_step, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32, tie_weights=False)
SEQ, STEPS, GLOBAL = 8, 3, 4  # GLOBAL: the global batch, split over the ranks


def init_fn(module: nn.Module) -> None:
    """A param_init_fn as a script writes one: materialise this module's own tensors, then GPT's init."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def real_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def fsdp(lib: str, model, **kwargs):
    if lib == "torch":
        return TorchFSDP(model, auto_wrap_policy=TorchModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                         **kwargs)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def full_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model, rank, world_size, steps=STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch_for_step(CFG, step, GLOBAL, seq_len=SEQ)
        if world_size > 1:
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        loss = model(x, y)
        loss.backward()
        if isinstance(model, (FSDP, TorchFSDP)):
            model.clip_grad_norm_(1.0)
        else:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses


def one_process(state: dict) -> list[float]:
    """The same steps on one process over the whole batch, from `state`."""
    model = GPT(CFG)
    model.load_state_dict(state)
    return train(model, 0, 1)


class CollectiveBytes(TorchDispatchMode):
    """Bytes each kind of c10d collective carried (the larger of its tensors' sizes), counted at the dispatcher, so
    fsdp_lab and torch are counted alike."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "c10d":
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            kind = "all_gather" if "allgather" in name else "reduce_scatter" if "reduce_scatter" in name else name
            size = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.bytes[kind] = self.bytes.get(kind, 0) + size
        return func(*args, **(kwargs or {}))


def unit_unsharded_bytes(model) -> int:
    """The largest unit's unsharded buffer (fsdp_lab's FSDP or fully_shard model): what one gather allocates."""
    if isinstance(model, FSDP):
        return max(sum(f.full_bytes for f in u.flats) for u in model.units)
    return max(sum(f.full_bytes for f in m._fsdp_lab_state.unit.flats) for m in model.modules()
               if hasattr(m, "_fsdp_lab_state"))


def fully_shard_gpt(lib: str, model: GPT, world_size: int, ignored_params=None, seed=None) -> GPT:
    """fully_shard (fsdp_lab's or torch's) per block, then the root; a model on meta is then moved with to_empty
    and re-initialised with reset_parameters under `seed`."""
    import fsdp_lab
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fsdp_lab.fully_shard if lib == "fsdp_lab" else torch_fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    on_meta = any(p.is_meta for p in model.parameters())
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh, ignored_params=ignored_params)
    if on_meta:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    return model


# -- cases -----------------------------------------------------------------------------------------------------
def meta_init(rank, world_size):
    """param_init_fn, then the default path (to_empty + reset_parameters), on both libraries with one seed."""
    out = {}
    for lib in ("torch", "fsdp_lab"):
        torch.manual_seed(1)
        cpu = {"device_id": torch.device("cpu")} if lib == "fsdp_lab" else {}  # torch's always has it
        model = fsdp(lib, meta_gpt(), param_init_fn=init_fn, **cpu)
        out[f"{lib}_fn_state"] = full_state(model)
        out[f"{lib}_fn_losses"] = train(model, rank, world_size)
        torch.manual_seed(2)
        model = fsdp(lib, meta_gpt())
        out[f"{lib}_default_state"] = full_state(model)
        out[f"{lib}_default_losses"] = train(model, rank, world_size)
    for lib, cls, kwargs in (("torch", TorchFSDP, {"device_id": torch.device("cpu")}), ("fsdp_lab", FSDP, {})):
        torch.manual_seed(1)  # wrapped by hand, each block first: the same order as the policy's
        model = meta_gpt()
        for i in range(len(model.blocks)):
            model.blocks[i] = cls(model.blocks[i], param_init_fn=init_fn, **kwargs)
        model = cls(model, param_init_fn=init_fn, **kwargs)
        out[f"{lib}_nested_state"] = full_state(model)
        out[f"{lib}_nested_losses"] = train(model, rank, world_size)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):  # each keeps other masters; one seed, one model
        torch.manual_seed(1)
        model = fsdp("fsdp_lab", meta_gpt(), param_init_fn=init_fn, use_orig_params=strategy == "FULL_SHARD",
                     sharding_strategy=strategy)
        out[f"orig_params_{strategy}_state"] = full_state(model)
    out["plain_fn_losses"] = one_process(out["torch_fn_state"])
    out["plain_default_losses"] = one_process(out["torch_default_state"])
    return out


def wrap_peaks(rank, world_size):
    """Peak and final bytes of CPU float storage per rank while building and wrapping: on meta with param_init_fn,
    on meta by default, and built for real (FSDP1, both libraries); and the fully_shard flow on meta against
    built for real."""
    out = {}
    paths = {"meta_fn": lambda: (meta_gpt(), {"param_init_fn": init_fn}), "meta_default": lambda: (meta_gpt(), {}),
             "real": lambda: (real_gpt(0), {})}
    for lib in ("fsdp_lab", "torch"):
        for path, build in paths.items():
            with StoragePeak() as counter:
                model, kwargs = build()
                wrapped = fsdp(lib, model, **kwargs)
                out[f"{lib}_{path}"] = {"peak": counter.peak, "final": counter.settled()}
            if lib == "fsdp_lab":
                out[f"{lib}_{path}"]["unit"] = unit_unsharded_bytes(wrapped)
            del model, wrapped
    for lib in ("fsdp_lab", "torch"):
        for path in ("meta", "real"):
            with StoragePeak() as counter:
                model = fully_shard_gpt(lib, meta_gpt() if path == "meta" else real_gpt(0), world_size, seed=0)
                out[f"fs_{lib}_{path}"] = {"peak": counter.peak, "final": counter.settled()}
            if lib == "fsdp_lab":
                out[f"fs_{lib}_{path}"]["unit"] = unit_unsharded_bytes(model)
            del model
    return out


def fully_shard_meta(rank, world_size):
    """fully_shard on a meta model, then to_empty and reset_parameters (one seed): the weights torch's fully_shard
    gives, and training that matches it and one process started from those weights."""
    out = {}
    for lib in ("torch", "fsdp_lab"):
        model = fully_shard_gpt(lib, meta_gpt(), world_size, seed=3)
        out[f"{lib}_state"] = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        out[f"{lib}_losses"] = train(model, rank, world_size)
    out["plain_losses"] = one_process(out["fsdp_lab_state"])
    return out


def sync_states(rank, world_size):
    """sync_module_states=True: rank 0 holds real weights (seed 0); the others random ones, or meta ones with a
    param_init_fn. Also the peak bytes on a meta rank while wrapping."""
    # torch FSDP1 refuses CPU tensors with sync_module_states (it has NCCL in mind); its broadcast itself runs on
    # gloo, so the reference lifts that device check and nothing else.
    import torch.distributed.fsdp._init_utils as torch_init

    torch_init._check_module_states_for_sync_module_states = lambda states: None
    out = {"plain_state": {k: v.clone() for k, v in real_gpt(0).state_dict().items()}}
    for lib in ("torch", "fsdp_lab"):
        for others in ("random", "meta"):
            model, kwargs = _sync_model(rank, others)
            wrapped, counted = _counted_sync_wrap(lib, model, kwargs)
            out[f"{lib}_{others}_state"] = full_state(wrapped)
            out[f"{lib}_{others}_losses"] = train(wrapped, rank, world_size)
            if lib == "fsdp_lab" and others == "meta":
                out["meta_peak"] = {**counted, "unit": unit_unsharded_bytes(wrapped)}
            del model, wrapped
    # [Note: a broadcast's tensor outlives the call]
    out["meta_peak"] = min([out["meta_peak"], _meta_peak(rank), _meta_peak(rank)], key=lambda p: p["peak"])
    out["plain_losses"] = one_process(out["plain_state"])
    return out


def _sync_model(rank: int, others: str) -> tuple[GPT, dict]:
    """What each rank builds before wrapping with sync_module_states, and the FSDP keywords it needs."""
    if rank == 0:
        return real_gpt(0), {}
    if others == "random":
        return real_gpt(10 + rank), {}
    return meta_gpt(), {"param_init_fn": init_fn}


# [Note: a broadcast's tensor outlives the call] gloo runs a collective on a worker thread, which still holds the
# tensors it moved for a moment after the caller's broadcast has returned, until it takes the next job. On a
# loaded machine that moment can last while the caller copies the unit into its shard and drops the parameter it
# broadcast, and then the counter sees that parameter alive one step longer than the runtime keeps it: once,
# the meta rank's peak came out one 128 x 32 weight (16 KiB) above its usual figure. That can only add bytes, so
# the meta-rank test takes the least peak of three wraps of the same meta model, each rank's own.
def _meta_peak(rank: int) -> dict:
    """fsdp_lab's sync_module_states wrap of the meta case once more, counted, without training."""
    wrapped, counted = _counted_sync_wrap("fsdp_lab", *_sync_model(rank, "meta"))
    return {**counted, "unit": unit_unsharded_bytes(wrapped)}


def _counted_sync_wrap(lib: str, model, kwargs: dict):
    """(the wrapped model, {peak, final}: the bytes counted while it was wrapped, and once it settled)."""
    with StoragePeak() as counter:
        wrapped = fsdp(lib, model, sync_module_states=True, **kwargs)
        peak, final = counter.peak, counter.settled()
    return wrapped, {"peak": peak, "final": final}


def _ignored_run(lib, rank, world_size, how):
    model = real_gpt(0)
    kwargs = {}
    if how == "modules":
        kwargs["ignored_modules"] = [model.lm_head]
    elif how == "states":
        kwargs["ignored_states"] = [model.blocks[0].mlp.fc.weight]
    report = None
    if lib in ("torch", "fsdp_lab"):
        model = fsdp(lib, model, **kwargs)
        report = model.memory_report().params_unsharded if lib == "fsdp_lab" else None
    else:  # fully_shard, per block then the root
        ignored = {model.lm_head.weight} if how == "modules" else None
        model = fully_shard_gpt(lib[3:], model, world_size, ignored_params=ignored)
    name = {"modules": "lm_head.weight", "states": "blocks.0.mlp.fc.weight"}.get(how)
    params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    param = params.get(name)
    x, y = batch_for_step(CFG, 0, GLOBAL, seq_len=SEQ)
    x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
    with CollectiveBytes() as counter:
        model(x, y).backward()
    grad = param.grad.detach().clone() if param is not None else None
    norm = model.clip_grad_norm_(1e9).item() if lib in ("torch", "fsdp_lab") else None  # the global norm, unclipped
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()
    losses = train(model, rank, world_size) if lib in ("torch", "fsdp_lab") else None
    state = model.state_dict()
    return {"type": type(param).__name__, "shape": tuple(param.shape) if param is not None else None, "grad": grad,
            "bytes": counter.bytes, "losses": losses, "keys": sorted(state), "unsharded_report": report,
            "norm": norm,
            "value": state[name].detach().clone() if name is not None else None}


def ignored(rank, world_size):
    """ignored_modules and ignored_states (FSDP1), ignored_params (fully_shard), each beside torch's."""
    out = {}
    for lib in ("torch", "fsdp_lab"):
        for how in ("modules", "states", "none"):
            out[f"{lib}_{how}"] = _ignored_run(lib, rank, world_size, how)
    for lib in ("fs_torch", "fs_fsdp_lab"):
        for how in ("modules", "none"):
            out[f"{lib}_{how}"] = _ignored_run(lib, rank, world_size, how)
    x, y = batch_for_step(CFG, 0, GLOBAL, seq_len=SEQ)
    local = real_gpt(0)  # what this rank's batch alone gives the ignored weights
    local(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    out["local_grads"] = {"lm_head.weight": local.lm_head.weight.grad.clone(),
                          "blocks.0.mlp.fc.weight": local.blocks[0].mlp.fc.weight.grad.clone()}
    return out


def refusals(rank, world_size):
    """What torch refuses about ignored states is refused here too, in one line naming it."""
    from ranks_features import message_of

    model = real_gpt(0)
    return {"both": message_of(lambda: FSDP(model, ignored_modules=[model.lm_head],
                                            ignored_states=[model.lm_head.weight])),
            "mixed": message_of(lambda: FSDP(model, ignored_states=[model.lm_head, model.wte.weight])),
            "root": message_of(lambda: FSDP(model, ignored_modules=[model])),
            "not_modules": message_of(lambda: FSDP(model, ignored_modules=[model.lm_head.weight])),
            "left_on_meta": message_of(lambda: FSDP(meta_gpt(), param_init_fn=lambda m: None))}


CASES = {f.__name__: f for f in (meta_init, wrap_peaks, fully_shard_meta, sync_states, ignored,
                                  refusals)}


def run_cases(rank, world_size, names):
    out = {}
    for name in names:
        try:
            out[name] = CASES[name](rank, world_size)
        except Exception:
            import traceback
            out[name] = "case failed: " + traceback.format_exc()
    return out
