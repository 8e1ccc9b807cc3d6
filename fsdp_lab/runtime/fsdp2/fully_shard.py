"""`fully_shard`: torch FSDP2's front end, over the same core as `FSDP` (unit, streams, collectives, trace).

Same signature as torch.distributed.fsdp.fully_shard; options we do not support raise a ValueError naming the
option. Applied bottom-up (each block, then the root) it makes one group per call: the parameters of the module
that no earlier call took, sharded per parameter on dim 0 (fsdp_lab/runtime/fsdp2/param_group.py), or on the dim
shard_placement_fn returns for it (fsdp_lab/runtime/fsdp2/shard_dim.py), driven by a Unit.

[Note: the root of a fully_shard model] fully_shard(block) cannot know whether the block will be the root: a
later fully_shard(model) may wrap it. As in torch, the first forward (or FSDPModule method) decides: the module
it runs on, and every fully_shard module below it, join that root's FSDPState (one process group, one step's
flags, one end-of-backward callback); the root's reshard_after_forward=None becomes False (its parameters are
needed first in backward), everyone else's True. An int k between 1 and the mesh size keeps, after forward,
each rank's share of its group of k ranks, and backward re-gathers within that group
([Note: the post-forward shard] in fsdp_lab/runtime/fsdp2/post_forward.py).
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.runtime.core.misuse import check_same_model, eager_hook, refuse_wrapped_param, watch_optimizers
from fsdp_lab.runtime.core.mixed_precision import MixedPrecisionPolicy, cast_floating, coerce_mp_policy
from fsdp_lab.runtime.core.root import drop_abandoned_backward, finish_backward, queue_finish_backward
from fsdp_lab.runtime.core.state import FSDPState
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy
from fsdp_lab.runtime.core.unit import Unit
from fsdp_lab.runtime.features.hybrid import hybrid_state, mesh_groups, shard_coordinate
from fsdp_lab.runtime.features.offload import OffloadPolicy, fsdp2_placement
from fsdp_lab.runtime.fsdp2.fsdp_module import FSDPModule
from fsdp_lab.runtime.fsdp2.module_group import GroupHooks, root_modules
from fsdp_lab.runtime.fsdp2.param_group import ParamGroup
from fsdp_lab.runtime.fsdp2.post_forward import check_group_size, make_post_forward_groups
from fsdp_lab.runtime.fsdp2.shard_dim import refuse_post_forward_shard, resolve_shard_dim
from fsdp_lab.runtime.fsdp2.tensor_parallel import check_tp_param, is_tp_param


class FullyShardState:
    """What fully_shard attaches to one module: its group's unit, its options, and the root it belongs to (set
    by the first forward: [Note: the root of a fully_shard model])."""

    def __init__(self, module: nn.Module, unit: Unit, mesh, device: torch.device, mp_policy: MixedPrecisionPolicy,
                 auto_reshard: bool, originals):
        self.module, self.unit, self.mesh, self.device = module, unit, mesh, device
        self.mp_policy, self.auto_reshard, self.originals = mp_policy, auto_reshard, originals
        self.post_forward_size: Optional[int] = None  # reshard_after_forward=int strictly between 1 and N
        self.root: Optional[FullyShardState] = None
        self.ctx: Optional[FSDPState] = None  # the root's: one per model
        self.states: list[FullyShardState] = []  # root only: every fully_shard module of the model, root first
        self.is_last_backward = True  # root only
        self.params_checked = False  # root only: the first forward looked for parameters left on meta
        self.group_hooks: Optional[GroupHooks] = None  # fully_shard of a list ([Note: one group over several
        # modules] in fsdp_lab/runtime/fsdp2/module_group.py)

    @property
    def units(self) -> list[Unit]:
        """The model's units, innermost first, the root last (root only)."""
        return [s.unit for s in reversed(self.states)]

    # -- becoming the root -----------------------------------------------------------------------------------
    def lazy_init(self) -> None:
        if self.root is not None:
            return
        if any(s.root is not None and s.root.ctx.in_backward for s in _states_below(self.module)):
            raise RuntimeError("a fully_shard module cannot become a root while its backward is running")
        states = [self] + [s for s in _states_below(self.module) if s is not self]
        groups = mesh_groups(self.mesh)  # [Note: hybrid sharding] in hybrid.py
        ranks = (groups.shard_ranks, groups.replicate_ranks)
        for s in states:
            other = mesh_groups(s.mesh)
            theirs = (other.shard_ranks, other.replicate_ranks)
            if theirs != ranks:
                raise ValueError(f"fully_shard modules of one model must share one mesh: the root's (shard, "
                                 f"replicate) ranks are {ranks}, '{type(s.module).__name__}''s {theirs}")
        shard_rank, shard_size = shard_coordinate(self.mesh)
        ctx = FSDPState(pg=groups.shard, world_size=shard_size, rank=shard_rank,
                        strategy=ShardingStrategy.FULL_SHARD, mixed_precision=None, compute_dtype=torch.float32,
                        reduce_dtype=torch.float32, device=self.device, forward_prefetch=False,
                        backward_prefetch=BackwardPrefetch.BACKWARD_PRE, max_gathers_in_flight=2,
                        on_backward_start=self._on_backward_start, **hybrid_state(groups))
        # One optimizer check per model, not one per fully_shard call: every step of every optimizer runs
        # each registered hook ([Note: traps that train nothing] in misuse.py).
        watch_optimizers(self.module)
        names = {id(m): n for n, m in self.module.named_modules()}
        post_forward = make_post_forward_groups(self.mesh, [s.post_forward_size for s in states if s.post_forward_size])
        for s in states:
            s.root, s.ctx = self, ctx
            s.unit.ctx, s.unit.is_root = ctx, s is self
            s.unit.name = names.get(id(s.module)) or "<root>"
            for layout in s.unit.flats:
                layout.unit_name = s.unit.name
            if s.auto_reshard:
                s.unit.reshard_after_forward = s is not self
            if s.post_forward_size:
                s.unit.post_forward_group = post_forward[s.post_forward_size]
        self.states = states

    # -- hooks -------------------------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        self.lazy_init()
        if self.root is self:
            if not self.params_checked:
                self._check_params()
            drop_abandoned_backward(self.ctx, self.units)
        args, kwargs = self.cast_inputs(args, kwargs)
        marked = self.unit.pre_forward(module, args, kwargs)
        return marked if marked is not None else (args, kwargs)

    def post_forward(self, module, args, output, also_hook: tuple = ()):
        """`also_hook`: outputs of a group's earlier modules, which backward may reach first."""
        if self.root is self:
            for state in self.states:
                if state.group_hooks is not None and state is not self:
                    state.group_hooks.complete_open_pass()
        hooked = self.unit.post_forward(module, args, (output, also_hook) if also_hook else output)
        output = hooked[0] if also_hook else hooked
        if self.root is self and self.ctx.forward_order:
            self.ctx.order_frozen = True
        return self.cast_output(output)

    def cast_inputs(self, args, kwargs):
        policy = self.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            return cast_floating(args, policy.param_dtype), cast_floating(kwargs, policy.param_dtype)
        return args, kwargs

    def cast_output(self, output):
        if self.mp_policy.output_dtype is not None:
            return cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _check_params(self) -> None:
        """Once, at the root's first forward (every rank runs it, and its gathers would fail first): a model built
        on meta must get storage and values after fully_shard (to_empty, then an init), else the gather fails with
        "Cannot copy out of meta tensor"; and every rank must have built the same model, else it trains on
        scrambled weights or aborts in the backend ([Note: every rank wraps the same model] in misuse.py)."""
        prefixes = {id(s): "" if s is self else f"{s.unit.name}." for s in self.states}
        on_meta = [prefixes[id(s)] + slot.name for s in reversed(self.states) for group in s.unit.flats
                   for slot in group.slots if slot.registered().to_local().is_meta]
        if on_meta:
            raise RuntimeError(f"fully_shard: {len(on_meta)} parameter(s) are still on the meta device at the first "
                               f"forward (first: '{on_meta[0]}'): they have no storage and no values. After "
                               f"fully_shard, call model.to_empty(device=...) and then initialise them (e.g. "
                               f"module.reset_parameters() for each module, under torch.no_grad())")
        check_same_model([(s.unit.name, [(slot.name, tuple(slot.shape), group.requires_grad)
                                         for group in s.unit.flats for slot in group.slots])
                          for s in reversed(self.states)], self.ctx.pg, self.ctx.rank, self.ctx.world_size,
                         self.device)
        self.params_checked = True

    def _on_backward_start(self) -> None:
        queue_finish_backward(self.ctx, self._finish_backward)

    def _finish_backward(self) -> None:
        finish_backward(self.ctx, self.units, wait_reduces=self.is_last_backward)


