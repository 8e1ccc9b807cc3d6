"""The article's own numbers, the ZeRO ordering, the corrections and the errors of fsdp_lab.theory.formulas."""
import math

import pytest

from fsdp_lab.theory import formulas as F
from fsdp_lab.theory import planner as P

PHI_7B = 7e9
GB = 1e9


def test_article_numbers_for_7b():
    assert 4 * PHI_7B == 28 * GB                      # 核心思想: fp32 params of 7B = 28 GB
    assert F.m_param(PHI_7B, 8) == 3.5 * GB            # 8 GPUs: 3.5 GB of params each
    assert F.m_ddp(PHI_7B) == 112 * GB                 # DDP: 16Φ = 112 GB
    assert F.m_zero3(PHI_7B, 8) == 14 * GB             # ZeRO-3 on 8 GPUs: 14 GB
    assert F.n_min(PHI_7B, 80 * GB) == 2               # 112 / 80 = 1.4 → 2
    assert F.n_min(7_000_000_000, 80_000_000_000) == 2
    assert F.comm_ratio_fsdp_vs_ddp(8) == 1.5
    assert F.c_step(PHI_7B) / PHI_7B == 3


def test_comm_ratio_is_one_and_a_half_for_every_world_size():
    for n in (2, 3, 4, 8, 64, 1000):
        assert F.comm_ratio_fsdp_vs_ddp(n) == pytest.approx(1.5)
        assert F.c_step_exact(1e6, n) / F.c_ddp(1e6, n) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="n >= 2"):
        F.comm_ratio_fsdp_vs_ddp(1)


def test_exact_step_comm_approaches_the_article_3phi():
    assert F.c_step_exact(1000, 2) == 1500
    assert F.c_step_exact(1000, 1) == 0                # one rank sends nothing
    assert F.c_step_exact(1000, 10_000) == pytest.approx(F.c_step(1000), rel=1e-3)
    assert F.c_step_exact(1000, 8) < F.c_step(1000)
    assert F.c_ddp(1000, 4) == 1500


def test_gather_is_layer_times_missing_fraction_and_bytes_on_request():
    assert F.c_gather(1024, 4) == 768
    assert F.c_gather(1024, 4, dtype_bytes=2) == 1536
    assert F.c_step(10, dtype_bytes=2) == 60
    assert F.c_ddp(8, 2, dtype_bytes=4) == 32
    with pytest.raises(ValueError, match="dtype_bytes"):
        F.c_gather(1024, 4, dtype_bytes=0)


def test_article_fsdp_and_peak_as_written():
    assert F.m_fsdp(1000, 4, 10) == 4000 / 4 + 8000 / 4 + 20
    assert F.m_peak(1000, 4, 10) == 40 + 12000 / 4


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_zero_stage_ordering(n):
    phi = 7e9
    ddp, z1, z2, z3 = F.m_ddp(phi), F.m_zero1(phi, n), F.m_zero2(phi, n), F.m_zero3(phi, n)
    assert ddp > z1 > z2 > z3, (ddp, z1, z2, z3)


def test_all_stages_equal_at_one_gpu():
    phi = 1234567
    assert F.m_ddp(phi) == F.m_zero1(phi, 1) == F.m_zero2(phi, 1) == F.m_zero3(phi, 1) == 16 * phi
    assert F.m_param(phi, 1) == 4 * phi


def test_zero_stage_values_for_7b_on_8():
    assert F.m_zero1(PHI_7B, 8) == 63 * GB
    assert F.m_zero2(PHI_7B, 8) == 38.5 * GB


def test_corrections_add_the_gradient_shard_and_never_predict_less():
    phi, phi_layer = 7e9, 12 * 4096**2
    for n in (1, 2, 8, 64):
        assert F.m_fsdp_corrected(phi, n, phi_layer) - F.m_fsdp(phi, n, phi_layer) == pytest.approx(4 * phi / n)
        assert F.m_peak_corrected(phi, n, phi_layer) - F.m_peak(phi, n, phi_layer) == pytest.approx(4 * phi / n)
        for act in (0, 1e9):
            for prefetch in (False, True):
                assert F.m_peak_corrected(phi, n, phi_layer, act, prefetch=prefetch) >= F.m_peak(phi, n, phi_layer)
            assert F.m_fsdp_corrected(phi, n, phi_layer, act) >= F.m_fsdp(phi, n, phi_layer)


