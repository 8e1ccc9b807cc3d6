"""The exercise checks (fsdp_lab.lessons.live.checks) on a real 2-rank run: a right answer passes, and each usual
wrong answer is told what it is, not only that it is wrong."""
from __future__ import annotations

import pytest

from fsdp_lab.training.launch import run_on_ranks
from ranks_live_checks import say_everything, say_to_other_models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def said():
    return run_on_ranks(say_everything, 2, timeout_s=180)


def test_right_answers_pass_on_both_ranks(said):
    for rank, out in enumerate(said):
        for check, verdicts in out.items():
            if "right" in verdicts:
                assert verdicts["right"].startswith("ok: "), (rank, check, verdicts["right"])


def test_bytes_per_rank_names_what_the_formula_misses(said):
    state = said[0]["state"]
    assert "the whole model's state: each of the 2 ranks keeps only 1/2" in state["not divided"]
    assert "the parameters only" in state["params only"]
    assert "AdamW's two moments are missing" in state["no adam"]
    assert "the gradients are missing" in state["no grads"]
    assert all(v.startswith("not yet: ") for k, v in state.items() if k != "right")


def test_shard_range_names_the_unit_and_the_real_chunk(said):
    wrong = said[1]["shard"]["wrong"]
    assert wrong.startswith("not yet: unit blocks.0 (49,408 elements on 2 ranks): you say rank 1 holds")
    assert "its shard is [24,704, 49,408)" in wrong and "every chunk has padded_size / n" in wrong


def test_beat_order_names_the_first_beat_that_differs(said):
    wrong = said[0]["beats"]["wrong"]
    assert "beat 3 of step 0: you say gather:blocks.1, rank 0's trace has free:blocks.0" in wrong


def test_the_mixed_precision_check_says_which_dtype_is_off(said):
    mp = said[0]["mp"]
    assert mp["none"] == "not yet: no mixed_precision was passed: the all-gather carries float32, 4 B per element"
    assert "gradients are reduced in torch.bfloat16, not torch.float32" in mp["bf16 reduce"]


def test_after_forward_and_granularity_and_reduce_scatter_explain_the_mistake(said):
    out = said[0]
    assert "that is a shard: the gathered copy is the whole unit" in out["after_forward"]["shard"]
    assert "one unit holds the whole model" in out["units"]["none"]
    assert out["units"]["size"].startswith("not yet: the units are blocks.0.attn, blocks.1.attn, <root>, not one")
    assert "that is the sum of the ranks' chunks: divide by world_size=2" in out["rs"]["sum"]
    assert "that is your own gradient's slice" in out["rs"]["own"]
    assert "differ at step 1: 0.500000 against 0.600000" in out["losses"]["wrong"]
    assert out["ratio"]["inverted"].startswith("not yet: that is NO_SHARD over FULL_SHARD")


def test_the_live_message_is_the_exercise_message(said):
    """One implementation: the live shard_range check on rank 1's model and the terminal exercise's core on the
    runtime's padding (course/exercises/ex02_sharding.py) say the same words for the same mistake."""
    from fsdp_lab.lessons.live.checks import chunks_of, shard_range_of

    def unpadded(numel, n, r):
        return r * (numel // n), (r + 1) * (numel // n) - 1

    chunks = [c for c in chunks_of("blocks.0", 49_408, 2) if c.rank == 1]
    assert said[1]["shard"]["wrong"] == str(shard_range_of(unpadded, chunks))


def test_reduce_scatter_check_pads_as_the_runtime_does():
    """5 elements on 2 ranks: each rank keeps 3 (one zero of padding on rank 1); the check knows the padding."""
    import torch

    from fsdp_lab.lessons.live.checks import reduce_scatter_mean

    grads = [torch.arange(5.0), torch.arange(5.0) * 3]
    mean = torch.cat([(grads[0] + grads[1]) / 2, torch.zeros(1)])
    assert reduce_scatter_mean(mean[3:], grads, 1).ok
    assert "each rank keeps 1/2 (5 padded to 6): 3" in str(reduce_scatter_mean(mean[2:], grads, 1))
    assert "that is the sum of the ranks' chunks" in str(reduce_scatter_mean(mean[3:] * 2, grads, 1))


@pytest.fixture(scope="module")
def told():
    return run_on_ranks(say_to_other_models, 2, timeout_s=180)


CHECKS_OF_A_MODEL = ("state_bytes", "shard_range", "mixed_precision", "gathered_after_forward", "wrapped_units",
                     "dim0_rows")


@pytest.mark.parametrize("check", CHECKS_OF_A_MODEL)
def test_a_check_given_a_plain_model_or_the_other_front_end_says_what_it_got(told, check):
    for rank, out in enumerate(told):
        plain = out[check, "plain"]
        assert plain.startswith("not yet: ") and "a plain GPT (not wrapped by fsdp_lab)" in plain, (rank, plain)
        other, wants = ("FSDP", "fully_shard") if check == "dim0_rows" else ("fully_shard", "FSDP(...)")
        if check == "state_bytes":  # reads either front end's memory: a fully_shard model is a right one
            assert not out[check, other].startswith("raised"), out[check, other]
            continue
        said = out[check, other]
        got = "an FSDP-wrapped GPT" if other == "FSDP" else "a fully_shard model (FSDPGPT)"
        assert said.startswith(f"not yet: {check} reads a model wrapped by {wants}; this is {got}"), (rank, said)
    assert all(out["dim0_rows", "fully_shard"].startswith("ok: ") for out in told)
