"""The widgets without a browser: frames against a real 2-rank trace, the slider driven from Python, the
planner's numbers against fsdp_lab.theory.formulas, and the live chart picking up lines as a JSONL file grows."""
import base64
import json
import shutil

import pytest

from fsdp_lab.lessons.widgets import (BEATS, LiveMemoryChart, MeasuredPoint, Planner, PotluckLifecycle, frame, sources,
                                      step_bytes_sent, unit_sizes)
from fsdp_lab.lessons.widgets.fmt import human_bytes
from fsdp_lab.lessons.widgets.planner import gb
from fsdp_lab.observe import trace
from fsdp_lab.theory import formulas, planner


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One real run (2 ranks, gloo, tiny GPT, 2 steps), started and followed by the live chart itself."""
    trace_dir = tmp_path_factory.mktemp("trace")
    chart = LiveMemoryChart.run(world_size=2, steps=2, preset="tiny", device="cpu", trace_dir=trace_dir,
                                timeout_s=150)
    run = chart.wait(timeout_s=180)
    return chart, run


@pytest.fixture(scope="module")
def run(live):
    return live[1]


def test_table_bytes_follow_the_runtime_memory_at_every_event(run):
    """Each household's table is exactly what its rank's memory record calls params_unsharded."""
    sizes = run.sizes
    for i, e in enumerate(run.events):
        h = frame(run.events, i, sizes).household(e["rank"])
        assert h.table_bytes == e["mem"].get("params_unsharded", 0), (i, e["event"], e["unit"], h.table)
        assert sum(h.fridge.values()) == e["mem"]["params_sharded"], (i, h.fridge)
        assert sum(h.grad_shards.values()) == e["mem"].get("grads_sharded", 0), (i, e["event"], h.grad_shards)


def test_gather_puts_the_unit_on_the_table_and_free_clears_it(run):
    sizes, checked = run.sizes, {"gather_end": 0, "regather_end": 0, "free": 0, "reduce_scatter": 0}
    units = {row["unit"]: row for row in run.ranks[0]["units"]}
    for i, e in enumerate(run.events):
        state = frame(run.events, i, sizes)
        h, unit = state.household(e["rank"]), e["unit"]
        if e["event"] in ("gather_end", "regather_end"):
            assert h.table[unit] == units[unit]["full_bytes"]
            assert state.beat.zh == ("聚合" if e["event"] == "gather_end" else "再聚合")
        elif e["event"] == "free":
            assert unit not in h.table and state.beat.zh == "释放"
        elif e["event"] == "reduce_scatter":
            assert h.grad_shards[unit] == units[unit]["shard_numel"] * 4 and state.beat.zh == "归约回分"
        elif e["event"] in ("forward_start", "backward_start"):
            assert h.computing == unit and state.beat.zh == "计算"
        if e["event"] in checked:
            checked[e["event"]] += 1
    # 2 ranks x 2 steps: 3 units gathered, 2 blocks re-gathered (the root stays), 3 reduce-scatters, 5 frees
    assert checked == {"gather_end": 12, "regather_end": 8, "reduce_scatter": 12, "free": 20}


def test_fridges_hold_the_shards_of_the_run(run):
    state = frame(run.events, len(run.events) - 1, run.sizes)
    for rank, result in enumerate(run.ranks):
        expected = {}
        for row in result["units"]:
            expected[row["unit"]] = expected.get(row["unit"], 0) + row["shard_numel"] * 4
        assert state.household(rank).fridge == expected


def test_sizes_derived_from_the_trace_alone_match_the_unit_table(run):
    traced = unit_sizes(run.events)  # the gathers carry each unit's sizes: exact, no warning
    assert traced.exact and traced.units == run.sizes.units
    older = [{k: v for k, v in e.items() if k != "unit_bytes"} for e in run.events]  # a trace without them
    derived = unit_sizes(older)
    assert not derived.exact
    assert derived.units == run.sizes.units


def test_step_bytes_sent_is_the_article_bill_less_the_root_regather(run):
    n, p = run.world_size, run.numel_padded_total
    root = run.sizes.units["<root>"]
    bill = step_bytes_sent(run.events, rank=0, step=1)
    assert bill["C_fwd"] == formulas.c_gather(p, n, dtype_bytes=4)
    assert bill["C_grad"] == formulas.c_gather(p, n, dtype_bytes=4)
    assert bill["C_bwd"] == bill["C_fwd"] - root.full_bytes * (n - 1) // n  # the root is not re-gathered
    assert bill["C_step"] == formulas.c_step_exact(p, n, dtype_bytes=4) - root.full_bytes * (n - 1) // n


def test_slider_and_play_drive_the_potluck(run):
    w = PotluckLifecycle.from_lifecycle_run(run, step=0)
    assert all(e["step"] == 0 for e in w.events) and w.slider.max == len(w.events) - 1
    i = next(k for k, e in enumerate(w.events) if e["event"] == "gather_end" and e["unit"] == "blocks.0")
    w.slider.value = i
    assert w.state.index == i and w.state.event is w.events[i]
    assert "聚合" in w.view.value and human_bytes(run.sizes.units["blocks.0"].full_bytes) in w.view.value
    w.play.value = i + 1  # the kernel-side link moves the slider, which redraws
    assert w.slider.value == i + 1 and w.state.index == i + 1
    before = w.view.value
    w.show(len(w.events) - 1)
    assert w.view.value != before and w.state.beat is BEATS["optimizer"]


def test_potluck_without_a_shipped_gpu_trace_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "GPU_TRACE_DIR", tmp_path / "gpu_traces")
    w = PotluckLifecycle.from_gpu_trace()
    assert w.events == [] and w.play.disabled and "no GPU trace ships" in w.view.value
    chart = LiveMemoryChart.replay()
    assert "no GPU trace ships" in chart.provenance.value
    assert sources.gpu_trace_note().startswith("No GPU trace ships with the course yet")
    assert "scripts/record_gpu_traces.py" in sources.gpu_trace_note()


def test_shipped_trace_plays_with_its_provenance(run, tmp_path, monkeypatch):
    shipped = tmp_path / "gpu_traces" / "example"
    shipped.mkdir(parents=True)
    for f in run.trace_dir.glob("rank*.jsonl"):
        shutil.copy(f, shipped / f.name)
    (shipped / "provenance.json").write_text(json.dumps({"gpu": "TEST-GPU", "torch": "9.9", "command": "x"}))
    monkeypatch.setattr(sources, "GPU_TRACE_DIR", tmp_path / "gpu_traces")
    w = PotluckLifecycle.from_gpu_trace()
    assert len(w.events) == len(run.events) and "TEST-GPU" in w.source.value
    chart = LiveMemoryChart.replay("example")
    assert "TEST-GPU" in chart.provenance.value and chart.steps_done == 2


def test_live_chart_followed_the_real_job(live):
    chart, run = live
    assert sum(len(v) for v in chart.events.values()) == len(run.events)
    assert chart.progress.value == chart.progress.max == 2  # 2 steps, done on both ranks
    assert "2 of 2 training step(s) done on every rank" in chart.status.value
    assert base64.b64decode(chart.out.outputs[0]["data"]["image/png"]).startswith(b"\x89PNG")


def test_live_chart_update_picks_up_appended_lines(run, tmp_path):
    lines = [json.dumps(e) + "\n" for e in run.events if e["rank"] == 0][:5]
    path = trace.rank_file(tmp_path, 0)
    path.write_text(lines[0] + lines[1])
    chart = LiveMemoryChart(tmp_path)
    assert chart.update() == 2 and len(chart.series()[0][1]) == 2
    with open(path, "a") as fh:
        fh.write(lines[2][:10])  # the rank is mid-write
    assert chart.update() == 0
    with open(path, "a") as fh:
        fh.write(lines[2][10:] + lines[3])
    assert chart.update() == 2
    assert chart.series()[0][1] == [e["mem"]["total"] for e in map(json.loads, lines[:4])]
    assert chart.update() == 0


def test_live_chart_plots_cuda_allocated_when_present(tmp_path):
    path = trace.rank_file(tmp_path, 1)
    record = {"t": 1.0, "rank": 1, "step": 0, "unit": "<root>", "phase": "forward", "event": "gather_end",
              "bytes_sent": 0, "bytes_received": 0, "mem": {"total": 10, "cuda_allocated": 3 * 2**20}}
    path.write_text(json.dumps(record) + "\n")
    chart = LiveMemoryChart(tmp_path)
    chart.update()
    assert chart.series() == {1: ([0.0], [3 * 2**20])}
    ax = chart.figure().axes[0]
    assert ax.get_ylabel() == "memory (MiB)" and "(s)" in ax.get_xlabel()


def test_planner_numbers_are_the_formulas():
    p = Planner(phi=7e9, n=8, gpu_mem_gb=80, strategy="ZeRO-3")
    want = planner.plan(7_000_000_000, 8, 80, strategy="ZeRO-3", precision="bf16")
    got = p.numbers()
    assert got["state_bytes"] == formulas.m_zero3(7e9, 8) == want.zero3_bytes
    assert (got["n_min"], got["n_min_with_activations"], got["rows"]) == (want.n_min, want.n_min_with_activations,
                                                                          want.rows())
    assert gb(formulas.m_zero3(7e9, 8)) in p.formula.value
    p.strategy.value, p.n.value, p.precision.value = "ZeRO-1", 4, "fp32"
    want = planner.plan(7_000_000_000, 4, 80, strategy="ZeRO-1", precision="fp32")
    assert p.numbers()["state_bytes"] == formulas.m_zero1(7e9, 4) and p.numbers()["peak_bytes"] == \
        want.peak_bytes("ZeRO-1")
    assert gb(formulas.m_zero1(7e9, 4)) in p.formula.value


def test_planner_shows_the_measured_point_beside_the_formula(run):
    m = MeasuredPoint.from_run(run)
    want = formulas.runtime_state_bytes("FULL_SHARD", run.numel_padded_total, 2)
    assert (m.measured["params"], m.measured["grads"]) == (want.params, want.grads)
    assert m.measured["optimizer"] == want.optimizer + run.ranks[0]["step_tensor_bytes"]
    p = Planner(measured=m)
    assert f"{m.measured['total']:,} B" in p.measured_html.value and f"{want.total:,} B" in p.measured_html.value
    p.jump_to_measured()
    assert (round(p.phi.value), p.n.value, p.strategy.value) == (m.phi, 2, "ZeRO-3")
    assert p.numbers()["state_bytes"] == formulas.m_zero3(m.phi, 2)


def test_jumping_to_the_measured_run_plans_that_model_not_a_llama_guess(run):
    """Chapter 03's button: no "0.00 GB", no more block parameters than the model has, and the run's own
    sequence length, micro-batch, precision and vocabulary for the activations and logits."""
    from fsdp_lab.training.models import PRESETS
    cfg = PRESETS[run.preset]
    p = Planner(measured=MeasuredPoint.from_run(run))
    p.jump_to_measured()
    plan = p.plan
    assert (plan.layers, plan.hidden, plan.heads, plan.vocab) == (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size)
    assert plan.layers * plan.phi_layer <= run.phi
    assert (plan.seq_len, plan.micro_batch, plan.precision) == (run.seq_len, run.micro_batch, "fp32")
    assert plan.logits_bytes == (4 + 4) * run.seq_len * run.micro_batch * cfg.vocab_size
    assert "0.00 GB" not in p.formula.value and "KiB" in p.formula.value
    assert p.figure().axes[1].get_ylabel() == "peak per GPU (MiB)"


def test_planner_has_recompute_sequence_micro_batch_and_attention_controls():
    p = Planner(phi=7e9, n=8, gpu_mem_gb=80)
    assert "MeasuredPoint" not in p.formula.value + p.measured_html.value  # no developer text without a run
    p.seq.value = 4096
    assert p.plan.seq_len == 4096 and p.plan.fits("ZeRO-3")
    p.attention.value = "materialized"
    assert p.plan.n_min_with_activations is None and "scores stored" in p.formula.value
    p.attention.value, p.recompute.value, p.micro_batch.value = "fused", True, 4
    want = planner.plan(7e9, 8, 80, seq_len=4096, micro_batch=4, recompute=True)
    assert p.numbers()["peak_bytes"] == want.peak_bytes("ZeRO-3") and "recomputed in backward" in p.formula.value


def test_the_potluck_agrees_with_itself_at_every_event(run):
    """Before a household's first event its memory panel already counts its shards (no "0 B" beside a full
    fridge); a unit being reduce-scattered is not "computing"; the optimizer state sits in the fridge."""
    w = PotluckLifecycle.from_lifecycle_run(run, step=1)
    first = frame(w.events, 0, run.sizes)
    for h in first.households:
        assert h.memory.get("params_sharded") == sum(h.fridge.values()) > 0
        assert h.optimizer_bytes == run.events[-1]["mem"]["optimizer_state"] > 0  # step 0 made AdamW's moments
    for i, e in enumerate(w.events):
        h = frame(w.events, i, run.sizes).household(e["rank"])
        if e["event"] == "reduce_scatter":
            assert h.computing != e["unit"] and h.reducing == e["unit"]
    w.show(next(i for i, e in enumerate(w.events) if e["event"] == "reduce_scatter"))
    assert "reduce-scatter 归约回分" in w.view.value and "AdamW moments" in w.view.value


def test_phase_strip_and_next_beat(run):
    w = PotluckLifecycle.from_lifecycle_run(run, step=1)
    assert w.state.phase == "forward" and "前向 forward" in w.phase_strip.value
    seen = [w.state.label]
    while w.state.index < len(w.events) - 1:
        before = (w.state.event["rank"], w.state.beat, w.state.event["unit"])
        w.next_button.click()
        after = w.state.event
        if w.state.index == len(w.events) - 1:
            break  # this household has no later beat: the button goes to the last event
        assert after["rank"] == before[0] and (w.state.beat, after["unit"]) != before[1:]
        seen.append(w.state.label)
    assert w.state.phase == "optimizer" and "优化器 optimizer step ◀ now" in w.phase_strip.value
    assert {"计算 compute", "释放 free", "再聚合 re-gather (all-gather)", "归约回分 reduce-scatter"} <= set(seen)


def test_live_chart_labels_the_beats_of_the_potlucks_step(run):
    chart = LiveMemoryChart(run.trace_dir, total_steps=2, world_size=2, focus_step=1)
    chart.update()
    zoom = chart.figure().axes[1]
    labels = [t.get_text() for t in zoom.texts]
    assert "step 1" in zoom.get_title() and "potluck" in zoom.get_xlabel()
    assert "blocks.0 · gather" in labels and "blocks.1 · reduce-scatter" in labels and "<root> · optimizer" in labels
    assert len(zoom.patches) >= len(labels) > 10  # one shaded span per labelled beat


def test_widgets_show_no_python_repr_before_they_run(run):
    """An untrusted notebook shows text/plain: no repr; the chart and the planner leave a picture instead."""
    chart = LiveMemoryChart(run.trace_dir, total_steps=2, world_size=2)
    chart.update()
    for w in (PotluckLifecycle.from_lifecycle_run(run, step=1), chart, Planner()):
        bundle = w._repr_mimebundle_()
        assert bundle["text/plain"] == "" and "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(chart._repr_mimebundle_()["image/png"]).startswith(b"\x89PNG")
    assert base64.b64decode(Planner()._repr_mimebundle_()["image/png"]).startswith(b"\x89PNG")


def test_every_widget_previews_itself_with_a_hint_and_no_answer(run):
    """[Note: first-open previews]: text/html with a run-this-cell hint and what the widget will show; the
    answers behind a button and the quiz's key and feedback are not in it."""
    from fsdp_lab.lessons.quiz import quiz
    from fsdp_lab.lessons.widgets import reveal_answers

    chart = LiveMemoryChart(run.trace_dir, total_steps=2, world_size=2)
    empty = LiveMemoryChart(run.trace_dir / "nothing-here", total_steps=2, world_size=2)
    chart.update()
    potluck = PotluckLifecycle.from_lifecycle_run(run, step=1)
    widgets_and_content = [(potluck, "blocks.0"), (chart, "data:image/png;base64,"), (Planner(), "16Φ/N"),
                           (empty, "The chart appears here"),
                           (reveal_answers(["1. the root stays"]), "Show the answers"),
                           (quiz("10", lang="en", progress=False), "Q10/10")]
    for w, content in widgets_and_content:
        page = w._repr_mimebundle_()["text/html"]
        assert "▶ Run" in page and content in page, (type(w).__name__, page[:300])
    assert "the root stays" not in reveal_answers(["1. the root stays"])._repr_mimebundle_()["text/html"]
    page = quiz("10", lang="en", progress=False)._repr_mimebundle_()["text/html"]
    assert "Answer:" not in page and "Right:" not in page and "Why:" not in page


