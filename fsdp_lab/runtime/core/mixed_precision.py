"""The mixed-precision policy (same name and fields as torch's FSDP1 MixedPrecision).

The shard is always the master copy the optimizer updates, in the dtype the parameters were wrapped in (fp32
in the course; a model loaded in bf16 keeps bf16 masters, as in torch). `param_dtype` is what the all-gather carries and
what compute sees; the shard is cast *before* the collective, so a bf16 policy halves the bytes on the wire.
`reduce_dtype` is what the gradient reduce-scatter carries; the result is stored in the master's dtype.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """torch FSDP1's fields, order and defaults. keep_low_precision_grads: the gradient the optimizer sees stays
    in param_dtype instead of being cast to the fp32 master's dtype. cast_root_forward_inputs: the root casts
    the model's floating inputs to param_dtype; cast_forward_inputs: every unit casts its own inputs too.
    _module_classes_to_ignore: torch keeps such modules (BatchNorm) in fp32; one compute dtype per model here,
    so a model holding one is refused when param_dtype is set (coerce_mixed_precision)."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating torch.dtype, got {value!r}")

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        """The dtype the sharded gradient is kept in, None for the master's (torch's keep_low_precision_grads)."""
        return self.param_dtype if self.keep_low_precision_grads else None


FULL_PRECISION = MixedPrecision()


def compute_dtype(policy: Optional[MixedPrecision], master_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """What the gather carries: param_dtype, else the master's (None: each flat buffer's own dtype)."""
    return (policy.param_dtype if policy and policy.param_dtype else master_dtype)


def reduce_dtype(policy: Optional[MixedPrecision], master_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if policy and policy.reduce_dtype:
        return policy.reduce_dtype
    return compute_dtype(policy, master_dtype)


def coerce_mixed_precision(policy, module) -> Optional[MixedPrecision]:
    """Accept ours or torch's FSDP1 MixedPrecision (same fields). A field this runtime would not honour raises a
    ValueError naming it rather than being dropped."""
    if policy is None:
        return None
    names = [f.name for f in dataclasses.fields(MixedPrecision)]
    if not isinstance(policy, MixedPrecision):
        if not all(hasattr(policy, a) for a in ("param_dtype", "reduce_dtype")):
            raise ValueError(f"mixed_precision must be a MixedPrecision, got {policy!r}")
        defaults = MixedPrecision()
        policy = MixedPrecision(**{n: getattr(policy, n, getattr(defaults, n)) for n in names})
    ignored = tuple(policy._module_classes_to_ignore or ())
    kept_fp32 = sorted({type(m).__name__ for m in module.modules() if ignored and isinstance(m, ignored)})
    if kept_fp32 and policy.param_dtype is not None:
        raise ValueError(f"MixedPrecision._module_classes_to_ignore would keep {kept_fp32} in fp32, which "
                         f"fsdp_lab does not support: every unit computes in param_dtype. Pass "
                         f"_module_classes_to_ignore=() to compute them in param_dtype too")
    return policy


def cast_inputs(dtype: torch.dtype, _module, args, kwargs):
    """MixedPrecision's input cast: every floating tensor in args and kwargs to `dtype` (a forward pre-hook)."""
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def cast_floating(tree, dtype: torch.dtype):
    """`tree` with every floating tensor in it cast to `dtype` (one already in `dtype` is returned as is). A hook
    runs this on every module's inputs or outputs every step, so the usual shapes (one tensor, a flat tuple, no
    kwargs) skip pytree's walk; anything else goes through tree_map."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

    if isinstance(tree, torch.Tensor):
        return cast(tree)
    if type(tree) is dict and not tree:
        return tree
    if type(tree) is tuple:  # the same tuple back when nothing needs a cast (the blocks after the first)
        out, changed = [], False
        for a in tree:
            if isinstance(a, torch.Tensor):
                if a.dtype != dtype and a.is_floating_point():
                    a, changed = a.to(dtype), True
            elif not isinstance(a, _PLAIN_LEAVES):
                return tree_map(cast, tree)
            out.append(a)
        return tuple(out) if changed else tree
    return tree_map(cast, tree)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """fully_shard's policy (torch.distributed.fsdp.MixedPrecisionPolicy's fields): `param_dtype` is what the
    all-gather carries and compute sees, `reduce_dtype` what the reduce-scatter carries (None: the compute dtype),
    `output_dtype` what floating outputs of the module are cast to, `cast_forward_inputs` whether its floating
    inputs are cast to `param_dtype`. The sharded parameters keep their own dtype: they are the masters."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{field} must be a floating torch.dtype, got {value!r}")


def coerce_mp_policy(policy) -> MixedPrecisionPolicy:
    """Accept ours or torch's MixedPrecisionPolicy (same four fields); anything else is refused by name."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(policy).__name__ != "MixedPrecisionPolicy" or not all(hasattr(policy, f) for f in fields):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {policy!r}")
    return MixedPrecisionPolicy(*(getattr(policy, f) for f in fields))
