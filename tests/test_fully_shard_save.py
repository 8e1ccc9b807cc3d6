"""fully_shard's `model.state_dict()` is written by torch.save and by torch.distributed.checkpoint (dcp.save and
dcp.async_save with get_state_dict) as torch's fully_shard's is, and loading into it in place still reaches the
parameters, on 2 gloo ranks (tests/ranks_fully_shard_save.py)."""
from __future__ import annotations

import pytest
from ranks_fully_shard_save import run

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("save"))
    return {lib: run_on_ranks(run, 2, lib, folder, timeout_s=400) for lib in ("torch", "fsdp_lab")}


def diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    assert all(a[k].shape == b[k].shape for k in a)
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].numel())


def test_torch_save_round_trips_the_sharded_state_dict_as_torchs(saved):
    for ref, got in zip(saved["torch"], saved["fsdp_lab"]):
        assert diff(got["saved"], got["live"]) == 0.0
        assert diff(got["saved"], ref["saved"]) <= TOL
        assert diff(got["from_file"], got["trained"]) == 0.0
        assert diff(got["from_file"], ref["from_file"]) <= TOL


def test_dcp_load_in_place_into_the_state_dict_reaches_the_parameters(saved):
    for ref, got in zip(saved["torch"], saved["fsdp_lab"]):
        assert diff(got["in_place"], got["trained"]) == 0.0
        assert diff(got["in_place"], ref["in_place"]) <= TOL


def test_async_save_of_get_state_dict_resumes_exactly(saved):
    for ref, got in zip(saved["torch"], saved["fsdp_lab"]):
        assert got["from_async"] == got["continued"], (got["from_async"], got["continued"])
        assert max(abs(a - b) for a, b in zip(got["continued"], ref["continued"])) <= TOL
