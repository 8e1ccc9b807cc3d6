"""fsdp_lab's fully_shard against torch's own, with FSDP2-style scripts in which only the import differs
(tests/ranks_fully_shard.py), on 2 and 4 gloo ranks, and against one process.

fp32 must match torch to float noise and one process to 1e-5; bf16 must stay close to torch. The cases cover
per-block then root wrapping, MixedPrecisionPolicy, reshard_after_forward False and int, meta-device init,
set_requires_gradient_sync accumulation, the FSDPModule methods, clip_grad_norm_, tied embeddings, a frozen
layer inside a group and an evaluation forward between steps; then sharded state dicts, DCP and get_state_dict
round trips with exact continuation."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from ranks_fully_shard import (CASES, api_checks, broadcast_loads, checkpoint_round_trips, run_cases,
                               trace_and_memory)

from fsdp_lab.training.launch import run_on_ranks

FP32_TOL = 1e-5
TORCH_TOL = 1e-6  # same algorithm, same reduction order: float noise only
BF16_TOL = 2e-3
FOUR_ONLY = ("group_reshard",)  # reshard_after_forward=2 needs a mesh of 4 (on 2 it is True)
ALL = tuple(c for c in CASES if c not in FOUR_ONLY)
AT_FOUR = ("fp32", "bf16", "accumulate", "meta", *FOUR_ONLY)  # 4 ranks on 2 cores are slow: the cases that differ
# most by N
FP32 = ("fp32", "no_reshard", "int_reshard", "accumulate", "methods", *FOUR_ONLY)  # the ones one process can replay


@functools.cache
def every_rank(lib: str, world_size: int) -> list:
    """Each rank's results of one launch of the ranks."""
    names = ALL if world_size < 4 else AT_FOUR
    if lib == "plain":
        return [run_cases(0, 1, "plain", FP32)]
    if lib == "fsdp_lab" and world_size == 1:
        names = tuple(n for n in FP32 if n not in FOUR_ONLY)
    return run_on_ranks(run_cases, world_size, lib, names, timeout_s=600)


def results(lib: str, world_size: int) -> dict:
    return every_rank(lib, world_size)[0]


def max_diff(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def param_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), "named_parameters() must give the plain names in the plain order"
    return max((a[k] - b[k]).abs().max().item() for k in a)


def compare(got: dict, ref: dict, tol: float, label: str) -> None:
    for key in ("losses", "norms", "evals"):
        diff = max_diff(got[key], ref[key])
        assert diff <= tol, f"{label}: {key} differ by {diff:.3g} (> {tol}): {got[key]} vs {ref[key]}"
    diff = param_diff(got["params"], ref["params"])
    assert diff <= tol, f"{label}: final parameters differ by {diff:.3g} (> {tol})"


CASE_PAIRS = [(2, c) for c in ALL] + [(4, c) for c in AT_FOUR]


@pytest.mark.parametrize("world_size,case", CASE_PAIRS, ids=[f"{c}-{n}ranks" for n, c in CASE_PAIRS])
def test_matches_torch_fully_shard(world_size, case):
    ref, got = results("torch", world_size)[case], results("fsdp_lab", world_size)[case]
    compare(got, ref, BF16_TOL if case == "bf16" else TORCH_TOL, f"{case} on {world_size} ranks")
    assert got["class"] == ref["class"] == "FSDPTiedLM"
    assert all(g is None for g in got["frozen_grads"]), "a frozen parameter got a gradient"
    assert got["between"] == ref["between"], "what stays unsharded between forward and backward"


@pytest.mark.parametrize("case,between", [("fp32", [True, False]), ("no_reshard", [False, True]),
                                          ("int_reshard", [True, False])])
def test_reshard_after_forward_decides_what_stays_unsharded(case, between):
    """Blocks reshard after forward by default, the root does not (None); False keeps a block unsharded for its
    backward; as ints, the mesh size means True and 1 means False."""
    assert results("fsdp_lab", 2)[case]["between"] == between


ONE_PROCESS_PAIRS = ([(n, c) for n in (1, 2) for c in FP32 if c not in FOUR_ONLY]
                     + [(4, c) for c in FP32 if c in AT_FOUR])


@pytest.mark.parametrize("world_size,case", ONE_PROCESS_PAIRS, ids=[f"{c}-{n}ranks" for n, c in ONE_PROCESS_PAIRS])
def test_matches_one_process(world_size, case):
    ref, got = results("plain", 1)[case], results("fsdp_lab", world_size)[case]
    compare(got, ref, FP32_TOL, f"{case} on {world_size} ranks against one process")


