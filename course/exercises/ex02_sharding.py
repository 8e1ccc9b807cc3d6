"""Exercise 02 · Flat buffers, padding and who owns what (chapter 02).

A unit's parameters lie end to end in one flat buffer, padded with zeros to a multiple of N; rank r keeps
elements [r·S, (r+1)·S) with S = padded / N. Run: python ex02_sharding.py
"""
import sys

import _package  # noqa: F401  (fsdp_lab from this checkout)
from fsdp_lab.lessons import exercises
from fsdp_lab.lessons.live import checks

# The tiny GPT's block as (name, number of elements), in flat-buffer order (see notebook 02).
TINY_BLOCK = [("ln1.weight", 64), ("ln1.bias", 64), ("attn.qkv.weight", 12288), ("attn.proj.weight", 4096),
              ("ln2.weight", 64), ("ln2.bias", 64), ("mlp.fc.weight", 16384), ("mlp.proj.weight", 16384)]


def padded_size(numel: int, n: int) -> int:
    """The flat buffer's length: numel rounded up to a multiple of n."""
    ### HINT: how many whole chunks of n do you need to cover numel? (integer arithmetic, no floats)
    ### BEGIN SOLUTION
    return -(-numel // n) * n
    ### END SOLUTION


def shard_range(numel: int, n: int, rank: int) -> tuple:
    """(start, stop) of rank's chunk in the padded flat buffer."""
    ### HINT: every chunk has padded_size(numel, n) // n elements
    ### BEGIN SOLUTION
    size = padded_size(numel, n) // n
    return rank * size, (rank + 1) * size
    ### END SOLUTION


def owners(slots: list, name: str, n: int) -> list:
    """The ranks that hold at least one element of parameter `name` (slots as in TINY_BLOCK)."""
    ### HINT: compute the parameter's offset from the sizes before it, then compare with each shard_range
    ### BEGIN SOLUTION
    total = sum(size for _, size in slots)
    offset = 0
    for slot_name, size in slots:
        if slot_name == name:
            break
        offset += size
    else:
        raise KeyError(name)
    ranks = []
    for r in range(n):
        start, stop = shard_range(total, n, r)
        if start < offset + size and offset < stop:
            ranks.append(r)
    return ranks
    ### END SOLUTION


def gather_bytes_sent(numel: int, n: int, bytes_per_element: int) -> int:
    """Bytes one rank sends in the all-gather of one unit (ring algorithm): C_gather = Φ_layer·(N-1)/N."""
    ### HINT: the whole padded buffer in bytes, times (n - 1) / n; use integer arithmetic
    ### BEGIN SOLUTION
    return padded_size(numel, n) * bytes_per_element * (n - 1) // n
    ### END SOLUTION


def check_padding():
    """The tiny block (49,408 elements) needs 2 zeros on 3 ranks and none on 2 or 4; 5 elements on 4 ranks need 3"""
    return exercises.all_of(exercises.padded_sizes(padded_size, 49_408, (2, 3, 4)),
                            exercises.padded_sizes(padded_size, 5, (4,)))


def check_ranges():
    """On 3 ranks the tiny block is cut into three chunks of 16,470 elements (and likewise on 2 and 4 ranks)"""
    layouts = [c for n in (2, 3, 4) for c in checks.chunks_of("blocks.0", 49_408, n)]
    return checks.shard_range_of(shard_range, layouts + checks.chunks_of("five", 5, 4))


def check_owners():
    """On 3 ranks the qkv weight sits on rank 0 only, the MLP's first weight straddles ranks 1 and 2"""
    return exercises.all_of(*(exercises.owners(owners, TINY_BLOCK, n) for n in (1, 2, 3, 4)))


def check_gather_bytes_against_the_trace():
    """C_gather matches the bytes fsdp_lab's trace records for one tiny block"""
    # From `fsdp-lab train --nproc-per-node N --steps 3 --trace DIR [--mixed-precision bf16]`: the gather_end event
    # of unit blocks.0 on rank 0 reports these bytes_sent (fp32 at N=2 and N=4, bf16 at N=2).
    measured = {(2, 4): 98_816, (4, 4): 148_224, (2, 2): 49_408}
    return exercises.all_of(*(exercises.gather_bytes(gather_bytes_sent, 49_408, n, width, sent)
                              for (n, width), sent in measured.items()))


if __name__ == "__main__":
    sys.exit(exercises.run(globals()))
