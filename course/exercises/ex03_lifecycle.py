"""Exercise 03 · The four beats of one training step, and its communication bill (chapters 03 and 04).

Units run in forward order root → blocks.0 → blocks.1; backward visits the blocks in reverse. Under FULL_SHARD
a block is gathered, computed and freed in forward, re-gathered in backward, then its gradient is
reduce-scattered and it is freed again. The root (embeddings, final norm, head) stays gathered from its
forward until its own gradient is reduced. Run: python ex03_lifecycle.py
"""
import sys

import _package  # noqa: F401  (fsdp_lab from this checkout)
from fsdp_lab.lessons import exercises
from fsdp_lab.lessons.live import checks

# Recorded from `fsdp-lab train --nproc-per-node 2 --steps 3 --trace DIR [--strategy S]` (tiny GPT): rank 0's
# events of the second step, keeping gather_start, regather_start, free and reduce_scatter.
MEASURED = {
    "FULL_SHARD": "gather:<root> gather:blocks.0 free:blocks.0 gather:blocks.1 free:blocks.1 regather:blocks.1 "
                  "reduce_scatter:blocks.1 free:blocks.1 regather:blocks.0 reduce_scatter:blocks.0 free:blocks.0 "
                  "reduce_scatter:<root> free:<root>",
    "SHARD_GRAD_OP": "gather:<root> gather:blocks.0 gather:blocks.1 reduce_scatter:blocks.1 free:blocks.1 "
                     "reduce_scatter:blocks.0 free:blocks.0 reduce_scatter:<root> free:<root>",
}


def step_events(blocks: list, strategy: str) -> list:
    """(event, unit) pairs of one step for the root plus `blocks`, under FULL_SHARD or SHARD_GRAD_OP."""
    ### HINT: forward: gather root, then for each block gather (and under FULL_SHARD free); backward: blocks in
    ### HINT: reverse (FULL_SHARD re-gathers first), each reduce_scatter then free; the root goes last
    ### BEGIN SOLUTION
    full = strategy == "FULL_SHARD"
    events = [("gather", "<root>")]
    for b in blocks:
        events.append(("gather", b))
        if full:
            events.append(("free", b))
    for b in reversed(blocks):
        if full:
            events.append(("regather", b))
        events += [("reduce_scatter", b), ("free", b)]
    return events + [("reduce_scatter", "<root>"), ("free", "<root>")]
    ### END SOLUTION


def bytes_sent_per_step(unit_numels: dict, n: int, param_bytes: int, reduce_bytes: int) -> int:
    """Bytes one rank sends in one FULL_SHARD step (ring collectives: (N-1)/N of each buffer).
    unit_numels maps unit name → padded element count; the root is '<root>' and is not re-gathered."""
    ### HINT: forward gathers every unit, backward re-gathers every unit but the root, and every unit's gradient
    ### HINT: is reduce-scattered in reduce_bytes per element
    ### BEGIN SOLUTION
    def ring(numel, width):
        return numel * width * (n - 1) // n
    gathers = sum(ring(v, param_bytes) for v in unit_numels.values())
    regathers = sum(ring(v, param_bytes) for k, v in unit_numels.items() if k != "<root>")
    reduces = sum(ring(v, reduce_bytes) for v in unit_numels.values())
    return gathers + regathers + reduces
    ### END SOLUTION


TINY = {"<root>": 20_608, "blocks.0": 49_408, "blocks.1": 49_408}


def _recorded(strategy: str) -> list:
    return [tuple(beat.split(":", 1)) for beat in MEASURED[strategy].split()]


def check_full_shard_order():
    """FULL_SHARD: the order of the beats matches a real trace"""
    return checks.beat_order_of(step_events, _recorded("FULL_SHARD"), "FULL_SHARD", rank=0, step=1)


def check_shard_grad_op_order():
    """SHARD_GRAD_OP (ZeRO-2): no free after forward, so no re-gather"""
    return checks.beat_order_of(step_events, _recorded("SHARD_GRAD_OP"), "SHARD_GRAD_OP", rank=0, step=1)


def check_bill_against_the_trace():
    """The per-step bytes match the trace: fp32 on 2 and 4 ranks, bf16 gathers on 2"""
    # Sum of bytes_sent over rank 0's events of one step, same runs as MEASURED (bf16: --mixed-precision bf16,
    # which gathers in bf16 and reduces in fp32). DDP (NO_SHARD) sends 477,696 bytes: the ratio is 1.41, not
    # the article's 1.5, because the root is not re-gathered.
    return exercises.all_of(*(exercises.step_bill(bytes_sent_per_step, TINY, n, pb, rb, measured)
                              for n, pb, rb, measured in ((2, 4, 4, 675_328), (4, 4, 4, 1_012_992),
                                                          (2, 2, 4, 457_088))))


if __name__ == "__main__":
    sys.exit(exercises.run(globals()))
