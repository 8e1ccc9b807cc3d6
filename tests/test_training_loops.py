"""Everyday training-loop patterns on 2 and 3 gloo ranks, each against the same loop in one process: eval mode for
the whole run, an evaluation forward under no_grad before a backward, inference_mode before training, a backward
that raises half-way and is caught, FSDP1's manual nested wrap, and use_orig_params=True with optimizer groups by
name (and clip_grad_norm_, summon_full_params, a sharded checkpoint and resume) under every strategy.

One process group per world size runs every pattern (spawning ranks is the slow part on a 2-core machine).
"""
from __future__ import annotations

import pytest
import torch
from ranks_loops import PATTERNS, reference, run_patterns, wrap_errors

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-5  # fp32 summation-order noise over a few AdamW steps
WORLD_SIZES = (2, 3)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def ranked(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"ckpt{request.param}")
    results = run_on_ranks(run_patterns, request.param, list(PATTERNS), str(directory), timeout_s=400)[0]
    return request.param, results


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in [*PATTERNS, "checkpoint_resume"]}


def max_differences(got, want) -> tuple[float, float]:
    """Largest absolute difference over the losses, and over every parameter (original names)."""
    losses, params, _ = got
    ref_losses, ref_params, _ = want
    assert len(losses) == len(ref_losses)
    assert sorted(params) == sorted(ref_params), sorted(set(params) ^ set(ref_params))
    return (max(abs(a - b) for a, b in zip(losses, ref_losses)),
            max((params[n] - ref_params[n]).abs().max().item() for n in ref_params))


def check_matches(name, ranked, references) -> dict:
    world_size, results = ranked
    assert not isinstance(results[name], str), f"{name} failed on {world_size} ranks:\n{results[name]}"
    loss_diff, param_diff = max_differences(results[name], references[name])
    print(f"{name} world {world_size}: max |loss difference| = {loss_diff:.3g}, "
          f"max |parameter difference| = {param_diff:.3g}")
    assert max(loss_diff, param_diff) <= TOL, \
        f"{name} on {world_size} ranks drifts {max(loss_diff, param_diff):.3g} from one process"
    facts = results[name][2]
    assert facts["clean"], f"{name}: units left unsharded after the run"
    return facts


def test_eval_mode_for_the_whole_run_trains(ranked, references):
    check_matches("eval_whole_run", ranked, references)


def test_no_grad_eval_forward_keeps_the_pending_backward(ranked, references):
    check_matches("no_grad_eval_before_backward", ranked, references)


def test_inference_mode_forward_before_training(ranked, references):
    check_matches("inference_mode_first", ranked, references)


def test_backward_that_raises_half_way_then_next_batch(ranked, references):
    facts = check_matches("failed_backward", ranked, references)
    assert "simulated out of memory" in facts["caught"]
    assert facts["left_unsharded"] > 0, "the failure should leave units unsharded until the next forward"


def test_forward_that_raises_half_way_then_next_batch(ranked, references):
    facts = check_matches("failed_forward", ranked, references)
    assert "simulated out of memory in forward" in facts["caught"]
    assert facts["left_unsharded"] > 0, "the failure should leave the block's unit gathered until the next forward"


@pytest.mark.parametrize("name", ["init_after_wrap", "init_after_wrap_orig_params"])
def test_apply_after_wrapping_initializes_the_full_parameters(name, ranked, references):
    check_matches(name, ranked, references)


@pytest.mark.parametrize("strategy,orig", [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("ZERO1", False),
                                           ("NO_SHARD", True)])
def test_state_dict_is_the_plain_models_and_loads_back(strategy, orig, ranked, references):
    """model.state_dict() as torch FSDP1 gives it by default: the unwrapped model's names, order and full shapes,
    on every rank; load_state_dict puts it back into a wrapped model."""
    name = f"state_dict_{strategy}_{orig}"
    facts = check_matches(name, ranked, references)
    plain = references[name][2]
    assert list(facts["shapes"].items()) == list(plain["shapes"].items())
    assert facts["plain_equal"], "the unwrapped model did not load model.state_dict() exactly"
    assert facts["same_on_every_rank"]
    world_size, _ = ranked
    assert facts["rank0_only"] == [len(facts["shapes"])] + [0] * (world_size - 1), facts["rank0_only"]
    assert facts["same_as_default"], "rank0_only/offload_to_cpu changed the values, or left them on the device"
    assert facts["default_after"], "the state_dict_type context did not restore the default"
    assert facts["units"] == 4 and facts["peak_units_gathered"] == 2, \
        f"state_dict() held {facts['peak_units_gathered']} units' masters at once, expected the root and one block"


