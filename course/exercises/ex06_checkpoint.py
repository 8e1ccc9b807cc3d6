"""Exercise 06 · Resharding a checkpoint: 4 ranks saved it, 2 (or 3) load it (chapter 06).

fsdp_lab saves each unit's *unpadded* flat buffer of `numel` elements in torch.chunk's layout: with
S = ceil(numel / N), saving rank r wrote elements [r·S, min((r+1)·S, numel)) (possibly nothing). On load with N'
ranks, each rank computes its new piece the same way and reads the overlapping parts of the saved pieces.
Run: python ex06_checkpoint.py
"""
import sys

import _package  # noqa: F401  (fsdp_lab from this checkout)
from fsdp_lab.lessons import exercises


def pieces(numel: int, n: int) -> list:
    """(start, stop) of every rank's piece, torch.chunk's layout (empty pieces are (numel, numel))."""
    ### HINT: S = ceil(numel / n) without floats; clamp both ends to numel
    ### BEGIN SOLUTION
    size = -(-numel // n)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(n)]
    ### END SOLUTION


def reads(numel: int, saved_n: int, new_n: int, rank: int) -> list:
    """What new rank `rank` reads: (saved rank, start, stop) for every non-empty overlap, in order."""
    ### HINT: intersect this rank's new piece with each saved piece; keep the intersections that are not empty
    ### BEGIN SOLUTION
    lo, hi = pieces(numel, new_n)[rank]
    out = []
    for saved_rank, (start, stop) in enumerate(pieces(numel, saved_n)):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out.append((saved_rank, a, b))
    return out
    ### END SOLUTION


def check_pieces():
    """10 elements on 4 ranks: 3, 3, 3 and 1; 5 elements on 4 ranks leave the last rank empty"""
    return exercises.all_of(exercises.checkpoint_pieces(pieces, 10, 4), exercises.checkpoint_pieces(pieces, 5, 4))


def check_four_to_two():
    """The tiny block (49,408 elements) saved by 4 ranks: new rank 1 of 2 reads saved ranks 2 and 3"""
    return exercises.checkpoint_reads(reads, 49_408, 4, 2)


def check_uneven():
    """10 elements, 4 → 3 ranks: new rank 1 reads parts of saved ranks 1 and 2"""
    return exercises.checkpoint_reads(reads, 10, 4, 3)


def check_everything_is_read_once():
    """For any world sizes, the new ranks together read every element exactly once"""
    return exercises.all_of(*(exercises.checkpoint_reads(reads, numel, saved_n, new_n) for numel in (1, 7, 49_408)
                              for saved_n in (1, 2, 3, 4) for new_n in (1, 2, 3, 4)))


if __name__ == "__main__":
    sys.exit(exercises.run(globals()))