@pytest.mark.parametrize("rank", [0, 3])
def test_group_reshard_keeps_the_groups_slice_after_forward(rank):
    """reshard_after_forward=2 on 4 ranks: between forward and backward no unsharded buffer is allocated, and each
    module holds, on every rank, what torch holds: half (1/k) of its padded unsharded parameters, each parameter's
    dim 0 padded to a multiple of 4."""
    ref = every_rank("torch", 4)[rank]["group_reshard"]["held"]
    got = dict(every_rank("fsdp_lab", 4)[rank]["group_reshard"]["held"])
    assert got.pop("unsharded") == 0, "an unsharded buffer is still allocated after forward"
    assert got == ref
    params = results("plain", 1)["group_reshard"]["params"]
    for module, held in got.items():
        own = [v for k, v in params.items() if k.startswith(f"{module}.")] if module != "<root>" else \
            [params[k] for k in ("embed.weight", "norm.weight", "norm.bias")]
        expected = sum(math.ceil(p.shape[0] / 4) * 4 * p[0].numel() for p in own) * 4 // 2
        assert held == expected, (module, held, expected)


def test_group_reshard_regathers_within_the_group_and_the_trace_names_it():
    """Each unit's forward free keeps its pair's shards and names the pair; its backward re-gather runs within
    that pair: it receives the other member's half (= what this rank holds), where a mesh-wide gather of 4
    receives three quarters of the unsharded bytes."""
    for rank, out in enumerate(every_rank("fsdp_lab", 4)):
        got = out["group_reshard"]
        pair = [0, 1] if rank < 2 else [2, 3]
        units = {"<root>", "layers.0", "layers.1", "layers.2"}
        assert got["frees"] == dict.fromkeys(units, pair), (rank, got["frees"])
        assert set(got["regathers"]) == units
        for unit, (group, received) in got["regathers"].items():
            assert group == pair and received == got["held"][unit], (rank, unit, group, received)
        refused = got["shard1_refused"]  # with a parameter on Shard(1): refused by name
        assert refused is not None and "reshard_after_forward=2" in refused and "'weight'" in refused, refused


@pytest.fixture(scope="module")
def observed():
    return {front_end: run_on_ranks(trace_and_memory, 2, front_end, timeout_s=300)
            for front_end in ("fsdp1", "fully_shard")}


def test_a_trace_alone_gives_the_potluck_the_unit_tables_exact_sizes(observed):
    """A live run's events reach the potluck without a unit table: its gathers carry each unit's sizes, so the
    potluck shows exact sizes (no "unit sizes derived from memory deltas" warning), the unit table's own."""
    for front_end, per_rank in observed.items():
        for sizes in (r["sizes"] for r in per_rank):
            assert sizes["exact"] and sizes["traced"] == sizes["table"], (front_end, sizes)


def test_trace_of_fully_shard_has_fsdp1s_event_kinds_per_unit(observed):
    """trace.record takes the root of a fully_shard model as it takes an FSDP model: with the same units (each
    block, then the root), every unit goes through the same beats in the same order."""
    for fsdp1, fully in zip(observed["fsdp1"], observed["fully_shard"]):
        assert fully["kinds"] == fsdp1["kinds"]
        assert set(fully["kinds"]) == {"<root>", "layers.0", "layers.1", "layers.2"}


def test_memory_report_of_fully_shard_counts_the_local_shards(observed):
    """memory_report of a fully_shard model, per rank: parameter shards are the DTensors' local tensors (rank 1
    holds fewer rows of the uneven layers), gradient shards the reduce-scatter outputs they are views of (padding
    included), optimizer state the local tensors of AdamW's DTensor state; the tracer's last event saw the same."""
    by_rank = observed["fully_shard"]
    for out in by_rank:
        report = out["report"]
        assert report["params_sharded"] == out["local_shard_bytes"] > 0
        assert report["grads_sharded"] == out["grad_storage_bytes"] >= out["local_grad_bytes"] > 0
        assert report["optimizer_state"] == out["optimizer_bytes"] > 0
        assert report["params_unsharded"] == report["grads_unsharded"] == 0
        assert out["last_mem"] == report
    assert by_rank[0]["local_shard_bytes"] > by_rank[1]["local_shard_bytes"], "9 rows on 2 ranks: 5 and 4"


def test_bf16_stays_near_one_process():
    ref, got = results("plain", 1)["fp32"], results("fsdp_lab", 2)["bf16"]
    assert max_diff(got["losses"], ref["losses"]) < 0.05, (got["losses"], ref["losses"])


def test_parameters_are_dtensors_and_tied_weight_stays_tied():
    got = results("fsdp_lab", 2)["fp32"]
    assert all(got["dtensor"]) and got["dtensor"] == results("torch", 2)["fp32"]["dtensor"]
    assert got["tied"], "head.weight and embed.weight must stay one parameter"
    assert "head.weight" not in got["params"], "a tied parameter is listed once, as in the plain model"


