"""Ranks for tests/test_fsdp2_equivalence.py: each FSDP1 line a notebook shows beside an FSDP2 line, run as the
notebook writes it, on the same model and batch, once per front end.

`lib` is "torch" (torch's FSDP1 with device_id=cpu, and torch's fully_shard) or "fsdp_lab" (fsdp_lab's FSDP and
fully_shard). Every run records a log of what the front end did, as (kind, unit) pairs in the order they happened:
"AG" a unit's all-gather was issued, "RS" a unit's gradients were reduced, "MARK" a point of the script
(forward_end, backward_end) or "grad_out" (the gradient of a block's output is ready: its backward begins).
For torch the log comes from wrapping the places where each front end issues a unit's collectives; for fsdp_lab
it is read from its lifecycle trace (fsdp_lab.observe), to which the marks are emitted as events of their own.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

D = 8  # divides by 2: every rank holds the same rows

_LOG: list = []  # torch's log: (kind, unit)
_NAMES: dict = {}  # id(module) -> its name in the model; "<root>" for the root
_CURRENT: list = []  # the unit whose collectives run now (torch)
_COLLECTIVES: list = []  # (collective, dtype) of every collective issued, both libs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(x)))


class Net(nn.Module):
    """A root with parameters of its own (inp, head) and two blocks, as the notebooks' GPT has."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def api(lib: str):
    """The FSDP1 and FSDP2 names a notebook imports, from torch or from fsdp_lab."""
    if lib == "torch":
        import torch.distributed.fsdp as fsdp
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
        cpu = {"device_id": torch.device("cpu")}
    else:
        import fsdp_lab as fsdp
        from fsdp_lab import FSDP
        from fsdp_lab.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
        cpu = {}
    return fsdp, functools.partial(FSDP, **cpu), FSDP, ModuleWrapPolicy, transformer_auto_wrap_policy


# ---- recording -----------------------------------------------------------------------------------------------


def _name(module) -> str:
    return _NAMES.get(id(module), type(module).__name__)


def _names_of(model: nn.Module) -> dict:
    """Module names before any wrapping (FSDP1's wrapper inserts _fsdp_wrapped_module into them)."""
    return {id(module): name or "<root>" for name, module in model.named_modules()}


def _in_unit(fn, unit_of, kind=None, issued=None):
    """Wrap fn so the collectives it issues are the unit's; with `kind`, log the unit when `issued` says so."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        unit = unit_of(*args, **kwargs)
        before = issued(args[0]) if issued is not None else None
        _CURRENT.append(unit)
        try:
            if kind is not None and issued is None:
                _LOG.append((kind, unit))
            result = fn(*args, **kwargs)
        finally:
            _CURRENT.pop()
        if kind is not None and issued is not None and before is None and issued(args[0]) is not None:
            _LOG.append((kind, unit))
        return result
    return wrapped


def _count(name, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        tensor = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
        tensor = args[0] if tensor is None and args else tensor
        _COLLECTIVES.append((name, str(getattr(tensor, "dtype", None))))
        return fn(*args, **kwargs)
    return wrapped


@functools.cache
def install_recorders(lib: str) -> None:
    """Count every collective (both libs); for torch, also log which unit each gather and reduction is for."""
    for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                 "reduce_scatter_tensor", "all_reduce", "broadcast"):
        setattr(dist, name, _count(name, getattr(dist, name)))
    if lib != "torch":  # fsdp_lab binds its gather and reduce-scatter at import
        from fsdp_lab.runtime.core import collectives

        collectives._all_gather = _count("all_gather_single", collectives._all_gather)
        collectives._reduce_scatter = _count("reduce_scatter_single", collectives._reduce_scatter)
        return
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    FlatParamHandle._all_gather_flat_param = _in_unit(
        FlatParamHandle._all_gather_flat_param, lambda self, *a, **k: _name(self._fully_sharded_module), "AG")
    _runtime_utils._reduce_grad = _in_unit(_runtime_utils._reduce_grad,
                                           lambda state, handle: _name(handle._fully_sharded_module))
    FSDPParamGroup.unshard = _in_unit(FSDPParamGroup.unshard, lambda self, *a, **k: _name(self.modules[0]), "AG",
                                      issued=lambda self: self._all_gather_result)
    FSDPParamGroup.post_backward = _in_unit(FSDPParamGroup.post_backward, lambda self, *a: _name(self.modules[0]))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        setattr(dist, name, _reduction(getattr(dist, name)))


def _reduction(fn):
    """A reduction issued inside a unit's post-backward is that unit's "RS" (once per unit and backward)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _CURRENT and (not _LOG or _LOG[-1] != ("RS", _CURRENT[-1])):
            _LOG.append(("RS", _CURRENT[-1]))
        return fn(*args, **kwargs)
    return wrapped


