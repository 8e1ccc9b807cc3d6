"""Every entry of the bug zoo (fsdp_lab/lessons/zoo, chapter 09a) on 2 gloo ranks: the broken version shows its
symptom (a hang named by the collective log within seconds, a wrong number against one process, bytes measured),
and the chapter's fix passes the chapter's own check. The ranks' side is tests/ranks_bug_zoo.py; one run does
every entry, and each test reads its part."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ranks_bug_zoo import zoo

from fsdp_lab.lessons.zoo import ENTRIES, cite
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
    assert all(r["norm_wrong"].startswith("not yet: ") for r in ranks)



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


WRONG = {  # the words each check's "not yet" must say, on every rank unless a rank is named
    "uneven": "the epoch still hangs: rank 0 waits in all_gather",
    "moe": "the step still hangs",
    "norm": "a norm of this rank's shards only?",
    "sum": "FSDP's gradients are 16 times one process's",
    "init": "the full parameters are no rank's model",
    "opt": "the optimizer holds 4 parameter(s) that FSDP replaced",
    "buffer": "the step buffer reads 256 after 4 forwards from 256, not 260",
    "buffer_fp32": "keep the compute in bfloat16",
    "sampler": "the sampler was never told the epoch",
    "nosync": "as many as no_sync's",
    "root": "no lower than the root-only",
    "gen": "generate() raises RuntimeError",
    "tied": "torch's FSDP1: after one step head.weight - embed.weight is",
    "tied_untie": "the weight is no longer tied",
    "tied_root": "one unit, the whole model gathered at once",
    "lora": "torch's FSDP1 refuses it: ValueError: Must flatten tensors with uniform `requires_grad`",
    "lora_unfreeze": "torch's FSDP1: the frozen bases moved by",
}


@pytest.mark.parametrize("answer", sorted(WRONG))
def test_each_check_refuses_the_wrong_answer_learners_give(ranks, answer):
    for rank, out in enumerate(ranks):
        said = out["wrong"][answer]
        assert said.startswith("not yet: ") and "not written yet" not in said, (rank, said)
        if answer not in ("uneven",) or rank == 0:  # in the uneven epoch only rank 0 waits
            assert WRONG[answer] in said, (rank, said)


def test_the_save_and_state_dict_checks_name_the_rank_that_is_wrong(ranks):
    assert ranks[0]["wrong"]["save"].startswith("not yet: the save still hangs: rank 0 waits in all_gather #2")
    assert ranks[1]["wrong"]["save"].startswith("not yet: ")  # rank 1 saw no hang, but rank 0 did
    assert ranks[1]["wrong"]["sd"] == f"not yet: rank 1 holds {FULL:,} B; want 0 B"
    assert ranks[0]["wrong"]["sd"].startswith("not yet: ") and "not on rank(s) [1]" in ranks[0]["wrong"]["sd"]
