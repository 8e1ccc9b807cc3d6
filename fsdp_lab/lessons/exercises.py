"""The terminal exercises in course/exercises/: their runner, and the checks only they use.

`python course/exercises/ex02_sharding.py` calls `run(globals())`: every `check_*` function of the file runs in
order and returns a Verdict from fsdp_lab.lessons.live.checks (the same cores the notebooks' "Your turn" cells call
on live ranks: [Note: one check, two callers] there) or from here. The runner prints `ok`, `FAIL` with what is
wrong, or `TODO` where the learner's function still raises NotImplementedError (the student copies), and exits 0
only when every check passes. The references are the library's own code (the runtime's padding, the checkpoint's
piece layout, the theory's formulas) or numbers recorded from a run, which the exercise file names.
"""
from __future__ import annotations

import math
import textwrap
import traceback
from types import SimpleNamespace
from typing import Callable, Sequence

from fsdp_lab.lessons.live.checks import Verdict, close_to, chunks_of, not_written, state_bytes_of
from fsdp_lab.runtime.fsdp1.flat_param import padded_size
from fsdp_lab.theory import formulas


def _indent(text: str) -> str:
    return textwrap.indent(text, "      ")


def run(namespace: dict) -> int:
    """Run every check_* in `namespace` (a module's globals) in order; print each verdict; 0 when all pass."""
    found = [(name, fn) for name, fn in namespace.items() if name.startswith("check_") and callable(fn)]
    passed = todo = failed = 0
    for name, fn in found:
        label = (fn.__doc__ or name).strip().splitlines()[0]
        try:
            verdict = fn()
        except NotImplementedError as err:  # the learner's function, called by the check itself
            verdict = Verdict(False, f"not written yet ({err})" if str(err) else "not written yet", todo=True)
        except Exception:  # a bug in the learner's code: show where
            failed += 1
            print(f"ERROR {label}")
            traceback.print_exc()
            continue
        if not isinstance(verdict, Verdict):
            failed += 1
            print(f"ERROR {label}\n{_indent(f'{name} returned {verdict!r}, not a Verdict')}")
        elif verdict.todo:
            todo += 1
            print(f"TODO  {label}\n{_indent(verdict.message)}")
        elif verdict.ok:
            passed += 1
            print(f"ok    {label}\n{_indent(verdict.message)}")
        else:
            failed += 1
            print(f"FAIL  {label}\n{_indent(verdict.message)}")
    print(f"\n{passed} passed, {failed} failed, {todo} not implemented yet, of {len(found)} checks")
    if passed == len(found):
        print("all checks passed")
    return 0 if passed == len(found) else 1


def all_of(*verdicts: Verdict) -> Verdict:
    """The first verdict not yet written or wrong, else one ok verdict joining their messages."""
    for verdict in sorted(verdicts, key=lambda v: not v.todo):
        if not verdict.ok:
            return verdict
    shown = [v.message for v in verdicts[:3]] + ([f"(and {len(verdicts) - 3} more)"] if len(verdicts) > 3 else [])
    return Verdict(True, "\n".join(shown))


def _call(fn: Callable, *args):
    """fn(*args), or the Verdict saying it is not written yet."""
    try:
        return fn(*args)
    except NotImplementedError as err:
        return not_written(fn.__name__, err)


