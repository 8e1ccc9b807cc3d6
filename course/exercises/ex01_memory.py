"""Exercise 01 · Bytes per GPU: DDP, ZeRO-1/2/3 and N_min (chapters 01, 05 and 07).

Φ is the number of parameters. Everything is fp32 with AdamW, as in the article: 4 bytes of parameters,
4 of gradients and 8 of optimizer state (two moments) per parameter. Run: python ex01_memory.py
"""
import math
import sys

from _checks import run

GB = 1e9


def ddp_bytes(phi: float) -> float:
    """Bytes one GPU holds under DDP: everything replicated."""
    ### HINT: parameters + gradients + AdamW's two moments, 4 bytes each, none of it divided by N
    ### BEGIN SOLUTION
    return 4 * phi + 4 * phi + 8 * phi
    ### END SOLUTION


def zero_bytes(phi: float, n: int, stage: int) -> float:
    """Bytes one GPU holds under ZeRO stage 1, 2 or 3 on n GPUs (ValueError for any other stage)."""
    ### HINT: stage 1 divides the 8Φ of optimizer state by n, stage 2 also the 4Φ of gradients, stage 3 all 16Φ
    ### BEGIN SOLUTION
    if stage == 1:
        return 8 * phi + 8 * phi / n
    if stage == 2:
        return 4 * phi + 12 * phi / n
    if stage == 3:
        return 16 * phi / n
    raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    ### END SOLUTION


def n_min(phi: float, gpu_bytes: float) -> int:
    """The article's lower bound on GPUs: the whole 16Φ spread over cards of gpu_bytes each."""
    ### HINT: a GPU count is an integer; a remainder needs one more card
    ### BEGIN SOLUTION
    return math.ceil(16 * phi / gpu_bytes)
    ### END SOLUTION


def check_ddp():
    """DDP on the article's 7B model holds 112 GB per GPU"""
    assert ddp_bytes(7e9) == 112 * GB, f"expected 112 GB, got {ddp_bytes(7e9) / GB} GB"


def check_zero_stages():
    """ZeRO-1/2/3 on 7B and 8 GPUs: 63, 38.5 and 14 GB per GPU"""
    got = [zero_bytes(7e9, 8, s) / GB for s in (1, 2, 3)]
    assert got == [63, 38.5, 14], f"expected [63, 38.5, 14] GB, got {got}"
    try:
        zero_bytes(7e9, 8, 4)
    except ValueError:
        return
    raise AssertionError("stage 4 should raise ValueError")


def check_n_min():
    """N_min for 7B on 80 GB cards is 2 (112 / 80 = 1.4, rounded up)"""
    assert n_min(7e9, 80 * GB) == 2, f"expected 2, got {n_min(7e9, 80 * GB)}"
    assert n_min(1e9, 16 * GB) == 1, "exactly one full card needs one card"


def check_against_a_measurement():
    """ZeRO-3 matches what fsdp_lab measured for the tiny GPT on 2 ranks"""
    # `fsdp-lab train --nproc-per-node 2 --steps 3 --json-log log.jsonl` (tiny GPT, 119,424 parameters, no padding
    # at N=2) logs memory.total = 955,404 bytes per rank after a step. The extra 12 bytes are AdamW's step
    # counters: one 4-byte scalar per flat shard, and the tiny GPT has 3 units.
    measured, phi, units = 955_404, 119_424, 3
    assert zero_bytes(phi, 2, 3) + 4 * units == measured, f"{zero_bytes(phi, 2, 3)} + 12 != {measured}"


if __name__ == "__main__":
    sys.exit(run(globals()))
