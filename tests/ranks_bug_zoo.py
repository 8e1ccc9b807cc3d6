"""The bug zoo on 2 gloo ranks, for tests/test_bug_zoo.py: every entry's broken version (its symptom) and its fix
(the chapter's solution) through the chapter's own check. One run of the ranks does all of them, so the file
pays for one start-up; each result is plain data (strings, numbers, Verdict text)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fsdp_lab import FSDP, FullStateDictConfig, MixedPrecision, StateDictType, register_fsdp_forward_method
from fsdp_lab.lessons.zoo import checks, hangs, memory, numbers, units
from fsdp_lab.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy


# -- the fixes, as the chapter's solutions write them ---------------------------------------------------------------
def even_batches(batches):
    steps = torch.tensor(len(batches))
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    return batches[:int(steps)]


def save_everywhere(model):
    state = model.state_dict()
    return state if dist.get_rank() == 0 else None


def mix_every_expert(experts, h, choice):
    out = torch.zeros_like(h)
    for i, expert in enumerate(experts):
        picked = choice == i
        out[picked] = expert(h[picked])
    return out


def full_grad_norm(model):
    return numbers.norm_of([p.grad.full_tensor() for p in model.parameters()])


def mean_loss(model, x, y):
    return numbers.loss_of(model, x, y)


def epoch_orders(sampler, epochs):
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def save_full_on_rank_0(model):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        return model.state_dict()


def accumulate_synced(model, micro):
    for x, y in micro:
        (memory.loss_of(model, x, y) / len(micro)).backward()


def blocks_own_units(FSDP, model):
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({units.Block}))


def lora_orig_params(FSDP, model):
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({units.LoRALinear}), use_orig_params=True)


def lora_separate_units(FSDP, model):
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))


def _stub(FSDP, model):
    raise NotImplementedError


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def zoo(rank, world_size):
    out = {}
    bf16 = torch.bfloat16
    batches = hangs.epoch_batches(rank, world_size)
    (out["uneven_broken"], out["uneven_s"]) = _timed(lambda: hangs.train_epoch(batches))
    out["uneven_fixed"] = str(checks.epoch_ends_together(even_batches(batches)))
    out["uneven_stub"] = str(checks.epoch_ends_together(None))

    out["save_broken"] = hangs.try_save(hangs.save_on_rank_0_only)[1]
    out["save_fixed"] = str(checks.saves_on_every_rank(save_everywhere))

    out["moe_broken"] = hangs.moe_step(hangs.mix_skipping_idle)[2]
    out["moe_fixed"] = str(checks.every_expert_runs(mix_every_expert))

    out["norm_broken"] = numbers.grad_norms(numbers.local_grad_norm)
    out["norm_fixed"] = str(checks.global_grad_norm(full_grad_norm))
    out["norm_fsdp1"] = numbers.fsdp1_grad_norms()

    out["sum_broken"] = numbers.grad_ratio(numbers.summed_loss)
    out["sum_fixed"] = str(checks.averages_like_one_process(mean_loss))

    out["init_broken"] = numbers.whose_weights(numbers.built_by_rank())
    out["init_fixed"] = str(checks.same_model_everywhere(numbers.built_by_rank(sync_module_states=True)))

    try:
        model, opt = numbers.optimizer_then_wrap()
        numbers.step_once(model, opt)
        out["opt_broken"] = ""
    except RuntimeError as err:
        out["opt_broken"] = str(err)
    model = numbers.wrapped(numbers.tiny())
    out["opt_fixed"] = str(checks.optimizer_steps_the_model(model, torch.optim.SGD(model.parameters(), lr=0.1)))

    out["buffer_broken"] = numbers.count_after(MixedPrecision(param_dtype=bf16, buffer_dtype=bf16))
    out["buffer_fixed"] = str(checks.buffers_keep_counting(MixedPrecision(param_dtype=bf16,
                                                                           buffer_dtype=torch.float32)))

    out["sampler_broken"] = numbers.orders_without_set_epoch(numbers.sampler(), 2)
    out["sampler_fixed"] = str(checks.reshuffles(epoch_orders))

    out["sd_broken"] = memory.state_dict_bytes(memory.full_everywhere)
    out["sd_sharded"] = memory.state_dict_bytes(memory.sharded_pieces)
    out["sd_fixed"] = str(checks.full_state_on_rank_0(save_full_on_rank_0))

    out["nosync_broken"] = memory.grad_bytes_between(memory.accumulate_no_sync)[0]
    out["nosync_fixed"] = str(checks.accumulates_sharded(accumulate_synced))

    out["root_broken"] = memory.forward_peak(memory.root_only())
    out["root_fixed"] = str(checks.saves_forward_memory(memory.wrapped()))

    out["gen_broken"] = memory.generate_or_error(memory.sharded_generator())[1]
    model = memory.sharded_generator()
    register_fsdp_forward_method(model, "generate")
    out["gen_fixed"] = str(checks.generates_like_one_process(model))

    out["tied_torch"] = units.tied_step(units.every_layer, units.torch_fsdp1)
    out["tied_ours"] = units.tied_step(units.every_layer, FSDP)
    out["tied_fixed"] = str(checks.keeps_the_weight_tied(blocks_own_units))
    out["tied_stub"] = str(checks.keeps_the_weight_tied(_stub))

    out["lora_torch"] = units.lora_step(units.lora_units, units.torch_fsdp1)
    out["lora_ours"] = units.lora_step(units.lora_units, FSDP)
    out["lora_flats"] = units.flat_buffers(units.lora_units(FSDP, units.adapted()))
    out["lora_fixed"] = str(checks.trains_only_the_adapter(lora_orig_params))
    out["lora_fixed_units"] = str(checks.trains_only_the_adapter(lora_separate_units))
    out["lora_stub"] = str(checks.trains_only_the_adapter(_stub))
    out["wrong"] = wrong_answers()
    return out


# -- the wrong answers learners type, beside the broken version itself ----------------------------------------------
def cell(build):
    """A wrong answer that is what a cell leaves behind (batches, a model, a model and its optimizer), not a function
    the check calls: `build()` makes the check's arguments on the ranks, when it is checked."""
    build.builds_arguments = True
    return build