def _states_below(module: nn.Module) -> list[FullyShardState]:
    """Every fully_shard state in `module`'s tree, once each (a group over several modules shares one)."""
    found = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            found.setdefault(id(m._fsdp_lab_state), m._fsdp_lab_state)
    return list(found.values())


# -- fully_shard -----------------------------------------------------------------------------------------------
def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), ignored_params=None,
                dp_mesh_dims=None):
    """Shard `module`'s parameters (those no earlier fully_shard call took) per parameter on dim 0, or on the
    dim shard_placement_fn(param) returns as Shard(dim), across `mesh` and make its class an FSDPModule; returns
    `module`. Call it on each block, then on the root."""
    modules = root_modules(module)  # [Note: one group over several modules] in module_group.py
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    if dp_mesh_dims is not None:
        raise ValueError(f"fully_shard option dp_mesh_dims={dp_mesh_dims!r} is not supported by fsdp_lab")
    mp_policy = coerce_mp_policy(mp_policy)
    mesh = _check_mesh(mesh)
    device = _mesh_device(mesh)
    placement = fsdp2_placement(offload_policy, device)  # [Note: host and device] in offload.py
    after_forward = _check_reshard_after_forward(reshard_after_forward, mesh)
    ignored = {id(p) for p in (ignored_params or ())}
    trainable, frozen, originals = _collect_params(modules, ignored)
    for param, aliases in trainable + frozen:  # [Note: FSDP over tensor parallel] in tensor_parallel.py
        if is_tp_param(param):
            check_tp_param(param, aliases[0][2], mesh, placement.offloaded,
                           after_forward if type(after_forward) is int else None)
    shard_size = shard_coordinate(mesh)[1]
    dims = {id(param): resolve_shard_dim(shard_placement_fn, param, aliases[0][2], shard_size, is_tp_param(param))
            for param, aliases in trainable + frozen}  # [Note: sharding on another dim] in shard_dim.py
    if type(after_forward) is int:
        refuse_post_forward_shard([a[0][2] for p, a in trainable + frozen if dims[id(p)]], after_forward)
    for sub in (sub for m in modules for sub in _managed_modules(m)):
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device.type != "meta" and buf.device != device:
                sub._buffers[name] = buf.to(device)
    first = modules[0]
    layouts = []
    for requires_grad, dtype, entries in _by_dtype(trainable, frozen, type(first).__name__):
        compute = _compute_dtype(dtype, mp_policy)
        layouts.append(ParamGroup(type(first).__name__, entries, mesh, requires_grad=requires_grad,
                                  compute_dtype=compute, reduce_dtype=mp_policy.reduce_dtype or compute,
                                  device=device, placement=placement,
                                  shard_dims=[dims[id(param)] for param, _a in entries]))
    unit = Unit(type(first).__name__, first, layouts, ctx=None, is_root=False)
    unit.reshard_after_forward = True if after_forward is None else bool(after_forward)
    state = FullyShardState(first, unit, mesh, device, mp_policy, after_forward is None, originals)
    if type(after_forward) is int:
        state.post_forward_size = after_forward
    hooks = state
    if len(modules) > 1:
        hooks = state.group_hooks = GroupHooks(state, modules)
    pre_hook = eager_hook(hooks.pre_forward)  # [Note: hooks outside compiled graphs] in misuse.py
    post_hook = eager_hook(hooks.post_forward)
    for m in modules:
        m.__dict__["_fsdp_lab_state"] = state  # not a submodule, not a parameter: a plain attribute
        unit.hook_handles += [m.register_forward_pre_hook(pre_hook, with_kwargs=True),
                              m.register_forward_hook(post_hook)]
        m.__class__ = _fsdp_class(type(m))
    return module


