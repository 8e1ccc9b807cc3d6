"""A model already in bf16 (every parameter bf16, as `from_pretrained(torch_dtype=torch.bfloat16)` loads it),
wrapped with no mixed-precision policy: FSDP1 and fully_shard train the bf16 parameters as they are, as torch's
do (bf16 shards, gradients, reduce-scatter and AdamW state), on 2 gloo ranks (tests/ranks_fsdp1_bf16_params.py).

[Note: the bf16 tolerance] Exact. Both runs do the same bf16 operations in the same order on the same values: the
same views of the same flat (or per-parameter) buffers, the same gloo reduce-scatter (a sum of two bf16 values,
rounded once, then a division by a power of two, which is exact), and AdamW's elementwise update on identical
bf16 tensors. FSDP1's clip_grad_norm_ takes each norm in fp32 and returns the total in bf16, as torch's does (under NO_SHARD
both hand it to nn.utils.clip_grad_norm_, whose norms are bf16). Any
difference would be a different rounding somewhere, i.e. a different computation, which is what
the test exists to catch; bf16 noise (about 2**-8 relative) would hide it.
"""
from __future__ import annotations

import functools

import pytest
from ranks_fsdp1_bf16_params import mixed_dtypes, run
from torch.distributed.fsdp import ShardingStrategy

from fsdp_lab.training.launch import run_on_ranks


CASES = {"fsdp1": ("fsdp1", {}), "fsdp1 use_orig_params": ("fsdp1", {"use_orig_params": True}),
         "fsdp1 NO_SHARD": ("fsdp1", {"sharding_strategy": ShardingStrategy.NO_SHARD}),
         "fsdp2": ("fsdp2", {})}


@functools.cache
def results(lib: str, case: str) -> dict:
    front, options = CASES[case]
    return run_on_ranks(run, 2, lib, front, options, timeout_s=300)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_parameters_train_as_torch_trains_them(case):
    ref, got = results("torch", case), results("fsdp_lab", case)
    for key in ("param_dtypes", "grad_dtypes", "state_dtypes", "state_dtypes_saved"):
        assert got.get(key) == ref.get(key), (key, got.get(key), ref.get(key))
    assert got["param_dtypes"] == got["grad_dtypes"] == got["state_dtypes"] == ["torch.bfloat16"]
    assert got["losses"] == ref["losses"], (got["losses"], ref["losses"])  # [Note: the bf16 tolerance]
    assert got["norms"] == ref["norms"], (got["norms"], ref["norms"])  # FSDP1's clip_grad_norm_: (dtype, value)
    assert sorted(got["params"]) == sorted(ref["params"])
    diff = {k: (got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]}
    assert max(diff.values()) == 0.0, diff


def test_a_unit_mixing_dtypes_is_refused_as_torch_refuses_it():
    ref = run_on_ranks(mixed_dtypes, 2, "torch", timeout_s=120)[0]
    got = run_on_ranks(mixed_dtypes, 2, "fsdp_lab", timeout_s=120)[0]
    assert "uniform dtype" in ref, ref
    assert "Must flatten tensors with uniform dtype" in got and "'1.weight'" in got and "'0.weight'" in got, got
