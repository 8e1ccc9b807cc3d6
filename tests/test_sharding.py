"""Each rank holds the padded P/N parameters and only its shard's optimizer state; unsharded storage is 0 bytes
once a unit is freed (checked through untyped_storage().size())."""
from __future__ import annotations

import pytest
from ranks_features import sharding_facts

from fsdp_lab.runtime.core.unit import UnitState
from fsdp_lab.training.launch import run_on_ranks


@pytest.mark.parametrize("world_size", [3, 4])
def test_each_rank_holds_padded_shard_and_its_optimizer_state(world_size):
    facts = run_on_ranks(sharding_facts, world_size, timeout_s=120)
    for rank, f in enumerate(facts):
        numels = [numel for numel, *_ in f["groups"]]
        assert sum(numels) == f["total_numel"], "every parameter is in exactly one flat buffer"
        for (numel, padded, shard, shard_param), opt_numels in zip(f["groups"], f["opt_numels"]):
            assert padded % world_size == 0 and 0 <= padded - numel < world_size, (numel, padded, world_size)
            assert shard == shard_param == padded // world_size
            assert opt_numels == [shard, shard], f"rank {rank}: AdamW state {opt_numels}, shard {shard}"
        if world_size == 3:  # the tiny GPT's unit sizes divide by 4 but not by 3
            assert any(padded != numel for numel, padded, *_ in f["groups"]), "expected padding at world size 3"


def test_unsharded_storage_is_zero_bytes_once_freed():
    f = run_on_ranks(sharding_facts, 2, timeout_s=120)[0]
    during = f["during_block1"]
    assert during["blocks.0"] == [0], "block 0 was freed after its forward"
    assert during["blocks.1"][0] > 0, "block 1 is gathered while it computes"
    assert during["<root>"][0] > 0, "the root stays gathered through forward"
    assert all(sizes == [0] for sizes in f["after_backward"].values()), f["after_backward"]
    assert set(f["states"].values()) == {UnitState.SHARDED}


def test_shard_grad_op_keeps_units_gathered_between_forward_and_backward():
    f = run_on_ranks(sharding_facts, 2, "SHARD_GRAD_OP", timeout_s=120)[0]
    assert f["during_block1"]["blocks.0"][0] > 0, "ZeRO-2 does not free after forward"
    assert all(sizes == [0] for sizes in f["after_backward"].values())


def _padding_per_rank(numel: int, world_size: int) -> list[int]:
    """How many of each rank's chunk elements are padding, read from the runtime's own FlatParam."""
    import torch
    from torch import nn

    from fsdp_lab.runtime.fsdp1.flat_param import FlatParam
    counts = []
    for rank in range(world_size):
        param = nn.Parameter(torch.arange(1.0, numel + 1))
        flat = FlatParam("unit", [(param, [(None, "w", "w")])], world_size, rank, requires_grad=True,
                         compute_dtype=torch.float32, keep_replica=False, shard_storage=True)
        _start, held = flat.local_range(flat.slots[0])
        assert torch.count_nonzero(flat.shard.detach()) == held  # the rest of the chunk is the zero padding
        counts.append(flat.shard_numel - held)
    return counts


def test_padding_lands_on_every_rank_past_the_end_not_only_the_last():
    """5 elements on 4 ranks: chunks of 2, so rank 2 holds 1 element and 1 pad, rank 3 holds 2 pads (chapter 02,
    quiz 02). The pad is at most N-1 elements; it sits only in the last chunk once a chunk is at least that long,
    i.e. from N·(N-1) elements on (every real layer)."""
    assert _padding_per_rank(5, 4) == [0, 0, 1, 2]
    assert _padding_per_rank(10, 4) == [0, 0, 0, 2]
    assert _padding_per_rank(49_408, 3) == [0, 0, 2]
    assert _padding_per_rank(12, 4) == [0, 0, 0, 0] and _padding_per_rank(13, 4) == [0, 0, 0, 3]
