"""The checks of FSDP2's row blocks: `dim0_rows`, the rows of a parameter's first dimension a rank keeps under
Shard(0) (chapter 06a's exercise), against the learner's fully_shard model and against first dimensions that do
not divide by the number of ranks, where plain division gives the wrong answer."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fsdp_lab.lessons.live.verdict import FSDP2, Verdict, not_written, unwritten_function, wrong_model

# Cases where plain division is wrong: the first dimension does not divide by n, and with 5 rows on 4 ranks the
# last rank keeps none (ceil(5/4) = 2 rows each: 2, 2, 1, 0). The tiny GPT's first dimensions all divide by 2.
UNEVEN_ROWS = ((5, 4), (7, 2), (3, 4), (10, 4))


def dim0_cases(shapes: Sequence[tuple]) -> list:
    """(name, dim0, n, rank, start, stop) for every rank of every (name, dim0, n), cut as fsdp_lab's fully_shard cuts
    Shard(0) (fsdp2.param_group._local_rows)."""
    from fsdp_lab.runtime.fsdp2.param_group import _local_rows

    cases = []
    for name, dim0, n in shapes:
        rows = -(-dim0 // n)
        for r in range(n):
            start = min(r * rows, dim0)
            cases.append((name, dim0, n, r, start, start + _local_rows(dim0, r, n)))
    return cases


def uneven_rows() -> list:
    """dim0_cases of the UNEVEN_ROWS first dimensions."""
    return dim0_cases([(f"a ({d},) parameter", d, n) for d, n in UNEVEN_ROWS])


def dim0_rows_of(fn: Callable[[int, int, int], tuple], cases: Sequence[tuple]) -> Verdict:
    """`fn(dim0, n, rank) -> (start, stop)` against each (name, dim0, n, rank, start, stop); the first wrong one is
    explained."""
    for name, dim0, n, rank, start, stop in cases:
        try:
            got = fn(dim0, n, rank)
        except NotImplementedError as err:
            return not_written("dim0_rows", err)
        where = f"{name} ({dim0} rows on {n} ranks)"
        try:
            got = tuple(int(v) for v in got)
        except (TypeError, ValueError):
            return Verdict(False, f"{where}: dim0_rows must return (start, stop), two integers; got {got!r}")
        if len(got) != 2:
            return Verdict(False, f"{where}: dim0_rows must return (start, stop), got {got!r}")
        if got == (start, stop):
            continue
        rows = -(-dim0 // n)
        if got[1] - got[0] == stop - start:
            why = f"the right count, but rank r starts at row r · {rows}"
        elif got[1] > dim0:
            why = f"there are only {dim0} rows: stop at {dim0} (a rank may keep fewer rows, or none)"
        else:
            why = (f"each rank gets ceil({dim0} / {n}) = {rows} rows, as torch.chunk cuts it, the last ones fewer or "
                   f"none" + (f"; {dim0} // {n} = {dim0 // n} loses rows" if dim0 % n else ""))
        return Verdict(False, f"{where}: you say rank {rank} keeps rows [{got[0]}, {got[1]}), Shard(0) gives it "
                              f"[{start}, {stop}); {why}")
    return Verdict(True, f"all {len(cases)} row blocks are where you said")


def dim0_rows(fn: Callable[[int, int, int], tuple], model) -> Verdict:
    """`fn(dim0, n, rank) -> (start, stop)`: the rows of a parameter's dim 0 that rank keeps under FSDP2's
    Shard(0), against every DTensor parameter of the learner's fully_shard model, then on first dimensions that do
    not divide by n (UNEVEN_ROWS)."""
    wrong = unwritten_function("dim0_rows", fn, *UNEVEN_ROWS[0], 0) or wrong_model("dim0_rows", model, FSDP2)
    if wrong:
        return wrong
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cases = []
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", None)
        if local is None:
            return Verdict(False, f"{name} is a plain tensor, not a DTensor: call fully_shard on the model first")
        start = min(rank * -(-param.shape[0] // n), param.shape[0])
        cases.append((f"{name} {tuple(param.shape)}", param.shape[0], n, rank, start, start + local.shape[0]))
    verdict = dim0_rows_of(fn, cases + uneven_rows())
    if not verdict.ok:
        return verdict
    return Verdict(True, f"rank {rank} keeps exactly the rows you said of every parameter (dim 0, Shard(0)), as "
                         f"in {len(UNEVEN_ROWS)} uneven cases")
