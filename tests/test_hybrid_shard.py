"""HSDP on 4 gloo ranks as 2×2: FSDP1's HYBRID_SHARD / _HYBRID_SHARD_ZERO2 and fully_shard on a 2-D mesh, against
torch's FSDP1 and fully_shard and against one process; the trace's bytes per group against the ring formulas."""
from __future__ import annotations

import pytest
from ranks_hybrid import STEPS, all_cases, one_process

from fsdp_lab.theory import formulas as F
from fsdp_lab.training.launch import run_on_ranks

WORLD = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(all_cases, WORLD, str(tmp_path_factory.mktemp("hsdp") / "ckpt"), timeout_s=420)


@pytest.fixture(scope="module")
def single():
    return one_process()


def _case(ranks, name):
    for facts in ranks:
        assert not isinstance(facts[name], str), facts[name]
    return [facts[name] for facts in ranks]


def _close(a, b, tol=TOL):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("groups", ["mesh", "pair"])
def test_fsdp1_hybrid_matches_torch_and_one_process(ranks, single, strategy, groups):
    for facts in _case(ranks, "fsdp1"):
        got = facts[f"{strategy}/{groups}"]
        ours, theirs = got["losses"]
        assert len(ours) == STEPS and _close(ours, theirs), got["losses"]
        assert _close(*got["norms"]), got["norms"]
        assert _close(ours, single["losses"]) and _close(got["norms"][0], single["norms"]), (got, single)
        assert got["params"] <= TOL and got["keys"], got
        # sharded 2 ways (inside the "node"), not 4
        assert got["shard_numel"] * 2 >= got["full_numel"] > got["shard_numel"]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_fsdp1_hybrid_gradients_match_torch_and_one_process(ranks, strategy):
    for facts in _case(ranks, "grads"):
        got = facts[strategy]
        assert got["scale"] > 1e-3, got  # gradients that are not all zero
        assert got["torch"] <= TOL and got["one_process"] <= TOL, got


def test_fsdp1_hybrid_refuses_by_name(ranks):
    got = _case(ranks, "refusals")[0]
    assert got["both"].startswith("ValueError: Cannot pass both process_group and device_mesh"), got
    assert "ndim=2" in got["one_dim"] and "ndim=1" in got["one_dim"], got
    assert "(shard_pg, replicate_pg)" in got["not_a_pair"] and got["not_a_pair"].startswith("ValueError"), got
    assert got["manual"].startswith("ValueError: Manual wrapping with HYBRID_SHARD"), got
    assert "SHARDED_STATE_DICT" in got["sharded_state_dict"] and "HYBRID_SHARD" in got["sharded_state_dict"]
    assert got["three_dims"].startswith("ValueError: fully_shard mesh with 3 dimensions"), got
    assert got["pair_not_hybrid"].startswith("ValueError: process_group as a tuple of 2 groups"), got


def test_fsdp1_hybrid_default_groups_on_cpu_are_refused_where_torch_stops_averaging(ranks, single):
    facts = _case(ranks, "default_groups")
    for rank, got in enumerate(facts):
        assert got["ours"].startswith("ValueError: HYBRID_SHARD without device_mesh or process_group"), got
        assert "device_count(), which is 1" in got["ours"], got
        assert got["torch_groups"] == ((rank,), tuple(range(WORLD))), got
    # torch's ranks each trained alone: the mean loss after one step is not the one-process loss
    assert not _close(facts[0]["torch_losses"][1:], single["losses"][1:2], 1e-4), (facts[0], single)


def test_fsdp1_hybrid_full_state_dict_round_trip(ranks):
    for got in _case(ranks, "round_trip"):
        assert got["first"] == got["second"], got


def test_fsdp1_hybrid_checkpoint_resumes_exactly(ranks):
    for got in _case(ranks, "checkpoint"):
        assert got["hybrid"] == got["whole"][2:], got
        assert _close(got["full"], got["whole"][2:]), got
    # written once for both shard groups (parameters, exp_avg, exp_avg_sq in fp32), not once per group
    assert got["one_copy"] <= got["written"] < 1.1 * got["one_copy"], got


def _ring(kind, numel, world, itemsize=4):
    return numel * itemsize * (world - 1) // world * (2 if kind == "all_reduce" else 1)