def test_prefetch_adds_one_more_unit_of_parameters_and_activations_add_as_given():
    base = F.m_peak_corrected(1000, 4, 10, param_bytes=2)
    assert F.m_peak_corrected(1000, 4, 10, param_bytes=2, prefetch=True) - base == 20
    assert F.m_peak_corrected(1000, 4, 10, activation_bytes=7, param_bytes=2) - base == 7
    assert F.m_fsdp_corrected(1000, 4, 10, param_bytes=4) - F.m_fsdp_corrected(1000, 4, 10) == 20


def test_activation_estimate_matches_korthikanti_with_materialized_scores():
    s, b, h, a = 2048, 1, 4096, 32
    kw = dict(attention="materialized")
    assert F.activation_bytes_per_layer(s, b, h, a, **kw) == s * b * h * (34 + 5 * a * s / h) == 956_301_312
    assert F.activation_bytes_per_layer(s, b, h, a, recompute=True, **kw) == 2 * s * b * h
    assert F.activation_bytes_per_layer(s, 2, h, a, **kw) == 2 * F.activation_bytes_per_layer(s, 1, h, a, **kw)
    # the attention term grows with s², the rest with s
    assert F.activation_bytes_per_layer(2 * s, b, h, a, **kw) > 2 * F.activation_bytes_per_layer(s, b, h, a, **kw)


def test_fused_attention_is_the_default_and_stores_no_scores():
    """SDPA/FlashAttention keeps 34sbh plus one fp32 log-sum-exp per head and row: linear in s, no 5as²b."""
    s, b, h, a = 2048, 1, 4096, 32
    assert F.activation_bytes_per_layer(s, b, h, a) == 34 * s * b * h + 4 * a * s * b == 285_474_816
    assert F.activation_bytes_per_layer(2 * s, b, h, a) == 2 * F.activation_bytes_per_layer(s, b, h, a)
    assert F.activation_bytes_per_layer(s, b, h, a, recompute=True) == 2 * s * b * h
    # the course GPT's "small" shape (s=64, b=4, h=128, a=4) in fp32, as chapter 06 measures it: 2056 KiB per
    # block measured; fused 2184 KiB (6 % over: it has no dropout masks), materialized 2816 KiB (37 % over)
    fused, kept = (F.activation_bytes_per_layer(64, 4, 128, 4, attention=x) * 2 / 1024
                   for x in ("fused", "materialized"))
    assert (fused, kept) == (2184, 2816)
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        F.activation_bytes_per_layer(s, b, h, a, attention="flash")


def test_q8_ratio_in_bytes_depends_on_dtypes_and_micro_batches():
    """Q8's 1.5 is about elements at one dtype; in bytes and with accumulation it moves (issue 20)."""
    n = 8
    assert F.comm_bytes_ratio_fsdp_vs_ddp(n) == 1.5  # equal dtypes, one micro-batch: the article
    assert F.comm_bytes_ratio_fsdp_vs_ddp(n, param_bytes=2, reduce_bytes=4) == 1.0  # vs DDP under autocast (fp32)
    assert F.comm_bytes_ratio_fsdp_vs_ddp(n, param_bytes=2, reduce_bytes=2) == 0.75
    for k in (1, 2, 4, 8):
        assert F.comm_bytes_ratio_fsdp_vs_ddp(n, micro_batches=k) == (2 * k + 1) / 2
    # the same numbers from the runtime's per-step byte counts (one micro-batch)
    p = 1024
    ddp = F.comm_bytes_per_step("NO_SHARD", p, n, 4, 4)
    assert F.comm_bytes_per_step("FULL_SHARD", p, n, 2, 4) / ddp == 1.0
    assert F.comm_bytes_per_step("FULL_SHARD", p, n, 2, 2) / ddp == 0.75
    with pytest.raises(ValueError, match="micro_batches must be a positive integer, got 0"):
        F.comm_bytes_ratio_fsdp_vs_ddp(n, micro_batches=0)


def test_q8_accumulation_ratio_without_no_sync_root_and_gloo():
    """Without no_sync both reduce every micro-batch (1.5 for any K); the root's share is gathered once per
    micro-batch, not twice; gloo's reduce-scatter costs two passes."""
    n = 2
    for k in (1, 2, 4):
        assert F.comm_bytes_ratio_fsdp_vs_ddp(n, micro_batches=k, no_sync=False) == 1.5
        assert F.comm_bytes_ratio_fsdp_vs_ddp(n, micro_batches=k, reduce_scatter_passes=2) == k + 1
        assert F.comm_bytes_ratio_fsdp_vs_ddp(n, micro_batches=k, root_share=0.5) == pytest.approx((1.5 * k + 1) / 2)
    with pytest.raises(ValueError, match=r"root_share must be a number in \[0, 1\), got 1"):
        F.comm_bytes_ratio_fsdp_vs_ddp(n, root_share=1)
    with pytest.raises(ValueError, match="no_sync must be True or False, got 'yes'"):
        F.comm_bytes_ratio_fsdp_vs_ddp(n, no_sync="yes")


