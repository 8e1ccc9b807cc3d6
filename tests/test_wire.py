"""Bytes on the wire ([Note: counting real bytes], fsdp_lab/observe/wire.py) against the ring formula's count.

On 2 gloo ranks in a private network namespace: DDP's all-reduce sends what the ring formula counts, plus under
3 % of TCP/IP headers and ACKs. gloo's reduce-scatter is not a ring reduce-scatter: it sends an all-reduce's bytes
(twice the ring count), so FSDP's step carries one more pass than 3Φ(N−1)/N says.
"""
from __future__ import annotations

import pytest

from fsdp_lab.observe.wire import isolation_problem, loopback_tx_bytes


def test_loopback_counter_parses_proc_net_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive                            |  Transmit\n"
                   " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
                   "    lo:  123456     100    0    0    0     0          0         0   654321     101    0 0 0 0 0 0\n"
                   "  eth0:       1       1    0    0    0     0          0         0        7       1    0 0 0 0 0 0\n")
    assert loopback_tx_bytes(dev) == 654321
    dev.write_text("Inter-|\n face |\n  eth0: 1 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0\n")
    with pytest.raises(RuntimeError, match="no loopback interface 'lo'"):
        loopback_tx_bytes(dev)


@pytest.fixture(scope="module")
def rows():
    problem = isolation_problem()
    if problem:
        pytest.skip(problem)
    from fsdp_lab.lessons.experiments.wire import measure_wire_bytes
    return {(r["strategy"], r["step"]): r for r in measure_wire_bytes(("FULL_SHARD", "NO_SHARD"), steps=STEPS)}


STEPS = 3


def least_excess(rows, strategy: str, expected) -> float:
    """Wire bytes over the expected count, at the step with the least excess: load only adds bytes (more ACKs and
    smaller segments on a busy machine; CI saw one step 6 % over), never removes them, so the least step is the
    one held to the header tolerance. Every step must still carry at least the expected bytes."""
    excess = []
    for step in range(STEPS):
        r = rows[(strategy, step)]
        assert r["wire_bytes"] >= expected(r), r
        excess.append(r["wire_bytes"] / expected(r))
    return min(excess)


def test_ddp_all_reduce_on_the_wire_is_the_ring_count_plus_headers(rows):
    assert least_excess(rows, "NO_SHARD", lambda r: r["counted_bytes"]) <= 1.03


def test_gloos_reduce_scatter_sends_an_all_reduces_bytes(rows):
    for step in range(STEPS):
        r = rows[("FULL_SHARD", step)]
        assert r["wire_bytes"] > 1.2 * r["counted_bytes"], r  # the ring count misses a whole pass
    two_passes = lambda r: r["counted_bytes"] + r["counted_by_collective"]["reduce_scatter"]  # noqa: E731
    assert least_excess(rows, "FULL_SHARD", two_passes) <= 1.03


@pytest.fixture(scope="module")
def accumulation():
    """K = 1, 2, 4 micro-batches per optimizer step, with and without no_sync, FSDP and DDP, fsdp_lab's and torch's
    (one launch; each table row is the least of STEPS steps: load only adds bytes)."""
    problem = isolation_problem()
    if problem:
        pytest.skip(problem)
    from fsdp_lab.lessons.experiments.wire import accumulation_table, measure_wire_bytes
    rows = measure_wire_bytes(("FULL_SHARD", "NO_SHARD", "torch_fsdp2", "torch_ddp"), steps=STEPS,
                              micro_batches=(1, 2, 4), no_sync=(True, False))
    torch_rows = accumulation_table(rows, fsdp="torch_fsdp2", ddp="torch_ddp")
    return {**{(t["micro_batches"], t["no_sync"]): t for t in accumulation_table(rows)},
            **{("torch", t["micro_batches"], t["no_sync"]): t for t in torch_rows}}


def test_accumulation_with_no_sync_sends_2k_plus_1_over_2_of_ddps_bytes(accumulation):
    """The variant (2K+1)/2 describes: the first K-1 micro-batches under no_sync() for FSDP and DDP. FSDP gathers
    twice per micro-batch and reduces once; DDP all-reduces once, whatever K is. On the wire the ratio is
    (2K+1)/2 with two stated departures, each a number of this run: the root's share ρ is gathered once per
    micro-batch (−Kρ/2) and gloo's reduce-scatter sends two passes, not one (+1/2). Tolerance: 3 % (TCP/IP
    headers). Ignoring K would leave FSDP at 1.91 for every K; reducing every micro-batch would too."""
    ddp_one = accumulation[(1, True)]["ddp_wire_bytes"]
    for k in (1, 2, 4):
        t = accumulation[(k, True)]
        assert t["formula"] == (2 * k + 1) / 2
        expected = t["formula"] - k * t["root_share"] / 2 + 0.5
        assert t["formula_root_gloo"] == pytest.approx(expected)
        assert abs(t["measured_ratio"] - expected) <= 0.03 * expected, t
        assert abs(t["ddp_wire_bytes"] - ddp_one) <= 0.03 * ddp_one, t  # DDP: one all-reduce per step
    slope = (accumulation[(4, True)]["measured_ratio"] - accumulation[(1, True)]["measured_ratio"]) / 3
    assert 1 - accumulation[(1, True)]["root_share"] / 2 - 0.03 <= slope <= 1.03, slope  # (2K+1)/2 grows by 1


