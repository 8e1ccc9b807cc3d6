"""The mixed-precision policy (same name and fields as torch's FSDP1 MixedPrecision).

The fp32 shard is always the master copy the optimizer updates. `param_dtype` is what the all-gather carries and
what compute sees; the shard is cast *before* the collective, so a bf16 policy halves the bytes on the wire.
`reduce_dtype` is what the gradient reduce-scatter carries; the result is stored in fp32 on the shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating torch.dtype, got {value!r}")


FULL_PRECISION = MixedPrecision()


def compute_dtype(policy: Optional[MixedPrecision], master_dtype: torch.dtype) -> torch.dtype:
    return (policy.param_dtype if policy and policy.param_dtype else master_dtype)


def reduce_dtype(policy: Optional[MixedPrecision], master_dtype: torch.dtype) -> torch.dtype:
    if policy and policy.reduce_dtype:
        return policy.reduce_dtype
    return compute_dtype(policy, master_dtype)


def coerce_mixed_precision(policy, module) -> Optional[MixedPrecision]:
    """Accept ours or torch's FSDP1 MixedPrecision. A torch field this runtime would not honour raises a
    ValueError naming it rather than being dropped."""
    if policy is None or isinstance(policy, MixedPrecision):
        return policy
    if not all(hasattr(policy, a) for a in ("param_dtype", "reduce_dtype")):
        raise ValueError(f"mixed_precision must be a MixedPrecision, got {policy!r}")
    if getattr(policy, "keep_low_precision_grads", False):
        raise ValueError("MixedPrecision option keep_low_precision_grads=True is not supported by fsdp_lab: "
                         "gradients are always stored in fp32 on the shard")
    ignored = tuple(getattr(policy, "_module_classes_to_ignore", ()) or ())
    kept_fp32 = sorted({type(m).__name__ for m in module.modules() if ignored and isinstance(m, ignored)})
    if kept_fp32 and policy.param_dtype is not None:
        raise ValueError(f"MixedPrecision._module_classes_to_ignore would keep {kept_fp32} in fp32, which "
                         f"fsdp_lab does not support: every unit computes in param_dtype")
    cast = bool(getattr(policy, "cast_root_forward_inputs", True) or getattr(policy, "cast_forward_inputs", False))
    return MixedPrecision(policy.param_dtype, policy.reduce_dtype, getattr(policy, "buffer_dtype", None), cast)


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
