"""The experiments behind chapters 06, 08 and 09: what the notebooks show must hold on every run.

One launch per experiment family (process start-up dominates on a 2-core CPU); the tiny preset and 2 steps.
"""
import pytest

from fsdp_lab.lessons.experiments.engineering import overlaps, run_engineering, spans
from fsdp_lab.lessons.experiments.granularity import WRAPPINGS, policy_for, units_picked
from fsdp_lab.training.models import GPT, PRESETS


def test_units_picked_by_each_wrapping_on_the_tiny_gpt():
    counts = {w: len(units_picked(w, "tiny")) for w in WRAPPINGS}
    assert counts == {"whole": 1, "block": 3, "sublayer": 5, "leaf": 13}
    for w in WRAPPINGS:
        rows = units_picked(w, "tiny")
        assert sum(n for _, n in rows) == 119_424, w  # every parameter in exactly one unit (tied weight once)
        assert rows[-1][0] == "<root>"
    leaf_names = [name for name, _ in units_picked("leaf", "tiny")]
    assert "lm_head" not in leaf_names and "wte" not in leaf_names  # the tied pair stays in the root
    assert [n for n, _ in units_picked("size:20000", "tiny")] == ["blocks.0.mlp", "blocks.1.mlp", "<root>"]


def test_unknown_wrapping_is_named():
    with pytest.raises(ValueError, match="unknown wrapping 'blocks'"):
        policy_for("blocks", GPT(PRESETS["tiny"]))


def _event(t, unit, event, phase="forward"):
    return {"t": t, "rank": 0, "step": 0, "unit": unit, "phase": phase, "event": event}


def test_spans_and_overlaps_from_events():
    events = [_event(0.000, "a", "gather_start"), _event(0.001, "a", "gather_end"),
              _event(0.0015, "b", "gather_start"),  # prefetch: b's gather issued before a computes
              _event(0.002, "a", "forward_start"), _event(0.004, "a", "forward_end"),
              _event(0.005, "b", "gather_end"), _event(0.006, "b", "forward_start"), _event(0.007, "b", "forward_end")]
    rows = spans(events)
    assert [(r["unit"], r["beat"]) for r in rows] == [("a", "gather"), ("a", "forward"), ("b", "gather"),
                                                      ("b", "forward")]
    assert rows[2]["start_ms"] == pytest.approx(1.5) and rows[2]["end_ms"] == pytest.approx(5.0)
    (ov,) = overlaps(rows)
    assert (ov["gathered"], ov["computing"], ov["beat"]) == ("b", "a", "gather")
    assert ov["ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no events for rank 1"):
        spans(events, rank=1)


