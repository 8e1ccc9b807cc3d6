"""fully_shard options torch 2.13 takes, against torch's fully_shard on gloo ranks
(tests/ranks_fully_shard_options.py): a list of modules sharded as one group."""
from __future__ import annotations

import pytest
from ranks_fully_shard_options import run_list_group

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-6


def test_a_list_of_modules_is_one_group_like_torchs():
    refs = run_on_ranks(run_list_group, 2, "torch", timeout_s=300)
    gots = run_on_ranks(run_list_group, 2, "fsdp_lab", timeout_s=300)
    for ref, got in zip(refs, gots):
        assert got["returned_list"] and ref["returned_list"]
        assert got["classes"] == ref["classes"] == ["FSDPEmbedding", "FSDPLinear", "FSDPTwoEnds"]
        assert got["same_state"] and ref["same_state"]
        assert got["keys"] == ref["keys"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert got["group_state"] == (False, "SHARDED")
        assert got["skipped"] == pytest.approx(ref["skipped"], abs=1e-4)
        assert got["after"] == pytest.approx(ref["after"], abs=1e-4)
        assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) <= TOL


def test_checkpoint_wrapper_before_fully_shard_matches_torch():
    from ranks_fully_shard_options import run_checkpoint_wrapper

    refs = run_on_ranks(run_checkpoint_wrapper, 2, "torch", timeout_s=300)
    gots = run_on_ranks(run_checkpoint_wrapper, 2, "fsdp_lab", timeout_s=300)
    for ref, got in zip(refs, gots):
        assert got["keys"] == ref["keys"]
        assert got["gathers"] == ref["gathers"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) <= TOL


def test_blocks_compiled_before_and_after_fully_shard_match_torch():
    """[Note: hooks outside compiled graphs] in fsdp_lab/runtime/core/misuse.py."""
    from ranks_fully_shard_options import run_compile

    refs = run_on_ranks(run_compile, 2, "torch", timeout_s=400)
    gots = run_on_ranks(run_compile, 2, "fsdp_lab", timeout_s=400)
    for ref, got in zip(refs, gots):
        for when in ("before", "after"):
            assert got[when]["losses"] == pytest.approx(ref[when]["losses"], abs=TOL), when
            params = ref[when]["params"]
            assert max((got[when]["params"][k] - params[k]).abs().max().item() for k in params) <= TOL, when