def test_the_live_chart_republishes_its_preview_once_the_run_is_in(run, monkeypatch):
    chart = LiveMemoryChart(run.trace_dir, total_steps=2, world_size=2)
    updates = []

    class Handle:
        def update(self, bundle, raw):
            updates.append(bundle)
    chart._preview_handle = Handle()
    chart.wait(timeout_s=10)
    assert updates and "image/png" in updates[-1] and "application/vnd.jupyter.widget-view+json" in updates[-1]


def test_planner_right_chart_follows_the_controls_and_says_why_precision_leaves_states_alone():
    p = Planner(phi=7e9, n=8, gpu_mem_gb=80)
    def right_heights():
        return [round(bar.get_height(), 3) for bar in p.figure().axes[1].patches]
    bf16 = right_heights()
    p.precision.value = "fp32"
    assert right_heights() != bf16 and "states do not" in p.formula.value
    p.n.value = 16
    assert p.figure().axes[1].get_title().startswith("peak at N = 16")
    assert "★" not in p.figure().axes[1].get_title()


def test_hidden_answers_stay_hidden_until_asked():
    from fsdp_lab.lessons.widgets import reveal_answers

    w = reveal_answers(["1. the root", "2. 5 all-gathers"])
    assert not w.shown and "the root" not in w.body.value and w._repr_mimebundle_()["text/plain"] == ""
    assert "the root" not in json.dumps(w.get_state())
    w.button.click()
    assert w.shown and "the root" in w.body.value and "5 all-gathers" in w.body.value
    w.button.click()
    assert not w.shown
    with pytest.raises(ValueError, match="at least one answer"):
        reveal_answers([])


def test_a_chart_that_only_follows_promises_no_picture_and_names_the_training_cell(tmp_path):
    """Chapter 03's `your_chart = LiveMemoryChart(trace_dir).follow()` trains nothing itself: its first-open hint
    sends the learner to the training cell below, and promises no saved picture (none is saved)."""
    chart = LiveMemoryChart(tmp_path, world_size=2, total_steps=3).follow(poll_s=0.05)
    try:
        html_preview = chart._repr_mimebundle_()["text/html"]
    finally:
        chart.stop()
    assert "the training cell below it" in html_preview and "picture" not in html_preview
    assert "train the ranks" not in html_preview
