"""torch DCP's state_dict functions on an FSDP1 model, fsdp_lab's against torch's, on 2 gloo ranks and 4
(tests/ranks_fsdp1_dcp.py).

get_model_state_dict(model) is sharded by default, as torch's: each rank holds its dim-0 piece of every parameter
(a DTensor here, a ShardedTensor in torch, the same rows), not the whole model ([Note: DCP's
get_model_state_dict] in fsdp_lab/runtime/fsdp1/state_dict.py). Saved with dcp.save on 2 ranks it loads on 4
through get_model_state_dict, dcp.load and set_model_state_dict, between the libraries both ways, bit for bit.
get_state_dict(model, optim) and set_state_dict(model, optim, ...) are refused, naming what works ([Note: DCP and
the optimizer state] in fsdp_lab/runtime/fsdp1/not_provided.py).
"""
from __future__ import annotations

import pytest
import torch
from ranks_fsdp1_dcp import READS, load_each, on_two

from fsdp_lab.training.launch import run_on_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("fsdp1_dcp"))
    two = run_on_ranks(on_two, 2, folder, timeout_s=400)
    four = run_on_ranks(load_each, 4, [(w, r, f"{folder}/{w}") for w, r in READS], timeout_s=400)
    return {"two": two, "four": four}


def test_get_model_state_dict_is_sharded_by_default_with_torchs_rows(runs):
    for rank, got in enumerate(runs["two"]):
        ours, theirs = got["state"]["fsdp_lab"]["sharded"], got["state"]["torch"]["sharded"]
        reference = got["state"]["fsdp_lab"]["reference"]
        assert list(ours) == list(theirs) == list(reference)
        assert {v["kind"] for v in theirs.values()} == {"ShardedTensor"}
        assert {v["kind"] for v in ours.values()} == {"DTensor"}, "each rank must hold its piece, not the model"
        for key, value in ours.items():
            assert value["shape"] == theirs[key]["shape"] == list(reference[key].shape), key
            assert torch.equal(value["local"], torch.chunk(reference[key], 2, dim=0)[rank]), key
            assert torch.allclose(value["local"], theirs[key]["local"], atol=1e-6), key


def test_get_model_state_dict_full_is_the_whole_model_as_torchs(runs):
    for rank, got in enumerate(runs["two"]):
        ours, theirs = got["state"]["fsdp_lab"]["full"], got["state"]["torch"]["full"]
        reference = got["state"]["fsdp_lab"]["reference"]
        assert list(ours) == list(theirs) == list(reference)
        assert {v["kind"] for v in ours.values()} == {"Tensor"}
        assert all(torch.equal(v["local"], reference[k]) for k, v in ours.items())
        # full_state_dict with cpu_offload: rank 0 only (torch's rank0_only=cpu_offload)
        offloaded = got["state"]["fsdp_lab"]["full_cpu"]
        if rank == 0:
            assert all(torch.equal(v["local"], reference[k]) for k, v in offloaded.items())
            assert list(offloaded) == list(reference)
        else:
            assert offloaded == {}


@pytest.mark.parametrize("writer,reader", READS, ids=[f"{w}-to-{r}" for w, r in READS])
def test_saved_on_two_ranks_loads_on_four_bit_for_bit(runs, writer, reader):
    saved = runs["two"][0]["saved"][writer]
    assert saved.keys() == runs["two"][1]["saved"][writer].keys()
    for rank in range(4):
        loaded = runs["four"][rank][writer, reader]
        assert list(loaded) == list(saved), rank
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), rank


@pytest.mark.parametrize("call", ["get_state_dict", "set_state_dict"])
def test_dcp_with_an_optimizer_is_refused_naming_what_works(runs, call):
    message = runs["two"][0]["with_optimizer"][call]
    assert message is not None and message.startswith("NotImplementedError: torch.distributed.checkpoint"), message
    for works in ("FSDP.optim_state_dict(model, optim)", "FSDP.optim_state_dict_to_load(model, optim, osd)",
                  "fsdp_lab.checkpoint.save/load", "get_model_state_dict(model)"):
        assert works in message, (works, message)
