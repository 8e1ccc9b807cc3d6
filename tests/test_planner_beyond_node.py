"""The planner's HSDP and CPU offload options (fsdp_lab.theory.planner): torch's semantics in formulas, checked
against the article's 7B example, against formulas.node_traffic, and against chapter 06b's stored two-node run
(bytes per group under HYBRID_SHARD on 2 × 2 gloo ranks, host bytes under CPUOffload)."""
from __future__ import annotations

import math

import pytest

from fsdp_lab.lessons.experiments.two_nodes import stored_run
from fsdp_lab.theory import formulas as F
from fsdp_lab.theory import planner as P


def test_hsdp_shards_inside_a_node_and_keeps_a_copy_per_node():
    flat = P.plan(7e9, 16, 80)
    hybrid = P.plan(7e9, 16, 80, strategy="HYBRID_SHARD", nodes=2)
    assert flat.shard_group == 16 and hybrid.shard_group == 8
    assert flat.hybrid_state_bytes == flat.zero3_bytes == 7 * 10**9  # one node: HSDP is ZeRO-3
    assert hybrid.hybrid_state_bytes == 14 * 10**9 == 2 * flat.zero3_bytes  # 16Φ/G, G = 8: twice 16Φ/N
    assert hybrid.gpu_bytes == hybrid.hybrid_state_bytes + hybrid.extra_bytes
    assert flat.gpu_bytes == flat.peak_bytes("ZeRO-3") and hybrid.host_bytes == 0


def test_hsdp_sends_only_the_reduced_shard_across_nodes():
    p = P.plan(7e9, 16, 80, strategy="HYBRID_SHARD", nodes=2)
    comm = p.comm_bytes_per_step()
    assert comm["inter_node"] == 2 * (2 - 1) / 2 * 7e9 / 8 * 4  # all-reduce of Φ/G fp32 over M = 2 nodes
    assert comm["intra_node"] == (8 - 1) / 8 * 7e9 * (2 + 2 + 4)  # two bf16 gathers and an fp32 reduce-scatter
    want = F.node_traffic(7e9, 8, 2, "HYBRID_SHARD", param_bytes=2, reduce_bytes=4)
    assert (comm["intra_node"], comm["inter_node"]) == (want.intra_node, want.inter_node)
    one = P.plan(7e9, 8, 80).comm_bytes_per_step()
    assert one["inter_node"] == 0 and one["intra_node"] == math.ceil(7 / 8 * 7e9 * 8)
    assert P.plan(7e9, 16, 80, precision="fp32", nodes=2).comm_bytes_per_step(reduce_bytes=4)["intra_node"] \
        == (8 - 1) / 8 * 7e9 * 12


def test_cpu_offload_puts_the_sharded_state_on_the_host_per_shard_group():
    p = P.plan(7e9, 4, 24, recompute=True, cpu_offload=True)
    assert p.host_bytes == p.cpu_offload_host_bytes == 28 * 10**9  # 16Φ/N: params, grads, Adam on the host
    assert p.gpu_bytes == p.cpu_offload_gpu_bytes == p.extra_bytes + 4 * p.phi_layer // 4
    hybrid = P.plan(7e9, 8, 24, recompute=True, cpu_offload=True, nodes=2, strategy="HYBRID_SHARD")
    assert hybrid.host_bytes == 28 * 10**9  # 16Φ/G with G = 4 ranks per node
    assert hybrid.gpu_bytes == hybrid.extra_bytes + 4 * hybrid.phi_layer // 4


@pytest.mark.parametrize("kwargs, needle", [
    ({"nodes": 3}, "divides gpus=8"), ({"nodes": 0}, "divides gpus=8"),
    ({"nodes": 2, "strategy": "SHARD_GRAD_OP"}, "is ZeRO-2"), ({"cpu_offload": "yes"}, "True or False")])
def test_bad_hsdp_and_offload_options_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        P.plan(7e9, 8, 80, **kwargs)