@pytest.fixture(scope="module")
def engineering(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    return ckpt, run_engineering(world_size=2, checkpoint_dir=ckpt, preset="tiny", steps=2, timeout_s=240)


def test_granularity_trades_collectives_for_peak_memory(engineering):
    _, results = engineering
    for r in results:
        g = r["granularity"]
        units = [g[w]["units"] for w in WRAPPINGS]
        assert units == [1, 3, 5, 13]
        assert [g[w]["collectives"] for w in WRAPPINGS] == [3 * u - 1 for u in units]
        peaks = [g[w]["peak_unsharded"] for w in WRAPPINGS]
        assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
        assert all(g[w]["losses"] == g["block"]["losses"] for w in WRAPPINGS)


def test_prefetch_runs_issue_gathers_where_their_options_say(engineering):
    """Prefetch off: every gather is issued when its unit needs it. torch's defaults (BACKWARD_PRE): the
    re-gather of block 0 is issued when block 1's backward starts, and forward gathers on demand (on CPU the
    implicit forward prefetching of CUDA cannot show: a collective completes before the next unit is reached).
    forward_prefetch=True on top: block 1's gather is issued before block 0 computes. Each early issue costs one
    more block on the table and changes no number."""
    _, results = engineering
    for rank, r in enumerate(results):
        off, default, fwd = (r["prefetch"][k] for k in ("prefetch off", "torch defaults", "+ forward_prefetch"))

        def early(run):
            return {(o["beat"], o["gathered"], o["computing"]) for o in overlaps(spans(run["events"], rank=rank))}

        assert early(off) == set()
        assert ("regather", "blocks.0", "blocks.1") in early(default)
        assert not {o for o in early(default) if o[0] == "gather"}
        assert {("gather", "blocks.1", "blocks.0"), ("regather", "blocks.0", "blocks.1")} <= early(fwd)
        assert off["peak_unsharded"] < default["peak_unsharded"] <= fwd["peak_unsharded"]
        assert off["losses"] == default["losses"] == fwd["losses"]


def test_activation_checkpointing_keeps_less_and_computes_the_same(engineering):
    _, results = engineering
    for r in results:
        off, on = r["checkpointing"]["off"], r["checkpointing"]["on"]
        assert 0 < on["saved_bytes"][-1] < off["saved_bytes"][-1] / 2
        assert on["losses"] == off["losses"]


def test_checkpoint_round_trip_and_full_state_dict(engineering):
    ckpt, results = engineering
    assert sorted(p.name for p in ckpt.rglob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for c in (r["checkpoint"] for r in results):
        assert c["same_params"] and c["same_optim"] and c["loss_saved_model"] == c["loss_loaded_model"]
    full = results[0]["checkpoint"]["full_state_dict"]
    assert results[1]["checkpoint"]["full_state_dict"] == {}
    assert list(full) == list(GPT(PRESETS["tiny"]).state_dict())


def test_minifsdp_matches_real_collectives_on_two_ranks():
    import numpy as np

    from fsdp_lab.lessons.experiments.pydemo import gather_scatter_step
    from fsdp_lab.theory.minifsdp import MiniFSDP
    from fsdp_lab.training.launch import run_on_ranks

    ranks = run_on_ranks(gather_scatter_step, 2, "tiny", 0.1, timeout_s=120)
    mini = MiniFSDP.from_shards([r["shard"] for r in ranks], ranks[0]["numel"])
    assert ranks[0]["units"] == ["blocks.0", "blocks.1", "<root>"]
    for i in range(len(ranks[0]["units"])):
        np.testing.assert_array_equal(mini.gather_layer(i, keep_padding=True), ranks[0]["gathered"][i])
        slices = mini.reduce_scatter_grad(i, [r["grad"][i] for r in ranks])
        for r in range(2):
            np.testing.assert_allclose(slices[r], ranks[r]["grad_shard"][i], rtol=0, atol=1e-6)
        mini.sgd_step(i, slices, lr=0.1)
        np.testing.assert_allclose(mini.gather_layer(i, keep_padding=True), ranks[1]["gathered_after_step"][i],
                                   rtol=0, atol=1e-6)


def test_misconceptions_fsdp_vs_ddp_and_granularity():
    from fsdp_lab.lessons.experiments.misconceptions import run_misconceptions
    from fsdp_lab.theory import formulas

    results = run_misconceptions(world_size=2, preset="tiny", steps=2, wrappings=("whole", "leaf"), timeout_s=240)
    for r in results:
        fsdp, ddp = r["strategies"]["FULL_SHARD"], r["strategies"]["NO_SHARD"]
        assert max(abs(a - b) for a, b in zip(fsdp["losses"], ddp["losses"])) < 1e-5  # same math
        assert fsdp["calls"] == {"all_gather": 5, "reduce_scatter": 3} and ddp["calls"] == {"all_reduce": 3}
        assert 2 * fsdp["persistent_bytes"] < ddp["persistent_bytes"] * 1.01
        root_regather = formulas.c_gather(fsdp["root_padded_numel"], 2, dtype_bytes=4)
        full = formulas.comm_bytes_per_step("FULL_SHARD", fsdp["numel_padded_total"], 2, 4, 4)
        assert fsdp["bytes_sent"] == full - root_regather
        assert ddp["bytes_sent"] == formulas.comm_bytes_per_step("NO_SHARD", ddp["numel_padded_total"], 2, 4, 4)
        assert 1.3 < fsdp["bytes_sent"] / ddp["bytes_sent"] < 1.5
        g = r["granularity"]
        assert g["leaf"]["collectives"] > g["whole"]["collectives"]


def test_bf16_masters_lose_updates_that_fp32_masters_keep():
    from fsdp_lab.lessons.experiments.misconceptions import accumulate, master_precision

    assert accumulate(1e-3, 1000, 1.0) == {"float32": pytest.approx(2.0, abs=1e-3), "bfloat16": 1.0}
    runs = master_precision(lr=1e-4, steps=3)
    fp32, bf16 = runs["fp32 masters"], runs["bf16 masters"]
    assert bf16["frozen_by_kind"]["LayerNorm weights"] == 1.0 and fp32["frozen_by_kind"]["LayerNorm weights"] == 0.0
    assert bf16["frozen"][-1] > 0.3 > 0.05 > fp32["frozen"][-1]