def test_zero_paper_accounting_differs_from_the_articles_for_stage_2():
    """The ZeRO paper's Figure 1 (Ψ = 7.5B, N = 64): 120, 31.4, 16.6, 1.9 GB; its P_os+g is 2Ψ + 14Ψ/N."""
    gb = [F.m_zero_paper(stage, 7.5e9, 64) / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]
    assert F.m_zero_paper(2, 7e9, 8) == 2 * 7e9 + 14 * 7e9 / 8 != F.m_zero2(7e9, 8)
    assert F.m_zero_paper(3, 7e9, 8) == F.m_zero3(7e9, 8)


def test_runtime_state_bytes_per_strategy():
    p, n = 1024, 4
    assert F.runtime_state_bytes("FULL_SHARD", p, n) == F.StateBytes(1024, 1024, 2048)
    assert F.runtime_state_bytes("SHARD_GRAD_OP", p, n).total == 16 * p // n
    assert F.runtime_state_bytes("ZERO1", p, n) == F.StateBytes(4096, 4096, 2048)
    assert F.runtime_state_bytes("no_shard", 1023, n) == F.StateBytes(4092, 4092, 8184)
    # the runtime's exact count agrees with the article's stages
    assert F.runtime_state_bytes("FULL_SHARD", p, n).total == F.m_zero3(p, n)
    assert F.runtime_state_bytes("ZERO1", p, n).total == F.m_zero1(p, n)
    assert F.runtime_state_bytes("NO_SHARD", p, n).total == F.m_ddp(p)


def test_runtime_state_rejects_unpadded_sharded_counts_and_unknown_strategies():
    with pytest.raises(ValueError, match="1023.*multiple of n=4"):
        F.runtime_state_bytes("FULL_SHARD", 1023, 4)
    with pytest.raises(ValueError, match="HYBRID"):
        F.runtime_state_bytes("HYBRID", 1024, 4)
    with pytest.raises(ValueError, match="-8"):
        F.runtime_state_bytes("NO_SHARD", -8, 4)


def test_runtime_state_accepts_the_enum():
    from fsdp_lab.runtime.core.strategy import ShardingStrategy
    assert F.runtime_state_bytes(ShardingStrategy.FULL_SHARD, 8, 2).total == 64


def test_unsharded_peak_bytes():
    assert F.unsharded_peak_bytes(1000, 2, prefetch=False) == 2000
    assert F.unsharded_peak_bytes(1000, 2, prefetch=True) == 4000
    with pytest.raises(ValueError, match="largest_unit_numel_padded.*0"):
        F.unsharded_peak_bytes(0, 2, prefetch=False)


def test_comm_bytes_per_step_ring():
    p, n = 800, 8  # (N-1)/N·P = 700 elements per collective
    assert F.comm_bytes_per_step("FULL_SHARD", p, n, 2, 4) == 700 * 2 * 2 + 700 * 4
    assert F.comm_bytes_per_step("SHARD_GRAD_OP", p, n, 2, 4) == 700 * 2 + 700 * 4
    assert F.comm_bytes_per_step("NO_SHARD", p, n, 2, 4) == 2 * 700 * 4
    assert F.comm_bytes_per_step("ZERO1", p, n, 2, 4) == 700 * 4 + 700 * 4  # reduce-scatter + fp32 all-gather
    assert F.comm_bytes_per_step("FULL_SHARD", p, 1, 2, 4) == 0
    # in one dtype, FULL_SHARD sends 1.5× what NO_SHARD (DDP) sends, as the article says
    assert F.comm_bytes_per_step("FULL_SHARD", p, n, 4, 4) / F.comm_bytes_per_step("NO_SHARD", p, n, 4, 4) == 1.5
    assert F.comm_bytes_per_step("FULL_SHARD", p, n, 1, 1) == F.c_step_exact(p, n)


