"""FSDP1's instances, compared with torch FSDP1 on 2 and 4 gloo ranks (tests/ranks_fsdp1_instances.py): every
auto-wrapped or hand-wrapped unit is an FSDP instance in the module tree around its original submodule ([Note: one
FSDP instance per unit] in fsdp_lab/runtime/fsdp1/nesting.py), listed by FSDP.fsdp_modules in torch's order, with
torch's names for modules, parameters and state-dict keys; training through them equals torch's; and the walk
accelerate and Lightning do over them (`.module`, set_state_dict_type, summon_full_params(m, recurse=False))
sees what it sees in torch. On 2 ranks also: FSDP(FSDP(model)) given directly, an auto_wrap_policy over a module
that already holds FSDP (refused with torch's words), and state_dict() called on an inner instance.

[Note: the instances tolerance] 1e-6 on losses and parameters: the same units and the same collectives, but
torch's and fsdp_lab's flat buffers pad and reduce in their own order, so float32 sums may round differently in
the last bits.
"""
from __future__ import annotations

import functools

import pytest
import torch
from ranks_fsdp1_instances import run, run_gaps

from fsdp_lab.training.launch import run_on_ranks

CASES = ("policy", "orig", "deep", "manual", "manual_deep")
TOL = 1e-6  # [Note: the instances tolerance]
BF16_TOL = 1e-4  # the same, for a step under bf16 reduction: one bf16 rounding of a gradient, times lr 0.1


@functools.cache
def results(lib: str, world_size: int) -> dict:
    return run_on_ranks(run, world_size, lib, CASES, timeout_s=420)[0]


def both(world_size: int, case: str):
    return results("torch", world_size)[case], results("fsdp_lab", world_size)[case]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_instances_are_torchs(world_size, case):
    ref, got = both(world_size, case)
    for when in ("structure", "after_training"):
        for key, value in ref[when].items():
            assert got[when][key] == value, (when, key, got[when][key], value)
    s = got["structure"]
    assert s["all_fsdp"] and s["first_is_model"] and s["module_is_wrapped_module"]
    assert all(s["inner_modules_are_the_originals"]) and s["count"] == len(s["module_types"]) > 1
    assert s["root_only"] == [True] and s["holder_root_only"] == 1
    assert s["is_root"] == [True] + [False] * (s["count"] - 1)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_training_through_the_instances_equals_torchs(world_size, case):
    ref, got = both(world_size, case)
    assert got["state_keys"] == ref["state_keys"]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TOL, (got["losses"], ref["losses"])
    diff = {k: (got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]}
    assert max(diff.values()) <= TOL, diff


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_accelerate_style_walk_sees_what_torch_shows(world_size, case):
    ref, got = both(world_size, case)
    ref, got = ref["walk"], got["walk"]
    for key in ("types_after_set", "own_params", "inner_summoned", "inner_clip_raises", "inner_no_sync_raises",
                "type_inside"):
        assert got[key] == ref[key], (key, got[key], ref[key])
    assert max(abs(a - b) for a, b in zip(got["own_sums"], ref["own_sums"])) <= 1e-5, (got["own_sums"],
                                                                                       ref["own_sums"])
    assert got["inner_clip_raises"] == "RuntimeError" and got["inner_no_sync_raises"] == "RuntimeError"


@functools.cache
def gaps(lib: str) -> list:
    return run_on_ranks(run_gaps, 2, lib, timeout_s=300)


def test_fsdp_of_fsdp_nests_as_torch_does():
    """FSDP(FSDP(model)): torch takes it, the outer owning nothing of its own and the inner as its one unit."""
    for ref, got in zip(gaps("torch"), gaps("fsdp_lab")):
        ref, got = ref["double"], got["double"]
        for key in ("named_modules", "named_parameters", "is_root"):
            assert got[key] == ref[key], (key, got[key], ref[key])
        assert got["inner_is_the_given"] and ref["inner_is_the_given"]
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TOL, (got["losses"], ref["losses"])
        assert list(got["state"]) == list(ref["state"])
        diff = {k: (got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"]}
        assert max(diff.values()) <= TOL, diff


@pytest.mark.parametrize("case", ["double_with_policy", "prenested_with_policy"])
def test_policy_over_a_module_with_fsdp_applied_is_refused_as_in_torch(case):
    for ref, got in zip(gaps("torch"), gaps("fsdp_lab")):
        assert ref[case] is not None and got[case] is not None, (ref[case], got[case])
        assert got[case][:2] == ref[case][:2], (got[case][:2], ref[case][:2])
        assert "FSDP(module, auto_wrap_policy=...)" in got[case][2], got[case][2]


def inner_facts(world_size: int, what: str) -> list:
    """(torch's, fsdp_lab's) facts of each rank: from run_gaps on 2 ranks, from run on 4."""
    if world_size == 2:
        return [(ref[what], got[what]) for ref, got in zip(gaps("torch"), gaps("fsdp_lab"))]
    return [(results("torch", 4)[what], results("fsdp_lab", 4)[what])]


@pytest.mark.parametrize("world_size", [2, 4])
def test_inner_instance_state_dict_is_torchs(world_size):
    """state_dict() on an inner instance: its subtree's keys, relative to it, full or sharded as torch gives them
    (before a forward torch allows one such call per model; fsdp_lab gives the same dict every time)."""
    for ref, got in inner_facts(world_size, "inner_state_dicts"):
        assert set(ref) <= set(got), set(ref) - set(got)
        for key, want in ref.items():
            have = got[key]
            assert list(have) == list(want), (key, list(have), list(want))
            for name, (shape, piece) in want.items():
                assert have[name][0] == shape and have[name][1].shape == piece.shape, (key, name)
                assert (have[name][1] - piece).abs().max().item() <= TOL if piece.numel() else True, (key, name)
        for (when, label, name), state in got.items():  # the calls torch can make once: the same dict again
            if (when, label, name) not in ref:
                after = got[("after_step", label, name)]
                assert list(state) == list(after) and all(state[k][0] == after[k][0] for k in state)


@pytest.mark.parametrize("world_size", [2, 4])
def test_inner_instance_load_state_dict_is_torchs(world_size):
    """load_state_dict() on an inner instance, full and sharded, under bf16 parameters and buffers: the block takes
    the other model's values as torch's does, the rest of the model keeps its own, and the next loss is torch's.

    Buffers come back in their own dtype (float32), as torch's MixedPrecision documents ("buffers are saved in
    full precision except for LOCAL_STATE_DICT"). torch 2.13 does so for the buffers of wrapped blocks, but gives
    the root's own buffer (`offset`) in bfloat16 when the model has nested units; fsdp_lab keeps to the
    documented dtype there too."""
    for ref, got in inner_facts(world_size, "inner_loads"):
        for label in ("full", "sharded"):
            assert got[(label, "result")] == ref[(label, "result")], (label, got[(label, "result")])
            source, target, want = got[(label, "source")], got[(label, "target")], ref[(label, "target")]
            assert list(target) == list(want), (label, list(target), list(want))
            for key, (dtype, value) in target.items():
                assert dtype == "torch.float32", (label, key, dtype)
                if key != "offset":
                    assert dtype == want[key][0], (label, key, dtype, want[key][0])
                assert (value - want[key][1]).abs().max().item() <= BF16_TOL, (label, key)
                if key.startswith("layers.1."):
                    assert torch.equal(value, source[key][1]), (label, key)
            assert not torch.equal(target["layers.0.up.weight"][1], source["layers.0.up.weight"][1])
            assert abs(got[(label, "next_loss")] - ref[(label, "next_loss")]) <= TOL, label
