"""The checks of the zoo's "Your turn" fixes, run on each live rank: each one runs the learner's fix on the ranks
and answers with a Verdict ("ok: ..." / "not yet: ..."), or "not written yet" for the copy's stub (None, or a
function that raises NotImplementedError).

[Note: a check runs the fix] A fix is judged by what it does on the ranks, not by its text: the hang checks run it
on a short-timeout group (a wrong fix hangs for seconds and is named by the collective log), the number checks
compare with one process, the memory checks measure with memory_report.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from fsdp_lab.lessons.live.verdict import Verdict, not_written, unwritten
from fsdp_lab.lessons.zoo import hangs, memory, numbers, units
from fsdp_lab.lessons.zoo.common import gathered
from fsdp_lab.runtime.fsdp1.api import FSDP


def _run(name: str, fn: Callable, *args):
    """fn(*args), or the "not written yet" Verdict when the learner's part raises NotImplementedError."""
    try:
        return fn(*args)
    except NotImplementedError as err:
        return not_written(name, err)


def agreed(check: Callable) -> Callable:
    """A check whose Verdict is ok only if it is ok on every rank (the ranks that are not are named). Every
    check's verdict passes through this one gather, so each rank takes part in it whatever its answer was; a
    stub's "not written yet" is the same on every rank and returns before it. A rank whose own verdict was ok
    quotes the first other rank's answer, so that every rank says what is off."""
    @functools.wraps(check)
    def checked(*args) -> Verdict:
        verdict = check(*args)
        if verdict.todo:
            return verdict
        everyone = gathered((verdict.ok, verdict.message))
        if verdict.ok and not all(ok for ok, _ in everyone):
            bad = [r for r, (ok, _) in enumerate(everyone) if not ok]
            return Verdict(False, f"{verdict.message}, but not on rank(s) {bad}; rank {bad[0]}: "
                                  f"{everyone[bad[0]][1]}")
        return verdict
    return checked


def _same_batch(a, b) -> bool:
    try:
        return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
    except (TypeError, RuntimeError):
        return False


@agreed
def epoch_ends_together(batches) -> Verdict:
    """The learner's `batches` for this rank: one epoch of them must end on every rank without a hang."""
    if batches is None:
        return unwritten("batches", batches)
    data = hangs.epoch_batches(dist.get_rank(), dist.get_world_size())
    made_up = [i for i, b in enumerate(batches) if not any(_same_batch(b, d) for d in data)]
    everyone = gathered((len(batches), made_up))
    lengths = [n for n, _ in everyone]
    padded = "; ".join(f"rank {r}: {made}" for r, (_, made) in enumerate(everyone) if made)
    if padded:
        return Verdict(False, f"batches that are not from the rank's data ({padded}): a padded batch is trained on "
                              f"like data, its loss and gradient enter the step; keep only as many of the real "
                              f"batches as every rank has")
    steps, report = hangs.train_epoch(batches)
    counts = gathered(steps)
    if report:
        return Verdict(False, f"the epoch still hangs: {report} (batches per rank: {lengths})")
    if len(set(counts)) > 1:
        return Verdict(False, f"no hang, but the ranks ran different numbers of steps {counts}")
    return (Verdict(True, f"every rank ran {counts[0]} steps and the epoch ended together"))


@agreed
def saves_on_every_rank(save: Callable) -> Verdict:
    """`save(model)`: no hang, and rank 0 gets the whole state dict (every tensor, at its full shape)."""
    if save is None:
        return unwritten("save", save)
    out = _run("save", hangs.try_save, save)
    if isinstance(out, Verdict):
        return out
    state, report = out
    if report:
        return Verdict(False, f"the save still hangs: {report}")
    full = hangs.tiny().state_dict()
    want = {k: tuple(v.shape) for k, v in full.items()}
    if dist.get_rank() == 0:
        got = {k: tuple(v.shape) for k, v in (state or {}).items()}
        if got != want:
            return (Verdict(False, f"rank 0 got {got or 'no state dict'}, not the full {want}"))
        pieces = [k for k, v in state.items() if type(v) not in (torch.Tensor, torch.nn.Parameter)]
        if pieces:
            return Verdict(False, f"rank 0 got {type(state[pieces[0]]).__name__}s ({', '.join(pieces)}): each "
                                  f"rank's own shards, not the gathered tensors a file of the whole model needs")
        off = [k for k, v in state.items() if not torch.equal(v, full[k])]
        if off:
            return Verdict(False, f"rank 0's {', '.join(off)} are not the model's values")
    return (Verdict(True, f"no hang; rank 0 holds all {len(want)} tensors at full shape"))


