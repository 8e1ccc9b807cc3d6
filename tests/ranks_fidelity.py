"""Rank functions for tests/test_fidelity.py: what a torch FSDP1 script does, run on fsdp_lab and on torch FSDP1
(device_id=cpu over gloo) or one process. Each case returns facts or the message the user saw, so one case that
fails does not hide the others."""
from __future__ import annotations

import dataclasses
import functools
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

from fsdp_lab import FSDP, MixedPrecision, StateDictType
from fsdp_lab.training.models import GPT, Block, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy, _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

SEQ = 8


class GenerativeGPT(GPT):
    """A model with what Hugging Face models have beside forward: a config and generate()."""

    @property
    def config(self):
        return self.cfg

    @torch.no_grad()
    def generate(self, idx, steps: int = 2):
        for _ in range(steps):
            idx = torch.cat([idx, self(idx)[:, -1:].argmax(-1)], dim=1)
        return idx


def gpt(cls=GPT, seed=0):
    torch.manual_seed(seed)
    return cls(build_gpt("tiny").cfg)


def wrap(model, **kwargs):
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def torch_wrap(model, **kwargs):
    return TorchFSDP(model, auto_wrap_policy=TorchModuleWrapPolicy({Block}), device_id=torch.device("cpu"), **kwargs)


def local_batch(model_cfg, step, rank, world_size):
    x, y = batch_for_step(model_cfg, step, 2 * world_size, seq_len=SEQ)
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