@functools.cache
def _fsdp_class(cls: type) -> type:
    """FSDP<Cls>: FSDPModule first in the method resolution order, then the original class, as torch makes it."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def _check_mesh(mesh):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (fsdp_lab.training.launch.run_on_ranks "
                           "does it for you), or run the script under torchrun.")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mesh_groups(mesh)  # 1-D: FSDP; 2-D (replicate, shard): HSDP; any other refused by name
    return mesh


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _check_reshard_after_forward(value, mesh):
    """None, a bool, or (as torch) an int that divides the mesh size N: 1 means False (reshard to one rank: keep
    everything), N means True, a size k in between is returned as k: after forward, reshard to groups of k ranks
    (fsdp_lab/runtime/fsdp2/post_forward.py)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward should be a bool or an int, not {value!r}")
    world_size = shard_coordinate(mesh)[1]  # an HSDP mesh reshards within its shard dimension
    if value < 1 or value > world_size or world_size % value:
        raise ValueError(f"reshard_after_forward={value} should be a factor of the mesh size {world_size}")
    if value in (1, world_size):
        return value == world_size
    if mesh.ndim > 1:
        raise ValueError(f"fully_shard option reshard_after_forward={value} on a {mesh.ndim}-D (HSDP) mesh is not "
                         f"supported by fsdp_lab: use True, False, or a 1-D mesh")
    check_group_size(mesh, value)
    return value


