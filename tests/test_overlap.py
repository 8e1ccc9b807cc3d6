"""Overlap on CPU/gloo, through the code path CUDA takes (null streams on CPU): a prefetched gather is issued and
stays in flight (GATHERING, not yet waited for) while the previous unit computes; BACKWARD_PRE and BACKWARD_POST
issue the next re-gather where torch's do; the number of gathers in flight stays bounded; reduces queue until the
compute stream waits for them, all by the end of backward; none of this changes the numbers. On fake CUDA
streams: every wait names its stream, and the ordering rules hold."""
from __future__ import annotations

import pytest
import torch
from ranks_overlap import fake_stream_run, gathering_count, prefetch_trace

from fsdp_lab import BackwardPrefetch
from fsdp_lab.training.launch import run_on_ranks

PRE, POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST


def _run(forward_prefetch, backward_prefetch, limit=None):
    return run_on_ranks(prefetch_trace, 2, forward_prefetch, backward_prefetch, limit, timeout_s=150)[0]


@pytest.fixture(scope="module")
def sync_run():
    return _run(False, None)


@pytest.fixture(scope="module")
def pre_run():
    return _run(True, PRE)


def _index(events, event, unit, step=1, phase=None):
    for i, e in enumerate(events):
        if e["step"] == step and e["event"] == event and e["unit"] == unit and (phase is None or e["phase"] == phase):
            return i
    raise AssertionError(f"no {event} of {unit} in step {step}")


def test_forward_prefetch_is_in_flight_while_the_previous_unit_computes(pre_run):
    # Step 0 records the forward order (nothing to prefetch yet); from step 1 block 1 is prefetched.
    assert pre_run["block1_during_block0"] == ["SHARDED", "GATHERING"], pre_run["block1_during_block0"]
    ev = pre_run["events"]
    assert _index(ev, "gather_start", "blocks.1") < _index(ev, "forward_end", "blocks.0") \
        < _index(ev, "gather_end", "blocks.1")
    assert ev[_index(ev, "gather_start", "blocks.1")]["prefetch"] is True


def test_without_prefetch_every_gather_completes_before_compute(sync_run):
    assert sync_run["block1_during_block0"] == ["SHARDED", "SHARDED"]
    ev = sync_run["events"]
    for i, e in enumerate(ev):
        if e["event"] in ("gather_start", "regather_start"):
            assert ev[i + 1]["event"].endswith("gather_end") and ev[i + 1]["unit"] == e["unit"], ev[i:i + 2]


def test_backward_pre_regathers_the_next_unit_before_this_one_reduces(pre_run):
    ev = pre_run["events"]
    start = _index(ev, "regather_start", "blocks.0")
    assert _index(ev, "backward_start", "blocks.1") < start < _index(ev, "reduce_scatter", "blocks.1")
    assert ev[start + 1]["event"] != "regather_end", "the prefetched re-gather should stay in flight"
    assert ev[start]["prefetch"] is True


def test_backward_pre_follows_backward_order_from_the_root_to_the_last_block(pre_run):
    """The root starts forward first but its head is the first thing backward reaches; the next unit is the last
    block (the reverse of the order in which units *finish* forward)."""
    ev = pre_run["events"]
    start = _index(ev, "regather_start", "blocks.1")
    assert start == _index(ev, "backward_start", "<root>") + 1, "issued as soon as the root's backward starts"
    assert start < _index(ev, "backward_start", "blocks.1")


def test_backward_post_regathers_once_this_unit_is_reduced_and_freed():
    run = _run(False, POST)
    ev = run["events"]
    start = _index(ev, "regather_start", "blocks.0")
    assert _index(ev, "reduce_scatter", "blocks.1") < _index(ev, "free", "blocks.1", phase="backward") < start
    assert start < _index(ev, "backward_start", "blocks.0")
    assert ev[start]["prefetch"] is True, "issued by blocks.1's post-backward, not on demand"
    assert max(gathering_count(e["states"]) + sum(s == "UNSHARDED" for u, s in e["states"].items() if u != "<root>")
               for e in ev if e["phase"] == "backward") <= 1, "POST never holds two blocks at once"


