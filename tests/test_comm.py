"""fsdp_lab.observe.traffic: bytes per collective, per step and per rank, summed from trace events.

Hand-made events pin the arithmetic; the real-run comparisons with the article's formulas are in
test_measured_vs_predicted.py."""
from __future__ import annotations

import pickle

import pytest

from fsdp_lab.observe.traffic import CommSummary, comm_summary


def ev(rank, step, event, sent=0, received=None, unit="blocks.0"):
    return {"t": 0.0, "rank": rank, "step": step, "unit": unit, "phase": "forward", "event": event,
            "bytes_sent": sent, "bytes_received": sent if received is None else received, "mem": {}}


def fsdp_like(rank, step):
    """Two units: forward gathers, one re-gather (the root is not freed), two reduce-scatters."""
    return [ev(rank, step, "gather_start"), ev(rank, step, "gather_end", 100, unit="<root>"),
            ev(rank, step, "gather_end", 300), ev(rank, step, "forward_end"), ev(rank, step, "free"),
            ev(rank, step, "regather_start"), ev(rank, step, "regather_end", 300),
            ev(rank, step, "reduce_scatter", 300), ev(rank, step, "reduce_scatter", 100, unit="<root>"),
            ev(rank, step, "optimizer_step")]


def test_sums_by_rank_step_beat_and_collective():
    events = fsdp_like(0, 0) + fsdp_like(0, 1) + fsdp_like(1, 0)
    s = comm_summary(events)
    assert s.ranks == [0, 1] and s.steps == [0, 1]
    assert s.per_step(0) == {0: 1100, 1: 1100}
    assert s.per_step(1) == {0: 1100, 1: 0}
    assert s.per_beat(0, step=0) == {"gather": 400, "regather": 300, "reduce_scatter": 400}
    assert s.per_collective(0, step=1) == {"all_gather": 700, "reduce_scatter": 400}
    assert s.calls(rank=0, step=0, collective="all_gather") == 3
    assert s.sent() == 3300 and s.received() == 3300
    assert s.mean_sent_per_step(rank=0) == 1100
    assert s.mean_sent_per_step() == 1100  # over the 3 (rank, step) pairs traced: rank 1 ran one step


def test_collectives_that_moved_nothing_are_not_communication():
    """NO_SHARD's gathers are local copies and a world of one skips its collectives: 0 bytes, no record."""
    s = comm_summary([ev(0, 0, "gather_end", 0), ev(0, 0, "all_reduce", 40)])
    assert s.per_collective(0) == {"all_reduce": 40}
    assert s.calls() == 1
    one_rank = comm_summary([ev(0, 0, "gather_end", 0), ev(0, 0, "optimizer_step"), ev(0, 1, "optimizer_step")])
    assert one_rank.records == () and one_rank.per_step(0) == {0: 0, 1: 0}
    assert one_rank.mean_sent_per_step() == 0.0


def test_received_is_kept_apart_from_sent():
    s = comm_summary([ev(0, 0, "all_reduce", 80, received=60)])
    assert (s.sent(), s.received()) == (80, 60)
    assert s.per_collective(0) == {"all_reduce": 80}


def test_ratio_of_two_runs_and_its_error_on_silence():
    fsdp = comm_summary(fsdp_like(0, 0))
    ddp = comm_summary([ev(0, 0, "all_reduce", 550), ev(0, 0, "all_reduce", 183)])
    assert fsdp.ratio(ddp) == pytest.approx(1100 / 733)
    silent = comm_summary([ev(0, 0, "gather_end", 0)])  # world size 1: the collective is skipped
    with pytest.raises(ValueError, match="0 bytes per step"):
        fsdp.ratio(silent)


def test_non_collective_event_with_bytes_is_an_error():
    with pytest.raises(ValueError, match="'free' of unit 'blocks.0' carries bytes"):
        comm_summary([ev(0, 0, "free", 8)])
    with pytest.raises(ValueError, match="negative"):
        comm_summary([ev(0, 0, "reduce_scatter", -1)])


def test_empty_trace_and_plain_data():
    empty = comm_summary([])
    assert empty.steps == [] and empty.mean_sent_per_step() == 0.0 and empty.table() == []
    s = comm_summary(fsdp_like(0, 0))
    assert isinstance(pickle.loads(pickle.dumps(s)), CommSummary)
    rows = s.table()
    assert {r["beat"] for r in rows} == {"gather", "regather", "reduce_scatter"}
    assert sum(r["sent"] for r in rows) == 1100