def padded_with_zeros():
    """Uneven batches evened out the other way: every rank pads to the most batches any rank has, with zeros."""
    batches = hangs.epoch_batches(dist.get_rank(), dist.get_world_size())
    most = torch.tensor(len(batches))
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    x, y = batches[0]
    return (batches + [(torch.zeros_like(x), torch.zeros_like(y))] * (int(most) - len(batches)),)


def save_inner_module_on_rank_0(model):
    """The collective skipped by reading the wrapped module's own state dict on rank 0."""
    if dist.get_rank() == 0:
        return model.module.state_dict()
    return None


def save_sharded_on_rank_0(model):
    """Every rank takes part, but in a state dict that gathers nothing: rank 0 keeps its own shards."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = model.state_dict()
    return state if dist.get_rank() == 0 else None


def mix_idle_on_a_dummy_row(experts, h, choice):
    """The idle expert run on a row it then throws away, so that its all-gather happens."""
    out = torch.zeros_like(h)
    for i, expert in enumerate(experts):
        picked = choice == i
        if picked.any():
            out[picked] = expert(h[picked])
        else:
            expert(h[:1])
    return out


def mix_every_expert_on_every_row(experts, h, choice):
    """Every expert run on every rank, on every row, and the outputs added."""
    out = torch.zeros_like(h)
    for expert in experts:
        out = out + expert(h)
    return out


def summed_shard_norms(model):
    """The ranks' shard norms all-reduced: one number on every rank, but a sum of norms."""
    norm = torch.tensor(numbers.local_grad_norm(model))
    dist.all_reduce(norm)
    return norm.item()


def mean_over_world(model, x, y):
    """A mean loss divided by the world size, to undo a sum over ranks that FSDP does not do."""
    return numbers.loss_of(model, x, y) / dist.get_world_size()


def broadcast_after_wrapping():
    """Rank 0's parameters broadcast as DDP users do, but after FSDP sharded them."""
    model = numbers.built_by_rank()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    return (model,)


def optimizer_of_a_fresh_model():
    """Wrapped first, then an optimizer over the parameters of the model as built, built again."""
    model = numbers.wrapped(numbers.tiny())
    return model, torch.optim.SGD(numbers.tiny().parameters(), lr=0.1)