def test_manual_nested_wrap_trains_every_block(ranked, references):
    facts = check_matches("nested_wrap", ranked, references)
    assert facts["units"] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert facts["optimizer_tensors"] == 4, "one flat shard per unit"
    assert facts["rewrap"] == [("FSDP", True), ("LoopNet", False)], "FSDP(model) nests it, as torch FSDP1 does"


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD"])
def test_use_orig_params_groups_by_name(strategy, ranked, references):
    world_size, _ = ranked
    name = f"orig_params_{strategy}"
    facts = check_matches(name, ranked, references)
    plain = references[name][2]
    assert facts["names"] == plain["names"], "original names, in the plain model's order"
    assert facts["levels"] == [2 if n.startswith("blocks.") else 1 for n in plain["names"]], \
        "torch FSDP1's names: one _fsdp_wrapped_module level per FSDP instance above the parameter"
    assert facts["group_sizes"] == plain["group_sizes"]
    assert facts["views_of_shard"] and facts["grads_views_of_shard_grad"]
    assert facts["same_objects_after_summon"], "summon_full_params must put the optimizer's parameters back"
    ref_params = references[name][1]
    assert facts["full_shapes"] == {n: tuple(p.shape) for n, p in ref_params.items()}
    local = facts["local_numels"]
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1"):
        assert sum(local.values()) < sum(p.numel() for p in ref_params.values()), "rank 0 holds only its part"
    else:
        assert local == {n: p.numel() for n, p in ref_params.items()}


def test_use_orig_params_sharded_checkpoint_resume(ranked, references):
    check_matches("checkpoint_resume", ranked, references)


def test_manual_nested_wrap_equals_the_policy_wrap_bit_for_bit(ranked):
    """Nested FSDP instances become the units the policy would pick, so every number is identical."""
    world_size, results = ranked
    for name in ("nested_wrap", "policy_wrap"):
        assert not isinstance(results[name], str), f"{name} failed on {world_size} ranks:\n{results[name]}"
    nested, policy = results["nested_wrap"], results["policy_wrap"]
    assert nested[2]["units"] == policy[2]["units"]
    assert nested[0] == policy[0]
    assert all(torch.equal(nested[1][n], policy[1][n]) for n in policy[1])


@pytest.fixture(scope="module")
def messages():
    return run_on_ranks(wrap_errors, 1, timeout_s=120)[0]


@pytest.mark.parametrize("key", ["bare_transformer_policy", "bare_torch_transformer_policy", "empty_partial"])
def test_bare_transformer_policy_shows_the_right_spelling(messages, key):
    msg = messages[key]
    # bare, as the article writes it: TypeError, as torch raises (its transformer_layer_cls is required)
    assert msg.startswith("ValueError" if key == "empty_partial" else "TypeError"), msg
    assert "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={" in msg, msg
    if key != "empty_partial":
        assert "transformer_layer_cls={LoopBlock}" in msg, msg


def test_unsupported_options_raise_naming_the_option(messages):
    for key in ("cpu_offload", "cpu_offload_bad"):  # offload with ZeRO-1's device replica; not a CPUOffload
        assert "cpu_offload" in messages[key] and messages[key].startswith("ValueError"), messages[key]
    assert messages["cpu_offload_off"] is None, "CPUOffload(offload_params=False) is what fsdp_lab does"
    assert "sharding_strategy" in messages["nested_other_strategy"]
    # the hand-nested inner FSDP is the outer model's instance of that unit, as in torch: calling it runs the unit
    assert messages["call_nested_inner"] is None, messages["call_nested_inner"]


@pytest.mark.parametrize("key,needle", [
    ("local_state_dict", "state_dict_type=LOCAL_STATE_DICT is not supported"),
    ("sharded_config", "does not go with FULL_STATE_DICT"),
    ("optim_config", "does not go with SHARDED_STATE_DICT"),
    ("assign", "assign=True is not supported"),
    ("no_fsdp_inside", "LoopNet contains no fsdp_lab.FSDP"),
])
def test_state_dict_options_we_do_not_have_raise_naming_them(messages, key, needle):
    assert messages[key] is not None and messages[key].startswith("ValueError") and needle in messages[key], \
        messages[key]