def test_fsdp_module_methods_behave_as_torchs():
    ref, got = results("torch", 2)["methods"], results("fsdp_lab", 2)["methods"]
    assert got["unsharded_is_dtensor"] is False and got["unsharded_shape"] == (11, 7)
    assert got["resharded_is_dtensor"] is True and got["async_unsharded_is_dtensor"] is False
    for key in ("unsharded_is_dtensor", "unsharded_shape", "resharded_is_dtensor", "async_unsharded_is_dtensor",
                "generated"):
        assert got[key] == ref[key], key
    assert got["generated"] == results("plain", 1)["methods"]["generated"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_init_allocates_only_shards(world_size):
    ref, got = results("torch", world_size)["meta"], results("fsdp_lab", world_size)["meta"]
    assert got["local_numel"] == ref["local_numel"]
    total = sum(p.numel() for p in got["params"].values())
    assert got["local_numel"] < total / world_size + 4 * 16, (got["local_numel"], total)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    return {lib: run_on_ranks(checkpoint_round_trips, 2, lib, str(folder), timeout_s=600)[0]
            for lib in ("torch", "fsdp_lab")}


def test_state_dict_is_sharded_without_communication(checkpoints):
    ref, got = checkpoints["torch"], checkpoints["fsdp_lab"]
    assert got["keys"] == ref["keys"]
    assert got["sharded"] == ref["sharded"]
    assert {kind for kind, _shape in got["sharded"].values()} == {"DTensor"}


def test_dcp_and_get_state_dict_round_trips_continue_exactly(checkpoints):
    got = checkpoints["fsdp_lab"]
    assert got["from_dcp"] == got["continued"], "DCP save/load must continue exactly"
    assert got["from_full"] == got["continued"], "a full state dict loaded with set_state_dict must continue exactly"
    assert max_diff(got["continued"], checkpoints["torch"]["continued"]) <= TORCH_TOL
    assert got["others_empty"] and got["full_plain"]


def test_full_state_dict_has_plain_names_and_values(checkpoints):
    got, ref = checkpoints["fsdp_lab"]["full"], checkpoints["torch"]["full"]
    assert list(got) == list(ref)
    assert all(v.device.type == "cpu" for v in got.values())
    assert max((got[k] - ref[k]).abs().max().item() for k in got) <= TORCH_TOL


@pytest.fixture(scope="module")
def broadcast_loaded():
    return {"torch": run_on_ranks(broadcast_loads, 2, "torch", timeout_s=300),
            "fsdp_lab": run_on_ranks(broadcast_loads, 2, "fsdp_lab", timeout_s=300),
            "plain": broadcast_loads(0, 1, "plain")}


@pytest.mark.parametrize("variant", ["empty", "meta_dict", "meta_model"])
def test_broadcast_from_rank0_loads_rank0s_weights_on_every_rank(broadcast_loaded, variant):
    """Only rank 0 holds the full state dict; set_model_state_dict(..., broadcast_from_rank0=True) gives every
    rank its shards of exactly those weights, and each trains them as torch's fully_shard does (and as one
    process trained from the same weights)."""
    plain = broadcast_loaded["plain"][variant]
    for rank, (got, ref) in enumerate(zip(broadcast_loaded["fsdp_lab"], broadcast_loaded["torch"])):
        got, ref = got[variant], ref[variant]
        assert got["loaded_diff"] == 0.0, f"rank {rank} did not load rank 0's weights: {got['loaded_diff']}"
        for key in ("tied", "count", "devices"):  # torch's assign=True load of a meta model unties head.weight
            assert got[key] == ref[key], (rank, key, got[key], ref[key])
        compare(got, ref, TORCH_TOL, f"{variant} on rank {rank}")
        shared = {k: got["params"][k] for k in plain["params"]}  # an untied head.weight trains nothing
        compare({**got, "params": shared}, plain, FP32_TOL, f"{variant} on rank {rank} against one process")


def test_api_shape_and_refusals():
    out = run_on_ranks(api_checks, 1, timeout_s=300)[0]
    assert out["returned_same"] and out["isinstance"]
    assert out["class"] == "FSDPLinear" and out["mro"] == ["FSDPLinear", "FSDPModule", "Linear"]
    assert out["slice_class"] == "Sequential", "building an FSDP<Cls> directly builds the plain class"
    assert out["offload_default_ok"] and out["cpu_offload_ok"]
    for key, words in (("again", "already applied"), ("cpu_offload", "offload_policy='cpu' should be"),
                       ("placement_replicate", "shard_placement_fn returned Replicate() for parameter 'weight'"),
                       ("placement_dim", "returned Shard(2) for parameter 'weight' of shape (2, 2)"),
                       ("placement_mesh", "ShardPlacementResult for parameter 'weight'"),
                       ("module_list", "a non-empty list of them"),
                       ("bad_int", "reshard_after_forward=3 should be a factor of the mesh size 1"),
                       ("bad_mp", "param_dtype"), ("tied_across", "tied"), ("positional", "positional")):
        assert out[key] is not None and words in out[key], (key, out[key])
    assert out["placement_fn_ok"] == (["S(1)"], ["S(0)"]), "shard_placement_fn is taken; None means Shard(0)"
    assert out["placement_mesh"].startswith("NotImplementedError"), out["placement_mesh"]
    assert out["ignored_kept"], "an ignored parameter stays the plain, unsharded one"
    assert out["seam_missing"] == {"FlatParam": [], "ParamGroup": []}, "both layouts provide the whole seam"