def train(model, opt, steps, rank, world_size, cfg):
    losses = []
    for step in steps:
        x, y = local_batch(cfg, step, rank, world_size)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def seen(fn):
    """What a user sees: the value, or "ExcType: message"."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the type is part of what the test checks
        return f"{type(exc).__name__}: {exc}"


def _cases(rank, world_size, cases) -> dict:
    facts = {}
    for name, case in cases.items():
        try:
            facts[name] = case(rank, world_size)
        except Exception:  # noqa: BLE001
            facts[name] = "case failed:\n" + traceback.format_exc()
    return facts


# -- attributes and torch DCP --------------------------------------------------------------------------------
def forwarding(rank, world_size):
    base = gpt(GenerativeGPT)
    model = wrap(base)
    x, _ = local_batch(base.cfg, 0, rank, world_size)
    seq = FSDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    return {"config": model.config is base.cfg, "blocks": model.blocks is base.blocks,
            "generate": model.generate(x).shape == (x.shape[0], x.shape[1] + 2),
            "getitem": seq[1] is seq.module[1], "missing": seen(lambda: model.no_such_thing),
            "not_provided": seen(lambda: FSDP.full_optim_state_dict(model, None))}


def dcp_state_dict(rank, world_size):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.tensor import DTensor

    base = gpt()
    model = wrap(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1), rank, world_size, base.cfg)
    reference = model.state_dict()
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    sharded = get_model_state_dict(model)  # the default: each parameter this rank's piece, as a DTensor
    pieces = {k: v for k, v in sharded.items() if isinstance(v, DTensor)}
    return {"model_keys": list(got) == list(reference) == list(sharded),
            "model_equal": all(torch.equal(got[k], reference[k]) for k in reference),
            "sharded_pieces": bool(pieces) and all(v.to_local().shape[0] < v.shape[0] for v in pieces.values()),
            "sharded_equal": all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, reference[k])
                                 for k, v in sharded.items()),
            "with_optimizer": seen(lambda: get_state_dict(model, opt) and "no error")}


# -- mixed precision -----------------------------------------------------------------------------------------
class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.1, 0.9, 4))

    def forward(self, x):
        return self.lin(x) * self.scale


def buffer_dtype(rank, world_size):
    policy = dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    torch.manual_seed(0)
    ours = FSDP(WithBuffer(), mixed_precision=MixedPrecision(**policy))
    torch.manual_seed(0)
    theirs = TorchFSDP(WithBuffer(), mixed_precision=TorchMixedPrecision(**policy), device_id=torch.device("cpu"))
    x = torch.ones(2, 4)
    ours(x), theirs(x)
    return {"ours": ours.state_dict()["scale"].dtype, "torch": theirs.state_dict()["scale"].dtype,
            "in_forward": ours.module.scale.dtype}


def low_precision_grads(rank, world_size):
    grads = {}
    for keep in (False, True):
        base = gpt()
        model = wrap(base, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep))
        x, y = local_batch(base.cfg, 0, rank, world_size)
        model(x, y).backward()
        grads[keep] = [p.grad for p in model.parameters()]
        if keep:
            torch.optim.SGD(model.parameters(), lr=0.1, foreach=False).step()  # an optimizer that takes them
    return {"dtypes": sorted({str(g.dtype) for g in grads[True]}),
            "equal": all(torch.equal(low, full.to(torch.bfloat16)) for low, full in zip(grads[True], grads[False]))}


# -- torch.compile and original parameters outside forward ---------------------------------------------------
def whole_model_compile(rank, world_size):
    """FSDP1's documented way, torch.compile(FSDP(model, use_orig_params=True)), trained beside torch's. The
    aot_eager backend traces with Dynamo and AOTAutograd as inductor does, without a C++ toolchain."""
    out = {}
    for name, wrapper in (("fsdp_lab", wrap), ("torch", torch_wrap)):
        base = gpt()
        model = wrapper(base, use_orig_params=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out[name] = seen(lambda: train(torch.compile(model, backend="aot_eager"), opt, range(3), rank, world_size,
                                       base.cfg))
    return out


def sharded_attributes(rank, world_size):
    facts = {}
    for orig in (False, True):
        base = gpt()
        model = wrap(base, use_orig_params=orig)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, range(1), rank, world_size, base.cfg)
        weight = model.module.blocks[0].mlp.fc.weight
        facts[orig] = {"method": seen(lambda: float(weight.sum())), "function": seen(lambda: float(torch.sum(weight))),
                       "linear": seen(lambda: nn.functional.linear(torch.ones(1, 64), weight)),
                       "operator": seen(lambda: weight * 2), "shape": tuple(weight.shape),
                       "after_forward_no_grad": seen(lambda: _read_after_no_grad_forward(model, base))}
    return facts


def _read_after_no_grad_forward(model, base):
    with torch.no_grad():
        model(local_batch(base.cfg, 0, 0, 1)[0])
    return float(model.module.blocks[1].attn.qkv.weight.sum())


# -- traps that train nothing --------------------------------------------------------------------------------
def traps(rank, world_size):
    facts = {}
    base = gpt()
    early = torch.optim.AdamW(base.parameters(), lr=1e-2)  # built before wrapping
    model = wrap(base)
    x, y = local_batch(base.cfg, 0, rank, world_size)
    model(x, y).backward()
    facts["optimizer_before_wrap"] = seen(early.step)
    facts["optimizer_after_wrap"] = seen(lambda: torch.optim.AdamW(model.parameters(), lr=1e-2).step() or "ok")
    facts["wrap_inner_module"] = seen(lambda: FSDP(model.module))
    facts["wrap_wrapped_block"] = seen(lambda: FSDP(model.module.blocks[0]))
    for orig in (False, True):
        frozen = wrap(gpt(), use_orig_params=orig)
        frozen.module.blocks[0].requires_grad_(False)
        facts[f"requires_grad_after_wrap_{orig}"] = seen(lambda: frozen(x, y))
    inner = FSDP(gpt().blocks[0])
    inner_opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    outer_base = gpt()
    outer_base.blocks[0] = inner
    outer = FSDP(outer_base)  # by hand: torch refuses an auto_wrap_policy over a module with FSDP applied
    outer(x, y).backward()
    facts["optimizer_of_nested_inner"] = seen(inner_opt.step)
    return facts


def different_models(rank, world_size):
    """Rank 1 builds a wider MLP in block 1 (a config read differently)."""
    base = gpt()
    if rank == 1:
        base.blocks[1].mlp.fc = nn.Linear(64, 200, bias=False)
        base.blocks[1].mlp.proj = nn.Linear(200, 64, bias=False)
    return seen(lambda: wrap(base) and "wrapped")


# -- missing features ----------------------------------------------------------------------------------------
def fsdp_modules(rank, world_size):
    model = wrap(gpt())
    holder = nn.ModuleDict({"policy": model})
    instances = FSDP.fsdp_modules(model)  # the root, then one instance per block (as torch lists them)
    ours = [instances[0] is model and instances[1:] == list(model.module.blocks) and len(instances) > 1 and
            all(type(m.module) is Block for m in instances[1:]),
            FSDP.fsdp_modules(holder, root_only=True) == [model],
            FSDP.fsdp_modules(nn.Linear(2, 2)) == []]
    return ours


def summon_options(rank, world_size):
    facts = {}
    base = gpt()
    model = wrap(base)
    with FSDP.summon_full_params(model, False):  # torch: recurse=False; writeback stays True
        facts["recurse_false_names"] = sorted(n for n, _ in model.named_parameters())
        with torch.no_grad():
            model.module.ln_f.weight.fill_(3.0)
        facts["block_inside"] = type(model.module.blocks[0].mlp.fc.weight).__name__
    with FSDP.summon_full_params(model):
        facts["written_back"] = bool(torch.all(model.module.ln_f.weight == 3.0))
    x, y = local_batch(base.cfg, 0, rank, world_size)
    with torch.no_grad():
        expected = model(x)
        with FSDP.summon_full_params(model, recurse=False, writeback=False):  # TRL's generation pattern
            facts["forward_in_root_summon"] = torch.allclose(model.module(x), expected, atol=1e-6)
            facts["root_still_full"] = tuple(model.module.wte.weight.shape)
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        facts["rank0_only_names"] = len([n for n, _ in model.named_parameters()])
    facts["rank0_only_writeback"] = seen(lambda: FSDP.summon_full_params(model, rank0_only=True).__enter__())
    model(x, y).backward()
    with FSDP.summon_full_params(model, with_grads=True, writeback=False, offload_to_cpu=True):
        facts["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        facts["devices"] = sorted({str(p.device) for p in model.parameters()})
    return facts


def grads_reference():
    """The gradients summon_options reads, in one process (its ln_f weight is 3 by then, as written there)."""
    base = gpt()
    with torch.no_grad():
        base.ln_f.weight.fill_(3.0)
    x, y = batch_for_step(base.cfg, 0, 2 * 2, seq_len=SEQ)
    base(x, y).backward()
    return {n: p.grad.clone() for n, p in base.named_parameters()}


def sharded_state_dict(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp

    base = gpt()
    model = wrap(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train(model, opt, range(2), rank, world_size, base.cfg)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = model.state_dict()
    dcp.save(state, checkpoint_id=directory)
    kinds = sorted({type(v).__name__ for v in state.values()})
    local = {k: tuple(v.to_local().shape) for k, v in state.items() if hasattr(v, "to_local")}
    continued = train(model, opt, range(2, 4), rank, world_size, base.cfg)

    fresh = wrap(gpt(seed=7))
    with FSDP.state_dict_type(fresh, TorchStateDictType.SHARDED_STATE_DICT):
        target = fresh.state_dict()
        dcp.load(target, checkpoint_id=directory)
        fresh.load_state_dict(target)
    resumed = train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.5), range(2, 4), rank, world_size, base.cfg)

    theirs = torch_wrap(gpt())
    with TorchFSDP.state_dict_type(theirs, TorchStateDictType.SHARDED_STATE_DICT):
        torch_state = theirs.state_dict()
    torch_local = {k: tuple(v.local_tensor().shape if hasattr(v, "local_tensor") else v.to_local().shape)
                   for k, v in torch_state.items() if hasattr(v, "local_tensor") or hasattr(v, "to_local")}
    return {"kinds": kinds, "local": local, "torch_local": torch_local, "keys": list(state),
            "torch_keys": list(torch_state), "continued": continued, "resumed": resumed}


def policies(rank, world_size):
    """PEFT's LoRA policy shape: _or_policy over a lambda policy and a transformer policy, here and in torch."""
    from torch.distributed.fsdp.wrap import _or_policy as torch_or
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy as torch_lambda
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_transformer

    def is_head(module):
        return isinstance(module, nn.LayerNorm) and module.normalized_shape == (64,) and module.bias is not None

    def policy(or_policy, lam, transformer):
        return functools.partial(or_policy, policies=[functools.partial(lam, lambda_fn=is_head),
                                                      functools.partial(transformer, transformer_layer_cls={Block})])

    ours = FSDP(gpt(), auto_wrap_policy=policy(_or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy))
    theirs = TorchFSDP(gpt(), auto_wrap_policy=policy(torch_or, torch_lambda, torch_transformer),
                       device_id=torch.device("cpu"))
    torch_units = [n.replace("_fsdp_wrapped_module.", "") for n, m in theirs.named_modules()
                   if isinstance(m, TorchFSDP) and m is not theirs]
    return {"ours": [u.name for u in ours.units if not u.is_root], "torch": torch_units}


