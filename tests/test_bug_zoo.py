"""Every entry of the bug zoo (fsdp_lab/lessons/zoo, chapter 09a) on 2 gloo ranks: the broken version shows its
symptom (a hang named by the collective log within seconds, a wrong number against one process, bytes measured),
and the chapter's fix passes the chapter's own check. The ranks' side is tests/ranks_bug_zoo.py; one run does
every entry, and each test reads its part."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ranks_bug_zoo import WRONG_ANSWERS, zoo

from fsdp_lab.lessons.zoo import ENTRIES, checks, cite
from fsdp_lab.lessons.zoo.common import HANG_TIMEOUT_S
from fsdp_lab.lessons.zoo.memory import FULL_BYTES
from fsdp_lab.training.launch import run_on_ranks

FULL = FULL_BYTES
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(zoo, 2, timeout_s=240, collective_timeout_s=60, threads_per_rank=1)


def ok_on_both(ranks, key):
    for rank, out in enumerate(ranks):
        assert out[key].startswith("ok: "), (rank, out[key])


def test_every_entry_cites_a_public_report():
    assert len(ENTRIES) >= 15
    for entry, (what, ref, url) in ENTRIES.items():
        repo, number = ref.split("#")
        assert url == f"https://github.com/{repo}/{'pull' if '/pull/' in url else 'issues'}/{number}", entry
        assert ref in cite(entry) and url in cite(entry)


def test_the_opening_list_is_in_the_chapters_order():
    """Entry N of ENTRIES (the chapter's opening list) is section N of 09a: that section cites its report."""
    cells = json.loads((REPO / "notebooks" / "09a-bug-zoo.ipynb").read_text())["cells"]
    sections, number = {}, None
    for cell in cells:
        if re.fullmatch(r"zoo-\d+", cell.get("id", "")):
            number = int(cell["id"].split("-")[1])
        if number is not None:
            sections[number] = sections.get(number, "") + "".join(cell["source"])
    assert sorted(sections) == list(range(1, len(ENTRIES) + 1)), sorted(sections)
    for number, (entry, (what, ref, url)) in enumerate(ENTRIES.items(), 1):
        assert ref in sections[number], (number, entry, ref)


def test_uneven_batches_hang_is_named_within_seconds_and_the_trimmed_epoch_ends(ranks):
    (steps0, report), took = ranks[0]["uneven_broken"], ranks[0]["uneven_s"]
    assert steps0 == 0 and report.startswith("rank 0 waits in all_gather #14 (0, forward), which rank 1 never "
                                             "entered: its last was reduce_scatter #13 (0, backward)"), report
    assert ranks[1]["uneven_broken"] == (2, "")
    assert took < 3 * 2 * 2 + HANG_TIMEOUT_S + 5, took  # three steps' build and run, the timeout, the report
    ok_on_both(ranks, "uneven_fixed")
    assert all("not written yet" in r["uneven_stub"] for r in ranks)


def test_a_save_on_rank_0_only_names_the_state_dict_gather(ranks):
    assert ranks[0]["save_broken"].startswith("rank 0 waits in all_gather #2 (0, state_dict), which rank 1 never "
                                              "entered: its last was all_gather #1 (root, init)"), ranks[0]["save_broken"]
    ok_on_both(ranks, "save_fixed")


def test_an_expert_skipped_on_one_rank_is_named_where_the_ranks_went_apart(ranks):
    for out in ranks:
        assert "the ranks first differ at #4: rank 0 all_gather #4 (experts.1, forward), rank 1 all_gather #4 " \
               "(experts.0, backward)" in out["moe_broken"], out["moe_broken"]
    ok_on_both(ranks, "moe_fixed")


def test_a_norm_of_local_shards_differs_by_rank_and_from_one_process(ranks):
    (local0, ref), (local1, _) = ranks[0]["norm_broken"], ranks[1]["norm_broken"]
    assert local0 != pytest.approx(local1) and local0 < ref and local1 < ref
    assert local0 ** 2 + local1 ** 2 == pytest.approx(ref ** 2, rel=1e-5)  # the shards' squares add up
    ok_on_both(ranks, "norm_fixed")



def test_under_fsdp1_torchs_clip_grad_norm_sees_the_local_flat_shards_and_the_wrappers_sees_all(ranks):
    (local0, total0, ref), (local1, total1, _) = ranks[0]["norm_fsdp1"], ranks[1]["norm_fsdp1"]
    assert local0 != pytest.approx(local1) and local0 < ref and local1 < ref
    assert local0 ** 2 + local1 ** 2 == pytest.approx(ref ** 2, rel=1e-5)  # the flat shards' squares add up
    assert total0 == pytest.approx(ref, rel=1e-5) and total1 == pytest.approx(ref, rel=1e-5)


def test_a_summed_loss_gives_gradients_rows_times_columns_too_large(ranks):
    assert all(r["sum_broken"] == pytest.approx(16.0) for r in ranks)  # 4 rows × 4 columns per rank
    ok_on_both(ranks, "sum_fixed")


def test_a_different_init_per_rank_trains_no_ranks_model_until_synced(ranks):
    assert all(r["init_broken"] == "no rank's model (a mix of their shards)" for r in ranks)
    ok_on_both(ranks, "init_fixed")


def test_an_optimizer_built_before_wrapping_is_refused_and_the_right_order_matches_one_process(ranks):
    for out in ranks:
        assert "the optimizer holds 4 parameter(s) that FSDP replaced" in out["opt_broken"], out["opt_broken"]
    ok_on_both(ranks, "opt_fixed")


def test_a_bf16_buffer_stops_counting_at_256(ranks):
    assert all(r["buffer_broken"] == 256.0 for r in ranks)
    ok_on_both(ranks, "buffer_fixed")


def test_a_sampler_without_set_epoch_repeats_its_order(ranks):
    for out in ranks:
        first, second = out["sampler_broken"]
        assert first == second
    ok_on_both(ranks, "sampler_fixed")


def test_a_full_state_dict_is_the_whole_model_on_every_rank_and_rank0_only_keeps_one(ranks):
    assert [r["sd_broken"] for r in ranks] == [FULL, FULL]
    assert [r["sd_sharded"] for r in ranks] == [FULL // 2, FULL // 2]
    ok_on_both(ranks, "sd_fixed")


def test_no_sync_holds_full_gradients_between_micro_batches(ranks):
    assert [r["nosync_broken"] for r in ranks] == [FULL, FULL]
    ok_on_both(ranks, "nosync_fixed")
    assert f"{FULL // 2:,} B held" in ranks[0]["nosync_fixed"]


def test_wrapping_only_the_root_holds_the_whole_model_in_forward(ranks):
    assert [r["root_broken"] for r in ranks] == [FULL + FULL // 2] * 2  # the whole model, and the shard beside it
    ok_on_both(ranks, "root_fixed")
    assert f"forward peak {FULL // 2 + FULL // 4:,} B" in ranks[0]["root_fixed"]  # shards + one of four units


def test_generate_outside_forward_fails_until_registered(ranks):
    for out in ranks:
        assert "mixed torch.Tensor and DTensor" in out["gen_broken"], out["gen_broken"]
    ok_on_both(ranks, "gen_fixed")


def test_a_weight_tied_across_units_is_untied_by_torch_and_refused_here_and_one_unit_for_both_fixes_it(ranks):
    for out in ranks:
        torch_got, ours = out["tied_torch"], out["tied_ours"]
        assert torch_got["units"] == 5 and torch_got["untied"] > 1e-3 and torch_got["gap"] > 1e-3, torch_got
        assert ours["error"].startswith("ValueError: parameter 'embed.weight' (unit 'embed') is tied to "
                                        "'head.weight' (unit 'head')"), ours
        assert out["tied_fixed"].startswith("ok: head and embedding one weight in 3 units"), out["tied_fixed"]
        assert "not written yet" in out["tied_stub"]


def test_frozen_and_trainable_in_one_flat_unit_is_refused_by_torch_and_split_in_two_flats_here(ranks):
    for out in ranks:
        assert out["lora_torch"]["error"] == ("ValueError: Must flatten tensors with uniform `requires_grad` when "
                                              "`use_orig_params=False`"), out["lora_torch"]
        assert out["lora_ours"] == {"moved": 0.0, "gap": pytest.approx(0.0, abs=1e-6)}
        assert out["lora_flats"] == [("0._flat_param", True, 8), ("0._flat_param_frozen", False, 10),  # per rank:
                                     ("2._flat_param", True, 8), ("2._flat_param_frozen", False, 10)]  # halves of 16, 20
        assert "not written yet" in out["lora_stub"]
    ok_on_both(ranks, "lora_fixed")
    ok_on_both(ranks, "lora_fixed_units")


WRONG = {  # the words each check's "not yet" must say to each wrong answer: on every rank, or {rank: words}
    "uneven": {0: "the epoch still hangs: rank 0 waits in all_gather #14", 1: "different numbers of steps [0, 2]"},
    "uneven_padded": "batches that are not from the rank's data (rank 1: [2]): a padded batch is trained on like data",
    "save": {0: "the save still hangs: rank 0 waits in all_gather #2", 1: "rank 0: the save still hangs"},
    "save_module": {0: "the save still hangs: rank 0 waits in all_gather #2", 1: "rank 0: the save still hangs"},
    "save_sharded": "rank 0 got DTensors (0.weight, 0.bias, 2.weight, 2.bias): each rank's own shards",
    "moe": "the step still hangs",
    "moe_dummy": "the ranks first differ at #7: rank 0 reduce_scatter #7 (experts.1, backward), rank 1 all_gather",
    "moe_dense": "no hang, but the loss",
    "norm": "and the ranks disagree (0.321768, 0.735388): a norm of this rank's shards only?",
    "norm_summed": "the sum of the ranks' shard norms 0.321768 + 0.735388; one process 0.802702: norms do not add",
    "sum": "FSDP's gradients are 16 times one process's: a sum over this rank's 16 elements",
    "sum_world": "FSDP's gradients are 0.5 times one process's: FSDP already divides the ranks' sum by the 2 ranks",
    "init": "the full parameters are no rank's model",
    "init_broadcast": "every rank holds the same shard, rank 0's, copied after FSDP had sharded the parameters",
    "opt": "the optimizer holds 4 parameter(s) that FSDP replaced",
    "opt_fresh": "the optimizer holds 0 of the wrapped model's 2 parameter(s) and 4 tensor(s) it does not use",
    "buffer": "the step buffer reads 256 after 4 forwards from 256, not 260",
    "buffer_fp32": "keep the compute in bfloat16",
    "sampler": "the sampler was never told the epoch",
    "sampler_seeded": "the sampler was never told the epoch (set_epoch)",
    "sampler_once": "the sampler was told epoch(s) [0] for 2 epochs",
    "sd": {0: "not on rank(s) [1]; rank 1: rank 1 holds", 1: f"rank 1 holds {FULL:,} B; want 0 B: the whole model"},
    "sd_sharded": {0: f"rank 0 holds {FULL // 2:,} B; want {FULL:,} B: 1/2 of the model, this rank's own shards",
                   1: f"rank 1 holds {FULL // 2:,} B; want 0 B: 1/2 of the model"},
    "nosync": "as many as no_sync's",
    "nosync_last": "after the last micro-batch the parameters have no gradient: no backward ran outside no_sync",
    "root": "no lower than the root-only",
    "root_size": "one FSDP unit, so the forward gathers the whole model at once",
    "gen": "generate() raises RuntimeError",
    "gen_reshard": "it reads the root's parameters still sharded (DTensor)",
    "tied": "torch's FSDP1: after one step head.weight - embed.weight is",
    "tied_untie": "the weight is no longer tied",
    "tied_root": "one unit, the whole model gathered at once",
    "lora": "torch's FSDP1 refuses it: ValueError: Must flatten tensors with uniform `requires_grad`",
    "lora_unfreeze": "torch's FSDP1: the frozen bases moved by",
}


def _fingerprint(answer) -> tuple:
    """What a wrong answer does, as its code: bytecode, names and constants (nested code by its own fingerprint,
    the docstring left out), so the same function passed twice, or a copy of it under another name, is one."""
    def of(code):
        consts = tuple(of(c) if hasattr(c, "co_code") else c for c in code.co_consts if c != answer.__doc__)
        return code.co_code, code.co_names, consts
    return of(answer.__code__)


def test_every_check_is_tested_against_at_least_two_different_wrong_answers():
    zoo_checks = {name for name, fn in vars(checks).items()
                  if callable(fn) and hasattr(fn, "__wrapped__") and fn.__module__ == checks.__name__}
    assert len(zoo_checks) >= len(ENTRIES) and set(WRONG_ANSWERS) == zoo_checks, \
        sorted(zoo_checks ^ set(WRONG_ANSWERS))
    for name, answers in WRONG_ANSWERS.items():
        prints = [_fingerprint(answer) for answer in answers.values()]
        assert len(answers) >= 2 and len(set(prints)) == len(prints), (name, list(answers))
    labels = [label for answers in WRONG_ANSWERS.values() for label in answers]
    assert len(labels) == len(set(labels)) and set(labels) == set(WRONG), sorted(set(labels) ^ set(WRONG))


@pytest.mark.parametrize("answer", sorted(WRONG))
def test_each_check_refuses_the_wrong_answers_learners_give(ranks, answer):
    for rank, out in enumerate(ranks):
        said = out["wrong"][answer]
        assert said.startswith("not yet: ") and "not written yet" not in said, (rank, said)
        words = WRONG[answer] if isinstance(WRONG[answer], str) else WRONG[answer][rank]
        assert words in said, (rank, said)


def test_the_save_and_state_dict_checks_name_the_rank_that_is_wrong(ranks):
    assert ranks[0]["wrong"]["save"].startswith("not yet: the save still hangs: rank 0 waits in all_gather #2")
    assert ranks[1]["wrong"]["save"].startswith("not yet: ")  # rank 1 saw no hang, but rank 0 did, and it says so
    assert ranks[1]["wrong"]["save"].endswith(ranks[0]["wrong"]["save"][len("not yet: "):])
    assert ranks[1]["wrong"]["sd"] == f"not yet: rank 1 holds {FULL:,} B; want 0 B: the whole model, which only " \
                                      f"rank 0 should keep"
    assert ranks[0]["wrong"]["sd"].startswith("not yet: ") and "not on rank(s) [1]" in ranks[0]["wrong"]["sd"]