def test_fsdp1_bytes_per_group_match_the_ring_formulas(ranks):
    for rank, got in enumerate(_case(ranks, "bytes")):
        flats = dict(got["flats"])
        gathers = sum(_ring("all_gather", n, 2) * (1 if name == got["root"] else 2) for name, n in flats.items())
        scatter = sum(_ring("reduce_scatter", n, 2) for n in flats.values())
        across = sum(_ring("all_reduce", n // 2, 2) for n in flats.values())  # the reduced shard, 1/G of it
        assert got["by_collective"] == {("shard", "all_gather"): gathers, ("shard", "reduce_scatter"): scatter,
                                        ("replicate", "all_reduce"): across}, got
        assert got["by_group"] == {"shard": gathers + scatter, "replicate": across}
        # the course's formula (theory.formulas.node_traffic), fp32 on the wire: across nodes exactly; inside
        # them less the root's backward re-gather, which FSDP skips (the root stays gathered)
        predicted = F.node_traffic(sum(flats.values()), 2, 2, "HYBRID_SHARD", param_bytes=4, reduce_bytes=4)
        assert got["by_group"]["replicate"] == predicted.inter_node
        assert got["by_group"]["shard"] == predicted.intra_node - _ring("all_gather", flats[got["root"]], 2)
        node, local = divmod(rank, 2)
        shard_ranks, replicate_ranks = (2 * node, 2 * node + 1), (local, local + 2)
        assert got["labels"] == sorted([("replicate", replicate_ranks), ("shard", shard_ranks)])
        assert got["by_ranks"] == {shard_ranks: gathers + scatter, replicate_ranks: across}


def test_fully_shard_2d_mesh_matches_torch_and_one_process(ranks, single):
    for got in _case(ranks, "fsdp2"):
        ours, theirs = got["losses"]
        assert _close(ours, theirs) and _close(*got["norms"]), got
        assert _close(ours, single["losses"]) and _close(got["norms"][0], single["norms"]), (got, single)
        assert got["params"] <= TOL and got["grads"] <= TOL and got["names"] and got["local_shapes"], got
        assert got["placements"] == ["R", "S(0)"] and got["mesh_dims"] == ("replicate", "shard"), got


def test_fully_shard_2d_mesh_dcp_round_trip(ranks):
    for got in _case(ranks, "fsdp2_dcp"):
        assert got["first"] == got["second"], got
        assert got["placements"] == ["(Replicate(), Shard(dim=0))"], got


def test_fsdp1_hybrid_sync_module_states_gives_every_rank_rank0s_weights(ranks):
    for got in _case(ranks, "sync"):
        assert got["diff"] == 0.0 and got["differs_unsynced"], got


def test_hybrid_zero2_keeps_parameters_gathered_after_forward(ranks):
    for got in _case(ranks, "kept"):
        assert got["HYBRID_SHARD"] == ["SHARDED", "SHARDED", "UNSHARDED"], got  # blocks freed, the root kept
        assert got["_HYBRID_SHARD_ZERO2"] == ["UNSHARDED"] * 3, got
        assert got["HYBRID_SHARD/after_backward"] == got["_HYBRID_SHARD_ZERO2/after_backward"] == ["SHARDED"] * 3


def test_fully_shard_2d_mesh_bytes_per_group(ranks):
    for got in _case(ranks, "fsdp2_bytes"):
        gathers = sum(_ring("all_gather", n, 2) * (2 if reshard else 1) for _name, n, reshard in got["units"])
        scatter = sum(_ring("reduce_scatter", n, 2) for _name, n, _r in got["units"])
        across = sum(_ring("all_reduce", n // 2, 2) for _name, n, _r in got["units"])
        assert got["by_collective"] == {("shard", "all_gather"): gathers, ("shard", "reduce_scatter"): scatter,
                                        ("replicate", "all_reduce"): across}, got


@pytest.mark.parametrize("world_size", [2, 4])
def test_groups_that_are_no_shard_by_replicate_grid_are_refused_on_every_rank(world_size):
    from ranks_hybrid import grid_refusals

    every = run_on_ranks(grid_refusals, world_size, timeout_s=120)
    for rank, got in enumerate(every):
        assert got["world_world"] == (
            f"ValueError: HYBRID_SHARD needs the shard and replicate groups to form a grid of the {world_size} "
            f"ranks: rank {rank}'s shard group {list(range(world_size))} ({world_size} ranks) times its replicate "
            f"group {list(range(world_size))} ({world_size} ranks) is {world_size * world_size} ranks, not "
            f"{world_size}"), got
        if world_size == 4:
            for key, front in (("fsdp1_3x1", "HYBRID_SHARD"), ("fsdp2_3x1", "fully_shard")):
                assert got[key] == (f"ValueError: {front} needs the shard and replicate groups to form a grid of "
                                    f"the 4 ranks: the mesh [[0], [1], [2]] (replicate 3 x shard 1) holds 3 ranks, "
                                    f"not 4"), (rank, got)
