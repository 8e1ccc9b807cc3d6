"""Chapter 06a's experiment: fsdp_lab's FSDP, fsdp_lab's fully_shard and torch's fully_shard on the same model
and batches, on 2 real ranks. What the chapter prints must hold here: equal losses, each layout's owners of
qkv.weight read off the runtime, copies only in the per-parameter layout, a sharded state dict with no
communication, and a fully_shard trace the potluck can replay."""
from __future__ import annotations

import pytest

from fsdp_lab.lessons.experiments.common import merge_events
from fsdp_lab.lessons.experiments.fsdp2 import FRONT_ENDS, compare_front_ends, script_diff
from fsdp_lab.lessons.widgets import PotluckLifecycle
from fsdp_lab.lessons.widgets.frames import frame, sizes_from_unit_table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks():
    return compare_front_ends(world_size=2, timeout_s=240)


def test_three_front_ends_give_the_same_losses(ranks):
    for r in ranks:
        losses = [r["front_ends"][name]["losses"] for name in FRONT_ENDS]
        assert losses[1] == losses[2], f"rank {r['rank']}: fsdp_lab fully_shard {losses[1]} != torch {losses[2]}"
        assert all(abs(a - b) < 1e-3 for a, b in zip(losses[0], losses[2])), losses


def test_owners_of_qkv_weight_follow_each_layout(ranks):
    flat = [r["front_ends"]["fsdp_lab FSDP"]["owned"] for r in ranks]
    assert (flat[0]["start"], flat[0]["stop"]) == (0, flat[0]["numel"]) and flat[1]["stop"] == flat[1]["start"]
    for name in ("fsdp_lab fully_shard", "torch fully_shard"):
        rows = [r["front_ends"][name]["owned"] for r in ranks]
        half = rows[0]["numel"] // 2
        assert [(o["start"], o["stop"]) for o in rows] == [(0, half), (half, 2 * half)], (name, rows)
    assert all(r["front_ends"][name]["owned"]["values_match"] for r in ranks for name in FRONT_ENDS)


def test_only_the_per_parameter_layout_copies(ranks):
    gathers = 5 * 2  # the root once and each of 2 blocks twice, for 2 steps
    for r in ranks:
        fe = r["front_ends"]
        assert fe["fsdp_lab FSDP"]["copy_calls"] == {"copy-in": 0, "copy-out": 0}
        assert fe["fsdp_lab fully_shard"]["copy_calls"] == {"copy-in": gathers, "copy-out": gathers}
        assert fe["torch fully_shard"]["copy_calls"]["copy-out"] == gathers
        assert fe["torch fully_shard"]["copy_calls"]["copy-in"] >= gathers


def test_fully_shard_state_dict_is_sharded_without_communication(ranks):
    for r in ranks:
        fe = r["front_ends"]
        assert fe["fsdp_lab FSDP"]["state_dict"]["collectives"] > 0  # FSDP1's default: a full state dict
        for name in ("fsdp_lab fully_shard", "torch fully_shard"):
            sd = fe[name]["state_dict"]
            assert sd["collectives"] == 0 and sd["type"] == "DTensor", (name, sd)
            assert sd["local_shape"] == (96, 64) and sd["global_shape"] == (192, 64)
        assert fe["fsdp_lab fully_shard"]["state_dict"]["keys"] == fe["torch fully_shard"]["state_dict"]["keys"]


def test_state_bytes_match_torch_and_the_tracer_counts_fully_shard(ranks):
    for r in ranks:
        fe = r["front_ends"]
        assert fe["fsdp_lab fully_shard"]["state_bytes"] == fe["torch fully_shard"]["state_bytes"]
        events = fe["fsdp_lab fully_shard"]["events"]
        ends = [e for e in events if e["event"] == "gather_end"]
        assert ends and all(e["mem"]["params_unsharded"] > 0 for e in ends)
        last = [e for e in events if e["event"] == "optimizer_step"][-1]["mem"]
        assert last["params_sharded"] == fe["fsdp_lab fully_shard"]["state_bytes"]["params"]
        assert last["optimizer_state"] == fe["fsdp_lab fully_shard"]["state_bytes"]["optimizer"]


@pytest.mark.parametrize("name", ["fsdp_lab FSDP", "fsdp_lab fully_shard"])
def test_the_potluck_replays_both_front_ends(ranks, name):
    fe = [r["front_ends"][name] for r in ranks]
    events = [e for e in merge_events([f["events"] for f in fe]) if e["step"] == 1]
    sizes = sizes_from_unit_table(fe[0]["units"], world_size=2)
    assert set(sizes.units) == {"<root>", "blocks.0", "blocks.1"}
    widget = PotluckLifecycle(events, sizes=sizes)
    assert widget.preview_html() and widget.slider.max == len(events) - 1
    tables = set()
    for i, e in enumerate(events):
        state = frame(events, i, sizes)
        tables |= set(state.household(e["rank"]).table)
    assert tables == {"<root>", "blocks.0", "blocks.1"}


def test_the_script_diff_is_the_migration():
    rows = script_diff()
    changed = {(a.strip(), b.strip()) for tag, a, b in rows if tag != "="}
    assert ("model.clip_grad_norm_(1.0)", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)") in changed
    assert any("fully_shard(model" in b for _a, b in changed)
    assert any("FSDP(model" in a for a, _b in changed)
    assert sum(tag == "=" for tag, _a, _b in rows) >= 8  # the training loop is the same
