"""Overlap on CPU/gloo, through the code path CUDA takes (null streams on CPU): a prefetched gather is issued and
stays in flight (GATHERING, not yet waited for) while the previous unit computes; BACKWARD_PRE and BACKWARD_POST
issue the next re-gather where torch's do; the number of gathers in flight stays bounded; reduces queue until the
compute stream waits for them, all by the end of backward; none of this changes the numbers. On fake CUDA
streams, from the recorded event/wait graph (never from timing): the gather stream waits for compute once per
iteration and no gather waits for the compute queued just before it (torch's implicit forward prefetching); no
unsharded buffer is released or gathered into again before the gather stream waited for its readers' event;
limit_all_gathers bounds the buffers held; every wait names its stream."""
from __future__ import annotations

import pytest
import torch
from ranks_overlap import fake_stream_run, gathering_count, prefetch_trace

from fsdp_lab import BackwardPrefetch, MixedPrecision
from fsdp_lab.training.launch import run_on_ranks

PRE, POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


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


def test_a_prefetched_regather_on_cpu_is_a_collective_in_flight(pre_run, sync_run):
    """[Note: a prefetch on CPU]: gloo runs the prefetched all-gather while block 1 computes its gradients; the
    host has not waited for it. Without prefetch nothing is pending there (the gather waits at once)."""
    assert pre_run["block0_during_block1"] == [[("PendingCollective", False)]] * 2, pre_run["block0_during_block1"]
    assert sync_run["block0_during_block1"] == [[]] * 2, sync_run["block0_during_block1"]


def test_a_failed_prefetched_gather_names_its_unit_at_the_wait():
    from fsdp_lab.runtime.core.collectives import Collective, CollectiveFailed, PendingCollective

    class DeadPeer:
        def wait(self):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    copied = []
    pending = PendingCollective(Collective("all_gather", 96, torch.bfloat16, 2), "blocks.0", DeadPeer(), keep=(),
                                then=lambda: copied.append(True))
    with pytest.raises(CollectiveFailed, match=r"all_gather of unit 'blocks.0' \(96 torch.bfloat16 elements, 2 "
                                               r"ranks\) did not complete(.|\n)*Connection closed by peer"):
        pending.wait()
    assert not copied and pending.done  # no copy-out of a buffer that was never filled, and no second wait


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


class GatherStreamReplay:
    """Replays a fake-stream log and keeps, for the gather stream, its horizon: the latest log position of compute
    work it is ordered after (a `wait_stream` on compute covers everything queued before it; waiting on an event
    covers what was queued before the event was recorded)."""

    def __init__(self, log):
        self.log, self.horizon, self.recorded_at = log, -1, {}

    def __iter__(self):
        for pos, entry in enumerate(self.log):
            if entry["kind"] == "record":
                self.recorded_at[entry["id"]] = (pos, entry["stream"])
            elif entry["kind"] == "wait_stream" and entry["stream"] == "gather":
                self.horizon = max(self.horizon, pos)
            elif entry["kind"] == "wait_event" and entry["stream"] == "gather":
                at, stream = self.recorded_at[entry["id"]]
                assert stream == "compute", f"{entry}: the gather stream waits for compute events only"
                self.horizon = max(self.horizon, at)
            yield pos, entry


def _fake(**options):
    return run_on_ranks(fake_stream_run, 2, "FULL_SHARD", options, timeout_s=150)[0]


@pytest.fixture(scope="module")
def default_fake():
    """torch's defaults: backward_prefetch=BACKWARD_PRE, forward_prefetch=False, limit_all_gathers=True."""
    return _fake()


def test_fake_streams_run_the_same_numbers(default_fake):
    assert default_fake["losses"] == default_fake["ref_losses"]
    for name, ref in default_fake["ref_params"].items():
        assert torch.equal(default_fake["params"][name], ref), name
    streams = [e for e in default_fake["log"] if e["kind"] == "new_stream"]
    assert [s["priority"] for s in streams] == [0, -1, 0], "compute, gather (high priority), reduce"


def test_gather_stream_waits_for_compute_once_per_iteration(default_fake):
    log = default_fake["log"]
    waits = [i for i, e in enumerate(log) if e["kind"] == "wait_stream" and e["stream"] == "gather"]
    roots = [i for i, e in enumerate(log) if e["kind"] == "lifecycle" and e["event"] == "gather_start"
             and e["unit"] == "<root>"]
    assert len(waits) == len(roots) == 2, (waits, roots)  # two steps, one root forward each
    ends = [i for i, e in enumerate(log) if e["kind"] == "lifecycle" and e["event"] == "backward_end"]
    assert waits[0] < roots[0] < ends[0] < waits[1] < roots[1] < ends[1], "at each root pre-forward, before it gathers"


def _gathers_checked(run):
    """Assert that when a gather is recorded, the gather stream is ordered after no compute of the unit that
    started computing last; return how many gathers were checked, and which blocks' forward gathers."""
    last_compute, checked, blocks_checked = None, 0, set()
    replay = GatherStreamReplay(run["log"])
    owner = None
    for pos, entry in replay:
        if entry["kind"] == "lifecycle" and entry["event"] == "backward_end":
            last_compute = None  # the next iteration's first gathers come before any of its compute
        if entry["kind"] == "lifecycle":
            owner = entry["unit"] if entry["event"].endswith("gather_start") else None
            if entry["event"] in ("forward_start", "backward_start"):
                last_compute = (pos, entry["unit"], entry["event"])
        elif entry["kind"] == "record" and entry["stream"] == "gather" and last_compute is not None:
            at, unit, event = last_compute
            assert replay.horizon < at, (f"the gather of {owner} waits for compute queued after {unit}'s "
                                         f"{event} (horizon {replay.horizon} >= {at})")
            checked += 1
            if event == "forward_start" and unit.startswith("blocks."):
                blocks_checked.add(owner)
    return checked, blocks_checked