def test_no_backward_prefetch_regathers_on_demand(sync_run):
    ev = sync_run["events"]
    free1 = _index(ev, "free", "blocks.1", phase="backward")
    assert ev[free1]["states"]["blocks.0"] == "SHARDED"
    assert ev[_index(ev, "regather_start", "blocks.0")]["prefetch"] is False


def _in_flight_between_events(events):
    """Gathers issued and not yet waited for, seen at every event except a gather's own start (an on-demand
    gather is GATHERING there for an instant before it is waited for)."""
    return [gathering_count(e["states"]) for e in events if not e["event"].endswith("gather_start")]


def test_gathers_in_flight_are_bounded(pre_run):
    bound = pre_run["max_in_flight"]
    assert 1 <= max(_in_flight_between_events(pre_run["events"])) <= bound
    off = _run(True, PRE, limit=0)
    assert off["block1_during_block0"] == ["SHARDED", "SHARDED"], "a bound of 0 leaves no room for prefetch"
    assert max(_in_flight_between_events(off["events"])) == 0


def test_queued_reduces_are_waited_for_by_the_end_of_backward(pre_run):
    ev = pre_run["events"]
    assert max(e["reduces_pending"] for e in ev if e["phase"] == "backward") >= 1
    ends = [e for e in ev if e["event"] == "backward_end"]
    assert ends and all(e["reduces_pending"] == 0 for e in ends)
    assert set(pre_run["states_after"]) == {"SHARDED"}


def test_overlap_changes_no_numbers(sync_run, pre_run):
    assert pre_run["losses"] == sync_run["losses"]
    for name, ref in sync_run["params"].items():
        assert torch.equal(pre_run["params"][name], ref), name


def test_cuda_stream_ordering_rules_on_fake_streams(sync_run):
    """The CUDA code path, run on CPU over stand-in streams that log every wait and event: each side stream
    waits for compute before it works; compute waits for a unit's gather before the unit computes and for every
    reduce by the end of backward; at most `limit` reduces are held. Every event wait names the stream that
    waits (a bare `event.wait()` would order whatever stream is current), and the gather stream has high
    priority."""
    out = run_on_ranks(fake_stream_run, 2, timeout_s=150)[0]
    assert out["losses"] == sync_run["losses"]
    for name, ref in sync_run["params"].items():
        assert torch.equal(out["params"][name], ref), name
    waited, pending_gather, gather_owner, reduce_open = set(), {}, None, []
    synced_since_record = {"gather": False, "reduce": False}
    checked = 0
    for entry in out["log"]:
        kind = entry["kind"]
        if kind == "wait_stream":
            assert entry["on"] == "compute", entry
            synced_since_record[entry["stream"]] = True
        elif kind == "record":
            assert synced_since_record[entry["stream"]], f"{entry}: side stream did not wait for compute first"
            synced_since_record[entry["stream"]] = False
            if entry["stream"] == "gather":
                assert gather_owner is not None, "a gather event outside any gather"
                pending_gather.setdefault(gather_owner, set()).add(entry["id"])
            else:
                reduce_open.append(entry["id"])
        elif kind == "wait_event":
            assert entry["stream"] is not None, f"{entry}: a wait left to the current stream"
            assert entry["stream"] == "compute", entry
            waited.add(entry["id"])
            reduce_open = [i for i in reduce_open if i != entry["id"]]
        elif kind == "lifecycle":
            event, unit = entry["event"], entry["unit"]
            assert len(reduce_open) <= out["limit"], f"{len(reduce_open)} reduces held, limit {out['limit']}"
            gather_owner = unit if event.endswith("gather_start") else None
            if event in ("forward_start", "backward_start"):
                missing = pending_gather.get(unit, set()) - waited
                assert not missing, f"{unit} {event} before compute waited for its gather events {missing}"
                checked += 1
            if event == "backward_end":
                assert not reduce_open, f"backward ended with reduce events {reduce_open} not waited for"
    assert checked >= 6
    streams = [e for e in out["log"] if e["kind"] == "new_stream"]
    assert [s["priority"] for s in streams] == [0, -1, 0], "compute, gather (high priority), reduce"
    assert sum(e["kind"] == "wait_event" for e in out["log"]) >= 6
