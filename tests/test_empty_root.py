"""An FSDP1 root with no parameter of its own (every Linear auto-wrapped) summons, loads and trains again and
again as torch FSDP1 does, on 2 gloo ranks (tests/ranks_empty_root.py)."""
from __future__ import annotations

import functools

from ranks_empty_root import run

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-6


@functools.cache
def results(lib: str) -> list:
    return run_on_ranks(run, 2, lib, timeout_s=180)


def diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_repeated_summon_load_and_training_match_torch_fsdp1():
    for ref, got in zip(results("torch"), results("fsdp_lab")):
        for key in ("first", "second", "trained", "state", "loaded", "final"):
            assert diff(got[key], ref[key]) <= TOL, key
        for key in ("losses", "resumed", "continued"):
            assert max(abs(a - b) for a, b in zip(got[key], ref[key])) <= TOL, (key, got[key], ref[key])
        assert diff(got["loaded"], got["trained"]) == 0.0
        assert got["resumed"] == got["continued"]
