"""Activation checkpointing composes with FSDP: same losses and parameters as without it, each block unit
gathered exactly twice per step (forward + one re-gather, no extra gather for the recomputation), fewer saved
activations, and either wrapping order works."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from ranks_overlap import STEPS, checkpoint_misuse, train_checkpointed

from fsdp_lab.runtime.features.activation_checkpointing import (apply_activation_checkpointing, is_checkpointed,
                                                                remove_activation_checkpointing)
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import Block, build_gpt


def is_block(module) -> bool:
    return isinstance(module, Block)


TOL = 1e-5


@pytest.fixture(scope="module")
def plain():
    return run_on_ranks(train_checkpointed, 2, "none", timeout_s=150)[0]


def _gathers_per_unit_and_step(events):
    return Counter((e["step"], e["unit"]) for e in events if e["event"] in ("gather_start", "regather_start"))


@pytest.mark.parametrize("order,prefetch,use_orig_params", [("after", False, False), ("before", False, False),
                                                             ("after", True, False), ("after", False, True),
                                                             ("before", True, True)])
def test_checkpointing_matches_and_gathers_twice(order, prefetch, use_orig_params, plain):
    """use_orig_params: the free after forward puts the sharded parameters back as the block's attributes, so
    the recomputation only sees the re-gathered weights because the pre-backward hook installs them again."""
    losses, params, events, saved = run_on_ranks(train_checkpointed, 2, order, prefetch, use_orig_params,
                                                 timeout_s=150)[0]
    ref_losses, ref_params, _, ref_saved = plain
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    for name, ref in ref_params.items():
        diff = (params[name] - ref).abs().max().item()
        assert diff <= TOL, f"{name}: differs by {diff} from training without checkpointing"
    counts = _gathers_per_unit_and_step(events)
    for step in range(STEPS):
        for block in ("blocks.0", "blocks.1"):
            assert counts[(step, block)] == 2, f"step {step} {block}: {counts[(step, block)]} gathers, expected 2"
        assert counts[(step, "<root>")] == 1, "the root stays gathered from forward to backward"
    recompute_regathers = [e for e in events if e["event"] == "regather_start" and e["phase"] == "forward"]
    assert not recompute_regathers
    assert saved < ref_saved, f"checkpointing saved {saved} elements, no fewer than without it ({ref_saved})"


def test_checkpointing_the_fsdp_wrapper_is_refused():
    msg = run_on_ranks(checkpoint_misuse, 1, timeout_s=120)[0]
    assert msg is not None and "FSDP wrapper" in msg and "<root>" in msg


def test_apply_is_idempotent_and_removable():
    model = build_gpt("tiny")
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    expected = model(x, x)
    assert apply_activation_checkpointing(model, check_fn=is_block) == ["blocks.0", "blocks.1"]
    again = apply_activation_checkpointing(model, check_fn=is_block)
    assert again == [], "a second call leaves checkpointed blocks alone"
    assert all(is_checkpointed(b) for b in model.blocks)
    loss = model(x, x)
    loss.backward()
    assert torch.allclose(loss, expected)
    assert model.blocks[0].mlp.fc.weight.grad is not None
    assert remove_activation_checkpointing(model) == ["blocks.0", "blocks.1"]
    assert not any(is_checkpointed(b) for b in model.blocks)
    with pytest.raises(ValueError, match="selected no module"):
        apply_activation_checkpointing(model, check_fn=lambda m: False)
    with pytest.raises(ValueError, match="check_fn must be a callable"):
        apply_activation_checkpointing(model, check_fn=42)