def test_accumulation_without_no_sync_keeps_fsdps_ratio(accumulation):
    """Without no_sync both reduce every micro-batch: DDP sends K all-reduces, FSDP 3 passes per micro-batch,
    so the ratio stays where K = 1 puts it (1.5 in the article's count, 1.91 with the root and gloo here).
    K = 1 has no micro-batch under no_sync: its one run serves both."""
    assert (1, False) not in accumulation
    one = accumulation[(1, True)]
    for k in (2, 4):
        t = accumulation[(k, False)]
        assert t["formula"] == 1.5
        assert abs(t["measured_ratio"] - one["measured_ratio"]) <= 0.03 * one["measured_ratio"], t
        assert abs(t["ddp_wire_bytes"] - k * one["ddp_wire_bytes"]) <= 0.03 * k * one["ddp_wire_bytes"], t
        assert abs(t["measured_ratio"] - t["formula_root_gloo"]) <= 0.03 * t["formula_root_gloo"], t


def test_accumulation_options_are_checked():
    from fsdp_lab.lessons.experiments.common import RunSpec, accumulation_step
    from fsdp_lab.lessons.experiments.wire import measure_wire_bytes
    import torch

    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1, got 0"):
        RunSpec(micro_batches=0)
    with pytest.raises(ValueError, match=r"batch of 3 does not split into micro_batches=2"):
        accumulation_step(None, None, torch.zeros(3, 4), torch.zeros(3, 4), micro_batches=2)
    with pytest.raises(ValueError, match="micro_batches must hold integers >= 1, got 0"):
        measure_wire_bytes(micro_batches=(1, 0))


def test_q8_feedback_quotes_this_measurement(accumulation):
    """Interview Q8's feedback quotes the chapter 05 table; the quoted ratios are this run's within 3 %."""
    import re

    from fsdp_lab.lessons.quiz import load_chapter_by_key

    q8 = next(q for q in load_chapter_by_key("10").questions if q.id == "interview-q8")
    text = next(o.feedback.en for o in q8.options if "Measured on the wire" in o.feedback.en)
    quoted = re.search(r"FSDP/DDP = ([\d.]+), ([\d.]+), ([\d.]+) at K = 1, 2, 4", text)
    assert quoted, text
    for k, value in zip((1, 2, 4), map(float, quoted.groups())):
        assert abs(value - accumulation[(k, True)]["measured_ratio"]) <= 0.03 * value, (k, value)
    without = float(re.search(r"Without no_sync: ([\d.]+) at every K", text).group(1))
    for k in (2, 4):
        assert abs(without - accumulation[(k, False)]["measured_ratio"]) <= 0.03 * without, (k, without)
    rho = float(re.search(r"ρ = ([\d.]+) here", text).group(1))
    assert round(accumulation[(1, True)]["root_share"], 2) == rho


def test_torch_fsdp2_and_ddp_send_the_same_bytes(accumulation):
    """torch's own fully_shard with set_requires_gradient_sync(False) on the first K-1 micro-batches, against
    torch's DistributedDataParallel with no_sync(): the same ratio as fsdp_lab's, and FSDP2 sends what fsdp_lab's
    FULL_SHARD sends (its root, too, stays gathered from forward to backward), within 3 %."""
    for k in (1, 2, 4):
        for quiet in (True, False):
            if k == 1 and not quiet:
                continue
            theirs, ours = accumulation[("torch", k, quiet)], accumulation[(k, quiet)]
            expected = theirs["formula_root_gloo"]
            assert abs(theirs["measured_ratio"] - expected) <= 0.03 * expected, theirs
            assert abs(theirs["fsdp_wire_bytes"] - ours["fsdp_wire_bytes"]) <= 0.03 * ours["fsdp_wire_bytes"], k
            assert abs(theirs["ddp_wire_bytes"] - ours["ddp_wire_bytes"]) <= 0.03 * ours["ddp_wire_bytes"], k