def seeded_orders(sampler, epochs):
    """A global seed per epoch, which reshuffles a RandomSampler but not a DistributedSampler."""
    orders = []
    for epoch in range(epochs):
        torch.manual_seed(epoch)
        orders.append(list(sampler))
    return orders


def epoch_set_once(sampler, epochs):
    """set_epoch called once, before the loop."""
    sampler.set_epoch(0)
    return [list(sampler) for _ in range(epochs)]


def sharded_everywhere(model):
    """What DCP saves: every rank keeps its own shards, rank 0 too."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()


def no_sync_to_the_end(model, micro):
    """Every micro-batch inside no_sync, the last one too: nothing is ever reduce-scattered."""
    with model.no_sync():
        for x, y in micro:
            (memory.loss_of(model, x, y) / len(micro)).backward()


def size_policy_defaults():
    """An auto-wrap policy, but size_based_auto_wrap_policy with its default of 100M parameters per unit."""
    return (FSDP(memory.wide(), auto_wrap_policy=size_based_auto_wrap_policy),)


def kept_unsharded_after_forward():
    """The root told to keep its parameters after forward, though generate() never calls forward."""
    model = memory.sharded_generator()
    model.set_reshard_after_forward(False)
    return (model,)


WRONG_ANSWERS = {  # check -> {label: a wrong answer}: the broken version first, then what learners type instead
    "epoch_ends_together": {
        "uneven": cell(lambda: (hangs.epoch_batches(dist.get_rank(), dist.get_world_size()),)),
        "uneven_padded": cell(padded_with_zeros)},
    "saves_on_every_rank": {"save": hangs.save_on_rank_0_only, "save_module": save_inner_module_on_rank_0,
                            "save_sharded": save_sharded_on_rank_0},
    "every_expert_runs": {"moe": hangs.mix_skipping_idle, "moe_dummy": mix_idle_on_a_dummy_row,
                          "moe_dense": mix_every_expert_on_every_row},
    "global_grad_norm": {"norm": numbers.local_grad_norm, "norm_summed": summed_shard_norms},
    "averages_like_one_process": {"sum": numbers.summed_loss, "sum_world": mean_over_world},
    "same_model_everywhere": {"init": cell(lambda: (numbers.built_by_rank(),)),
                              "init_broadcast": cell(broadcast_after_wrapping)},
    "optimizer_steps_the_model": {"opt": cell(lambda: numbers.optimizer_then_wrap()),
                                  "opt_fresh": cell(optimizer_of_a_fresh_model)},
    "buffers_keep_counting": {
        "buffer": cell(lambda: (MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),)),
        "buffer_fp32": cell(lambda: (MixedPrecision(),))},
    "reshuffles": {"sampler": numbers.orders_without_set_epoch, "sampler_seeded": seeded_orders,
                   "sampler_once": epoch_set_once},
    "full_state_on_rank_0": {"sd": memory.full_everywhere, "sd_sharded": sharded_everywhere},
    "accumulates_sharded": {"nosync": memory.accumulate_no_sync, "nosync_last": no_sync_to_the_end},
    "saves_forward_memory": {"root": cell(lambda: (memory.root_only(),)), "root_size": cell(size_policy_defaults)},
    "generates_like_one_process": {"gen": cell(lambda: (memory.sharded_generator(),)),
                                   "gen_reshard": cell(kept_unsharded_after_forward)},
    "keeps_the_weight_tied": {"tied": units.every_layer, "tied_untie": units.untie,
                              "tied_root": lambda FSDP, model: FSDP(model)},
    "trains_only_the_adapter": {"lora": units.lora_units, "lora_unfreeze": units.unfreeze},
}


def wrong_answers() -> dict:
    """label -> what the check said to that wrong answer, for every check and every wrong answer in
    WRONG_ANSWERS, in that order on every rank."""
    said = {}
    for name, answers in WRONG_ANSWERS.items():
        for label, answer in answers.items():
            args = answer() if getattr(answer, "builds_arguments", False) else (answer,)
            said[label] = str(getattr(checks, name)(*args))
    return said