def test_no_gather_waits_for_the_compute_queued_just_before_it(default_fake):
    """Implicit prefetching: when a gather (forward or backward re-gather) is recorded, the gather stream is
    ordered after no compute of the unit that started computing last, so the GPU can run the two together.
    In forward that is the gather of block i+1 against block i's compute."""
    checked, blocks_checked = _gathers_checked(default_fake)
    assert checked >= 16 and {"blocks.1", "blocks.2", "blocks.3"} <= blocks_checked, (checked, blocks_checked)


def _replay_buffers(run):
    """Check every buffer rule along the log; return the most blocks' buffers alive at once, per phase."""
    replay = GatherStreamReplay(run["log"])
    limit = run["all_gather_limit"]
    alive, held, readers_done, last_use = {}, set(), {}, {}
    peak = {"forward": 0, "backward": 0}
    phase = "forward"
    for pos, entry in replay:
        kind = entry["kind"]
        if kind == "lifecycle":
            unit, event = entry["unit"], entry["event"]
            phase = entry["phase"] if entry["phase"] in peak else phase
            if event == "free":
                readers_done[unit] = last_use[unit]
                held |= {f for f, u in alive.items() if u == unit}
            else:
                last_use[unit] = pos
        elif kind == "alloc":
            assert entry["stream"] == "gather", f"{entry}: the unsharded buffer is allocated on the gather stream"
            if entry["fresh"]:
                if limit is not None:
                    assert len(held) <= limit - 1, f"{len(held)} freed buffers held when a gather allocates"
                alive[entry["flat"]] = entry["unit"]
            else:  # a held buffer gathered again: written only after its readers are done
                assert entry["flat"] in held, entry
                assert replay.horizon >= readers_done[entry["unit"]], f"{entry} rewritten before its readers' event"
            held.discard(entry["flat"])
        elif kind == "release":
            unit = entry["unit"]
            assert entry["flat"] in held, f"{entry}: released while its unit is not freed"
            assert replay.horizon >= readers_done[unit], (
                f"{unit}'s buffer released (its block reusable by the next gather) before the gather stream waited "
                f"for its readers: horizon {replay.horizon}, last use at {readers_done[unit]}")
            held.discard(entry["flat"])
            alive.pop(entry["flat"])
        if limit is not None:
            assert len(held) <= limit, f"{len(held)} freed buffers held, limit {limit}"
        blocks = sum(u != "<root>" for u in alive.values())
        peak[phase] = max(peak[phase], blocks)
        if kind == "lifecycle" and entry["event"] == "backward_end":
            assert not alive, f"buffers still allocated at the end of backward: {set(alive.values())}"
    return peak


def test_no_buffer_is_reused_before_its_readers_event(default_fake):
    """A freed unit's buffer keeps its storage until the gather stream has waited for the compute event after
    its last reader; only then is it released (its block reusable) or gathered into again. At most two blocks'
    buffers are allocated in forward (limit_all_gathers), one more in backward with BACKWARD_PRE's prefetch."""
    peak = _replay_buffers(default_fake)
    assert peak == {"forward": 2, "backward": 3}, peak
    assert default_fake["freed_after"] and not any(default_fake["freed_after"])


def test_limit_all_gathers_false_leaves_the_buffers_unbounded():
    """The fake GPU never catches up, so without the limit every block's buffer stays allocated through forward,
    and the same safety rules still hold."""
    run = _fake(limit_all_gathers=False)
    peak = _replay_buffers(run)
    blocks = sum(u.startswith("blocks.") for u in run["units"])
    assert peak["forward"] == blocks > 2, (peak, blocks)


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "ZERO1", "NO_SHARD"])
def test_stream_rules_hold_for_every_strategy_in_bf16(strategy):
    """bf16 gives every strategy a separate unsharded buffer (ZeRO-1 and NO_SHARD a working copy of their fp32
    replica): the same gather and buffer rules hold, and the numbers are those of CPU's null streams."""
    run = run_on_ranks(fake_stream_run, 2, strategy, {"mixed_precision": BF16}, timeout_s=150)[0]
    assert run["losses"] == run["ref_losses"]
    _gathers_checked(run)
    peak = _replay_buffers(run)
    assert peak["forward"] >= 1
    assert run["freed_after"] and not any(run["freed_after"])


def test_reduce_and_compute_waits_on_fake_streams(default_fake):
    """The compute stream waits for a unit's gather before the unit computes and for every reduce by the end of
    backward; the reduce stream waits for compute before each reduce; at most `limit` reduces are held. Every
    event wait names the stream that waits (a bare `event.wait()` would order whatever stream is current)."""
    out = default_fake
    waited, pending_gather, gather_owner, reduce_open = set(), {}, None, []
    reduce_synced = False
    checked = 0
    for entry in out["log"]:
        kind = entry["kind"]
        if kind == "wait_stream":
            assert entry["on"] == "compute", entry
            reduce_synced |= entry["stream"] == "reduce"
        elif kind == "record":
            if entry["stream"] == "gather":
                assert gather_owner is not None, "a gather event outside any gather"
                pending_gather.setdefault(gather_owner, set()).add(entry["id"])
            elif entry["stream"] == "reduce":
                assert reduce_synced, f"{entry}: the reduce stream did not wait for compute first"
                reduce_synced = False
                reduce_open.append(entry["id"])
        elif kind == "wait_event":
            assert entry["stream"] is not None, f"{entry}: a wait left to the current stream"
            if entry["stream"] == "compute":
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
    assert sum(e["kind"] == "wait_event" and e["stream"] == "compute" for e in out["log"]) >= 6
