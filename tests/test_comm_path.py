"""The one collective path (fsdp_lab/runtime/core/streams.py, collectives.py) on gloo CPU ranks: ZeRO-1 correct with
any optimizer and current in exports, float16 means that do not overflow, clip_grad_norm_ without host reads,
16-byte aligned flat offsets, optimizer state restored through load_state_dict, and the launcher's device choice.
The stream ordering on fake CUDA streams is in test_overlap.py."""
from __future__ import annotations

import types

import pytest
import torch
from ranks_comm_path import (aligned_layout, clip_host_reads, clip_reference, fp16_mean, resume_fused,
                             zero1_training)

from fsdp_lab.runtime.core.collectives import divide_factors
from fsdp_lab.theory import formulas as F
from fsdp_lab.training.launch import run_on_ranks, set_rank_device

FP32_NOISE = 2e-6  # summation-order differences between 1 and N ranks, after 3 steps


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["fused", "foreach", "forloop", "data"])
def test_zero1_matches_single_process_with_any_optimizer_and_exports_current_masters(kind, world_size):
    """fused AdamW and hand-written `.data` updates bump no version counter; the replicas must still be
    refreshed once per step, and the export right after optimizer.step() must show every rank's new chunk."""
    out = run_on_ranks(zero1_training, world_size, kind, timeout_s=120)[0]
    assert max(out["export_diffs"]) <= FP32_NOISE, out
    assert out["forward_diff"] <= FP32_NOISE, out
    assert out["collectives"] == ["all_gather", "reduce_scatter"], "ZeRO-1: reduce-scatter + all-gather, no all-reduce"


def test_fp16_means_are_divided_before_and_after_the_sum():
    assert divide_factors(2, torch.float16) == (2.0, 1.0)
    assert divide_factors(3, torch.float16) == (2.0, 1.5)
    assert divide_factors(8, torch.float16) == (4.0, 2.0)
    assert divide_factors(8, torch.float32) == divide_factors(8, torch.bfloat16) == (1.0, 8.0)
    out = run_on_ranks(fp16_mean, 2, 40000.0, timeout_s=60)[0]  # the sum, 80000, is past float16's 65504
    assert set(out["reduce_scatter"]) == {40000.0}, out
    assert set(out["all_reduce"]) == {40000.0}, out


def test_the_fp16_pre_divide_is_exact_only_in_the_normal_range():
    """[Note: dividing by N without overflow]: a power-of-two divide loses tiny float16 gradients."""
    pre, _post = divide_factors(8, torch.float16)
    normal = torch.tensor([1e-3, 0.5, 6e4], dtype=torch.float16)
    assert torch.equal((normal / pre) * pre, normal)  # exact while the quotient stays normal
    tiny = torch.tensor([1e-7, 2e-7], dtype=torch.float16)  # subnormal already: 1.19e-7, 1.79e-7
    assert (tiny / pre)[0] == 0  # underflows to zero: that gradient is gone
    assert not torch.equal((tiny / pre) * pre, tiny)  # and the other has lost bits
    assert torch.finfo(torch.float16).tiny == pytest.approx(6.1e-5, rel=0.01)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_reads_nothing_back_to_the_host(norm_type):
    out = run_on_ranks(clip_host_reads, 2, norm_type, timeout_s=60)[0]
    assert out["host_reads"] == [], f"clip_grad_norm_ read {len(out['host_reads'])} values back to the host"
    assert out["norm"] == pytest.approx(clip_reference(norm_type), rel=1e-5)


@pytest.mark.parametrize("dtype_name, align", [("fp32", 4), ("bf16", 8)])
def test_flat_offsets_are_16_byte_aligned_and_accounted(dtype_name, align):
    out = run_on_ranks(aligned_layout, 1, dtype_name, timeout_s=60)[0]
    assert all(offset % align == 0 for offset, _size in out["offsets"]), out["offsets"]
    assert out["addresses"] and all(a % 16 == 0 for a in out["addresses"]), out["addresses"]
    assert out["gaps_nonzero"] == 0, "alignment gaps must stay zero through AdamW with weight decay"
    assert out["numel_total"] > out["params"], "odd-sized layers need alignment gaps"
    state = F.runtime_state_bytes("FULL_SHARD", out["numel_padded_total"], 1)
    mem = out["memory"]
    assert (mem["params_sharded"], mem["grads_sharded"], mem["optimizer_state"]) == \
        (state.params, 0, state.optimizer + 3 * 4), "gaps are counted as the bytes they are (+ AdamW's 3 steps)"


def test_resume_restores_optimizer_state_through_load_state_dict(tmp_path):
    out = run_on_ranks(resume_fused, 2, str(tmp_path), timeout_s=120)
    assert all(r["hooks"] == ["load_state_dict"] for r in out), out
    for value_device, value_dtype, param_device, param_dtype, name in out[0]["restored"]:
        assert value_device == param_device, name
        assert value_dtype == ("torch.float32" if name == "step" else param_dtype), name
    assert out[0]["diff"] <= FP32_NOISE, out[0]["diff"]


def test_launcher_sets_each_rank_s_device():
    calls = []
    fake = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, set_device=calls.append)
    assert [set_rank_device(r, fake) for r in range(3)] == [0, 1, 0] and calls == [0, 1, 0]
    none = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0, set_device=calls.append)
    assert set_rank_device(0, none) is None and calls == [0, 1, 0]


def test_fsdp_given_a_device_id_makes_it_the_current_device(monkeypatch):
    """FSDP(device_id=...) resolves the device before anything is built; on a CUDA device it also makes it current,
    so event waits and DCP's object collectives land on the rank's own GPU. Checked here with torch.cuda faked and
    the module's move stubbed (this machine has no GPU)."""
    from fsdp_lab.runtime.fsdp1 import device

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    module = torch.nn.Linear(3, 2)
    monkeypatch.setattr(module, "to", lambda device: calls.append(("to", str(device))) or module)
    assert device.resolve_device(module, 1, "nccl") == torch.device("cuda", 1)
    assert calls == [("to", "cuda:1"), ("set_device", "cuda:1")]
    calls.clear()
    assert device.resolve_device(module, "cpu", "gloo") == torch.device("cpu") and ("set_device", "cpu") not in calls
