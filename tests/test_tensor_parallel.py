"""Tensor parallel on a 2-D mesh ("dp", "tp"), then fully_shard on "dp" (torchtitan's apply_tp + apply_fsdp),
against torch's fully_shard and one process, on 4 gloo ranks (tests/ranks_tensor_parallel.py); [Note: FSDP over
tensor parallel] in fsdp_lab/runtime/fsdp2/tensor_parallel.py."""
from __future__ import annotations

import pytest
from ranks_tensor_parallel import run_dcp_resume, run_train_and_state_dicts

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_tp_then_fully_shard_trains_clips_and_saves_like_torch():
    refs = run_on_ranks(run_train_and_state_dicts, 4, "torch", timeout_s=300)
    gots = run_on_ranks(run_train_and_state_dicts, 4, "fsdp_lab", timeout_s=300)
    plain = run_on_ranks(run_train_and_state_dicts, 1, "plain", timeout_s=300)[0]
    for ref, got in zip(refs, gots):
        assert got["placements"] == ref["placements"]
        assert got["placements"]["layers.0.w1.weight"] == (("_S(0, 2)", "S(0)"), ("dp", "tp"))  # strided
        assert got["placements"]["layers.0.w2.weight"] == (("S(0)", "S(1)"), ("dp", "tp"))
        assert got["placements"]["layers.0.w2.bias"] == (("S(0)", "R"), ("dp", "tp"))
        assert got["local_shapes"] == ref["local_shapes"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert got["losses"] == pytest.approx(plain["losses"], abs=TOL)
        assert got["norms"] == pytest.approx(ref["norms"], abs=TOL)  # clip_grad_norm_ over 2-D DTensor grads
        assert got["norms"] == pytest.approx(plain["norms"], abs=TOL)
        assert _max_diff(got["params"], ref["params"]) <= TOL
        assert _max_diff(got["params"], plain["params"]) <= TOL
        for kind, want in ref["state_dicts"].items():  # full and sharded, model alone and with the optimizer
            have = got["state_dicts"][kind]
            assert list(have) == list(want), kind
            for key, value in want.items():
                if isinstance(value, tuple):
                    assert have[key][0] == value[0], (kind, key)  # placements and mesh dim names
                    assert (have[key][1] - value[1]).abs().max().item() <= TOL, (kind, key)
                else:
                    assert have[key] == value, (kind, key)


def test_dcp_resume_on_2x2_and_resharded_to_dp4_continues_exactly(tmp_path):
    refs = run_on_ranks(run_dcp_resume, 4, "torch", str(tmp_path / "torch"), timeout_s=300)
    gots = run_on_ranks(run_dcp_resume, 4, "fsdp_lab", str(tmp_path / "fsdp_lab"), timeout_s=300)
    for ref, got in zip(refs, gots):
        assert got["continued"] == pytest.approx(ref["continued"], abs=TOL)
        for target in ("2x2", "dp4"):
            assert got[target]["resumed"] == pytest.approx(got["continued"], abs=TOL), target
            assert got[target]["resumed"] == pytest.approx(ref[target]["resumed"], abs=TOL), target
            assert _max_diff(got[target]["params"], got["expected"]) <= TOL, target
            assert _max_diff(got[target]["params"], ref[target]["params"]) <= TOL, target


def test_trace_counts_bytes_per_mesh_dim():
    """One forward and backward per rank. dp: each block's group is S = 51 fp32 elements per rank (w1: 3 of
    its 5 tp rows of 8, bias 3; w2: 4 of 8 rows of 5, bias 4), gathered as 2·51·4 = 408 bytes; a ring
    all-gather or reduce-scatter on 2 ranks sends half: 204 bytes. Two blocks, each gathered in forward and
    again in backward, each reduce-scattered once. tp: each RowwiseParallel output all-reduces the (4, 3, 8)
    fp32 activation (384 bytes; a ring all-reduce on 2 ranks sends 384), and in backward block 1's
    ColwiseParallel input gradient does (block 0's input needs no gradient)."""
    from ranks_tensor_parallel import run_trace

    for got in run_on_ranks(run_trace, 4, timeout_s=300):
        assert got["by_dim_collective"] == {("dp", "all_gather"): 2 * 2 * 204, ("dp", "reduce_scatter"): 2 * 204,
                                            ("tp", "all_reduce"): 3 * 384}
        assert got["by_dim"] == {"dp": 6 * 204, "tp": 3 * 384}
        assert [e[:3] for e in got["dtensor_events"]] == [("forward", "all_reduce", "tp")] * 2 + \
            [("backward", "all_reduce", "tp")]
        # torch's CommDebugMode counts the same pass: DTensor's 3 all-reduces, fully_shard's 4 + 2 on dp
        assert got["torch_counts"] == {"c10d_functional.all_reduce": 3, "c10d._allgather_base_": 4,
                                       "c10d._reduce_scatter_base_": 2}
        assert {e[1] for e in got["fsdp_dims"]} == {"dp"}
        assert "2-D (HSDP) mesh" in got["refusals"]["hsdp"] and "'w1.weight'" in got["refusals"]["hsdp"]
        assert "offload_policy=CPUOffloadPolicy()" in got["refusals"]["offload"]
