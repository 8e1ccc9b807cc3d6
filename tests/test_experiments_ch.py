"""The experiments behind chapters 00-05 (sharding, precision, memory_compare): what each chapter shows must hold
on real ranks, byte for byte where the runtime is exact."""
from __future__ import annotations

import pytest
import torch

from fsdp_lab.lessons.experiments.memory_compare import comm_by_depth, ratio_rows
from fsdp_lab.lessons.experiments.precision import VARIANTS, memory_points, precision_runs, spacing, update_stall
from fsdp_lab.lessons.experiments.sharding import gather_summary, shard_sizes, sharding_layout
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.runtime.fsdp1.flat_param import padded_size
from fsdp_lab.theory import formulas
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import PRESETS, build_gpt, count_params

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def layout3():
    return sharding_layout(world_size=3, wrappings=("whole", "block"), global_batch=3, seq_len=8, timeout_s=150)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_chunks_tile_the_padded_buffer_and_hold_the_parameters(layout3):
    n = 3
    params = dict(build_gpt("tiny").named_parameters())
    for name in ("blocks.0", "blocks.1", "<root>"):
        rows = [{u["unit"]: u for u in r["layout"]}[name] for r in layout3]
        numel, padded, size = rows[0]["numel"], rows[0]["padded_numel"], rows[0]["shard_numel"]
        assert padded == padded_size(numel, n) and 0 <= padded - numel < n, (name, numel, padded)
        assert [r["shard_start"] for r in rows] == [rank * size for rank in range(n)], name
        values = torch.tensor([v for r in rows for v in r["shard_values"]])
        expected = torch.cat([params[s["name"]].detach().reshape(-1) for s in rows[0]["slots"]])
        assert values.numel() == padded
        assert torch.equal(values[:numel], expected), f"{name}: chunks end to end differ from the parameters"
        assert torch.count_nonzero(values[numel:]) == 0, f"{name}: padding is not zeros"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gather_bytes_match_c_gather_and_granularity_counts(layout3):
    n, blocks = 3, TINY.n_layer
    for r in layout3:
        runs = r["runs"]
        padded = {u["unit"]: u["padded_numel"] for u in runs["block"]["units"]}
        for e in runs["block"]["events"]:
            if e["event"] in ("gather_end", "regather_end"):
                want = formulas.c_gather(padded[e["unit"]], n, dtype_bytes=4)
                assert e["bytes_sent"] == e["bytes_received"] == want, (e["unit"], e["bytes_sent"], want)
        whole, block = gather_summary(runs["whole"]["events"]), gather_summary(runs["block"]["events"])
        assert whole["all_gathers"] == 1, whole
        assert block["all_gathers"] == 2 * blocks + 1, block
        one_block = max(v for k, v in padded.items() if k != "<root>")
        assert block["peak_gathered_bytes"] == 4 * (padded["<root>"] + one_block), block
        assert whole["peak_gathered_bytes"] == 4 * runs["whole"]["units"][0]["padded_numel"], whole


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shard_sizes_two_ranks_keep_half_of_each_unit():
    results = run_on_ranks(shard_sizes, 2, "tiny", timeout_s=100)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["units"] == results[1]["units"]
    for u in results[0]["units"]:
        assert u["shard_numel"] * 2 == u["padded_numel"] and u["shard_bytes"] == 4 * u["shard_numel"], u
    assert sum(u["numel"] for u in results[0]["units"]) == count_params(build_gpt("tiny"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bf16_halves_the_gathers_and_memory_matches_m_fsdp_terms():
    n = 2
    runs = precision_runs(world_size=n, steps=2, timeout_s=120)
    fp32, bf16 = (comm_summary(runs[0][d]["events"]).per_beat(rank=0, step=1) for d in ("fp32", "bf16"))
    assert bf16["gather"] * 2 == fp32["gather"] and bf16["regather"] * 2 == fp32["regather"], (fp32, bf16)
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"], "reduce_dtype is fp32: the reduce-scatter must not shrink"
    run = runs[0]["bf16"]
    units = {u["unit"]: u for u in run["units"]}
    total = sum(u["padded_numel"] for u in run["units"])
    phi, phi_layer = count_params(build_gpt("tiny")), units["blocks.0"]["numel"]
    points = memory_points(run["events"], rank=0, step=1)
    fwd = points["forward"]
    assert fwd["params_sharded"] == formulas.m_param(phi, n) == 4 * total // n
    assert fwd["optimizer_state"] == 8 * total // n + run["step_tensor_bytes"]
    assert fwd["params_unsharded"] == units["blocks.0"]["full_bytes"] + units["<root>"]["full_bytes"]
    assert units["blocks.0"]["full_bytes"] == 2 * phi_layer, "the working copy must be bf16"
    assert fwd["total"] == (formulas.m_fsdp(phi, n, phi_layer) + units["<root>"]["full_bytes"]
                            + run["step_tensor_bytes"])
    assert points["after_backward"]["grads_sharded"] == 4 * total // n, "the gradient term the article leaves out"
    assert points["backward_peak"]["total"] > formulas.m_fsdp(phi, n, phi_layer)


def test_spacing_is_the_gap_rounding_hides():
    assert spacing(1.0, torch.bfloat16) == 2.0**-7
    assert spacing(1.0, torch.float32) == 2.0**-23
    assert spacing(-0.02, torch.bfloat16) == 2.0**-13
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    assert (one + spacing(1.0, torch.bfloat16) / 4).item() == 1.0
    assert (one + spacing(1.0, torch.bfloat16)).item() == 1.0 + 2.0**-7
    with pytest.raises(ValueError, match="non-zero"):
        spacing(0.0, torch.bfloat16)


@pytest.mark.timeout(120)
def test_pure_bf16_updates_stall_and_fp32_masters_do_not():
    runs = update_stall(steps=20, lr=1e-5)
    assert set(runs) == set(VARIANTS)
    drop = {v: r["losses"][0] - r["losses"][-1] for v, r in runs.items()}
    moved = {v: sum(r["moved"]) / len(r["moved"]) for v, r in runs.items()}
    assert moved["bf16 only"] < 0.5 < moved["bf16 compute, fp32 masters"], moved
    assert drop["bf16 compute, fp32 masters"] > 3 * drop["bf16 only"] > 0, drop
    assert abs(drop["fp32"] - drop["bf16 compute, fp32 masters"]) < 0.1 * drop["fp32"], drop


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown variants"):
        update_stall(steps=1, variants=("fp8",))
    with pytest.raises(ValueError, match="steps >= 1"):
        update_stall(steps=0)
    with pytest.raises(ValueError, match="global_batch=4 must divide by world_size=3"):
        sharding_layout(world_size=3, global_batch=4)
    with pytest.raises(ValueError, match="unknown wrapping"):
        sharding_layout(world_size=2, wrappings=("per-atom",))
    with pytest.raises(ValueError, match="no events for rank 0, step 5"):
        memory_points([{"rank": 0, "step": 0}], rank=0, step=5)
    with pytest.raises(ValueError, match="depths must be positive"):
        comm_by_depth(depths=(0,))
    with pytest.raises(ValueError, match="depth 1: need both FULL_SHARD and NO_SHARD"):
        ratio_rows([{"depth": 1, "strategy": "FULL_SHARD", "sent": 3, "root_padded_numel": 1,
                     "numel_padded_total": 2}])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp_over_ddp_traffic_is_one_and_a_half_minus_the_root():
    per_rank = comm_by_depth(world_size=2, depths=(1, 4), timeout_s=120)
    rows = ratio_rows(per_rank[0])
    assert [r["depth"] for r in rows] == [1, 4]
    for r in rows:
        assert r["ratio"] == pytest.approx(1.5 - r["root_share"] / 2, rel=1e-12), r
        assert r["ratio"] < formulas.comm_ratio_fsdp_vs_ddp(2)
    assert rows[0]["ratio"] < rows[1]["ratio"], "deeper models must get closer to 1.5"
    assert ratio_rows(per_rank[1]) == rows, "both ranks send the same"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_jobs_run_together_return_what_each_experiment_returns_alone():
    """Chapter 05 runs its three rank experiments in one launch (fsdp_lab.lessons.experiments.together): each
    job's results are those of the experiment launched by itself."""
    from fsdp_lab.lessons.experiments.memory_compare import depth_job
    from fsdp_lab.lessons.experiments.strategies import measure_strategy_matrix, strategy_matrix_job
    from fsdp_lab.lessons.experiments.together import run_together

    matrix, depths = run_together(2, strategy_matrix_job(("FULL_SHARD", "ZERO1"), ("fp32", "bf16"), steps=2),
                                  depth_job(depths=(1, 2)), timeout_s=180)
    assert depths == comm_by_depth(world_size=2, depths=(1, 2), timeout_s=120)
    assert matrix == measure_strategy_matrix(2, ("FULL_SHARD", "ZERO1"), ("fp32", "bf16"), steps=2)
    with pytest.raises(ValueError, match="needs one or more Job"):
        run_together(2)
