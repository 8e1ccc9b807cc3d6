"""A sharded FSDP1 checkpoint of model and optimizer, written as torch's documentation writes it
(SHARDED_STATE_DICT, FSDP.optim_state_dict, torch.distributed.checkpoint), saved on 2 gloo ranks and resumed on 4
through `load_sharded_optimizer_state_dict` and `FSDP.optim_state_dict_to_load`
(tests/ranks_fsdp1_resharded_optim.py),
with torch's FSDP1 and with fsdp_lab's.

Tolerances: the state loaded on 4 ranks is the state saved on 2, bit for bit (a checkpoint moves values, it does
not compute them). Against torch, 1e-6: the same steps over the same values. Against an uninterrupted run on 4
ranks, 1e-5: the first two steps ran on 2 ranks there, whose gradient sums add the batch in another order.
"""
from __future__ import annotations

import pytest
from ranks_fsdp1_resharded_optim import load, save, straight

from fsdp_lab.training.launch import run_on_ranks

TORCH_TOL = 1e-6
ORDER_TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {}
    for lib in ("torch", "fsdp_lab"):
        folder = str(tmp_path_factory.mktemp(f"sharded_{lib}"))
        out[lib] = {"save": run_on_ranks(save, 2, lib, folder, timeout_s=300),
                    "load": run_on_ranks(load, 4, lib, folder, timeout_s=300),
                    "straight": run_on_ranks(straight, 4, lib, timeout_s=300)}
    return out


def biggest_gap(a: dict, b: dict) -> float:
    """max |a - b| over the params and the optimizer state of two `_full` dicts (same names required)."""
    assert sorted(a["params"]) == sorted(b["params"]) and sorted(a["optim"]) == sorted(b["optim"])
    gaps = [(a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"]]
    for name, state in a["optim"].items():
        assert sorted(state) == sorted(b["optim"][name]), name
        gaps += [(value - b["optim"][name][key]).abs().max().item() for key, value in state.items()]
    return max(gaps)


def test_state_saved_on_two_ranks_loads_on_four_bit_for_bit(runs):
    for lib in ("torch", "fsdp_lab"):
        saved = runs[lib]["save"][0]
        for rank, got in enumerate(runs[lib]["load"]):
            assert biggest_gap(got["loaded"], saved) == 0.0, (lib, rank)


def test_the_resumed_run_continues_as_torch_does(runs):
    ref, got = runs["torch"], runs["fsdp_lab"]
    assert max(abs(a - b) for a, b in zip(got["save"][0]["losses"], ref["save"][0]["losses"])) <= TORCH_TOL
    assert biggest_gap(got["load"][0]["loaded"], ref["load"][0]["loaded"]) <= TORCH_TOL
    resumed, torch_resumed = got["load"][0]["losses"], ref["load"][0]["losses"]
    assert len(resumed) == 2 and max(abs(a - b) for a, b in zip(resumed, torch_resumed)) <= TORCH_TOL, \
        (resumed, torch_resumed)
    assert biggest_gap(got["load"][0], ref["load"][0]) <= TORCH_TOL


def test_the_resumed_run_continues_as_an_uninterrupted_one(runs):
    for lib in ("torch", "fsdp_lab"):
        whole = runs[lib]["straight"][0]
        parts = runs[lib]["save"][0]["losses"] + runs[lib]["load"][0]["losses"]
        assert max(abs(a - b) for a, b in zip(parts, whole["losses"])) <= ORDER_TOL, (lib, parts, whole["losses"])
        assert biggest_gap(runs[lib]["load"][0], whole) <= ORDER_TOL, lib