class Recorder:
    """Marks points of a script into the front end's log, and reads the log back as (kind, unit) pairs."""

    def __init__(self, lib: str, model: nn.Module, names: dict):
        install_recorders(lib)
        self.lib, self.tracer = lib, None
        _NAMES.clear()
        _NAMES.update(names)
        _LOG.clear()
        _COLLECTIVES.clear()
        if lib == "fsdp_lab":
            from fsdp_lab.observe import trace

            self.tracer = trace.Tracer(rank=dist.get_rank(), model=model)
            trace.attach(model, self.tracer)

    def mark(self, kind: str, unit: str = "") -> None:
        if self.tracer is not None:
            self.tracer.emit(f"mark:{kind}", unit=unit, phase="mark")
        else:
            _LOG.append((kind, unit))

    def log(self) -> list:
        if self.tracer is None:
            return [list(e) for e in _LOG]
        out = []
        for e in self.tracer.events:
            if e["event"] in ("gather_start", "regather_start"):
                out.append(["AG", e["unit"]])
            elif e["event"] in ("reduce_scatter", "all_reduce") and e["phase"] == "backward":
                if not out or out[-1] != ["RS", e["unit"]]:
                    out.append(["RS", e["unit"]])
            elif e["event"].startswith("mark:"):
                out.append([e["event"][5:], e["unit"]])
        return out

    def close(self, model) -> None:
        if self.tracer is not None:
            from fsdp_lab.observe import trace

            trace.attach(model, None)


def batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(4, D, generator=g)
    return x[rank * 2:(rank + 1) * 2]


def step(model, x, rec: Recorder | None = None):
    out = model(x)
    if rec is not None:
        rec.mark("forward_end")
    loss = out.float().pow(2).mean()
    loss.backward()
    if rec is not None:
        rec.mark("backward_end")
    return out, loss


def fresh(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


# ---- the notebooks' lines ------------------------------------------------------------------------------------


def fsdp1_wrap(lib, net, **kwargs):
    """legacy-01/02/03/04/05/07/09/10: FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), ...)."""
    _, FSDP, _, ModuleWrapPolicy, _ = api(lib)
    return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def fsdp1_transformer_policy(lib, net):
    """legacy-06: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})."""
    _, FSDP, _, _, transformer_auto_wrap_policy = api(lib)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(net, auto_wrap_policy=policy)


def fsdp2_wrap(lib, net, block_kwargs=None, root_kwargs=None):
    """for block in net.blocks: fully_shard(block); fully_shard(net)."""
    fsdp = api(lib)[0]
    for block in net.blocks:
        fsdp.fully_shard(block, **(block_kwargs or {}))
    fsdp.fully_shard(net, **(root_kwargs or {}))
    return net


def bf16_policies(lib):
    fsdp = api(lib)[0]
    return (fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


# ---- cases ---------------------------------------------------------------------------------------------------


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
    """fsdp2-19: model.clip_grad_norm_(max) against torch.nn.utils.clip_grad_norm_(model.parameters(), max)."""
    out = {}
    for front in ("fsdp1", "fsdp2"):
        model = fsdp1_wrap(lib, fresh()) if front == "fsdp1" else fsdp2_wrap(lib, fresh())
        step(model, batch(rank))
        if front == "fsdp1":
            total = model.clip_grad_norm_(0.01)
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            total = total.full_tensor() if isinstance(total, DTensor) else total
        out[front] = {"norm": float(total), "after": _norm(model, front == "fsdp2"),
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
    for key, value in sd.items():
        if isinstance(value, DTensor):
            local, kind = value.to_local(), "DTensor"
        elif type(value).__name__ == "ShardedTensor":
            shards = value.local_shards()
            local, kind = (shards[0].tensor if shards else torch.empty(0)), "ShardedTensor"
        else:
            local, kind = value, type(value).__name__
        out[key] = {"kind": kind, "shape": list(value.shape), "local": local.detach().float().clone()}
    return out


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


if __name__ == "__main__":
    import json
    import sys

    from fsdp_lab.training.launch import run_on_ranks

    lib = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    res = run_on_ranks(run_cases, 2, lib, names, timeout_s=300)

    def clean(o):
        if isinstance(o, torch.Tensor):
            return o.tolist()[:2]
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o
    print(json.dumps(clean(res[0]), indent=1))
