"""fully_shard used wrongly is named at the user's own call (tests/ranks_fully_shard_misuse.py, 2 gloo ranks),
instead of failing later inside the runtime or training nothing."""
from __future__ import annotations

import functools

import pytest
from ranks_fully_shard_misuse import CASES, run_cases

from fsdp_lab.training.launch import run_on_ranks


@functools.cache
def every_rank() -> list:
    return run_on_ranks(run_cases, 2, tuple(CASES), timeout_s=300)


def results() -> dict:
    return every_rank()[0]


def test_fully_shard_of_a_block_after_its_root_is_refused_by_name():
    message = results()["root_first"]
    assert message.startswith("fully_shard(0): its parameters are already sharded by the earlier "
                              "fully_shard(<root>) (a Sequential)"), message
    assert "call fully_shard on the blocks first, then the root" in message


@pytest.mark.parametrize("case,call", [("fsdp_then_fully_shard", "fully_shard"),
                                       ("fully_shard_then_fsdp", "FSDP(...)")])
def test_mixing_fsdp_and_fully_shard_is_refused_at_the_second_wrap(case, call):
    message = results()[case]
    assert message.startswith(f"{call}: "), message
    assert "FSDP(...)" in message and "fully_shard" in message and "not both" in message, message


def test_an_optimizer_built_before_fully_shard_is_named_at_its_first_step():
    message = results()["stale_optimizer"]
    assert message.startswith("SGD.step(): the optimizer holds 4 parameter(s) that fully_shard replaced"), message
    assert "Build the optimizer after" in message


def test_meta_parameters_without_to_empty_are_named_at_the_first_forward():
    message = results()["meta_without_to_empty"]
    assert message.startswith("fully_shard: 4 parameter(s) are still on the meta device at the first forward "
                              "(first: '0.weight')"), message
    assert "model.to_empty(device=...)" in message and "reset_parameters" in message


def test_ranks_that_built_weights_of_one_size_but_other_shapes_are_named_at_the_first_forward():
    messages = [r["shapes_differ"] for r in every_rank()]
    assert messages[0] == ("ranks wrap different models: FSDP unit '1' has 'weight' of shape (16, 8) on rank 0 "
                           "but 'weight' of shape (8, 16) on rank 1; every rank must build the same model "
                           "(same config, same sizes) before wrapping"), messages[0]
    assert "of shape (8, 16) on rank 1 but 'weight' of shape (16, 8) on rank 0" in messages[1], messages[1]


def test_ranks_that_built_different_models_are_named_not_aborted():
    for rank, result in enumerate(every_rank()):
        assert result["models_differ"].startswith("ranks wrap different models: FSDP unit "), (rank, result)