@agreed
def every_expert_runs(mix: Callable) -> Verdict:
    """`mix(experts, h, choice)`: one MoE step with no hang, and the loss one process gets on these rows."""
    if mix is None:
        return unwritten("mix", mix)
    out = _run("mix", hangs.moe_step, mix)
    if isinstance(out, Verdict):
        return out
    loss, reference, report = out
    if report:
        return Verdict(False, f"the step still hangs: {report}")
    if abs(loss - reference) > 1e-5:
        return (Verdict(False, f"no hang, but the loss {loss:.6f} differs from one process's {reference:.6f}: "
                               f"each row must get the output of the expert it picked, and of no other"))
    return (Verdict(True, f"no hang; loss {loss:.4f} equals one process's on this rank's rows"))


@agreed
def global_grad_norm(grad_norm: Callable) -> Verdict:
    """`grad_norm(model)` of an FSDP2 model after one backward: the one-process norm, on every rank."""
    if grad_norm is None:
        return unwritten("grad_norm", grad_norm)
    out = _run("grad_norm", numbers.grad_norm_parts, grad_norm)
    if isinstance(out, Verdict):
        return out
    got, local, want = out

    def close(a, b):
        return abs(a - b) <= 1e-5 * max(1.0, abs(b))

    everyone = gathered((got, local))
    gots, locals_ = [g for g, _ in everyone], [n for _, n in everyone]
    if close(got, want):
        return (Verdict(True, f"norm {got:.6f} on every rank, equal to one process's"))
    if not all(close(g, gots[0]) for g in gots):
        return (Verdict(False, f"rank {dist.get_rank()} reports {got:.6f}, one process {want:.6f}, and the ranks "
                               f"disagree ({', '.join(f'{g:.6f}' for g in gots)}): a norm of this rank's shards "
                               f"only?"))
    if close(got, sum(locals_)):
        return Verdict(False, f"every rank reports {got:.6f}, the sum of the ranks' shard norms "
                              f"{' + '.join(f'{n:.6f}' for n in locals_)}; one process {want:.6f}: norms do not "
                              f"add, their squares do (the square root of the sum of squares)")
    one = [r for r, n in enumerate(locals_) if close(got, n)]
    if one:
        return Verdict(False, f"every rank reports {got:.6f}, the norm of rank {one[0]}'s shards only; one process "
                              f"{want:.6f}")
    return Verdict(False, f"every rank reports {got:.6f}, one process {want:.6f}")


@agreed
def averages_like_one_process(loss_fn: Callable) -> Verdict:
    """`loss_fn(model, x, y)` on this rank's rows: FSDP's gradients must equal one process's on the whole batch."""
    if loss_fn is None:
        return unwritten("local_loss", loss_fn)
    ratio = _run("local_loss", numbers.grad_ratio, loss_fn)
    if isinstance(ratio, Verdict):
        return ratio
    if abs(ratio - 1.0) > 1e-4:
        world, elements = dist.get_world_size(), numbers.elements_per_rank()
        why = ""
        if abs(ratio * world - 1.0) <= 1e-4:
            why = (f": FSDP already divides the ranks' sum by the {world} ranks, so a loss divided by the world "
                   f"size is divided twice")
        elif abs(ratio - elements) <= 1e-4 * elements:
            why = f": a sum over this rank's {elements} elements where one process takes their mean"
        return (Verdict(False, f"FSDP's gradients are {ratio:g} times one process's{why}"))
    return (Verdict(True, "FSDP's gradients equal one process's on the whole batch (ratio 1.0)"))


@agreed
def same_model_everywhere(model) -> Verdict:
    """The learner's wrapped model: its full parameters are rank 0's model on every rank."""
    if model is None:
        return unwritten("model", model)
    whose = numbers.whose_weights(model)
    shards = gathered([p.detach().clone() for p in model.parameters()])
    copied = all(len(s) == len(shards[0]) and all(torch.equal(a, b) for a, b in zip(s, shards[0]))
                 for s in shards[1:])
    if whose != "rank 0's model" and copied:
        return Verdict(False, f"the full parameters are no rank's model: every rank holds the same shard, rank "
                              f"0's, copied after FSDP had sharded the parameters; rank 0's values must reach the "
                              f"other ranks before FSDP keeps one slice of them per rank")
    if whose != "rank 0's model":
        return (Verdict(False, f"the full parameters are {whose}"))
    return (Verdict(True, "the full parameters are rank 0's model on every rank"))


