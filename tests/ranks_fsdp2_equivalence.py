"""Ranks for tests/test_fsdp2_equivalence.py: each FSDP1 line a notebook shows beside an FSDP2 line, run as the
notebook writes it (tests/ranks_fsdp2_lines.py), on the same model and batch, once per front end. Each case
returns what the test compares: the logs, dtypes, norms, state dicts and parameters each pair gives."""
from __future__ import annotations

import functools
import warnings

import torch
from ranks_fsdp2_lines import (_COLLECTIVES, Recorder, _names_of, api, batch, bf16_policies, fresh,
                               fsdp1_transformer_policy, fsdp1_wrap, fsdp2_wrap, install_recorders, step)
from torch import nn
from torch.distributed.tensor import DTensor


def _lifecycle(lib, rank, build, before_step=None):
    """One forward and backward of a wrapped model; the log, and the dtypes seen."""
    net = fresh()
    seen = {}

    def note_dtype(module, args):
        seen.setdefault("param_in_forward", str(module.weight.dtype))

    for block in net.blocks:
        block.fc.register_forward_pre_hook(note_dtype)
    names = _names_of(net)
    marks = []

    def mark_grad_out(module, args, output):
        name = names[id(module)]
        output.register_hook(lambda grad: marks[0].mark("grad_out", name))

    for block in net.blocks:  # before the front end's own hooks, so the mark comes first
        block.register_forward_hook(mark_grad_out)
    model = build(net)
    rec = Recorder(lib, model, names)
    marks.append(rec)
    if before_step is not None:
        before_step(model)
    out, loss = step(model, batch(rank), rec)
    log = rec.log()
    rec.close(model)
    seen["output"] = str(out.dtype)
    seen["reductions"] = sorted({dtype for name, dtype in _COLLECTIVES if name.startswith("reduce_scatter")})
    seen["master"] = sorted({str(p.dtype) for p in model.parameters()})
    seen["grads"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return {"log": log, "dtypes": seen, "loss": loss.item()}


def case_lifecycles(rank, lib):
    """Every pair whose claim is about units, resharding, prefetch order and precision."""
    fsdp, _, FSDP, _, _ = api(lib)
    mp1, mp2 = bf16_policies(lib)
    S = fsdp.ShardingStrategy
    runs = {
        "fsdp1_default": lambda n: fsdp1_wrap(lib, n),
        "fsdp1_transformer_policy": lambda n: fsdp1_transformer_policy(lib, n),
        "fsdp1_no_backward_prefetch": lambda n: fsdp1_wrap(lib, n, backward_prefetch=None),
        "fsdp1_full_shard": lambda n: fsdp1_wrap(lib, n, sharding_strategy=S.FULL_SHARD),
        "fsdp1_shard_grad_op": lambda n: fsdp1_wrap(lib, n, sharding_strategy=S.SHARD_GRAD_OP),
        "fsdp1_mixed_precision": lambda n: fsdp1_wrap(lib, n, mixed_precision=mp1),
        "fsdp2_default": lambda n: fsdp2_wrap(lib, n),
        "fsdp2_no_reshard_blocks": lambda n: fsdp2_wrap(lib, n, {"reshard_after_forward": False}),
        "fsdp2_mixed_precision": lambda n: fsdp2_wrap(lib, n, {"mp_policy": mp2}, {"mp_policy": mp2}),
    }
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP):  # legacy-10's line, as written
        runs[f"fsdp2_legacy10_{strategy.name}"] = (
            lambda n, strategy=strategy: fsdp2_wrap(lib, n, {"reshard_after_forward": (strategy is S.FULL_SHARD)}))

    def empty_backward_prefetch(model):
        for module in [*model.blocks, model]:
            module.set_modules_to_backward_prefetch([])

    out = {name: _lifecycle(lib, rank, build) for name, build in runs.items()}
    out["fsdp2_empty_backward_prefetch"] = _lifecycle(lib, rank, lambda n: fsdp2_wrap(lib, n),
                                                      before_step=empty_backward_prefetch)
    return out


