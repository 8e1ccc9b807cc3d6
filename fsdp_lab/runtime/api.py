"""`FSDP`: wrap a module so each unit the policy picks (and the root) is sharded across the process group.

Same constructor names as torch.distributed.fsdp.FullyShardedDataParallel for the subset we support; options
we do not support raise a ValueError naming the option instead of being silently ignored.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from fsdp_lab.runtime.flat_param import FlatParam
from fsdp_lab.runtime.grad_norm import clip_grad_norm_
from fsdp_lab.runtime.memory import memory_report
from fsdp_lab.runtime.mixed_precision import MixedPrecision, coerce_mixed_precision, compute_dtype, reduce_dtype
from fsdp_lab.runtime.partition import partition_params
from fsdp_lab.runtime.root import drop_abandoned_backward, finish_backward, queue_finish_backward
from fsdp_lab.runtime.state import FSDPState
from fsdp_lab.runtime.state_dict import (DEFAULT_SETTINGS, StateDictSettings, coerce_settings, full_state_dict,
                                         load_full_state_dict)
from fsdp_lab.runtime.strategy import BackwardPrefetch, ShardingStrategy, coerce_enum
from fsdp_lab.runtime.summon import flat_param_name, gather_master, register_full_params, summon_full_params
from fsdp_lab.runtime.unit import Unit
from fsdp_lab.runtime.wrap import select_units

_PREFIX = "_fsdp_wrapped_module."


def _check_process_group(process_group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fsdp_lab.FSDP needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (fsdp_lab.training.launch.run_on_ranks "
                           "does it for you), or run the script under torchrun.")
    return process_group if process_group is not None else dist.group.WORLD


def _resolve_device(module: nn.Module, device_id, backend: str) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices):
        names = [n for n, p in module.named_parameters() if p.device.type == "meta"][:3]
        raise ValueError(f"module has parameters on the meta device ({', '.join(names)}): materialise them "
                         f"(e.g. module.to_empty(device=...) and re-initialise) before wrapping with FSDP")
    if device_id is not None:
        target = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device_id={device_id!r} asks for CUDA but torch.cuda.is_available() is False")
        if devices - {torch.device("cpu"), target} and devices != {target}:
            raise ValueError(f"module is on {sorted(map(str, devices))} but device_id is {target}; "
                             f"move it to {target} or to CPU first")
        module.to(target)
        if target.type == "cuda":  # event waits, NCCL and DCP's object collectives use the current device
            torch.cuda.set_device(target)
        return target
    if len(devices) > 1:
        by_dev = {}
        for n, p in module.named_parameters():
            by_dev.setdefault(str(p.device), n)
        raise ValueError(f"module's parameters are on several devices: {by_dev}; FSDP needs one device "
                         f"per rank (move the module, or pass device_id)")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"module is on {device} but the process group's backend is nccl, which needs CUDA "
                         f"tensors: move the module to cuda or pass device_id")
    return device


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper (ZeRO-3 by default). See DESIGN.md §2–3 and notebooks 02–06."""

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=None, cpu_offload=None,
                 auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: Optional[MixedPrecision] = None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states: bool = False, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, use_orig_params: bool = False, ignored_states=None,
                 device_mesh=None):
        super().__init__()
        if cpu_offload is not None and getattr(cpu_offload, "offload_params", True) is not False:
            raise ValueError(f"FSDP option cpu_offload={cpu_offload!r} is not supported by fsdp_lab")
        for option, value in (("ignored_modules", ignored_modules), ("param_init_fn", param_init_fn),
                              ("ignored_states", ignored_states), ("device_mesh", device_mesh)):
            if value is not None:
                raise ValueError(f"FSDP option {option}={value!r} is not supported by fsdp_lab")
        if isinstance(module, FSDP):
            raise ValueError("module is already wrapped with FSDP")
        pg = _check_process_group(process_group)
        strategy = coerce_enum(sharding_strategy or ShardingStrategy.FULL_SHARD, ShardingStrategy,
                               "sharding_strategy")
        prefetch = coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        mixed_precision = coerce_mixed_precision(mixed_precision, module)
        self._settings = {"process_group": tuple(dist.get_process_group_ranks(pg)), "sharding_strategy": strategy,
                          "mixed_precision": mixed_precision, "backward_prefetch": prefetch,
                          "forward_prefetch": bool(forward_prefetch), "limit_all_gathers": bool(limit_all_gathers),
                          "use_orig_params": bool(use_orig_params)}
        self._nested_into = None  # the outer FSDP, once one has taken this one's units over
        nested_units = self._take_over_nested(module)
        device = _resolve_device(module, device_id, dist.get_backend(pg))
        masters = {p.dtype for p in module.parameters()}
        if masters - {torch.float32}:
            raise ValueError(f"fsdp_lab keeps fp32 master weights; module has parameters of dtype "
                             f"{sorted(map(str, masters))}. Keep the module in fp32 and use MixedPrecision")
        if sync_module_states:
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(tensor.data, src=dist.get_global_rank(pg, 0), group=pg)
        if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
            for buf_module in module.modules():
                for name, buf in buf_module._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        buf_module._buffers[name] = buf.to(mixed_precision.buffer_dtype)
        self._fsdp_wrapped_module = module
        self._use_orig_params = bool(use_orig_params)
        self._state_dict_settings = DEFAULT_SETTINGS
        self._ctx = FSDPState(
            pg=pg, world_size=dist.get_world_size(pg), rank=dist.get_rank(pg), strategy=strategy,
            mixed_precision=mixed_precision, compute_dtype=compute_dtype(mixed_precision, torch.float32),
            reduce_dtype=reduce_dtype(mixed_precision, torch.float32), device=device,
            forward_prefetch=forward_prefetch, backward_prefetch=prefetch,
            max_gathers_in_flight=2 if limit_all_gathers else 1 << 30,
            on_backward_start=self._on_backward_start)
        self._units = self._build_units(module, auto_wrap_policy, nested_units)

    def _take_over_nested(self, module: nn.Module) -> list[nn.Module]:
        """[Note: nested FSDP] FSDP1 scripts often wrap by hand: FSDP(Net(blocks=[FSDP(b) for b in blocks])).
        Each FSDP found inside `module` is taken apart: its module gets its original parameters back (gathered
        from the shards), its hooks are removed, it takes the FSDP's place in the tree, and every unit it had
        becomes a unit of this model, exactly as if the policy had picked it. Its options must equal ours:
        this runtime has one set of options per model, so a different one would be silently ignored."""
        found = []

        def visit(parent: nn.Module):
            for name, child in parent._modules.items():
                if isinstance(child, FSDP):
                    found.append((parent, name, child))  # it already took over the FSDPs inside it
                elif child is not None:
                    visit(child)

        visit(module)
        unit_modules = []
        for parent, name, inner in found:
            for option, ours in self._settings.items():
                theirs = inner._settings[option]
                if theirs != ours:
                    raise ValueError(f"nested FSDP '{name}' has {option}={theirs!r} but the outer FSDP has "
                                     f"{ours!r}: fsdp_lab applies one set of options to a whole model; pass the "
                                     f"same to both, or wrap once with an auto_wrap_policy")
            unit_modules.extend(inner._hand_over_units(self))
            parent._modules[name] = inner.module
        return unit_modules

    def _hand_over_units(self, outer: "FSDP") -> list[nn.Module]:
        """Give every unit's original parameters back and unhook it; return the unit modules, innermost first."""
        if self._ctx.in_backward:
            raise RuntimeError("an FSDP cannot be nested into another while its backward is running")
        self._reshard_all("summon")
        for unit in self._units:
            for handle in unit.hook_handles:
                handle.remove()
            for flat in unit.flats:
                full = gather_master(unit, flat).detach().clone()
                register_full_params(unit, flat, full)
        modules = [unit.module for unit in self._units]
        self._units, self._nested_into = [], outer
        return modules

    def _build_units(self, module, policy, nested_units=()) -> list[Unit]:
        ctx = self._ctx
        units = []
        for info in partition_params(module, select_units(module, policy, nested_units)):
            flats = []
            for params, trainable in ((info.trainable, True), (info.frozen, False)):
                if not params:
                    continue
                flats.append(FlatParam(
                    info.name or "<root>", params, ctx.world_size, ctx.rank, requires_grad=trainable,
                    compute_dtype=ctx.compute_dtype, keep_replica=ctx.strategy is ShardingStrategy.ZERO1,
                    shard_storage=ctx.strategy.shards_params, reduce_dtype=ctx.reduce_dtype))
            for _param, aliases in info.trainable + info.frozen:  # the flat shards replace them
                for owner, attr, _q in aliases:
                    owner._parameters.pop(attr, None)
            for flat in flats:
                if self._use_orig_params:  # [Note: original parameters] in flat_param.py
                    for slot, param in zip(flat.slots, flat.make_orig_params()):
                        for owner, attr, _q in slot.aliases:
                            owner._parameters[attr] = param
                else:
                    info.module.register_parameter(flat_param_name(flat), flat.shard)
            unit = Unit(info.name or "<root>", info.module, flats, ctx, is_root=info.module is module)
            unit.hook_handles = [info.module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True),
                                 info.module.register_forward_hook(unit.post_forward)]
            units.append(unit)
        return units

    # -- forward / backward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        ctx = self._ctx
        if self._nested_into is not None:
            raise RuntimeError("this FSDP was nested into another FSDP, which now runs its units: call the outer "
                               "one")
        self._drop_abandoned_backward()
        policy = ctx.mixed_precision
        if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
            def cast(t):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return t.to(policy.param_dtype)
                return t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        if ctx.forward_order:
            ctx.order_frozen = True
        if not torch.is_grad_enabled() or not self.training:
            self._reshard_all("forward")  # an earlier forward's backward stays pending: it re-gathers
        return output

    def _drop_abandoned_backward(self) -> None:
        drop_abandoned_backward(self._ctx, self._units)  # [Note: per-iteration state is reset ...] in root.py

    def _on_backward_start(self) -> None:
        queue_finish_backward(self._ctx, self._finish_backward)

    def _finish_backward(self) -> None:
        def orig_grads(unit):
            for flat in unit.trainable_flats:
                if flat.orig_params is not None:
                    flat.shard_grad_to_orig()

        finish_backward(self._ctx, self._units, orig_grads)

    def _reshard_all(self, phase: str) -> None:
        """Free every unit. A pending backward is kept: its units re-gather when it reaches them."""
        for unit in self._units:
            unit.free(phase)

    # -- torch-compatible helpers ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backwards run inside this context."""
        previous = self._ctx.sync_gradients
        self._ctx.sync_gradients = False
        try:
            yield
        finally:
            self._ctx.sync_gradients = previous

    @staticmethod
    def summon_full_params(module: "FSDP", writeback: bool = True, rank0_only: bool = False,
                           with_grads: bool = False, recurse: bool = True):
        if not isinstance(module, FSDP):
            raise TypeError(f"summon_full_params expects an fsdp_lab.FSDP model, got {type(module).__name__}")
        for option, value, supported in (("rank0_only", rank0_only, False), ("with_grads", with_grads, False),
                                         ("recurse", recurse, True)):
            if value != supported:
                raise ValueError(f"summon_full_params option {option}={value!r} is not supported by fsdp_lab")
        return summon_full_params(module, writeback=writeback)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (computed across all ranks' shards)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def named_parameters(self, *args, **kwargs):
        for name, param in super().named_parameters(*args, **kwargs):
            yield name.replace(_PREFIX, ""), param

    def named_buffers(self, *args, **kwargs):
        for name, buf in super().named_buffers(*args, **kwargs):
            yield name.replace(_PREFIX, ""), buf

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """Collective, like torch FSDP1's default FULL_STATE_DICT: the plain module's state dict, original names
        and full fp32 tensors, on every rank (on rank 0 only, or on the CPU, under FSDP.state_dict_type with a
        FullStateDictConfig). Every rank must call it: one that skips it leaves the others waiting until the
        collective timeout. `keep_vars` gives detached copies, which is all a gathered copy can be."""
        return full_state_dict(self, self._state_dict_settings, destination, prefix)

    def apply(self, fn):
        """Collective, as in torch FSDP1: `fn` runs inside summon_full_params(writeback=True), so an init function
        written for the plain module (nn.init.kaiming_uniform_ on a 2-D weight) sees full parameters under their
        original names, and what it writes reaches every rank's shard."""
        with summon_full_params(self, writeback=True):
            return super().apply(fn)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Collective: load a plain module's state dict (as `state_dict()` gives it) on every rank."""
        return load_full_state_dict(self, state_dict, strict, assign)

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
