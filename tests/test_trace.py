"""The lifecycle trace on real 2-rank runs: off costs nothing, on records every beat with exact memory, and a
second process can follow the files while the job is still writing them."""
from __future__ import annotations

import json
import threading
import time

import pytest

from fsdp_lab.lessons.experiments import run_lifecycle, trace_on_off, unit_event_sequences
from fsdp_lab.lessons.experiments.lifecycle import FULL_SHARD_ROOT_EVENTS, FULL_SHARD_UNIT_EVENTS
from fsdp_lab.observe import trace
from fsdp_lab.observe.follow import follow
from fsdp_lab.runtime.fsdp1.flat_param import padded_size
from fsdp_lab.training.models import build_gpt, count_params

WORLD = 2
STEPS = 3


def _expected_full_bytes(preset: str, world_size: int) -> dict[str, int]:
    """Bytes of each unit's gathered fp32 buffer, from the plain model: each Block is a unit, the rest is the root
    (the tied embedding/head weight counted once), padded to a multiple of the world size."""
    model = build_gpt(preset)
    blocks = {f"blocks.{i}": count_params(b) for i, b in enumerate(model.blocks)}
    root = count_params(model) - sum(blocks.values())
    return {name: padded_size(n, world_size) * 4 for name, n in {**blocks, "<root>": root}.items()}


@pytest.mark.timeout(180)
def test_tracing_off_emits_nothing_and_does_not_change_the_losses():
    for r in trace_on_off(WORLD, steps=2):
        assert r["memory_reports_untraced"] == 0, f"tracing off still counted memory: {r}"
        assert r["memory_reports_traced"] == r["events_traced"] > 0, r
        assert r["losses_traced"] == r["losses_untraced"], f"rank {r['rank']}: {r}"
        assert r["events_while_attached"] > 0
        assert r["events_after_detach"] == r["events_while_attached"], \
            f"a detached tracer still received {r['events_after_detach'] - r['events_while_attached']} events"


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A 3-step FULL_SHARD job on 2 ranks, run in a background thread (its ranks are two other processes)
    while this process follows the trace files. Returns what the job returned, what the follower saw (with the
    time and whether the job had finished), the trace folder and the job's end time."""
    directory = tmp_path_factory.mktemp("live")
    outcome: dict = {}
    finished = threading.Event()

    def job():
        try:
            outcome["events"] = run_lifecycle(WORLD, "FULL_SHARD", steps=STEPS, trace_dir=str(directory),
                                              step_sleep_s=1.0, timeout_s=150)
        except BaseException as exc:  # re-raised below
            outcome["error"] = exc
        finally:
            outcome["finished_at"] = time.time()
            finished.set()

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    followed = [(e, time.time(), finished.is_set())
                for e in follow(directory, WORLD, poll_s=0.05, timeout_s=160, stop=finished.is_set)]
    thread.join(timeout=10)
    if "error" in outcome:
        raise outcome["error"]
    return {"events": outcome["events"], "followed": followed, "directory": directory,
            "finished_at": outcome["finished_at"]}


@pytest.mark.timeout(200)
def test_full_shard_event_sequence_per_unit(live_run):
    events = live_run["events"]
    units = _expected_full_bytes("tiny", WORLD)
    for rank in range(WORLD):
        seqs = unit_event_sequences(events, rank)
        assert sorted(seqs) == sorted((step, u) for step in range(STEPS) for u in units), seqs.keys()
        for (step, unit), seq in seqs.items():
            expected = FULL_SHARD_ROOT_EVENTS if unit == "<root>" else FULL_SHARD_UNIT_EVENTS
            assert tuple(seq) == expected, f"rank {rank} step {step} unit {unit}: {seq}"
        for step in range(STEPS):
            names = [e["event"] for e in events if e["rank"] == rank and e["step"] == step]
            assert names[-2:] == ["backward_end", "optimizer_step"], (step, names[-2:])