def test_plan_reproduces_the_article_and_counts_activations():
    p = P.plan(7e9, 8, 80)
    assert (p.layers, p.hidden, p.heads) == (32, 4096, 32)
    assert "layers=32" in p.assumptions and "hidden=4096" in p.assumptions
    assert p.ddp_bytes == 112 * 10**9 and not p.fits("DDP", with_activations=False)
    assert p.zero3_bytes == 14 * 10**9 and p.fits("ZeRO-3")
    assert (p.zero1_bytes, p.zero2_bytes) == (63 * 10**9, 385 * 10**8)
    assert p.n_min == 2
    assert p.attention == "fused"
    assert p.n_min_with_activations == 2
    assert p.n_min_with_reserve == 3
    assert p.activation_bytes == 32 * F.activation_bytes_per_layer(2048, 1, 4096, 32)
    kept = P.plan(7e9, 8, 80, attention="materialized")  # the s×s scores stored: one more GPU each
    assert (kept.n_min_with_activations, kept.n_min_with_reserve) == (3, 4)
    # the planner's ZeRO-3 peak is the corrected article peak plus the logits and their fp32 copy for the loss
    assert p.logits_bytes == (2 + 4) * 2048 * 1 * 32_000 and p.recompute_layer_bytes == 0
    assert p.peak_bytes("ZeRO-3") == F.m_peak_corrected(7e9, 8, p.phi_layer, p.activation_bytes) + p.logits_bytes
    assert [r[0] for r in p.rows()] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


def test_plan_n_min_with_activations_actually_fits_and_one_less_does_not():
    p = P.plan(7e9, 8, 80)
    at = P.plan(7e9, p.n_min_with_activations, 80)
    below = P.plan(7e9, p.n_min_with_activations - 1, 80)
    assert at.fits("ZeRO-3") and not below.fits("ZeRO-3")


def test_plan_recompute_and_shape_and_strategy_options():
    assert P.plan(7e9, 8, 80, recompute=True).n_min_with_activations == 2
    assert P.plan(7e9, 8, 80, micro_batch=2).activation_bytes == 2 * P.plan(7e9, 8, 80).activation_bytes
    assert P.plan(7e9, 8, 80, micro_batch=4).n_min_with_activations > 2
    given = P.plan(7e9, 8, 80, layers=32, hidden=4096, heads=32)
    assert given.assumptions.startswith("shape given")
    assert P.plan(7e9, 8, 80, strategy="NO_SHARD").n_min_with_activations is None  # DDP never fits 80 GB
    assert P.plan(1e9, 8, 80, strategy="DDP").n_min_with_activations == 1
    assert P.plan(7e9, 8, 80, strategy="SHARD_GRAD_OP").strategy == "ZeRO-2"
    assert P.llama_like_shape(13e9) == (40, 5120, 40)


def test_seven_b_at_seq_4096_on_8x80_fits_with_fused_attention():
    """Chapter 07's case: with the scores stored no number of 80 GB cards is enough; fused attention fits."""
    fused = P.plan(7e9, 8, 80, seq_len=4096)
    kept = P.plan(7e9, 8, 80, seq_len=4096, attention="materialized")
    assert kept.n_min_with_activations is None and not kept.fits("ZeRO-3")
    assert fused.fits("ZeRO-3") and (fused.n_min_with_activations, fused.n_min_with_reserve) == (2, 3)
    assert 33e9 < fused.peak_bytes("ZeRO-3") < 34e9


def test_plan_counts_the_recomputed_layer_and_the_logits():
    """14B, batch 8, recompute on 4 x 80 GB, scores stored: the recomputed layer's full activations (9.56 GB)
    and the logits put the peak above 73.6 GB, over the 20 % reserve though still under the card."""
    p = P.plan(14e9, 4, 80, micro_batch=8, recompute=True, attention="materialized")
    assert p.recompute_layer_bytes == F.activation_bytes_per_layer(2048, 8, p.hidden, p.heads,
                                                                   attention="materialized")
    assert p.logits_bytes == 6 * 2048 * 8 * 32_000
    assert p.peak_bytes("ZeRO-3") == p.zero3_bytes + p.working_bytes + p.activation_bytes + \
        p.recompute_layer_bytes + p.logits_bytes
    assert p.peak_bytes("ZeRO-3") > 73.6e9 and p.fits("ZeRO-3")
    assert p.peak_bytes("ZeRO-3") > 0.8 * p.gpu_mem_bytes and p.n_min_with_reserve > 4
    assert P.plan(14e9, 4, 80, micro_batch=8).recompute_layer_bytes == 0  # nothing is recomputed without it


def test_plan_precision_changes_working_bytes():
    assert P.plan(7e9, 8, 80, precision="fp32").working_bytes == 2 * P.plan(7e9, 8, 80).working_bytes


