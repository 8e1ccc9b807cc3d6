"""Chapter 06c's "Your turn" check, checks.apply_order, against the solution, the stub of the learner's copy ("not
written yet") and the wrong orders a learner really types, on 4 gloo ranks (a 2 × 2 mesh;
tests/ranks_apply_order.py): [Note: reading the order off the model] in fsdp_lab/lessons/live/apply_order.py."""
from __future__ import annotations

import pytest
from ranks_apply_order import run_cases

from fsdp_lab.training.launch import run_on_ranks

pytestmark = pytest.mark.timeout(460)  # the module's one launch may take its 400 s on a loaded machine


@pytest.fixture(scope="module")
def cases() -> list:
    return run_on_ranks(run_cases, 4, timeout_s=400)


def _wrong(case, *words):
    ok, todo, message = case
    assert not ok and not todo, message
    for word in words:
        assert word in message, message


def test_the_solution_passes_eager_and_compiled_with_the_single_process_loss_on_every_rank(cases):
    for got in cases:
        for case, how in (("solution", "run eagerly"), ("solution_compiled", "compiled")):
            ok, todo, message = got[case]
            assert ok and not todo, message
            assert "(2, 2) mesh" in message and f"({how})" in message and "as one process" in message


def test_the_stub_is_not_written_yet(cases):
    for got in cases:
        ok, todo, message = got["stub"]
        assert not ok and todo and "not written yet" in message, message


def test_fully_shard_before_tensor_parallel_is_named(cases):
    for got in cases:
        _wrong(got["fsdp_before_tp"], "fully_shard ran before tensor parallel", "apply_tp comes first")
        _wrong(got["no_tp"], "sharded on 'dp' only")


def test_fully_shard_on_the_whole_mesh_is_named(cases):
    for got in cases:
        _wrong(got["whole_mesh"], "whole 2-D mesh", "mesh=mesh['dp']")


def test_an_unwrapped_root_is_named(cases):
    for got in cases:
        _wrong(got["no_root"], "the root is not wrapped", "fully_shard(model, mesh=mesh['dp'])")


def test_checkpointing_after_fully_shard_is_named(cases):
    for got in cases:
        _wrong(got["ac_after_fsdp"], "checkpoint_wrapper around the fully_shard module", "apply_ac goes before")
