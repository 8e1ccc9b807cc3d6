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
    derived = unit_sizes(run.events)
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
    assert w.events == [] and w.play.disabled and "no GPU trace is shipped" in w.view.value
    chart = LiveMemoryChart.replay()
    assert "no GPU trace is shipped" in chart.provenance.value


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
    assert "TEST-GPU" in chart.provenance.value and chart.steps_done == 4


def test_live_chart_followed_the_real_job(live):
    chart, run = live
    assert sum(len(v) for v in chart.events.values()) == len(run.events)
    assert chart.progress.value == chart.progress.max == 4  # 2 steps x 2 ranks
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
