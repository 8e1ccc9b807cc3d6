"""Exercise 01 · Bytes per GPU: DDP, ZeRO-1/2/3 and N_min (chapters 01, 05 and 07).

Φ is the number of parameters. Everything is fp32 with AdamW, as in the article: 4 bytes of parameters,
4 of gradients and 8 of optimizer state (two moments) per parameter. Run: python ex01_memory.py
"""
import math
import sys

import _package  # noqa: F401  (fsdp_lab from this checkout)
from fsdp_lab.lessons import exercises
from fsdp_lab.lessons.live import checks

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
    phi = 7e9
    return checks.state_bytes_of(ddp_bytes(phi), 4 * phi, 4 * phi, 8 * phi, world_size=1)


def check_zero_stages():
    """ZeRO-1/2/3 on 7B and 8 GPUs: 63, 38.5 and 14 GB per GPU"""
    return exercises.zero_stage_bytes(zero_bytes, 7e9, 8)


def check_n_min():
    """N_min for 7B on 80 GB cards is 2 (112 / 80 = 1.4, rounded up)"""
    return exercises.all_of(exercises.gpus_needed(n_min, 7e9, 80 * GB), exercises.gpus_needed(n_min, 1e9, 16 * GB))


def check_against_a_measurement():
    """ZeRO-3 matches what fsdp_lab measured for the tiny GPT on 2 ranks"""
    # `fsdp-lab train --nproc-per-node 2 --steps 3 --json-log log.jsonl` (tiny GPT, 119,424 parameters, no padding
    # at N=2): memory_report after a step on each rank: 238,848 B of parameter shards, 238,848 B of gradient shards,
    # 477,708 B of AdamW state (955,404 B in all). The extra 12 bytes are AdamW's step counters: one 4-byte scalar
    # per flat shard, and the tiny GPT has 3 units; the check allows 1 %.
    return checks.state_bytes_of(zero_bytes(119_424, 2, 3), 238_848, 238_848, 477_708, world_size=2)


if __name__ == "__main__":
    sys.exit(exercises.run(globals()))