# -- ex01: bytes per GPU ------------------------------------------------------------------------------------------
def zero_stage_bytes(fn: Callable[[float, int, int], float], phi: float, n: int) -> Verdict:
    """`fn(phi, n, stage)`: bytes per GPU under ZeRO stage 1, 2, 3 (formulas.m_zero1/2/3), and ValueError for 4."""
    for stage, formula in ((1, formulas.m_zero1), (2, formulas.m_zero2), (3, formulas.m_zero3)):
        got = _call(fn, phi, n, stage)
        if isinstance(got, Verdict):
            return got
        params, grads = 4 * phi / (n if stage == 3 else 1), 4 * phi / (n if stage >= 2 else 1)
        others = [(formulas.m_zero1(phi, n), "that is ZeRO-1's: only the optimizer state is sharded"),
                  (formulas.m_zero2(phi, n), "that is ZeRO-2's: the optimizer state and the gradients are sharded"),
                  (formulas.m_zero3(phi, n), "that is ZeRO-3's: everything is sharded")]
        verdict = state_bytes_of(got, params, grads, 8 * phi / n, n, full=(4 * phi, 4 * phi, 8 * phi),
                                 hints=[h for h in others if not close_to(h[0], formula(phi, n))])
        if not verdict.ok:
            return Verdict(False, f"stage {stage}, Φ = {phi:,.0f} on {n} GPUs: {verdict.message}")
    try:
        fn(phi, n, 4)
    except ValueError:
        return Verdict(True, f"ZeRO-1/2/3 on {n} GPUs: " + ", ".join(
            f"{f(phi, n) / 1e9:g} GB" for f in (formulas.m_zero1, formulas.m_zero2, formulas.m_zero3)))
    except NotImplementedError as err:
        return not_written(fn.__name__, err)
    return Verdict(False, "stage 4 does not exist: raise ValueError naming the stage")


def gpus_needed(fn: Callable[[float, float], int], phi: float, gpu_bytes: float) -> Verdict:
    """`fn(phi, gpu_bytes)`: the article's N_min = ceil(16Φ / M_GPU) (formulas.n_min)."""
    got = _call(fn, phi, gpu_bytes)
    if isinstance(got, Verdict):
        return got
    want, exact = formulas.n_min(phi, gpu_bytes), 16 * phi / gpu_bytes
    if got == want and isinstance(got, int):
        return Verdict(True, f"16Φ = {16 * phi / 1e9:g} GB on {gpu_bytes / 1e9:g} GB cards: {want} GPU(s)")
    if not isinstance(got, int):
        why = "a GPU count is an integer" + (": round up" if close_to(got, exact, 1e-9) else "")
    elif got == math.floor(exact):
        why = "rounded down: the remainder needs one more card"
    else:
        why = "16Φ (params, grads, AdamW) spread over cards of gpu_bytes each"
    return Verdict(False, f"Φ = {phi:,.0f} on {gpu_bytes / 1e9:g} GB cards: you say {got!r}, it is {want}; {why}")


# -- ex02: flat buffers -------------------------------------------------------------------------------------------
def padded_sizes(fn: Callable[[int, int], int], numel: int, world_sizes: Sequence[int]) -> Verdict:
    """`fn(numel, n)`: the runtime's padded length (flat_param.padded_size) for each n."""
    for n in world_sizes:
        got = _call(fn, numel, n)
        if isinstance(got, Verdict):
            return got
        want = padded_size(numel, n)
        if got != want:
            why = ("a multiple of n is needed, and the padding is less than n" if got != numel else
                   f"{numel:,} does not divide by {n}: pad with {want - numel} zero(s)")
            return Verdict(False, f"{numel:,} elements on {n} ranks: you say {got!r}, the runtime pads to "
                                  f"{want:,}; {why}")
    return Verdict(True, ", ".join(f"{padded_size(numel, n):,} on {n}" for n in world_sizes))


def owners(fn: Callable[[list, str, int], list], slots: Sequence[tuple], n: int) -> Verdict:
    """`fn(slots, name, n)`: the ranks holding an element of each parameter, from the runtime's chunks of the flat
    buffer `slots` (name, numel) lays out end to end."""
    chunks = chunks_of("block", sum(size for _, size in slots), n)
    offset = 0
    for name, size in slots:
        want = [c.rank for c in chunks if c.shard_offset < offset + size and offset < c.shard_offset + c.shard_numel]
        got = _call(fn, list(slots), name, n)
        if isinstance(got, Verdict):
            return got
        if list(got) != want:
            why = (f"it spans elements [{offset:,}, {offset + size:,}) and every chunk holds {chunks[0].shard_numel:,}"
                   + ("; a parameter can straddle two ranks" if len(want) > 1 else ""))
            return Verdict(False, f"{name} on {n} ranks: you say ranks {list(got)}, it is on {want}: {why}")
        offset += size
    return Verdict(True, f"every parameter's ranks on {n} ranks are right")


