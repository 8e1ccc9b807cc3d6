"""The collective log names where ranks went apart: uneven batches, a collective one rank enters alone, two ranks
in different orders, on 2 and 4 gloo ranks under both front ends. Each report is asserted word for word (ranks,
ops, units, phases, sequence numbers), must come within the group's timeout plus 5 s of the mismatching call, and
no rank process may be left running. The scenarios are in tests/ranks_collective_log.py. Each group's first
collective is the check that every rank wrapped the same model (#1, at construction under FSDP, at the first
forward under fully_shard); the lifecycle's are numbered after it."""
from __future__ import annotations

import psutil
import pytest
import torch
from ranks_collective_log import (only_on_rank_0, patient_collective, ring_of_one_step, side_collective_on_rank_0_only,
                                  swapped_order, uneven_batches)

from fsdp_lab.runtime.core import collective_log
from fsdp_lab.runtime.core.collective_log import CollectiveLog
from fsdp_lab.training.launch import run_on_ranks

GROUP_TIMEOUT_S = 10.0  # the live ranks' default; 3 s let a collective of a starved rank time out under load
FRONT_ENDS = ("FSDP", "fully_shard")


def _who(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _run(fn, world_size, front_end) -> list[dict]:
    results = run_on_ranks(fn, world_size, front_end, timeout_s=150, collective_timeout_s=GROUP_TIMEOUT_S,
                           threads_per_rank=1)
    left = [r["pid"] for r in results if psutil.pid_exists(r["pid"])
            and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"rank processes left running: {left}"
    return results


def _reported(results, ranks) -> str:
    """The one message every failing rank reported, checked to have come within the timeout plus 5 s."""
    messages = {results[r]["message"] for r in ranks}
    assert len(messages) == 1, messages
    for r in ranks:
        assert results[r]["seconds"] < GROUP_TIMEOUT_S + 5, (r, results[r]["seconds"])
        assert "collective log: " + results[r]["message"] in results[r]["text"]
    return messages.pop()


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_uneven_batches_name_the_rank_with_one_more_step(front_end, world_size):
    others = list(range(1, world_size))
    results = _run(uneven_batches, world_size, front_end)
    assert _reported(results, [0]) == (
        f"rank 0 waits in all_gather #8 (0, forward), which {_who(others)} never entered: "
        f"{'its' if world_size == 2 else 'their'} last was reduce_scatter #7 (0, backward)")


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_collective_entered_on_rank_0_alone_is_named_with_its_phase(front_end, world_size):
    """FSDP: a full state dict on rank 0 only; fully_shard: an evaluation forward on rank 0 only. The others stay
    alive and idle, so rank 0's gather runs into the group's timeout."""
    others = list(range(1, world_size))
    phase = "state_dict" if front_end == "FSDP" else "forward"
    results = _run(only_on_rank_0, world_size, front_end)
    assert _reported(results, [0]) == (
        f"rank 0 waits in all_gather #8 (0, {phase}), which {_who(others)} never entered: "
        f"{'its' if world_size == 2 else 'their'} last was reduce_scatter #7 (0, backward)")


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_two_orders_are_named_where_they_wait_and_where_they_first_differ(front_end, world_size):
    """Rank 1 gathers (a state dict under FSDP, an evaluation under fully_shard) before its step, the others after
    theirs. Equal-sized gathers pair up silently; the report names both where they wait and the first sequence
    number at which their records differ."""
    rest = [r for r in range(world_size) if r != 1]
    verb = "waits in" if len(rest) == 1 else "wait in"
    results = _run(swapped_order, world_size, front_end)
    if front_end == "FSDP":
        first = f"#2: {_who(rest)} all_gather #2 (0, forward), rank 1 all_gather #2 (0, state_dict)"
    else:
        first = f"#4: {_who(rest)} all_gather #4 (2, backward), rank 1 all_gather #4 (0, forward)"
    assert _reported(results, range(world_size)) == (
        f"{_who(rest)} {verb} reduce_scatter #6 (2, backward); rank 1 is in all_gather #6 (2, backward); "
        f"the ranks first differ at {first}")


@pytest.mark.parametrize("what", ("optim_state_dict", "checkpoint"))
def test_a_side_collective_entered_on_rank_0_alone_is_named_with_its_phase(what):
    """Collectives off the unit lifecycle (fsdp_lab/runtime/core/side_collectives.py) are logged too: rank 0 alone
    asks for FSDP.optim_state_dict (its first collective gathers each rank's keys as objects) or saves a
    checkpoint (its first asks every rank whether its state is finite)."""
    results = _run(side_collective_on_rank_0_only, 2, what)
    message = _reported(results, [0])
    assert message == (f"rank 0 waits in all_gather_object #8 (root, {what}), which rank 1 never entered: its last "
                       f"was reduce_scatter #7 (0, backward)")
    assert "FSDP all_gather_object (2 objects, 2 ranks) did not complete" in results[0]["text"]
    assert "rank 0: #8 all_gather_object (root, " + what + ") shape [2] object pickled issued" in results[0]["text"]


def test_a_patient_collective_outlasts_the_groups_timeout_which_it_restores():
    """[Note: patient collectives]: rank 1 enters two group timeouts late, the patient all_gather_object waits
    for it; inside, the backend's timeout is the patient one, after it the group's own again."""
    results = _run(patient_collective, 2, "FSDP")
    for r in results:
        assert (r["own"], r["inside"], r["after"]) == (GROUP_TIMEOUT_S, 60.0, GROUP_TIMEOUT_S)
        assert r["everyone"] == [0, 1]
        assert r["record"] == (1, "all_gather_object", "root", "init", (2,), "object", 0, "done")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_one_step_records_each_collective_with_its_unit_phase_shape_and_bytes(front_end):
    snap = run_on_ranks(ring_of_one_step, 2, front_end, timeout_s=120, collective_timeout_s=30)[0]
    assert [r[:8] for r in snap["records"]] == [
        (1, "all_gather", "root", "init", (1,), "int64", 8, "done"),  # every rank wrapped the same model
        (2, "all_gather", "0", "forward", (20,), "float32", 80, "done"),
        (3, "all_gather", "2", "forward", (20,), "float32", 80, "done"),
        (4, "all_gather", "2", "backward", (20,), "float32", 80, "done"),
        (5, "all_gather", "0", "backward", (20,), "float32", 80, "done"),
        (6, "reduce_scatter", "2", "backward", (20,), "float32", 80, "done"),
        (7, "reduce_scatter", "0", "backward", (20,), "float32", 80, "done"),
    ]


def test_the_ring_is_bounded_and_keeps_the_newest_records():
    log = CollectiveLog("g", rank=0, ranks=(0, 1), size=4)
    t = torch.empty(3, 2, dtype=torch.bfloat16)
    recs = [log.issue("all_gather", f"blocks.{i}", "forward", t.shape, t.dtype, t.numel()) for i in range(6)]
    assert log.seq == 6 and len(log.records) == 4 and list(log.records) == recs[2:]
    recs[-1][collective_log.STATE] = collective_log.DONE
    snap = log.snapshot("finished")
    assert [r[:8] for r in snap["records"]][-2:] == [
        (5, "all_gather", "blocks.4", "forward", (3, 2), "bfloat16", 12, "issued"),
        (6, "all_gather", "blocks.5", "forward", (3, 2), "bfloat16", 12, "done")]
    assert collective_log.RING <= 64  # small: one store key carries a rank's whole ring


def test_a_rank_that_raised_or_never_posted_is_named():
    def snap(status, records, error=""):
        return {"rank": 0, "status": status, "error": error, "records": records}

    gather = (12, "all_gather", "root", "state_dict", (8,), "float32", 32, "issued", 0.0)
    scatter = (11, "reduce_scatter", "root", "backward", (8,), "float32", 32, "done", 0.0)
    text = collective_log.report({0: snap("failed", [scatter, gather]), 1: snap("raised", [scatter], "ValueError"),
                                  2: None})
    assert text == ("rank 0 waits in all_gather #12 (root, state_dict), which rank 1 never entered (it raised "
                    "ValueError): its last was reduce_scatter #11 (root, backward); rank 2 did not report (dead, or "
                    "stuck outside a collective)")


def test_outside_torch_distributed_nothing_is_logged():
    assert not torch.distributed.is_initialized() and collective_log.log_of(None) is None


def test_the_gpu_check_of_the_collective_log_covers_both_front_ends_and_runs_here_on_cpu():
    """The GPU checks (fsdp_lab/bench/gpu_checks.py, tests/test_gpu.py on two gloo ranks sharing one GPU) name a
    forward rank 0 runs alone under each front end; without CUDA the same checks run on CPU tensors, here."""
    from fsdp_lab.bench.gpu_checks import MULTI_RANK_CHECKS, run_checks

    names = [n for n in MULTI_RANK_CHECKS if n.startswith("collective_log_")]
    assert names == ["collective_log_names_a_skipped_forward", "collective_log_names_a_skipped_forward_fully_shard"]
    results = run_on_ranks(run_checks, 2, names, timeout_s=150, threads_per_rank=1)
    for rank, checks in enumerate(results):
        for check in checks:
            assert check["ok"], (rank, check["name"], check["detail"])
    reports = [check["detail"] for check in results[0]]
    assert reports[0].startswith("FSDP: 'rank 0 waits in all_gather") and "on cpu tensors" in reports[0], reports
    assert reports[1].startswith("fully_shard: 'rank 0 waits in all_gather"), reports