def param_init_fn(rank, world_size):
    calls = {"ours": [], "torch": []}
    ours = wrap(gpt(), param_init_fn=lambda m: calls["ours"].append(type(m).__name__))
    torch_wrap(gpt(), param_init_fn=lambda m: calls["torch"].append(type(m).__name__))
    with FSDP.summon_full_params(ours):
        same = all(torch.equal(p, q) for (_, p), (_, q) in zip(ours.named_parameters(), gpt().named_parameters()))
    untied = dataclasses.replace(build_gpt("tiny").cfg, tie_weights=False)
    on_meta = {}
    for key, wrapper in (("ours", wrap), ("torch", torch_wrap)):  # on meta: called per module, in torch's order
        with torch.device("meta"):
            model = GPT(untied)
        on_meta[key] = []
        wrapper(model, param_init_fn=lambda m, key=key: (on_meta[key].append(type(m).__name__),
                                                         m.to_empty(device="cpu", recurse=False)))
    with torch.device("meta"):
        tied = gpt()
    return {"calls": calls, "unchanged": same, "meta_calls": on_meta,
            "untied": seen(lambda: wrap(tied, param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False)))}


CASES = {f.__name__: f for f in (forwarding, dcp_state_dict, buffer_dtype, low_precision_grads, whole_model_compile,
                                  sharded_attributes, traps, different_models, fsdp_modules, summon_options,
                                  policies, param_init_fn)}


def run_cases(rank, world_size, directory):
    os.environ.setdefault("TORCHDYNAMO_VERBOSE", "0")
    cases = dict(CASES)
    cases["sharded_state_dict"] = functools.partial(sharded_state_dict, directory=directory)
    return _cases(rank, world_size, cases)
