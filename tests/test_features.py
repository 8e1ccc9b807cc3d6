"""What real models have: odd sizes, tied weights, frozen+trainable in one unit, buffers, nested units, no_grad and
eval forwards, several forwards before one backward, no_sync accumulation and summon_full_params writes."""
from __future__ import annotations

import pytest
import torch
from ranks_features import no_grad_and_eval, no_sync_reference, no_sync_step, summon_writeback, train_outer

from fsdp_lab.runtime.core.unit import UnitState
from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def outer_reference():
    return train_outer(0, 1, "plain")


@pytest.mark.parametrize("strategy,world_size", [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("ZERO1", 4),
                                                 ("NO_SHARD", 2)])
def test_nested_frozen_tied_buffers_match_single_process(strategy, world_size, outer_reference):
    ref_losses, ref_params, _ = outer_reference
    losses, params, info = run_on_ranks(train_outer, world_size, strategy, timeout_s=120)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        assert torch.allclose(params[name], ref_params[name], atol=TOL), name
    assert set(info["states"]) == {UnitState.SHARDED}
    assert info["frozen_grads"] and all(g is None for g in info["frozen_grads"]), "frozen params got gradients"
    if strategy != "NO_SHARD" and strategy != "ZERO1":
        assert set(info["opt_numels"]) <= set(info["shard_numels"]), "optimizer state only for trainable shards"
    assert 2 in info["tied_aliases"], "the tied head/embedding is one slot with two names"
    assert "wrapped.0.scale" in info["buffers"]


def test_no_grad_and_eval_forward_reshard_everything_without_regather():
    after_no_grad, after_eval, regathers = run_on_ranks(no_grad_and_eval, 2, timeout_s=120)[0]
    assert set(after_no_grad.values()) == {UnitState.SHARDED}, after_no_grad
    assert set(after_eval.values()) == {UnitState.SHARDED}, after_eval
    assert regathers == []


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "ZERO1"])
def test_no_sync_accumulates_without_communication(strategy):
    ref = no_sync_reference()
    params, comm_in_no_sync = run_on_ranks(no_sync_step, 2, strategy, timeout_s=120)[0]
    assert comm_in_no_sync == 0 or strategy == "FULL_SHARD", comm_in_no_sync
    for name in ref:
        assert torch.allclose(params[name], ref[name], atol=TOL), name


def test_no_sync_full_shard_sends_only_gathers():
    """Under FULL_SHARD, no_sync still gathers parameters (they are sharded) but never reduces gradients."""
    _, comm = run_on_ranks(no_sync_step, 2, "FULL_SHARD", timeout_s=120)[0]
    _, comm_zero2 = run_on_ranks(no_sync_step, 2, "NO_SHARD", timeout_s=120)[0]
    assert comm > 0 and comm_zero2 == 0


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "ZERO1", "NO_SHARD"])
def test_summon_full_params_original_names_and_writeback(strategy):
    results = run_on_ranks(summon_writeback, 2, strategy, timeout_s=120)
    from fsdp_lab.training.models import build_gpt

    plain = build_gpt("tiny")
    assert sorted(results[0][0]) == sorted(n for n, _ in plain.named_parameters())
    for names, ln_weight, wte_row, _logits, states in results:
        assert torch.all(ln_weight == 2.0)
        assert torch.all(wte_row == 0.5)
        assert set(states) == {UnitState.SHARDED}
    with torch.no_grad():
        plain.blocks[0].ln1.weight.fill_(2.0)
        plain.wte.weight[0].fill_(0.5)
    from fsdp_lab.training.models import batch_for_step

    x, _ = batch_for_step(plain.cfg, 0, 2)
    expected = plain(x).detach()
    assert torch.allclose(torch.cat([results[0][3], results[1][3]]), expected, atol=1e-5)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "ZERO1", "NO_SHARD"])
def test_clip_grad_norm_uses_the_global_norm_across_shards(strategy):
    from ranks_features import clipped_gradients, clipped_reference

    max_norm = 0.1  # well below the tiny GPT's first gradient norm, so clipping really scales
    ref_norm, ref_params = clipped_reference(max_norm)
    assert ref_norm > max_norm
    for norm, params in run_on_ranks(clipped_gradients, 2, strategy, max_norm, timeout_s=120):
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
        for name in ref_params:
            assert torch.allclose(params[name], ref_params[name], atol=1e-6), name