@agreed
def optimizer_steps_the_model(model, opt) -> Verdict:
    """The learner's model and optimizer: one step must move the full parameters as one process's step does."""
    if model is None or opt is None:
        return unwritten("model and opt", None)
    try:
        gap = numbers.step_once(model, opt)
    except RuntimeError as err:
        return Verdict(False, str(err).split(". ")[0])
    if gap > 1e-5:
        ours = {id(p) for p in model.parameters()}
        held = [p for group in opt.param_groups for p in group["params"]]
        theirs = sum(id(p) in ours for p in held)
        if theirs < len(ours):
            return Verdict(False, f"after one step the parameters differ from one process's by {gap:.2e}: the "
                                  f"optimizer holds {theirs} of the wrapped model's {len(ours)} parameter(s) and "
                                  f"{len(held) - theirs} tensor(s) it does not use, which its step moves instead")
        return (Verdict(False, f"after one step the parameters differ from one process's by {gap:.2e}"))
    return (Verdict(True, f"one step matches one process's (largest difference {gap:.1e})"))


@agreed
def buffers_keep_counting(mixed_precision) -> Verdict:
    """The learner's MixedPrecision: the step buffer (256 at the start) must reach 260 after 4 forwards."""
    if mixed_precision is None:
        return unwritten("mp", mixed_precision)
    count = numbers.count_after(mixed_precision)
    if count != 260.0:
        return Verdict(False, f"the step buffer reads {count:g} after 4 forwards from 256, not 260")
    dtype = getattr(mixed_precision, "param_dtype", None)
    if dtype is not torch.bfloat16:
        return Verdict(False, f"the count is right, but param_dtype is {dtype}: keep the compute in bfloat16")
    return (Verdict(True, "256 + 4 forwards = 260 in the buffer, with bf16 compute"))


@agreed
def reshuffles(orders: Callable) -> Verdict:
    """`orders(sampler, epochs)`: each epoch a new order, and the ranks' indices of one epoch are disjoint."""
    if orders is None:
        return unwritten("epoch_orders", orders)
    sampler = numbers.sampler()
    got = _run("epoch_orders", orders, sampler, 2)
    if isinstance(got, Verdict):
        return got
    if got[0] == got[1] and not sampler.told:
        return (Verdict(False, f"epochs 0 and 1 both read {got[0]}: the sampler was never told the epoch "
                               f"(set_epoch); it shuffles with its own generator, seeded with seed + epoch, which "
                               f"no global seed reaches"))
    if got[0] == got[1]:
        return Verdict(False, f"epochs 0 and 1 both read {got[0]}: the sampler was told epoch(s) {sampler.told} "
                              f"for 2 epochs; tell it each epoch's own number as that epoch starts")
    everyone = gathered(got)
    for epoch in range(2):
        seen = [i for rank_orders in everyone for i in rank_orders[epoch]]
        if sorted(seen) != list(range(len(seen))):
            return Verdict(False, f"epoch {epoch}: the ranks' indices overlap {seen}: give every rank the same epoch")
    return (Verdict(True, f"epoch 0 {got[0]}, epoch 1 {got[1]}; the ranks split each epoch"))


@agreed
def full_state_on_rank_0(save: Callable) -> Verdict:
    """`save(model)`: rank 0 holds the whole model's bytes, the other ranks none."""
    if save is None:
        return unwritten("save_full", save)
    held = _run("save_full", memory.state_dict_bytes, save)
    if isinstance(held, Verdict):
        return held
    full = memory.host_bytes(memory.wide().state_dict())
    want = full if dist.get_rank() == 0 else 0
    if held != want:
        world = dist.get_world_size()
        why = (": the whole model, which only rank 0 should keep" if held == full else
               f": 1/{world} of the model, this rank's own shards, as a sharded state dict keeps them"
               if held * world == full else "")
        return (Verdict(False, f"rank {dist.get_rank()} holds {held:,} B; want {want:,} B{why}"))
    return (Verdict(True, f"rank {dist.get_rank()} holds {held:,} B (the whole model is {full:,} B)"))


