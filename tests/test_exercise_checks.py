"""The "Your turn" checks (fsdp_lab.lessons.live.checks) against the solution, the stub of the learner's copy
("not written yet"), and at least two wrong answers a learner really types, each on a case where it shows: the
numbers' cores in this process, the checks that read a wrapped model on 2 gloo ranks (tests/ranks_exercise_checks.py)."""
from __future__ import annotations

import functools

import pytest
import torch
from ranks_exercise_checks import run_cases

from fsdp_lab.lessons.live import checks
from fsdp_lab.training.launch import run_on_ranks

BLOCKS = ["blocks.0", "blocks.1"]


def _nyi(*_args):
    raise NotImplementedError("the stub")


def assert_right(verdict):
    assert verdict.ok and not verdict.todo, verdict.message


def assert_wrong(verdict, *words):
    assert not verdict.ok and not verdict.todo, verdict.message
    for word in words:
        assert word in verdict.message, verdict.message


def assert_not_written(verdict):
    assert not verdict.ok and verdict.todo, verdict.message
    assert "not written yet" in str(verdict)


# -- 02 shard_range: the uneven flat buffers come first, so `numel // n` cannot pass on an even model --------------
def shard_range_solution(numel, n, rank):
    size = -(-numel // n)
    return rank * size, (rank + 1) * size


def test_shard_range_takes_the_solution_and_names_the_stub():
    assert_right(checks.shard_range_of(shard_range_solution, checks.uneven_chunks()))
    assert_not_written(checks.shard_range_of(_nyi, checks.uneven_chunks()))
    assert_not_written(checks.shard_range(shard_range_solution, None))  # the stub of a wrap line: model = None


@pytest.mark.parametrize("check", ["shard_range", "dim0_rows", "hsdp_groups"])
def test_a_stubbed_function_is_not_written_yet_whatever_model_the_cell_holds(check):
    """06a: the wrap line above is a stub too, so the model is a plain GPT; the check names its own stub first."""
    from fsdp_lab.training.models import build_gpt

    extra = {"nodes": 2} if check == "hsdp_groups" else {}
    verdict = getattr(checks, check)(_nyi, build_gpt("tiny"), **extra)
    assert_not_written(verdict)
    assert "the stub" in verdict.message and "plain" not in verdict.message


def test_shard_range_refuses_plain_division_even_when_every_unit_divides():
    def divided(numel, n, rank):
        return rank * (numel // n), (rank + 1) * (numel // n)

    assert all(divided(numel, 2, r) == shard_range_solution(numel, 2, r) for numel in (8, 16) for r in (0, 1))
    assert_wrong(checks.shard_range_of(divided, checks.uneven_chunks()), "padding counts")


def test_shard_range_refuses_an_inclusive_stop_and_a_shifted_start():
    chunks = checks.uneven_chunks()
    assert_wrong(checks.shard_range_of(lambda numel, n, r: (r * -(-numel // n), (r + 1) * -(-numel // n) - 1),
                                       chunks), "padding counts")
    assert_wrong(checks.shard_range_of(lambda numel, n, r: ((r + 1) * -(-numel // n), (r + 2) * -(-numel // n)),
                                       chunks), "starts at the wrong place")


# -- 06a dim0_rows: the case the tiny GPT cannot show (5 rows on 4 ranks: 2, 2, 1, 0) ------------------------------
def dim0_solution(dim0, n, rank):
    rows = -(-dim0 // n)
    start = min(rank * rows, dim0)
    return start, min(start + rows, dim0)


def test_dim0_rows_cases_follow_fully_shards_own_cut():
    cases = checks.dim0_cases([("p", 5, 4)])
    assert [(start, stop) for *_rest, start, stop in cases] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert_right(checks.dim0_rows_of(dim0_solution, checks.uneven_rows()))
    assert_not_written(checks.dim0_rows_of(_nyi, checks.uneven_rows()))


def test_dim0_rows_refuses_plain_division():
    def divided(dim0, n, rank):  # right for every first dimension of the tiny GPT on 2 ranks
        return rank * (dim0 // n), (rank + 1) * (dim0 // n)

    assert all(divided(d, 2, r) == dim0_solution(d, 2, r) for d in (64, 192, 256) for r in (0, 1))
    assert_wrong(checks.dim0_rows_of(divided, checks.uneven_rows()), "loses rows")


def test_dim0_rows_refuses_ceil_without_the_clamp_and_a_tuple_of_the_wrong_shape():
    def unclamped(dim0, n, rank):
        rows = -(-dim0 // n)
        return rank * rows, (rank + 1) * rows

    assert_wrong(checks.dim0_rows_of(unclamped, checks.uneven_rows()), "stop at")
    assert_wrong(checks.dim0_rows_of(lambda dim0, n, r: -(-dim0 // n), checks.uneven_rows()), "(start, stop)")


# -- 03 the beats of one FULL_SHARD step ----------------------------------------------------------------------------
def step_solution(blocks, strategy):
    events = [("gather", "<root>")]
    for b in blocks:
        events += [("gather", b), ("free", b)]
    for b in reversed(blocks):
        events += [("regather", b), ("reduce_scatter", b), ("free", b)]
    return events + [("reduce_scatter", "<root>"), ("free", "<root>")]


def test_beat_order_solution_stub_and_two_wrong_orders():
    want = step_solution(BLOCKS, "FULL_SHARD")
    assert_right(checks.beat_order_of(step_solution, want, "FULL_SHARD"))
    assert_not_written(checks.beat_order_of(_nyi, want, "FULL_SHARD"))

    def forward_order_backward(blocks, strategy):  # backward in the forward's order
        return step_solution(list(reversed(blocks)), strategy)[:1] + step_solution(blocks, strategy)[1:5] + [
            e for b in blocks for e in (("regather", b), ("reduce_scatter", b), ("free", b))] + want[-2:]

    def no_regather(blocks, strategy):  # the backward gathers again, as if it were a forward
        return [("gather", u) if e == "regather" else (e, u) for e, u in step_solution(blocks, strategy)]

    assert_wrong(checks.beat_order_of(forward_order_backward, want, "FULL_SHARD"), "regather:blocks.1")
    assert_wrong(checks.beat_order_of(no_regather, want, "FULL_SHARD"), "you say gather:blocks.1")


# -- 08 the reduce-scatter by hand ----------------------------------------------------------------------------------
def test_reduce_scatter_mean_solution_stub_and_two_wrong_chunks():
    grads = [torch.arange(8.0) * (r + 1) for r in range(2)]
    mean = (grads[0] + grads[1]) / 2
    assert_right(checks.reduce_scatter_mean(mean[4:], grads, 1))
    assert_not_written(checks.reduce_scatter_mean(None, grads, 1))
    assert_wrong(checks.reduce_scatter_mean(mean[4:] * 2, grads, 1), "divide by world_size")
    assert_wrong(checks.reduce_scatter_mean(grads[1][4:], grads, 1), "your own gradient")
    assert_wrong(checks.reduce_scatter_mean(mean[:4], grads, 1), "chunk 0")


# -- 09 and 10: losses and the bytes ratio --------------------------------------------------------------------------
def test_same_losses_solution_stub_and_two_wrong_runs():
    a = [4.2, 4.1, 4.0]
    assert_right(checks.same_losses(a, list(a)))
    assert_not_written(checks.same_losses(None, None))
    assert_wrong(checks.same_losses(a, [4.2, 4.1, 4.05]), "step 2")
    assert_wrong(checks.same_losses(a, a[:2]), "same number of steps")


def _events(sent, regathered=("blocks.0",)):
    return ([{"step": 0, "event": "all_gather", "unit": "u", "bytes_sent": sent}]
            + [{"step": 0, "event": "gather_end", "unit": u, "bytes_sent": 0} for u in ("<root>", "blocks.0")]
            + [{"step": 0, "event": "regather_end", "unit": u, "bytes_sent": 0} for u in regathered])


def test_comm_ratio_solution_stub_and_two_wrong_ratios():
    fsdp, ddp = _events(1400), _events(1000)
    assert_right(checks.comm_ratio(1.4, fsdp, ddp))
    assert_not_written(checks.comm_ratio(None, fsdp, ddp))
    assert_wrong(checks.comm_ratio(1000 / 1400, fsdp, ddp), "NO_SHARD over FULL_SHARD")
    assert_wrong(checks.comm_ratio(1.5, fsdp, ddp), "1.400")


# -- the checks that read a wrapped model, on 2 ranks ---------------------------------------------------------------
@functools.cache
def live() -> list:
    return run_on_ranks(run_cases, 2, timeout_s=240)


@pytest.mark.parametrize("rank", [0, 1])
def test_state_bytes_on_the_tiny_gpt(rank):
    got = live()[rank]["state"]
    assert got["solution"][0], got["solution"][2]
    assert got["stub"][:2] == (False, True) and "not written yet" in got["stub"][2]
    for wrong, why in (("undivided", "whole model"), ("params_only", "parameters only"), ("no_adam", "AdamW")):
        ok, todo, message = got[wrong]
        assert not ok and not todo and why in message, message


def test_mixed_precision_on_the_tiny_gpt():
    got = live()[0]["mixed"]
    assert got["solution"][0], got["solution"][2]
    assert got["stub"][:2] == (False, True) and "not written yet" in got["stub"][2]
    for wrong, why in (("bf16_reduce", "reduced in torch.bfloat16"), ("no_param_dtype", "not torch.bfloat16"),
                       ("none", "no mixed_precision")):
        ok, todo, message = got[wrong]
        assert not ok and not todo and why in message, message


def test_gathered_after_forward_under_shard_grad_op():
    got = live()[0]["gathered"]
    assert got["solution"][0], got["solution"][2]
    assert got["stub"][:2] == (False, True)
    for wrong, why in (("a_shard", "that is a shard"), ("root_only", "the root alone")):
        ok, todo, message = got[wrong]
        assert not ok and not todo and why in message, message


def test_wrapped_units_per_block():
    got = live()[0]["units"]
    assert got["solution"][0], got["solution"][2]
    for wrong, why in (("attention", "not one per Block"), ("no_policy", "one unit holds the whole model")):
        ok, todo, message = got[wrong]
        assert not ok and not todo and why in message, message


@pytest.mark.parametrize("rank", [0, 1])
def test_the_row_and_chunk_solutions_pass_on_the_real_models(rank):
    got = live()[rank]
    assert got["shard_range_solution"][0], got["shard_range_solution"][2]
    assert got["dim0_solution"][0], got["dim0_solution"][2]
    assert not got["dim0_on_fsdp1"][0] and "fully_shard" in got["dim0_on_fsdp1"][2]
    for key, case, why in (("shard_range_divided", "a 10-element unit", "padding counts"),
                           ("dim0_divided", "a (5,) parameter", "loses rows")):
        ok, todo, message = got[key]  # right for every unit and parameter of the tiny GPT, wrong where it shows
        assert not ok and not todo and case in message and why in message, message
    assert got["dim0_stub"][:2] == (False, True) and "not written yet" in got["dim0_stub"][2]


# -- 06b hsdp_groups: DeviceMesh's rows shard, its columns replicate -------------------------------------------------
def hsdp_solution(rank, nodes, per_node):
    node, local = divmod(rank, per_node)
    return [node * per_node + i for i in range(per_node)], [n * per_node + local for n in range(nodes)]


def test_hsdp_groups_take_the_solution_and_name_the_stub():
    assert [c[3:] for c in checks.hsdp_cases([(2, 2)])] == [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)),
                                                           ((2, 3), (1, 3))]
    assert_right(checks.hsdp_groups_of(hsdp_solution, checks.hsdp_cases()))
    assert_not_written(checks.hsdp_groups_of(_nyi, checks.hsdp_cases()))


def test_hsdp_groups_refuse_the_swapped_groups_and_local_indices():
    swapped = lambda r, m, g: hsdp_solution(r, m, g)[::-1]  # noqa: E731 (shard across the nodes: the slow links)
    assert_wrong(checks.hsdp_groups_of(swapped, checks.hsdp_cases()), "swapped")
    local = lambda r, m, g: (list(range(g)), list(range(m)))  # noqa: E731 (indices, not global ranks)
    assert_wrong(checks.hsdp_groups_of(local, checks.hsdp_cases()), "local indices")


def test_hsdp_groups_refuse_a_stride_of_nodes_and_a_wrong_shape():
    def by_nodes(rank, nodes, per_node):  # right on 2 x 2, where nodes == per_node; wrong on 2 x 4
        node, local = divmod(rank, nodes)
        return [node * nodes + i for i in range(nodes)], [n * nodes + local for n in range(per_node)]

    assert all(by_nodes(r, 2, 2) == hsdp_solution(r, 2, 2) for r in range(4))
    assert_wrong(checks.hsdp_groups_of(by_nodes, checks.hsdp_cases()), "2 nodes × 4 ranks")
    assert_wrong(checks.hsdp_groups_of(lambda r, m, g: r, checks.hsdp_cases()), "two lists of global ranks")


@pytest.mark.parametrize("rank", [0, 1])
def test_hsdp_groups_read_the_live_hybrid_model(rank):
    got = live()[rank]["hsdp"]
    assert got["solution"][0], got["solution"][2]
    assert not got["swapped"][0] and "swapped" in got["swapped"][2]
    assert got["stub"][:2] == (False, True)
    assert not got["full_shard"][0] and "no replicate group" in got["full_shard"][2]
    assert not got["fully_shard"][0] and "FSDP(...)" in got["fully_shard"][2]