def test_the_widget_shows_the_options():
    from fsdp_lab.lessons.widgets import Planner

    w = Planner(phi=7e9, n=16, gpu_mem_gb=80)
    w.nodes.value, w.cpu_offload.value = 2, True
    got = w.numbers()
    want = P.plan(7_000_000_000, 16, 80, strategy="ZeRO-3", nodes=2, cpu_offload=True)
    assert got["gpu_bytes"] == want.gpu_bytes and got["host_bytes"] == want.host_bytes
    assert got["comm"] == want.comm_bytes_per_step()
    assert "HSDP" in w.formula.value and "CPU offload" in w.formula.value
    w.n.value = 3  # 3 GPUs do not split over 2 nodes: the nodes fall back to 1, and the widget says so
    assert w.nodes.value == 1 and w.numbers()["comm"]["inter_node"] == 0


# -- chapter 06b's stored run against the planner's formulas ---------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    return stored_run()


def test_stored_run_is_two_launchers_of_two_ranks(run):
    where = [r["where"] for r in run["ranks"]]
    assert [(w["node"], w["local_rank"]) for w in where] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all("--nnodes 2" in c and "--rdzv-backend c10d" in c for c in run["commands"]) and len(run["commands"]) == 2


def test_stored_hsdp_bytes_are_the_planners(run):
    for r in run["ranks"]:
        h = r["hybrid"]["HYBRID_SHARD"]
        padded = sum(u["padded_numel"] for u in h["units"])
        root = next(u for u in h["units"] if u["is_root"])["padded_numel"]
        p = P.plan(padded, 4, 80, strategy="HYBRID_SHARD", nodes=2, precision="fp32")
        comm = p.comm_bytes_per_step(reduce_bytes=4)
        assert sum(h["bytes"]["replicate"].values()) == comm["inter_node"]
        assert sum(h["bytes"]["shard"].values()) == comm["intra_node"] - root * 4 // 2  # no root re-gather
        node, local = divmod(r["where"]["rank"], 2)
        assert h["groups"] == {"shard": [2 * node, 2 * node + 1], "replicate": [local, local + 2]}
        assert h["losses"] == pytest.approx(r["hybrid"]["FULL_SHARD"]["losses"], abs=1e-5)


def test_stored_offload_bytes_are_the_planners(run):
    for r in run["ranks"]:
        on, off = r["offload"]["offload"], r["offload"]["none"]
        p = P.plan(on["numel_padded"], 4, 80, precision="fp32", cpu_offload=True)
        steps = on["optimizer_state"] - 8 * on["numel_padded"] // 4  # AdamW's step counters, not in 16Φ
        assert on["host"] == p.host_bytes + steps and on["device"] == 0
        assert off["host"] == 0 and off["device"] == on["host"]
        assert on["gathered_peak"] == off["gathered_peak"]  # the device still holds the gathered units


def test_stored_meta_init_peak_is_shards_plus_one_unit(run):
    for r in run["ranks"]:
        meta, real = r["meta_init"]["meta"], r["meta_init"]["real"]
        assert meta["peak"] <= meta["shards"] + meta["unit"] < r["meta_init"]["budget"] < real["peak"]


def test_stored_checkpoint_loads_on_two_ranks_with_the_same_loss(run):
    from fsdp_lab.lessons.experiments.beyond_node import load_resharded
    from fsdp_lab.training.launch import run_on_ranks

    got = run_on_ranks(load_resharded, 2, run["checkpoint"], timeout_s=120)
    assert [g["saved_world_size"] for g in got] == [4, 4]
    assert got[0]["next_loss"] == pytest.approx(run["ranks"][0]["checkpoint"]["next_loss"], abs=1e-6)
    assert got[0]["shard_numel"] > 2 * run["ranks"][0]["checkpoint"]["shard_numel"] - 64  # half the model, not 1/4
