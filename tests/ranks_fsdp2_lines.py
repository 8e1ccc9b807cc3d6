"""The model, the notebooks' FSDP1 and FSDP2 lines, and the log of what a front end did, for
tests/ranks_fsdp2_equivalence.py.

`lib` is "torch" (torch's FSDP1 with device_id=cpu, and torch's fully_shard) or "fsdp_lab" (fsdp_lab's FSDP and
fully_shard). Every run records a log of what the front end did, as (kind, unit) pairs in the order they happened:
"AG" a unit's all-gather was issued, "RS" a unit's gradients were reduced, "grad_out" the gradient of a block's
output is ready (its backward begins), and the script's own marks (forward_end, backward_end, micro_batch_end).
For torch the log comes from wrapping the places where each front end issues a unit's collectives; for fsdp_lab
it is read from its lifecycle trace (fsdp_lab.observe), to which the marks are emitted as events of their own.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

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