def test_memory_rises_on_gather_and_falls_on_free_by_the_unit_bytes(live_run):
    events = live_run["events"]
    full_bytes = _expected_full_bytes("tiny", WORLD)
    for rank in range(WORLD):
        mine = [e for e in events if e["rank"] == rank]
        assert mine[0]["mem"]["params_unsharded"] == 0, "nothing is gathered before the first gather"
        for before, e in zip(mine, mine[1:]):
            delta = e["mem"]["params_unsharded"] - before["mem"]["params_unsharded"]
            if e["event"] in ("gather_end", "regather_end"):
                assert delta == full_bytes[e["unit"]], (rank, e["event"], e["unit"], delta)
            elif e["event"] == "free":
                assert delta == -full_bytes[e["unit"]], (rank, e["event"], e["unit"], delta)
            else:
                assert delta == 0, f"{e['event']} of {e['unit']} changed params_unsharded by {delta}"
        for e in (e for e in mine if e["event"] == "grad_ready"):  # the unsharded gradient, before its reduce
            assert e["mem"]["grads_unsharded"] == full_bytes[e["unit"]], (rank, e["unit"], e["mem"])
        ends = [e for e in mine if e["event"] in ("backward_end", "optimizer_step")]
        assert len(ends) == 2 * STEPS and all(e["mem"]["params_unsharded"] == 0 for e in ends), \
            "every unit is freed after each backward"
        for e in mine:
            assert set(e) >= {"t", "rank", "step", "unit", "phase", "event", "bytes_sent", "bytes_received", "mem"}
            assert e["mem"]["total"] == sum(v for k, v in e["mem"].items() if k != "total")


def test_rank_files_merge_into_the_same_timeline(live_run):
    events = live_run["events"]
    loaded = trace.load_trace(live_run["directory"])
    assert sorted(json.dumps(e, sort_keys=True) for e in loaded) == \
        sorted(json.dumps(e, sort_keys=True) for e in events)
    assert [e["t"] for e in loaded] == sorted(e["t"] for e in loaded)
    assert {e["rank"] for e in loaded} == set(range(WORLD))


def test_follow_waits_for_missing_files_and_half_written_lines(tmp_path):
    path0, path1 = trace.rank_file(tmp_path, 0), trace.rank_file(tmp_path, 1)
    first = {"t": 1.0, "rank": 0, "step": 0, "event": "gather_start"}
    second = {"t": 2.0, "rank": 0, "step": 0, "event": "gather_end"}
    other = {"t": 1.5, "rank": 1, "step": 0, "event": "gather_start"}
    line2 = json.dumps(second) + "\n"
    path0.write_text(json.dumps(first) + "\n" + line2[:10])  # rank 1 has no file yet; rank 0's line 2 is half
    done = threading.Event()

    def writer():
        time.sleep(0.3)
        with open(path0, "a") as fh:
            fh.write(line2[10:])
        path1.write_text(json.dumps(other) + "\n")
        time.sleep(0.3)
        done.set()

    seen = []
    thread = threading.Thread(target=writer)
    thread.start()
    for e in follow(tmp_path, 2, poll_s=0.02, timeout_s=10, stop=done.is_set):
        seen.append((e, done.is_set()))
    thread.join()
    assert [e for e, _ in seen] == [first, other, second]
    assert not seen[0][1], "the complete first line is yielded at once, before the writer finishes"


def test_follow_sees_step_0_while_the_two_rank_job_is_still_running(live_run):
    """Step 0 must reach the follower before the job has finished: it is live, not a post-mortem reader. The
    job sleeps 1 s after each step, so step 0 ends more than 2 s before the job does."""
    followed, finished_at = live_run["followed"], live_run["finished_at"]
    step0_end = [(seen_at, done) for e, seen_at, done in followed
                 if e["step"] == 0 and e["event"] == "optimizer_step"]
    assert len(step0_end) == WORLD, f"saw {len(step0_end)} step-0 optimizer_step events"
    for seen_at, done in step0_end:
        assert not done and seen_at < finished_at, \
            f"step 0 was seen at {seen_at:.2f}, the job finished at {finished_at:.2f}"
    assert finished_at - max(s for s, _ in step0_end) > 1.0, (finished_at, step0_end)
    steps_in_order = [e["step"] for e, _, _ in followed if e["rank"] == 0]
    assert steps_in_order == sorted(steps_in_order) and steps_in_order[-1] == STEPS - 1
    assert sorted(json.dumps(e, sort_keys=True) for e, _, _ in followed) == \
        sorted(json.dumps(e, sort_keys=True) for e in live_run["events"]), "the follower lost or repeated events"
