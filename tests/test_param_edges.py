"""fully_shard at the edges of its per-parameter layout, against torch's fully_shard on gloo ranks
(tests/ranks_param_edges.py): a parameter frozen after fully_shard stays exactly where it was, and a group where
some rank holds none of a parameter's rows trains, saves and loads as torch's does."""
from __future__ import annotations

import functools

import pytest
from ranks_param_edges import run_cases

from fsdp_lab.training.launch import run_on_ranks

TORCH_TOL = 1e-6


@functools.cache
def results(lib: str, world_size: int) -> dict:
    names = ("frozen", "no_rows", "dtypes") if world_size == 2 else ("no_rows",)
    return run_on_ranks(run_cases, world_size, lib, names, timeout_s=300)


def param_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_parameter_frozen_after_fully_shard_does_not_move():
    ref, got = results("torch", 2)[0]["frozen"], results("fsdp_lab", 2)[0]["frozen"]
    assert ref["frozen_change"] == 0.0 and ref["frozen_grad"]
    assert got["frozen_change"] == 0.0, f"the frozen weight moved by {got['frozen_change']}"
    assert got["frozen_grad"], "a gradient was stored for a parameter with requires_grad False"
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TORCH_TOL
    assert param_diff(got["params"], ref["params"]) <= TORCH_TOL


@pytest.mark.parametrize("world_size,rows", [(2, [1, 0]), (4, [2, 2, 1, 0])])
def test_a_rank_without_rows_trains_and_round_trips_like_torch(world_size, rows):
    refs, gots = results("torch", world_size), results("fsdp_lab", world_size)
    assert [r["no_rows"]["weight_rows"] for r in refs] == [g["no_rows"]["weight_rows"] for g in gots] == rows
    ref, got = refs[0]["no_rows"], gots[0]["no_rows"]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TORCH_TOL, (got["losses"], ref["losses"])
    assert param_diff(got["params"], ref["params"]) <= TORCH_TOL
    assert param_diff(got["loaded"], got["params"]) == 0.0 and got["same_output"]


def test_unfreezing_a_parameter_frozen_at_fully_shard_is_refused_by_name():
    assert results("fsdp_lab", 2)[0]["frozen"]["refused"].startswith(
        "requires_grad of '2.weight' (fully_shard module '<root>') was set to True after fully_shard")


def test_frozen_parameters_of_other_dtypes_share_a_group_with_trainable_ones():
    """[Note: dtypes in one group] int8 and bf16 frozen bases beside fp32 adapters, in every fully_shard group."""
    ref, got = results("torch", 2)[0]["dtypes"], results("fsdp_lab", 2)[0]["dtypes"]
    assert got["dtypes"] == ref["dtypes"] and "torch.int8" in got["dtypes"].values()
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TORCH_TOL, (got["losses"], ref["losses"])
    assert param_diff(got["params"], ref["params"]) <= TORCH_TOL
