"""The four ways `fsdp-lab bench` trains the same GPT, each behind the same small interface.

    fsdp_lab              fsdp_lab.FSDP, one unit per Block plus the root, bf16 compute, fp32 masters and
                          reduction, and otherwise torch FSDP1's defaults (BACKWARD_PRE, limit_all_gathers,
                          no forward prefetch)
    fsdp_lab_fully_shard  fsdp_lab.fully_shard, applied as fsdp2 is (the same script with fsdp_lab's import)
    fsdp2                 torch's fully_shard on each Block, then on the root, MixedPrecisionPolicy(bf16, fp32)
    plain                 the whole model on one device, fp32 weights, torch.autocast(bf16): no sharding, no
                          communication

All four start from the same weights (same seed, built on the target device), see the same batches and use the
same AdamW settings, so their losses can be compared as a sanity check.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from fsdp_lab.training.models import Block, GPTConfig, build_gpt

MODES = ("fsdp_lab", "fsdp_lab_fully_shard", "fsdp2", "plain")
OPTIMIZERS = ("fused", "foreach", "loop")


def optimizer_kwargs(kind: str) -> dict:
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer implementation {kind!r}; expected one of {OPTIMIZERS}")
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[kind]


@dataclass
class Runner:
    """One training setup: `step(x, y)` runs forward, backward and the optimizer and returns the loss (a tensor,
    never read inside the step: reading it would be a host sync)."""

    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Optional[Callable[[], contextlib.AbstractContextManager]] = None

    def step(self, x: torch.Tensor, y: torch.Tensor, after_backward: Optional[Callable] = None) -> torch.Tensor:
        with (self.autocast() if self.autocast else contextlib.nullcontext()):
            loss = self.model(x, y)
        loss.backward()
        if after_backward is not None:
            after_backward(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes(self) -> dict:
        """Live bytes of parameters, gradients and optimizer state this rank holds (storage counted once). For
        fsdp_lab it is the runtime's own memory_report (unsharded buffers included, 0 once freed)."""
        if self.mode == "fsdp_lab":
            rep = self.model.memory_report(self.optimizer)
            return {"params": rep.params_sharded + rep.params_unsharded,
                    "grads": rep.grads_sharded + rep.grads_unsharded, "optimizer": rep.optimizer_state,
                    "total": rep.total}
        seen: set[int] = set()

        def count(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None or not isinstance(t, torch.Tensor):
                    continue
                t = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's piece
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = list(self.model.parameters())
        out = {"params": count(params), "grads": count(p.grad for p in params),
               "optimizer": count(v for s in self.optimizer.state.values() for v in s.values())}
        out["total"] = sum(out.values())
        return out


def build_runner(mode: str, cfg: GPTConfig, device: torch.device, optimizer: str, lr: float,
                 seed: int = 0) -> Runner:
    """Build one setup on `device` (the model is created there directly: no slow CPU init of big presets)."""
    if mode not in MODES:
        raise ValueError(f"unknown bench mode {mode!r}; expected one of {MODES}")
    opt_kwargs = dict(lr=lr, **optimizer_kwargs(optimizer))
    with torch.device(device):
        model = build_gpt(cfg, seed=seed)
    bf16 = torch.bfloat16
    if mode == "fsdp_lab":
        from fsdp_lab.runtime import FSDP, MixedPrecision
        from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32))
        return Runner(mode, model, torch.optim.AdamW(model.parameters(), **opt_kwargs))
    if mode in ("fsdp2", "fsdp_lab_fully_shard"):
        if mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from fsdp_lab.runtime import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return Runner(mode, model, torch.optim.AdamW(model.parameters(), **opt_kwargs))
    return Runner(mode, model, torch.optim.AdamW(model.parameters(), **opt_kwargs),
                  autocast=lambda: torch.autocast(device.type, dtype=bf16))