def case_linear_policy(rank, lib):
    """legacy-08: ModuleWrapPolicy({nn.Linear}) against the loop over layers.modules(), on the notebook's
    Sequential and on one with a Linear nested a level down."""
    fsdp, FSDP, _, ModuleWrapPolicy, _ = api(lib)
    out = {}
    for shape in ("flat", "nested"):
        for front in ("fsdp1", "fsdp2_modules", "fsdp2_children"):
            torch.manual_seed(0)
            layers = (nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)) if shape == "flat" else
                      nn.Sequential(nn.Linear(6, 5), nn.Sequential(nn.Tanh(), nn.Linear(5, 3))))
            names = _names_of(layers)
            if front == "fsdp1":
                model = FSDP(layers, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
            else:
                for layer in (layers.modules() if front == "fsdp2_modules" else layers):
                    if isinstance(layer, nn.Linear):
                        fsdp.fully_shard(layer)
                fsdp.fully_shard(layers)
                model = layers
            rec = Recorder(lib, model, names)
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
            step(model, x, rec)
            out[f"{shape}/{front}"] = rec.log()
            rec.close(model)
    return out


def _norm(model, fsdp2: bool) -> float:
    if fsdp2:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        return float(total.full_tensor() if isinstance(total, DTensor) else total)
    return float(model.clip_grad_norm_(float("inf")))


def case_clip(rank, lib):
    """fsdp2-19: model.clip_grad_norm_(max) against torch.nn.utils.clip_grad_norm_(model.parameters(), max); and
    whether the wrapped model is the same object, of an FSDPModule class."""
    out = {}
    for front in ("fsdp1", "fsdp2"):
        net = fresh()
        model = fsdp1_wrap(lib, net) if front == "fsdp1" else fsdp2_wrap(lib, net)
        step(model, batch(rank))
        kept = {"same_object": model is net, "fsdp_module": isinstance(model, api(lib)[0].FSDPModule)}
        if front == "fsdp1":
            total = model.clip_grad_norm_(0.01)
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            total = total.full_tensor() if isinstance(total, DTensor) else total
        out[front] = {"norm": float(total), "after": _norm(model, front == "fsdp2"), **kept,
                      "dtensor_grads": all(isinstance(p.grad, DTensor) for p in model.parameters())}
    return out


def case_accumulation(rank, lib):
    """fsdp2-19 and accum-05-00: `with model.no_sync():` against set_requires_gradient_sync(False), and
    set_reshard_after_backward(False) keeping the parameters gathered between micro-batches."""
    out = {}
    for front in ("fsdp1", "fsdp2", "fsdp2_keep_gathered"):
        net = fresh()
        names = _names_of(net)
        model = fsdp1_wrap(lib, net) if front == "fsdp1" else fsdp2_wrap(lib, net)
        rec = Recorder(lib, model, names)
        if front == "fsdp1":
            with model.no_sync():
                step(model, batch(rank, 0), rec)
        else:
            model.set_requires_gradient_sync(False)
            if front == "fsdp2_keep_gathered":
                model.set_reshard_after_backward(False)
            step(model, batch(rank, 0), rec)
            model.set_requires_gradient_sync(True)
            if front == "fsdp2_keep_gathered":
                model.set_reshard_after_backward(True)
        rec.mark("micro_batch_end")
        step(model, batch(rank, 1), rec)
        out[front] = {"log": rec.log(), "norm": _norm(model, front != "fsdp1")}
        rec.close(model)
    return out


def _sd_summary(sd: dict) -> dict:
    out = {}
    with warnings.catch_warnings():  # reading a ShardedTensor warns that it is deprecated: the cell says so
        warnings.simplefilter("ignore", FutureWarning)
        for key, value in sd.items():
            out[key] = _summary(value)
    return out


def _summary(value) -> dict:
    if isinstance(value, DTensor):
        local, kind = value.to_local(), "DTensor"
    elif type(value).__name__ == "ShardedTensor":
        shards = value.local_shards()
        local, kind = (shards[0].tensor if shards else torch.empty(0)), "ShardedTensor"
    else:
        local, kind = value, type(value).__name__
    return {"kind": kind, "shape": list(value.shape), "local": local.detach().float().clone()}


def _collectives_of(fn):
    _COLLECTIVES.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, len(_COLLECTIVES), sorted({w.category.__name__ for w in caught})


def case_state_dict(rank, lib):
    """fsdp2-15/17/19: FSDP1's SHARDED_STATE_DICT against FSDP2's plain state_dict(), and get_model_state_dict
    on both."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fsdp, _, FSDP, _, _ = api(lib)
    install_recorders(lib)
    out = {}
    model1 = fsdp1_wrap(lib, fresh())
    step(model1, batch(rank))

    def fsdp1_sharded():
        with FSDP.state_dict_type(model1, fsdp.StateDictType.SHARDED_STATE_DICT):
            return model1.state_dict()

    model2 = fsdp2_wrap(lib, fresh())
    step(model2, batch(rank))
    for name, fn in (("fsdp1_sharded", fsdp1_sharded), ("fsdp2_state_dict", model2.state_dict),
                     ("fsdp1_get_model_state_dict", lambda: get_model_state_dict(model1)),
                     ("fsdp2_get_model_state_dict", lambda: get_model_state_dict(model2))):
        try:
            sd, calls, warned = _collectives_of(fn)
            out[name] = {"values": _sd_summary(sd), "collectives": calls, "warnings": warned}
        except Exception as e:  # noqa: BLE001 (reported, the test says which)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _is_full(p, ref) -> bool:
    return not isinstance(p, DTensor) and tuple(p.shape) == tuple(ref.shape)


def _gathered(model, shapes: dict) -> list:
    """The parameters a module's attributes hold unsharded now (what its code would read)."""
    return sorted(n for n in shapes if _is_full(functools.reduce(getattr, n.split("."), model), shapes[n]))


def _attr(model, name: str):
    return functools.reduce(getattr, name.split("."), model)


def case_full_params(rank, lib):
    """fsdp2-19's last row: FSDP.summon_full_params(model) against param.full_tensor() and
    module.unshard() ... module.reshard(), under a bf16 policy."""
    fsdp, _, FSDP, _, _ = api(lib)
    mp1, mp2 = bf16_policies(lib)
    shapes = dict(fresh().named_parameters())
    out = {}

    model1 = fsdp1_wrap(lib, fresh(), mixed_precision=mp1)
    step(model1, batch(rank))
    with FSDP.summon_full_params(model1):
        inside = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model1.named_parameters()}
        out["summon"] = {"full": sorted(n for n, p in inside.items() if _is_full(p, shapes[n])),
                         "dtypes": sorted({str(p.dtype) for p in inside.values()})}
        with torch.no_grad():
            inside["blocks.0.fc.weight"].fill_(7.0)
    with FSDP.summon_full_params(model1):
        again = dict((n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model1.named_parameters())
        out["summon"]["write_kept"] = bool((again["blocks.0.fc.weight"] == 7.0).all())

    model2 = fsdp2_wrap(lib, fresh(), {"mp_policy": mp2}, {"mp_policy": mp2})
    step(model2, batch(rank))
    for module in model2.modules():  # torch keeps the root gathered after forward (reshard_after_forward=None)
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()
    weight = model2.blocks[0].fc.weight
    full = weight.full_tensor()
    with torch.no_grad():
        full.fill_(7.0)
    out["full_tensor"] = {"shape": list(full.shape), "dtype": str(full.dtype),
                          "write_kept": bool((weight.full_tensor() == 7.0).all())}
    model2.unshard()
    unsharded = _gathered(model2, shapes)
    dtypes = sorted({str(_attr(model2, n).dtype) for n in unsharded})
    x = batch(rank).to(torch.bfloat16)
    with torch.no_grad():
        model2.inp(x)  # use a gathered parameter: it stays gathered until reshard()
    still = _gathered(model2, shapes)
    model2.reshard()
    after = _gathered(model2, shapes)
    out["unshard"] = {"full": unsharded, "dtypes": dtypes, "still_full": still, "after_reshard": after}
    return out


def case_no_shard(rank, lib):
    """legacy-10: torch's FSDP1 warns that NO_SHARD is deprecated in favour of DDP."""
    fsdp, FSDP, _, _, _ = api(lib)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(fresh(), sharding_strategy=fsdp.ShardingStrategy.NO_SHARD)
    return sorted({f"{w.category.__name__}: {w.message}" for w in caught if "NO_SHARD" in str(w.message)})


def _locals(model) -> list:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def case_grad_scaler(rank, lib):
    """939481c3: ShardedGradScaler under FSDP1, the plain torch.amp.GradScaler under FSDP2. An inf in rank 1's
    gradient shard only: both ranks must skip the step (the inf/NaN check reduces across the ranks)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out = {}
    for front in ("fsdp1", "fsdp2"):
        model = fsdp1_wrap(lib, fresh()) if front == "fsdp1" else fsdp2_wrap(lib, fresh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler(device="cpu") if front == "fsdp1" else torch.amp.GradScaler("cpu")
        scaler.scale(model(batch(rank)).float().pow(2).mean()).backward()
        if rank == 1:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        before = _locals(model)
        scaler.step(opt)
        scaler.update()
        out[front] = {"stepped": any(not torch.equal(a, b) for a, b in zip(before, _locals(model))),
                      "scale": scaler.get_scale(), "dtensor_grads": all(isinstance(p.grad, DTensor)
                                                                         for p in model.parameters())}
    return out


def case_cpu_offload(rank, lib):
    """91c9dfb4: CPUOffload(offload_params=True) in FSDP1, offload_policy=CPUOffloadPolicy() in FSDP2: parameters,
    gradients and optimizer state on the host, the optimizer stepping there. (torch's two need an accelerator;
    where there is none, what they raise is returned.)"""
    fsdp = api(lib)[0]
    out = {}
    for front in ("fsdp1", "fsdp2"):
        try:
            if front == "fsdp1":
                model = fsdp1_wrap(lib, fresh(), cpu_offload=fsdp.CPUOffload(offload_params=True))
            else:
                policy = fsdp.CPUOffloadPolicy()
                model = fsdp2_wrap(lib, fresh(), {"offload_policy": policy}, {"offload_policy": policy})
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            _, loss = step(model, batch(rank))
            opt.step()
        except RuntimeError as e:
            out[front] = {"error": str(e)}
            continue
        out[front] = {"loss": loss.item(), "params": sorted({str(p.device) for p in model.parameters()}),
                      "grads": sorted({str(p.grad.device) for p in model.parameters()}),
                      "optimizer_state": sorted({str(v.device) for st in opt.state.values() for v in st.values()
                                                 if torch.is_tensor(v)})}
    return out


CASES = {"lifecycles": case_lifecycles, "linear_policy": case_linear_policy, "clip": case_clip,
         "accumulation": case_accumulation, "state_dict": case_state_dict, "full_params": case_full_params,
         "no_shard": case_no_shard, "grad_scaler": case_grad_scaler, "cpu_offload": case_cpu_offload}


def run_cases(rank, world_size, lib, names):
    out = {}
    for name in names:
        try:
            out[name] = CASES[name](rank, lib)
        except Exception as e:  # noqa: BLE001 (one case's failure is reported by name, the others still run)
            import traceback

            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    return out