@agreed
def accumulates_sharded(accumulate: Callable) -> Verdict:
    """`accumulate(model, micro)`: the no_sync gradients, with only sharded gradients held in between."""
    if accumulate is None:
        return unwritten("accumulate", accumulate)
    out = _run("accumulate", memory.grad_bytes_between, accumulate)
    if isinstance(out, Verdict):
        return out
    held, grads = out
    no_sync_held, want = memory.grad_bytes_between(memory.accumulate_no_sync)
    if any(g is None for g in grads):
        return Verdict(False, "after the last micro-batch the parameters have no gradient: no backward ran outside "
                              "no_sync, so none was reduce-scattered and every rank still holds only its own "
                              "unsharded sum")
    gap = max((a - b).abs().max().item() for a, b in zip(grads, want))
    if gap > 1e-5:
        return (Verdict(False, f"the accumulated gradients differ from no_sync's by {gap:.2e}"))
    if held >= no_sync_held:
        return (Verdict(False, f"{held:,} B of gradients held between micro-batches, as many as no_sync's"))
    return (Verdict(True, f"same gradients; {held:,} B held between micro-batches instead of "
                                 f"{no_sync_held:,} B"))


@agreed
def saves_forward_memory(model) -> Verdict:
    """The learner's wrapped model: its forward peak is below the root-only one's (one unit at a time)."""
    if model is None:
        return unwritten("model", model)
    peak, root = memory.forward_peak(model), memory.forward_peak(memory.root_only())
    if peak >= root:
        units = len(FSDP.fsdp_modules(model))
        why = (": one FSDP unit, so the forward gathers the whole model at once; no layer became a unit of its "
               "own" if units == 1 else f" with {units} FSDP units")
        return (Verdict(False, f"forward peak {peak:,} B, no lower than the root-only {root:,} B{why}"))
    return (Verdict(True, f"forward peak {peak:,} B instead of {root:,} B with the root alone"))


@agreed
def generates_like_one_process(model) -> Verdict:
    """The learner's sharded Generator: generate() gives one process's output."""
    if model is None:
        return unwritten("model", model)
    out, error = memory.generate_or_error(model)
    if error:
        why = ("; it reads the root's parameters still sharded (DTensor): only forward, or a method registered "
               "as one, gathers them" if "DTensor" in error else "")
        return (Verdict(False, f"generate() raises {error}{why}"))
    gap = (out - memory.reference_generate()).abs().max().item()
    if gap > 1e-5:
        return (Verdict(False, f"generate() differs from one process's by {gap:.2e}"))
    return (Verdict(True, "generate() gives one process's output"))


@agreed
def keeps_the_weight_tied(wrap: Callable) -> Verdict:
    """`wrap(FSDP, model)` of the tied LM, with torch's FSDP1 and with fsdp_lab's: no refusal, more than one
    unit, head and embedding one weight after a step, and that step one process's."""
    if wrap is None:
        return unwritten("wrap", wrap)
    for name, front_end in units.front_ends():
        got = _run("wrap", units.tied_step, wrap, front_end)
        if isinstance(got, Verdict):
            return got
        if "error" in got:
            return Verdict(False, f"{name} refuses it: {got['error'][:160]}")
        if got["units"] < 2:
            return Verdict(False, f"{name}: one unit, the whole model gathered at once (entry 12): keep the "
                                  f"blocks in units of their own")
        if got["untied"] > 0 or got["gap"] > 1e-5:
            return Verdict(False, f"{name}: after one step head.weight - embed.weight is {got['untied']:.2e} and "
                                  f"one process's step is {got['gap']:.2e} away: the weight is no longer tied")
    return Verdict(True, f"head and embedding one weight in {got['units']} units with both front ends; "
                         f"one process's step (off by {got['gap']:.1e})")


@agreed
def trains_only_the_adapter(wrap: Callable) -> Verdict:
    """`wrap(FSDP, model)` of the LoRA model, with torch's FSDP1 and with fsdp_lab's: no refusal, the frozen bases
    unmoved after a step, and the adapters where one process's step puts them."""
    if wrap is None:
        return unwritten("wrap", wrap)
    for name, front_end in units.front_ends():
        got = _run("wrap", units.lora_step, wrap, front_end)
        if isinstance(got, Verdict):
            return got
        if "error" in got:
            return Verdict(False, f"{name} refuses it: {got['error'][:160]}")
        if got["moved"] > 0:
            return Verdict(False, f"{name}: the frozen bases moved by {got['moved']:.2e}: they were unfrozen, "
                                  f"and now hold gradients and optimizer state too")
        if got["gap"] > 1e-5:
            return Verdict(False, f"{name}: one step is {got['gap']:.2e} off one process's")
    return Verdict(True, f"bases frozen, adapters at one process's step (off by {got['gap']:.1e}) with both "
                         f"front ends")