def gather_bytes(fn: Callable[[int, int, int], int], numel: int, n: int, width: int, measured: int) -> Verdict:
    """`fn(numel, n, width)`: bytes one rank sends in a unit's ring all-gather, against a trace's `measured`."""
    got = _call(fn, numel, n, width)
    if isinstance(got, Verdict):
        return got
    if got == measured:
        return Verdict(True, f"{numel:,} elements of {width} B on {n} ranks: {measured:,} B, as the trace says")
    padded = padded_size(numel, n) * width
    hints = [(padded, "that is the whole buffer: each rank already holds its own 1/N and sends only the rest"),
             (2 * measured, "that is an all-reduce's bytes: an all-gather makes one pass"),
             (numel * width * (n - 1) // n, "the padding is sent too: use the padded size"),
             (padded // n, "that is one chunk: a ring all-gather relays N-1 of them")]
    why = next((text for value, text in hints if got == value and value != measured), "C_gather = Φ_layer·(N-1)/N")
    return Verdict(False, f"{numel:,} elements of {width} B on {n} ranks: you say {got!r} B, the trace has "
                          f"{measured:,} B; {why}")


# -- ex03: a step's communication bill ----------------------------------------------------------------------------
def step_bill(fn: Callable[[dict, int, int, int], int], units: dict, n: int, param_bytes: int, reduce_bytes: int,
              measured: int) -> Verdict:
    """`fn(units, n, param_bytes, reduce_bytes)`: bytes one rank sends in a FULL_SHARD step, against a trace."""
    got = _call(fn, dict(units), n, param_bytes, reduce_bytes)
    if isinstance(got, Verdict):
        return got
    case = f"N={n}, params {param_bytes} B, reduce {reduce_bytes} B"
    if got == measured:
        return Verdict(True, f"{case}: {measured:,} B per step, as the trace says")

    def ring(numel, width):
        return numel * width * (n - 1) // n

    root = ring(units.get("<root>", 0), param_bytes)
    regathers = sum(ring(v, param_bytes) for k, v in units.items() if k != "<root>")
    reduces = sum(ring(v, reduce_bytes) for v in units.values())
    hints = [(measured + root, "the root is not re-gathered: it stays gathered from its forward to its backward"),
             (measured - regathers, "backward re-gathers every unit but the root under FULL_SHARD"),
             (measured + reduces, "a reduce-scatter makes one pass, not an all-reduce's two"),
             (measured - reduces + sum(ring(v, param_bytes) for v in units.values()),
              "gradients are reduced in reduce_bytes, not param_bytes")]
    why = next((text for value, text in hints if got == value), "two gathers (the root once) and one reduce-scatter")
    return Verdict(False, f"{case}: you say {got!r} B, the trace has {measured:,} B; {why}")


# -- ex06: resharding a checkpoint --------------------------------------------------------------------------------
def _saved_pieces(numel: int, n: int) -> list:
    """Every rank's (start, stop) in the checkpoint, from the checkpoint's own layout (checkpoint.sharded.piece)."""
    from fsdp_lab.checkpoint.sharded import piece

    out = []
    for r in range(n):
        start, length = piece(SimpleNamespace(numel=numel), SimpleNamespace(world_size=n, rank=r))
        out.append((start, start + length))
    return out


def checkpoint_pieces(fn: Callable[[int, int], list], numel: int, n: int) -> Verdict:
    """`fn(numel, n)`: every rank's (start, stop) of the unpadded buffer, as fsdp_lab's checkpoint stores it."""
    got = _call(fn, numel, n)
    if isinstance(got, Verdict):
        return got
    want = _saved_pieces(numel, n)
    got = [tuple(p) for p in got]
    if got == want:
        return Verdict(True, f"{numel:,} elements on {n} ranks: {want}")
    size = padded_size(numel, n) // n
    if got == [(r * size, (r + 1) * size) for r in range(n)]:
        why = "that is the padded layout the shards have in memory; the checkpoint stores unpadded pieces"
    else:
        why = "S = ceil(numel / n); clamp both ends to numel (a rank may save nothing)"
    return Verdict(False, f"{numel:,} elements on {n} ranks: you say {got}, the checkpoint has {want}; {why}")


def checkpoint_reads(fn: Callable[[int, int, int, int], list], numel: int, saved_n: int, new_n: int) -> Verdict:
    """`fn(numel, saved_n, new_n, rank)`: (saved rank, start, stop) every new rank reads, non-empty, in order."""
    saved = _saved_pieces(numel, saved_n)
    for rank, (lo, hi) in enumerate(_saved_pieces(numel, new_n)):
        want = [(s, max(lo, a), min(hi, b)) for s, (a, b) in enumerate(saved) if max(lo, a) < min(hi, b)]
        got = _call(fn, numel, saved_n, new_n, rank)
        if isinstance(got, Verdict):
            return got
        got = [tuple(r) for r in got]
        if got != want:
            empty = [r for r in got if len(r) == 3 and r[1] >= r[2]]
            why = (f"{empty} read nothing: leave out empty overlaps" if empty else
                   f"new rank {rank} needs [{lo:,}, {hi:,}); saved pieces are {saved}")
            return Verdict(False, f"{numel:,} elements, {saved_n} → {new_n} ranks, new rank {rank}: you say {got}, "
                                  f"it reads {want}; {why}")
    return Verdict(True, f"{numel:,} elements, {saved_n} → {new_n} ranks: every new rank reads the right parts")


# -- ex08: a NumPy MiniFSDP ---------------------------------------------------------------------------------------
def padded_chunks(chunks: Sequence, full: Sequence[float], n: int) -> Verdict:
    """`chunks`: the learner's n chunks of `full`, padded with zeros to a multiple of n, as the runtime cuts it."""
    values = list(full)
    layout = chunks_of("layer", len(values), n)
    lengths = [len(c) for c in chunks]
    if lengths != [c.shard_numel for c in layout]:
        return Verdict(False, f"{len(values):,} elements on {n} ranks: your chunks have {lengths} elements, each "
                              f"should have {layout[0].shard_numel:,} (padded to {layout[0].padded_numel:,})")
    padded = values + [0.0] * (layout[0].padded_numel - len(values))
    for c, mine in zip(layout, chunks):
        if list(mine) != padded[c.shard_offset:c.shard_offset + c.shard_numel]:
            return Verdict(False, f"chunk {c.rank} does not hold elements [{c.shard_offset:,}, "
                                  f"{c.shard_offset + c.shard_numel:,}) of the zero-padded layer")
    return Verdict(True, f"{n} chunks of {layout[0].shard_numel:,} ({layout[0].padded_numel - len(values)} zeros "
                         f"of padding)")


def gathered(got: Sequence[float], full: Sequence[float], rel: float = 0.0) -> Verdict:
    """`got`: the all-gathered layer, which must be `full` again (to `rel`), without the padding."""
    got, full = list(got), list(full)
    if len(got) == len(full) and all(math.isclose(a, b, rel_tol=rel, abs_tol=rel) for a, b in zip(got, full)):
        return Verdict(True, f"the gather gives back all {len(full):,} elements")
    if len(got) > len(full) and got[:len(full)] == full:
        return Verdict(False, f"{len(got) - len(full)} padding element(s) are still on the end: cut to numel")
    return Verdict(False, f"{len(got):,} elements that are not the layer's {len(full):,}: concatenate the chunks in "
                          f"rank order")
