"""The bug zoo on 2 gloo ranks, for tests/test_bug_zoo.py: every entry's broken version (its symptom) and its fix
(the chapter's solution) through the chapter's own check. One run of the ranks does all of them, so the file
pays for one start-up; each result is plain data (strings, numbers, Verdict text)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fsdp_lab import FSDP, FullStateDictConfig, MixedPrecision, StateDictType, register_fsdp_forward_method
from fsdp_lab.lessons.zoo import checks, hangs, memory, numbers, units
from fsdp_lab.wrap import ModuleWrapPolicy


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
    out["norm_wrong"] = str(checks.global_grad_norm(numbers.local_grad_norm))
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
    out["wrong"] = wrong_answers(batches)
    return out


def wrong_answers(batches) -> dict:
    """Each check against the answer learners give before they see the bug: the broken version itself (and, for
    the buffers, a MixedPrecision that fixes the count by dropping bf16 compute; for the tied weight, an untied copy
    and a single unit; for the LoRA unit, unfreezing the base)."""
    bf16 = torch.bfloat16
    return {
        "uneven": str(checks.epoch_ends_together(batches)),
        "save": str(checks.saves_on_every_rank(hangs.save_on_rank_0_only)),
        "moe": str(checks.every_expert_runs(hangs.mix_skipping_idle)),
        "norm": str(checks.global_grad_norm(numbers.local_grad_norm)),
        "sum": str(checks.averages_like_one_process(numbers.summed_loss)),
        "init": str(checks.same_model_everywhere(numbers.built_by_rank())),
        "opt": str(checks.optimizer_steps_the_model(*numbers.optimizer_then_wrap())),
        "buffer": str(checks.buffers_keep_counting(MixedPrecision(param_dtype=bf16, buffer_dtype=bf16))),
        "buffer_fp32": str(checks.buffers_keep_counting(MixedPrecision())),
        "sampler": str(checks.reshuffles(numbers.orders_without_set_epoch)),
        "sd": str(checks.full_state_on_rank_0(memory.full_everywhere)),
        "nosync": str(checks.accumulates_sharded(memory.accumulate_no_sync)),
        "root": str(checks.saves_forward_memory(memory.root_only())),
        "gen": str(checks.generates_like_one_process(memory.sharded_generator())),
        "tied": str(checks.keeps_the_weight_tied(units.every_layer)),
        "tied_untie": str(checks.keeps_the_weight_tied(units.untie)),
        "tied_root": str(checks.keeps_the_weight_tied(lambda FSDP, model: FSDP(model))),
        "lora": str(checks.trains_only_the_adapter(units.lora_units)),
        "lora_unfreeze": str(checks.trains_only_the_adapter(units.unfreeze)),
    }
