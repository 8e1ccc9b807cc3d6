"""fully_shard's shard_placement_fn against torch's fully_shard on 2 gloo ranks and against one process
(tests/ranks_shard_placement.py; [Note: sharding on another dim] in fsdp_lab/runtime/fsdp2/shard_dim.py)."""
from __future__ import annotations

import pytest
from ranks_shard_placement import run

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shard_placement"))
    torch_ranks = run_on_ranks(run, 2, "torch", folder, timeout_s=400)  # first: the fsdp_lab ranks load its save
    return {"torch": torch_ranks, "fsdp_lab": run_on_ranks(run, 2, "fsdp_lab", folder, timeout_s=400),
            "plain": run(0, 1, "plain", folder)}


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("case", ["fp32", "bf16", "offload", "hsdp"])
def test_training_with_shard1_matches_torch_and_one_process(runs, case):
    """AdamW with gradient accumulation (set_requires_gradient_sync(False) first): the full parameters match
    torch's fully_shard with the same shard_placement_fn and, in fp32, one process."""
    plain = runs["plain"]["fp32"]
    for rank, (got, ref) in enumerate(zip(runs["fsdp_lab"], runs["torch"])):
        got, ref = got[case], ref[case]
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL), (case, rank)
        assert got["grads"] == ref["grads"], "the same parameters keep a gradient"
        assert diff(got["params"], ref["params"]) <= TOL, (case, rank)
        if case != "bf16":
            assert diff(got["params"], plain["params"]) <= TOL, (case, rank)
            assert got["losses"] == pytest.approx(plain["losses"], abs=TOL), (case, rank)


@pytest.mark.parametrize("case", ["fp32", "bf16", "offload", "hsdp"])
def test_placements_local_shapes_and_state_dict_match_torch(runs, case):
    for rank, (got, ref) in enumerate(zip(runs["fsdp_lab"], runs["torch"])):
        got, ref = got[case]["layout"], ref[case]["layout"]
        assert got == ref, (case, rank)
        lead = ["R"] if case == "hsdp" else []
        assert got["layers.0.up.weight"] == {"placements": lead + ["S(1)"], "local": (10, 4), "global": (10, 8),
                                             "state_dict": lead + ["S(1)"]}
        assert got["layers.1.down.weight"]["placements"] == lead + ["S(1)"], "Shard(-1) of a 2-D weight is Shard(1)"
        assert got["layers.1.gate.weight"]["local"] == (8, 4), "a frozen weight is sharded on its dim 1 too"
        assert got["head.bias"]["placements"] == lead + ["S(0)"], "None: the default Shard(0)"
        assert got["head.bias"]["local"] == ((6,) if rank == 0 else (5,)), "dim 0 stays uneven"


def test_dcp_checkpoint_of_shard1_loads_into_shard0_models(runs):
    """dcp.save of a Shard(1) model's state_dict(), dcp.load into Shard(0) models of either library: the same
    full weights, each library's save into each library's model."""
    for rank, got in enumerate(runs["fsdp_lab"]):
        saved = {"torch": runs["torch"][rank]["saved"], "fsdp_lab": got["saved"]}
        assert set(got["loads"]) == {"torch->torch", "torch->fsdp_lab", "fsdp_lab->torch", "fsdp_lab->fsdp_lab"}
        for key, loaded in got["loads"].items():
            assert diff(loaded["params"], saved[key.split("->")[0]]) == 0.0, (key, rank)
            assert loaded["layout"]["layers.0.up.weight"]["placements"] == ["S(0)"], key
        theirs = got["loads"]["torch->torch"]["layout"]
        assert all(loaded["layout"] == theirs for loaded in got["loads"].values()), "the Shard(0) models alike"


def test_uneven_shard_on_dim1_is_refused_as_torch_refuses_it(runs):
    for got, ref in zip(runs["fsdp_lab"], runs["torch"]):
        ours, theirs = got["refused"]["uneven"], ref["refused"]["uneven"]
        assert theirs is not None and theirs.startswith("NotImplementedError") and "uneven sharding on dim 1" in theirs
        assert ours is not None and ours.startswith("NotImplementedError"), ours
        for words in ("'weight'", "(4, 3)", "dim 1", "size 3", "2 ranks"):
            assert words in ours, (words, ours)


def test_shard1_of_a_tensor_parallel_weight_is_refused_by_name(runs):
    for got in runs["fsdp_lab"]:
        message = got["refused"]["tp"]
        assert message is not None and message.startswith("NotImplementedError"), message
        assert "tensor parallel" in message and "'weight'" in message and "Shard(1)" in message, message