@pytest.mark.parametrize("kwargs, needle", [
    (dict(params=0, gpus=8, gpu_mem_gb=80), "params.*0"),
    (dict(params=-7e9, gpus=8, gpu_mem_gb=80), "-7000000000"),
    (dict(params=7e9, gpus=0, gpu_mem_gb=80), "gpus.*0"),
    (dict(params=7e9, gpus=2.5, gpu_mem_gb=80), "gpus.*2.5"),
    (dict(params=7e9, gpus=8, gpu_mem_gb=-80), "gpu_mem_gb.*-80"),
    (dict(params=float("nan"), gpus=8, gpu_mem_gb=80), "params.*nan"),
    (dict(params=7e9, gpus=8, gpu_mem_gb=80, strategy="ZERO9"), "ZERO9"),
    (dict(params=7e9, gpus=8, gpu_mem_gb=80, precision="int3"), "int3"),
    (dict(params=7e9, gpus=8, gpu_mem_gb=80, seq_len=0), "seq_len"),
])
def test_plan_rejects_bad_input_with_the_number(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        P.plan(**kwargs)


@pytest.mark.parametrize("call, needle", [
    (lambda: F.m_param(0, 8), "phi.*0"),
    (lambda: F.m_zero3(7e9, 0), "n .*0"),
    (lambda: F.m_zero3(7e9, 2.0), "n .*2.0"),
    (lambda: F.m_zero3(7e9, True), "n .*True"),
    (lambda: F.n_min(7e9, 0), "gpu_mem_bytes.*0"),
    (lambda: F.m_peak(7e9, 8, -1), "phi_layer.*-1"),
    (lambda: F.m_peak_corrected(7e9, 8, 10, activation_bytes=-5), "activation_bytes.*-5"),
    (lambda: F.activation_bytes_per_layer(2048, 0, 4096, 32), "micro_batch.*0"),
])
def test_formulas_reject_bad_input(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_plan_is_frozen_and_validates_itself():
    p = P.plan(7e9, 8, 80)
    with pytest.raises(AttributeError):
        p.gpus = 4
    with pytest.raises(ValueError, match="reserve_fraction"):
        P.plan(7e9, 8, 80, reserve_fraction=1.0)
    assert math.isclose(F.m_zero3(7e9, 3) * 3, 112e9)


def test_hybrid_shard_keeps_the_gathers_inside_the_node():
    """7B on 8 nodes × 8 GPUs, bf16 gathers and fp32 reduce: FULL_SHARD sends ~55 GB per GPU per step over the
    links between nodes; HYBRID_SHARD sends 48 GB over NVLink and only 12 GB between nodes."""
    phi = 7e9
    flat = F.node_traffic(phi, 8, 8, "FULL_SHARD")
    hybrid = F.node_traffic(phi, 8, 8, "HYBRID_SHARD")
    assert flat.intra_node == 0 and flat.inter_node == pytest.approx(63 / 64 * phi * 8)
    assert hybrid.intra_node == pytest.approx(7 / 8 * phi * 8)
    assert hybrid.inter_node == pytest.approx(2 * 7 / 8 * phi / 8 * 4)
    assert flat.inter_node / hybrid.inter_node > 4
    one_node = F.node_traffic(phi, 8, 1, "FULL_SHARD")
    assert one_node.inter_node == 0 and one_node.intra_node == pytest.approx(F.c_step_exact(phi, 8) * 8 / 3)
    assert F.node_traffic(phi, 8, 1, "HYBRID_SHARD").inter_node == 0
    with pytest.raises(ValueError, match="unknown strategy 'NO_SHARD'"):
        F.node_traffic(phi, 8, 2, "NO_SHARD")


def test_cpu_offload_moves_the_whole_sharded_state_to_the_host():
    """Chapter 07's 7B on 4 × RTX 4090 (24 GB): 16Φ/N = 28 GB of state cannot fit a card, recompute or not; with
    torch's offload (params, grads and Adam on the host, the step on the CPU) the card holds only what it
    computes, and each rank needs 28 GB of host memory."""
    p = P.plan(7e9, 4, 24, recompute=True)
    assert not p.fits("ZeRO-3") and p.zero3_bytes == 28 * 10**9
    assert p.cpu_offload_host_bytes == 28 * 10**9
    assert p.cpu_offload_gpu_bytes == p.peak_bytes("ZeRO-3") - p.zero3_bytes + 4 * p.phi_layer // 4
    assert p.cpu_offload_gpu_bytes < 0.8 * p.gpu_mem_bytes  # fits, with the reserve kept free
