"""The host-side short cuts of the gather path hold what they promise and change no number (tests/ranks_gather_paths.py):
fully_shard's copy-in reads one master buffer where it can, and falls back to one piece per parameter when a local
tensor is swapped; each forward cuts the unsharded views once and its backward installs the same ones.
fsdp_lab's losses, evaluation outputs and final parameters equal torch fully_shard's to float noise."""
from __future__ import annotations

import functools

import pytest
from ranks_gather_paths import run

from fsdp_lab.training.launch import run_on_ranks

TORCH_TOL = 1e-6


@functools.cache
def ranks(lib: str, world_size: int) -> tuple:
    return tuple(run_on_ranks(run, world_size, lib, timeout_s=300))


@pytest.mark.parametrize("world_size", [1, 2])
def test_master_buffer_path_where_the_layout_allows_and_fallback_after_a_swap(world_size):
    for r in ranks("fsdp_lab", world_size):
        # The head's 9 rows in blocks of 5: rank 1 of 2 holds 4 and a padding row: one piece per parameter there
        even = world_size == 1 or r["rank"] == 0
        assert r["fast_before"] == {"blocks.0": True, "blocks.1": True, "<root>": even}, r["fast_before"]
        assert r["locals_share_one_buffer"] and r["locals_at_offset_0"]
        assert r["fast_after"] == {"blocks.0": True, "blocks.1": False, "<root>": even}, r["fast_after"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_forward_cuts_views_and_its_backward_reuses_them(world_size):
    for r in ranks("fsdp_lab", world_size):
        assert r["views"] == {"forwards": 6, "backwards": 6, "backward_reuses_forward": True,
                              "fresh_each_forward": True}, r["views"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_numbers_equal_torch_fully_shard(world_size):
    for ours, theirs in zip(ranks("fsdp_lab", world_size), ranks("torch", world_size)):
        for key in ("losses", "evals"):
            diff = max(abs(a - b) for a, b in zip(ours[key], theirs[key]))
            assert len(ours[key]) == len(theirs[key]) and diff <= TORCH_TOL, (key, ours[key], theirs[key])
        for name, value in theirs["params"].items():
            diff = (ours["params"][name] - value).abs().max().item()
            assert diff <= TORCH_TOL, (name, diff)
