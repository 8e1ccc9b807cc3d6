"""Activation checkpointing for FSDP units: keep a block's input, recompute its insides during backward.

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))   # the course GPT's unit

[Note: checkpoint the inner forward] We do not put a wrapper module around the block (torch's
checkpoint_wrapper does, and renames every parameter `..._checkpoint_wrapped_module...`). We replace the block's
`forward` on the instance with a non-reentrant `torch.utils.checkpoint` of the original forward. `nn.Module.__call__`
still runs the block's hooks around it, so FSDP's per-unit hooks stay *outside* the checkpointed region:

    forward:   pre_forward (gather) → checkpoint(forward): nothing saved inside → post_forward (free)
    backward:  the output's pre-backward hook re-gathers the unit → autograd unpacks a saved tensor of the
               block → checkpoint re-runs the original forward on the re-gathered weights → gradients →
               reduce-scatter → free

The pre-backward hook sits on the block's output tensor, so it runs before any node of the block needs a saved
tensor, i.e. before the recomputation: the recomputation finds the unit UNSHARDED and the block's attributes
pointing at views of the unsharded buffer, which the re-gather refilled and the hook installed again (under
use_orig_params the free after forward had put the sharded parameters back in their place). So each unit is
gathered exactly twice per step (forward, and one re-gather), as without checkpointing.
A checkpointed region that *contains* units' hooks re-enters them during backward; they see `ctx.in_backward`,
gather if needed and neither record the forward order nor free. Hugging Face's gradient_checkpointing_enable()
is that case, not this module's: transformers checkpoints each decoder layer's `__call__` (its
`_gradient_checkpointing_func(decoder_layer.__call__, ...)`, later GradientCheckpointingLayer.__call__), so the
unit's pre-forward hook runs again inside the recomputation and finds the unit already re-gathered.

Order: apply it before or after wrapping with FSDP, both work and give the same result, because FSDP only
registers hooks and never replaces a module's forward. Parameter names do not change either way, so
checkpoints and `summon_full_params` are unaffected. Refused, with a ValueError naming the module: a check_fn
that selects the FSDP wrapper itself (FSDP.forward must not run again inside backward).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from fsdp_lab.runtime.core.observed import is_fsdp_wrapper


class CheckpointedForward:
    """A module's forward, recomputed in backward. Stored on the instance (shadowing the class's forward)."""

    def __init__(self, forward: Callable, preserve_rng_state: bool, replaced_instance_forward: bool):
        self.forward = forward
        self.preserve_rng_state = preserve_rng_state
        self.replaced_instance_forward = replaced_instance_forward  # put it back on removal

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved under no_grad: checkpointing would only cost
            return self.forward(*args, **kwargs)
        return torch_checkpoint.checkpoint(self.forward, *args, use_reentrant=False,
                                           preserve_rng_state=self.preserve_rng_state, **kwargs)


def _display(name: str) -> str:
    """A submodule's name as the user wrote it (an FSDP model's names carry the wrapper's prefix)."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module") or "<root>"


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def apply_activation_checkpointing(module: nn.Module, check_fn: Callable[[nn.Module], bool],
                                   preserve_rng_state: bool = True) -> list[str]:
    """Checkpoint the forward of every submodule for which check_fn(module) is true (as torch's function of the
    same name, e.g. `check_fn=lambda m: isinstance(m, Block)`). `module` may be a plain model or an fsdp_lab.FSDP
    model. Returns the qualified names newly checkpointed; modules already checkpointed are left as they are
    (re-running a notebook cell is safe)."""
    check = check_fn
    if not callable(check):
        raise ValueError(f"check_fn must be a callable taking a module, got {check!r}")
    root = module.module if is_fsdp_wrapper(module) else module
    chosen = []
    for name, sub in module.named_modules():
        if not check(sub):
            continue
        if is_fsdp_wrapper(sub):
            raise ValueError(f"activation checkpointing selected the FSDP wrapper '{name or '<root>'}' itself: "
                             f"FSDP.forward cannot be recomputed inside backward. Select the modules inside it "
                             f"(e.g. check_fn=lambda m: isinstance(m, Block)).")
        chosen.append((name, sub))
    if not chosen:
        raise ValueError(f"apply_activation_checkpointing: check_fn selected no module of "
                         f"{type(root).__name__}; nothing would be checkpointed")
    added = []
    for name, sub in chosen:
        if is_checkpointed(sub):
            continue
        own = "forward" in sub.__dict__
        sub.forward = CheckpointedForward(sub.forward, preserve_rng_state, replaced_instance_forward=own)
        added.append(_display(name))
    return added


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo apply_activation_checkpointing: every checkpointed submodule gets its own forward back."""
    removed = []
    for name, sub in module.named_modules():
        if is_checkpointed(sub):
            wrapper = sub.__dict__.pop("forward")
            if wrapper.replaced_instance_forward:
                sub.forward = wrapper.forward
            removed.append(_display(name))
    return removed
