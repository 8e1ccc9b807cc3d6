"""`FSDP`: wrap a module so each unit the policy picks (and the root) is sharded across the process group.

Same constructor names as torch.distributed.fsdp.FullyShardedDataParallel for the subset we support; options
we do not support raise a ValueError naming the option instead of being silently ignored.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.runtime.core.memory import memory_report
from fsdp_lab.runtime.core.misuse import (FLAT_OF, check_requires_grad, check_same_model, mark_replaced,
                                          eager_hook, refuse_wrapped_inside, watch_optimizers)
from fsdp_lab.runtime.core.mixed_precision import (MixedPrecision, cast_inputs, coerce_mixed_precision, compute_dtype,
                                                   reduce_dtype)
from fsdp_lab.runtime.core.root import drop_abandoned_backward, finish_backward, queue_finish_backward
from fsdp_lab.runtime.core.state import FSDPState
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy, coerce_enum
from fsdp_lab.runtime.core.unit import Unit, UnitState
from fsdp_lab.runtime.features.deferred_init import UnitInit
from fsdp_lab.runtime.features.hybrid import device_type_of, fsdp1_groups, hybrid_state
from fsdp_lab.runtime.features.ignored import resolve_ignored
from fsdp_lab.runtime.features.offload import fsdp1_placement
from fsdp_lab.runtime.fsdp1 import optim_state_dict as optim_state
from fsdp_lab.runtime.fsdp1.device import check_param_init_fn, check_process_group, resolve_device
from fsdp_lab.runtime.fsdp1.flat_param import FlatParam, check_flat_dtypes
from fsdp_lab.runtime.fsdp1.grad_norm import clip_grad_norm_
from fsdp_lab.runtime.fsdp1.nesting import (WRAPPED, install_unit_wrappers, refuse_nested_with_policy, set_seam,
                                            take_over_nested)
from fsdp_lab.runtime.fsdp1.not_provided import (NOT_PROVIDED, not_provided, not_provided_message,
                                                 refuse_dcp_optimizer_state)
from fsdp_lab.runtime.fsdp1.partition import partition_params
from fsdp_lab.runtime.fsdp1.state_dict import (DEFAULT_SETTINGS, StateDictSettings, cast_buffers, coerce_settings,
                                               instance_state_dict, load_full_state_dict)
from fsdp_lab.runtime.fsdp1.summon import flat_param_name, summon_full_params
from fsdp_lab.runtime.fsdp1.wrap import select_units

_PREFIX = WRAPPED + "."


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper (ZeRO-3 by default). See DESIGN.md §2–3 and notebooks 02–06.

    torch FSDP1's constructor, option for option (tests/test_torch_signatures.py). A module built on the meta
    device is materialised one unit at a time (param_init_fn, or to_empty + reset_parameters), and
    sync_module_states broadcasts rank 0's values one unit at a time ([Note: materialising one unit at a time] in
    deferred_init.py); ignored_modules / ignored_states stay plain local parameters ([Note: ignored modules] in
    ignored.py). HYBRID_SHARD and _HYBRID_SHARD_ZERO2 take device_mesh or process_group=(shard_pg, replicate_pg)
    as torch does (hybrid.py). cpu_offload keeps shards, gradients and optimizer state on the host (offload.py).
    Unknown attributes and indexing reach the wrapped module, as in torch."""

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=None, cpu_offload=None,
                 auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: Optional[MixedPrecision] = None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states: bool = False, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, use_orig_params: bool = False, ignored_states=None,
                 device_mesh=None):
        super().__init__()
        check_param_init_fn(param_init_fn)
        ignored = resolve_ignored(module, ignored_modules, ignored_states, FSDP)
        check_process_group(None)  # initialised? (fsdp1_groups checks the groups given)
        strategy = coerce_enum(sharding_strategy or ShardingStrategy.FULL_SHARD, ShardingStrategy,
                               "sharding_strategy")
        groups = fsdp1_groups(process_group, device_mesh, strategy, auto_wrap_policy,
                              device_type_of(module, device_id))  # [Note: hybrid sharding] in hybrid.py
        pg = groups.shard
        prefetch = coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        mixed_precision = coerce_mixed_precision(mixed_precision, module)
        self._settings = {"process_group": groups.shard_ranks, "replicate_group": groups.replicate_ranks,
                          "sharding_strategy": strategy,
                          "mixed_precision": mixed_precision, "backward_prefetch": prefetch,
                          "forward_prefetch": bool(forward_prefetch), "limit_all_gathers": bool(limit_all_gathers),
                          "use_orig_params": bool(use_orig_params),
                          "cpu_offload": bool(getattr(cpu_offload, "offload_params", False))}
        self.__dict__["_root"] = self  # [Note: one FSDP instance per unit] in nesting.py
        refuse_nested_with_policy(module, auto_wrap_policy, FSDP)  # as torch's _auto_wrap does
        nested_units, nested_objects = take_over_nested(self, module, FSDP)
        refuse_wrapped_inside(module)  # [Note: traps that train nothing] in misuse.py
        device = resolve_device(module, device_id, dist.get_backend(pg))
        self._placement = fsdp1_placement(cpu_offload, device)  # [Note: host and device] in offload.py
        if self._placement.offloaded and strategy is ShardingStrategy.ZERO1:
            raise ValueError("FSDP options cpu_offload=CPUOffload(offload_params=True) and sharding_strategy=ZERO1 "
                             "cannot be combined: ZeRO-1 keeps a replica on the device, which offload would not free")
        unit_params = partition_params(module, select_units(module, auto_wrap_policy, nested_units, ignored),
                                       ignored)
        check_flat_dtypes(unit_params)  # [Note: the master is the parameters' own dtype] in flat_param.py
        check_same_model([(u.name, [(aliases[0][2], tuple(p.shape), p.requires_grad)
                                    for p, aliases in u.trainable + u.frozen]) for u in unit_params],
                         pg, dist.get_rank(pg), dist.get_world_size(pg), device)
        unit_init = UnitInit(param_init_fn, device, bool(sync_module_states),
                             tuple(g for g in (groups.replicate, pg) if g is not None),
                             frozenset(id(u.module) for u in unit_params), ignored.modules, ignored.params)
        self._buffer_dtypes = cast_buffers(module, mixed_precision, ignored.modules)  # what state_dict() gives
        self._fsdp_wrapped_module = module
        self._use_orig_params = bool(use_orig_params)
        self._state_dict_settings = DEFAULT_SETTINGS
        self._ctx = FSDPState(
            pg=pg, world_size=dist.get_world_size(pg), rank=dist.get_rank(pg), strategy=strategy,
            mixed_precision=mixed_precision, compute_dtype=compute_dtype(mixed_precision, None),
            reduce_dtype=reduce_dtype(mixed_precision, None), device=device,
            forward_prefetch=forward_prefetch, backward_prefetch=prefetch,
            limit_all_gathers=bool(limit_all_gathers),
            on_backward_start=self._on_backward_start, **hybrid_state(groups))
        self._groups = groups
        set_seam(self, self, self._build_units(unit_params, unit_init))
        install_unit_wrappers(self, FSDP, nested_objects)
        watch_optimizers(self)

    def _build_units(self, unit_params, unit_init: UnitInit) -> list[Unit]:
        ctx = self._ctx
        module = self._fsdp_wrapped_module
        units = []
        for info in unit_params:
            flats = []
            for params, trainable in ((info.trainable, True), (info.frozen, False)):
                if not params:
                    continue
                flats.append(FlatParam(
                    info.name or "<root>", params, ctx.world_size, ctx.rank, requires_grad=trainable,
                    compute_dtype=ctx.compute_dtype, keep_replica=ctx.strategy is ShardingStrategy.ZERO1,
                    shard_storage=ctx.strategy.shards_params, reduce_dtype=ctx.reduce_dtype, device=ctx.device,
                    placement=self._placement))
            unit_init.prepare(info.name or "<root>", info.module, flats)  # deferred_init.py
            for param, aliases in info.trainable + info.frozen:  # the flat shards replace them
                mark_replaced(param, aliases[0][2])  # [Note: traps that train nothing] in misuse.py
                for owner, attr, _q in aliases:
                    owner._parameters.pop(attr, None)
            info.trainable.clear()  # the shards hold the values now: let each unit's originals go before the next
            info.frozen.clear()
            for flat in flats:
                setattr(flat.shard, FLAT_OF, info.name or "<root>")
                if self._use_orig_params:  # [Note: original parameters] in flat_param.py
                    for slot, param in zip(flat.slots, flat.make_orig_params()):
                        setattr(param, FLAT_OF, info.name or "<root>")
                        for owner, attr, _q in slot.aliases:
                            owner._parameters[attr] = param
                else:
                    info.module.register_parameter(flat_param_name(flat), flat.shard)
                flat.install_views()  # [Note: an attribute while sharded] in flat_param.py
            unit = Unit(info.name or "<root>", info.module, flats, ctx, is_root=info.module is module)
            # [Note: hooks outside compiled graphs] in misuse.py
            unit.hook_handles = [info.module.register_forward_pre_hook(eager_hook(unit.pre_forward),
                                                                       with_kwargs=True),
                                 info.module.register_forward_hook(eager_hook(unit.post_forward))]
            if unit.is_root:  # after the root unit's own post-forward: the forward is over
                unit.hook_handles.append(info.module.register_forward_hook(eager_hook(self._hide_freed_views)))
            policy = ctx.mixed_precision
            if unit.module is not module and policy is not None and policy.param_dtype is not None \
                    and policy.cast_forward_inputs:
                unit.hook_handles.insert(0, info.module.register_forward_pre_hook(
                    functools.partial(cast_inputs, policy.param_dtype), with_kwargs=True, prepend=True))
            units.append(unit)
        return units

    # -- forward / backward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # _modules directly: nn.Module.__getattr__ (and ours over it) would cost a Python call per unit
        if self._root is not self:  # a unit's instance: its module's hooks run the unit ([Note: one FSDP ...])
            return self._modules[WRAPPED](*args, **kwargs)
        args, kwargs = self._before_forward(args, kwargs)
        output = self._modules[WRAPPED](*args, **kwargs)
        self._after_forward()
        return output

    @torch._disable_dynamo
    def _before_forward(self, args, kwargs):
        self._drop_abandoned_backward()
        check_requires_grad(self._units)
        policy = self._ctx.mixed_precision
        if policy is not None and policy.param_dtype is not None and policy.cast_root_forward_inputs:
            args, kwargs = cast_inputs(policy.param_dtype, None, args, kwargs)
        return args, kwargs

    @torch._disable_dynamo
    def _after_forward(self) -> None:
        if self._ctx.forward_order:
            self._ctx.order_frozen = True
        if not torch.is_grad_enabled() or not self.training:
            self._reshard_all("forward")  # an earlier forward's backward stays pending: it re-gathers

    def _drop_abandoned_backward(self) -> None:
        drop_abandoned_backward(self._ctx, self._root._units)  # [Note: per-iteration state is reset ...] in root.py

    def _on_backward_start(self) -> None:
        if not self._ctx.final_callback_queued:  # accumulate in the master's dtype, as torch does with
            self._cast_grads(None, self._units)   # keep_low_precision_grads
        queue_finish_backward(self._ctx, self._finish_backward)

    def _cast_grads(self, dtype: Optional[torch.dtype], units) -> None:
        """MixedPrecision(keep_low_precision_grads=True): the sharded gradients the optimizer sees are in
        param_dtype (`dtype`); None casts them back to the fp32 master's dtype. A gradient may differ from its
        parameter's dtype only through `.data`, which is how torch FSDP1 keeps them too."""
        policy = self._ctx.mixed_precision
        if policy is None or policy.grad_dtype is None:
            return
        for unit in units:
            for flat in unit.trainable_flats:
                grad = flat.shard.grad
                target = dtype or flat.shard.dtype
                if grad is not None and grad.dtype != target:
                    grad.data = grad.data.to(target)

    def _finish_backward(self) -> None:
        policy = self._ctx.mixed_precision
        grad_dtype = policy.grad_dtype if policy is not None else None

        def after_unit(unit):
            self._cast_grads(grad_dtype, [unit])
            for flat in unit.trainable_flats:
                if flat.orig_params is not None:
                    flat.shard_grad_to_orig()

        try:
            finish_backward(self._ctx, self._units, after_unit)
        finally:
            self._hide_freed_views()

    def _reshard_all(self, phase: str) -> None:
        """Free every unit (of the whole model). A pending backward is kept: its units re-gather when it reaches
        them."""
        for unit in self._root._units:
            unit.free(phase)
        self._ctx.frees.drain()  # nothing held until the next forward ([Note: memory across streams])
        self._hide_freed_views()

    def _hide_freed_views(self, *_hook_args) -> None:
        """Outside forward and backward, no view of a freed buffer is left on a module ([Note: an attribute while
        sharded] in flat_param.py)."""
        for unit in self._root._units:
            if unit.state is UnitState.SHARDED:
                for flat in unit.flats:
                    flat.hide_freed_views()

    # -- torch-compatible helpers ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backwards run inside this context."""
        if self._root is not self:
            raise RuntimeError("no_sync() on inner FSDP instances is not supported (as in torch FSDP1): call "
                               "no_sync() on the root FSDP module")
        previous = self._ctx.sync_gradients
        self._ctx.sync_gradients = False
        try:
            yield
        finally:
            self._ctx.sync_gradients = previous

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False):
        """Collective, as in torch FSDP1: inside the context the original parameters are full fp32 nn.Parameters
        under their original names (with their full .grad if with_grads); with writeback, what was written to
        them reaches the shards on exit. `module` is an FSDP model or any module holding some (each is
        summoned); recurse=False summons the root unit only ([Note: recurse=False] in summon.py). rank0_only:
        only rank 0 sees full parameters (every rank must still enter); offload_to_cpu: they are on the CPU."""
        if rank0_only and writeback:
            raise ValueError("summon_full_params options rank0_only=True and writeback=True cannot be combined (as "
                             "in torch FSDP1): the other ranks hold no full parameters to write back; pass "
                             "writeback=False")
        roots = [module] if isinstance(module, FSDP) else FSDP.fsdp_modules(module, root_only=True)
        with contextlib.ExitStack() as stack:
            for root in roots:
                stack.enter_context(summon_full_params(root, recurse, writeback, rank0_only, offload_to_cpu,
                                                       with_grads))
            yield module

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FSDP"]:
        """Every FSDP instance in `module`'s tree (`module` included), in module order, as torch lists them: the
        root and one per unit ([Note: one FSDP instance per unit] in nesting.py); root_only: the roots."""
        found = [m for m in module.modules() if isinstance(m, FSDP)]
        return [m for m in found if m._root is m] if root_only else found

    def check_is_root(self) -> bool:
        """True for the root, False for the instance of a unit inside it."""
        return self._root is self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (computed across all ranks' shards)."""
        if self._root is not self:
            raise RuntimeError("clip_grad_norm_() should only be called on the root FSDP instance (as in torch "
                               "FSDP1)")
        return clip_grad_norm_(self, max_norm, norm_type)

    def named_parameters(self, *args, **kwargs):
        """As torch FSDP1's: the `_fsdp_wrapped_module.` levels are in the names, except while this instance is
        summoned (summon_full_params over it), when they are the plain module's ([Note: names with and without
        the levels] in nesting.py)."""
        refuse_dcp_optimizer_state(sys._getframe(1))
        clean = self._summoning
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(_PREFIX, "") if clean else name), param

    def named_buffers(self, *args, **kwargs):
        """As torch FSDP1's (and as named_parameters): plain names only while this instance is summoned."""
        clean = self._summoning
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (name.replace(_PREFIX, "") if clean else name), buf

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Collective, like torch FSDP1's default FULL_STATE_DICT: the plain module's state dict (an inner
        instance's: its own module's, keys relative to it), original names and full fp32 tensors (buffers in
        their own dtype), on every rank (on rank 0 only, or on the CPU, under FSDP.state_dict_type with a
        FullStateDictConfig); under SHARDED_STATE_DICT each rank's dim-0 piece of every parameter as a DTensor
        ([Note: SHARDED_STATE_DICT] in state_dict.py). Called by torch DCP's get_model_state_dict it follows
        DCP's options as torch's FSDP1 does (sharded by default: [Note: DCP's get_model_state_dict]). Every rank
        must call it: one that skips it leaves the others waiting until the collective timeout. `keep_vars` gives
        detached copies, which is all a gathered copy can be."""
        if args:
            raise ValueError("FSDP.state_dict() takes destination, prefix and keep_vars by name only (positional "
                             "arguments are deprecated in torch)")
        # [Note: an inner instance's state dict]; under torch DCP, [Note: DCP's get_model_state_dict]
        return instance_state_dict(self, destination, prefix, keep_vars, sys._getframe(1))

    def apply(self, fn):
        """Collective, as in torch FSDP1: `fn` runs inside summon_full_params(writeback=True), so an init function
        written for the plain module (nn.init.kaiming_uniform_ on a 2-D weight) sees full parameters under their
        original names, and what it writes reaches every rank's shard."""
        if any(u.summoned for u in self._units):  # inside the root's apply or a summon: already gathered
            return super().apply(fn)
        with summon_full_params(self, writeback=True):
            return super().apply(fn)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Collective: load a plain module's state dict (as `state_dict()` gives it) on every rank."""
        return load_full_state_dict(self, state_dict, strict, assign)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict=None,
                         group=None) -> dict:
        """Collective: `optim`'s state keyed by original parameter names, full or sharded as state_dict_type says
        ([Note: optimizer state by original name] in optim_state_dict.py)."""
        return optim_state.optim_state_dict(FSDP._one_root(model, "optim_state_dict"), optim, optim_state_dict,
                                            group)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False, group=None) -> dict:
        """Collective: what `optim.load_state_dict` takes on this rank, from an FSDP.optim_state_dict dict saved on
        any number of ranks."""
        return optim_state.optim_state_dict_to_load(FSDP._one_root(model, "optim_state_dict_to_load"), optim,
                                                    optim_state_dict, is_named_optimizer, load_directly, group)

    @staticmethod
    def _one_root(module: nn.Module, what: str) -> "FSDP":
        roots = [module._root] if isinstance(module, FSDP) else FSDP.fsdp_modules(module, root_only=True)
        if len(roots) != 1:
            raise ValueError(f"FSDP.{what}: {type(module).__name__} holds {len(roots)} root fsdp_lab.FSDP models; "
                             f"pass the one the optimizer trains")
        return roots[0]

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None) -> StateDictSettings:
        """Set what state_dict() gives for every FSDP in `module`; return the previous settings."""
        settings = coerce_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        models = [m for m in module.modules() if isinstance(m, FSDP)]
        if not models:
            raise ValueError(f"set_state_dict_type: {type(module).__name__} contains no fsdp_lab.FSDP")
        previous = models[0]._state_dict_settings
        for model in models:
            model._state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the FSDP models in `module` (they must agree)."""
        settings = {m._state_dict_settings for m in FSDP.fsdp_modules(module)}
        if not settings:
            raise ValueError(f"get_state_dict_type: {type(module).__name__} contains no fsdp_lab.FSDP")
        if len(settings) > 1:
            raise ValueError(f"get_state_dict_type: the FSDP models in {type(module).__name__} have different "
                             f"settings: {sorted(map(repr, settings))}")
        return settings.pop()

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None) -> Iterator[None]:
        """The settings of set_state_dict_type inside the context only."""
        models = [m for m in module.modules() if isinstance(m, FSDP)]
        before = [m._state_dict_settings for m in models]
        FSDP.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            for model, settings in zip(models, before):
                model._state_dict_settings = settings

    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str):
        """Forward what FSDP does not have to the wrapped module, as torch FSDP1 does (model.config,
        model.generate, model.blocks)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":  # not set yet: __init__ is still running
                raise
        if name in NOT_PROVIDED:
            raise AttributeError(not_provided_message(name))
        return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key):
        """Forward indexing to the wrapped module (an nn.Sequential, a ModuleList), as torch FSDP1 does."""
        return self._fsdp_wrapped_module.__getitem__(key)

    @property
    def units(self) -> list[Unit]:
        """Every unit, innermost first, the root last."""
        return list(self._units)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._ctx.strategy

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def rank(self) -> int:
        return self._ctx.rank

    def set_tracer(self, tracer) -> None:
        """Attach (or with None, detach) a fsdp_lab.observe.trace.Tracer; tracing costs nothing while detached."""
        self._ctx.tracer = tracer

    def memory_report(self, optimizer=None):
        return memory_report(self, optimizer)


for _name in NOT_PROVIDED:  # torch FSDP1's methods we do not have raise naming themselves
    setattr(FSDP, _name, not_provided(_name))
