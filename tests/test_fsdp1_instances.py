"""FSDP1's instances, compared with torch FSDP1 on 2 and 4 gloo ranks (tests/ranks_fsdp1_instances.py): every
auto-wrapped or hand-wrapped unit is an FSDP instance in the module tree around its original submodule ([Note: one
FSDP instance per unit] in fsdp_lab/runtime/fsdp1/nesting.py), listed by FSDP.fsdp_modules in torch's order, with
torch's names for modules, parameters and state-dict keys; training through them equals torch's; and the walk
accelerate and Lightning do over them (`.module`, set_state_dict_type, summon_full_params(m, recurse=False))
sees what it sees in torch.

[Note: the instances tolerance] 1e-6 on losses and parameters: the same units and the same collectives, but
torch's and fsdp_lab's flat buffers pad and reduce in their own order, so float32 sums may round differently in
the last bits.
"""
from __future__ import annotations

import functools

import pytest
from ranks_fsdp1_instances import run

from fsdp_lab.training.launch import run_on_ranks

CASES = ("policy", "orig", "deep", "manual", "manual_deep")
TOL = 1e-6  # [Note: the instances tolerance]


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
