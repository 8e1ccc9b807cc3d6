"""A Hugging Face Llama under fsdp_lab, on 2 gloo ranks against one process: every strategy, with and without
HF's own gradient checkpointing (which checkpoints each decoder layer's __call__, so FSDP's hooks run inside it).
transformers is not a dependency of the course, only of the test suite (the `test` extra installs it)."""
from __future__ import annotations

import pytest
from ranks_hf import train, train_fully_shard

from fsdp_lab.training.launch import run_on_ranks

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test] installs it)")

TOL = 1e-5


@pytest.fixture(scope="module")
def references():
    return {gc: train(0, 1, None, gc) for gc in (False, True)}


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD"])
def test_llama_matches_one_process(strategy, gradient_checkpointing, references):
    ref = references[gradient_checkpointing]
    got = run_on_ranks(train, 2, strategy, gradient_checkpointing, timeout_s=300)[0]
    assert list(got) == list(ref), "state_dict() must give the plain model's names in its order"
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    print(f"{strategy} gradient_checkpointing={gradient_checkpointing}: max |parameter difference| = {diff:.3g}")
    assert diff <= TOL


def test_llama_with_tied_embeddings_under_fully_shard_matches_torch_and_one_process():
    """FSDP2's recipe (fully_shard per decoder layer, then the model) with only the import swapped."""
    ref = train_fully_shard(0, 1, "plain")
    ours = run_on_ranks(train_fully_shard, 2, "fsdp_lab", timeout_s=300)[0]
    theirs = run_on_ranks(train_fully_shard, 2, "torch", timeout_s=300)[0]
    assert list(ours) == list(ref) == list(theirs)
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) <= TOL
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ref) <= 1e-6