def _managed_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its submodules, not descending into modules an earlier fully_shard took."""
    found, stack, seen = [], [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append(m)
        stack.extend(c for c in reversed(list(m._modules.values())) if c is not None and not isinstance(c, FSDPModule))
    return found


def _collect_params(modules: list[nn.Module], ignored: set[int]):
    """(trainable, frozen, originals): [(param, [(owner, attr, qualified name), ...])] for this group's parameters,
    and a weak map id → original parameter that later fully_shard calls check ties against."""
    claimed = weakref.WeakValueDictionary()
    for state in (state for module in modules for state in _states_below(module)):
        claimed.update(state.originals)
    seen: dict[int, tuple] = {}

    def visit(mod: nn.Module, prefix: str):
        for attr, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            name = prefix + attr
            refuse_wrapped_param(param, name, "fully_shard")  # [Note: traps that train nothing] in misuse.py
            if claimed.get(id(param)) is param:
                raise ValueError(f"parameter '{name}' is tied to a parameter of a module fully_shard was already "
                                 f"applied to: a weight shared by two fully_shard groups cannot be sharded. Apply "
                                 f"fully_shard to their common parent only, or untie it.")
            aliases = seen.setdefault(id(param), (param, []))[1]
            if all(a[0] is not mod or a[1] != attr for a in aliases):
                aliases.append((mod, attr, name))
        for child_name, child in mod._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                visit(child, f"{prefix}{child_name}.")

    for i, module in enumerate(modules):
        visit(module, "" if len(modules) == 1 else f"{i}.")
    trainable = [entry for entry in seen.values() if entry[0].requires_grad]
    frozen = [entry for entry in seen.values() if not entry[0].requires_grad]
    originals = weakref.WeakValueDictionary({id(p): p for p, _a in seen.values()})
    return trainable, frozen, originals


# [Note: dtypes in one group] torch's fully_shard takes a module whose parameters have several dtypes (a
# quantized int8 base, bf16 frozen weights and fp32 adapters, as PEFT builds them): it all-gathers them as bytes
# in one collective, keeps each parameter's dtype, and casts only floating parameters to param_dtype. Its
# reduce-scatter needs one gradient dtype, so trainable parameters of two dtypes fail there, in backward. Here one
# ParamGroup holds one (requires_grad, dtype) kind: the unit gathers each in its own collective (one more
# all-gather per extra dtype, the same bytes), casts as torch does, and reduces each kind's gradients in their
# own dtype, so trainable parameters of two dtypes train as they would in one process.
def _by_dtype(trainable: list, frozen: list, unit_name: str) -> list[tuple[bool, torch.dtype, list]]:
    """(requires_grad, dtype, entries) per kind, trainable first, each kind in the module's order."""
    kinds: dict[tuple[bool, torch.dtype], list] = {}
    for requires_grad, entries in ((True, trainable), (False, frozen)):
        for entry in entries:
            kinds.setdefault((requires_grad, entry[0].dtype), []).append(entry)
    return [(requires_grad, dtype, entries) for (requires_grad, dtype), entries in kinds.items()]


def _compute_dtype(dtype: torch.dtype, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """What a parameter of `dtype` is gathered and computed in: param_dtype for floating parameters, their own
    dtype otherwise (an int8 weight is never cast)."""
    if mp_policy.param_dtype is not None and dtype.is_floating_point:
        return mp_policy.param_dtype
    return dtype
