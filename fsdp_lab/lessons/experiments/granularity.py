"""How big should a unit be? The same model wrapped four ways, from one unit to one unit per linear layer.

The article (工程实践): bigger units mean fewer collectives but a higher peak; smaller units the reverse. Each
wrapping here trains the same steps on the same ranks; from the trace we read the largest amount of gathered
parameters at any event (the peak "on the table") and how many collectives one step issued. `train_wrapped` is
also the training loop of the engineering and misconceptions experiments: it adds prefetch and
activation checkpointing to the plain loop of fsdp_lab.lessons.experiments.common. Runs take torch's defaults
(backward_prefetch=BACKWARD_PRE, forward_prefetch=False). With explicit prefetch a unit's gather is issued one
unit early and waited on when the unit needs its parameters; meanwhile it runs on its own stream on a GPU, and
on gloo's thread on CPU ranks ([Note: a prefetch on CPU] in fsdp_lab/runtime/core/streams.py).

Wrappings (a name, so a rank can rebuild the policy: spawned processes get plain data):
    whole      no policy: the root is the only unit (one gather for everything)
    block      ModuleWrapPolicy({Block}): the usual choice, one unit per transformer block
    sublayer   ModuleWrapPolicy({CausalSelfAttention, MLP}): attention and MLP apart
    leaf       every Linear and LayerNorm inside a block (the embedding and the head share a weight, so both
               stay in the root: a weight tied across two units cannot be sharded)
    size:K     size_based_auto_wrap_policy(min_num_params=K)
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from fsdp_lab.lessons.experiments.common import config_for, unit_table
from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.runtime import FSDP
from fsdp_lab.runtime.features.activation_checkpointing import apply_activation_checkpointing
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy, select_units, size_based_auto_wrap_policy
from fsdp_lab.training.models import MLP, Block, CausalSelfAttention, batch_for_step, build_gpt, rank_slice

WRAPPINGS = ("whole", "block", "sublayer", "leaf")
LABELS = {"whole": "whole model", "block": "per block", "sublayer": "per sub-layer (attn / MLP)",
          "leaf": "per Linear / LayerNorm"}


class InsideBlocks:
    """Wrap modules of the given classes, but only inside a transformer Block (keeps the tied head in the root)."""

    def __init__(self, model: nn.Module, classes: tuple):
        self.classes = classes
        self.inside = {id(m) for b in model.modules() if isinstance(b, Block) for m in b.modules() if m is not b}

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.classes) and id(module) in self.inside


def policy_for(wrapping: str, model: nn.Module):
    """The auto_wrap_policy a wrapping name stands for (None: the root is the only unit)."""
    if wrapping == "whole":
        return None
    if wrapping == "block":
        return ModuleWrapPolicy({Block})
    if wrapping == "sublayer":
        return ModuleWrapPolicy({CausalSelfAttention, MLP})
    if wrapping == "leaf":
        return InsideBlocks(model, (nn.Linear, nn.LayerNorm))
    if wrapping.startswith("size:") and wrapping[5:].isdigit():
        return functools.partial(size_based_auto_wrap_policy, min_num_params=int(wrapping[5:]))
    raise ValueError(f"unknown wrapping {wrapping!r}; expected one of {WRAPPINGS} or 'size:<min_num_params>'")


def units_picked(wrapping: str, preset="tiny") -> list[tuple[str, int]]:
    """(qualified name, parameters) of the modules a policy wraps on the course GPT, innermost first, then the
    root with whatever is left. Runs in this process: choosing units needs no process group."""
    model = build_gpt(config_for(preset))
    picked = select_units(model, policy_for(wrapping, model))
    claimed = set()
    rows = []
    for name, module in picked:
        params = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        rows.append((name, sum(p.numel() for p in params)))
    rest = {id(p): p for p in model.parameters() if id(p) not in claimed}
    return rows + [("<root>", sum(p.numel() for p in rest.values()))]


@dataclass(frozen=True)
class WrapRun:
    """One training run under a chosen wrapping; plain data, so it can cross to spawned ranks."""

    wrapping: str = "block"
    preset: str = "tiny"
    strategy: str = "FULL_SHARD"
    steps: int = 3
    global_batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    forward_prefetch: bool = False  # torch's defaults, as FSDP(...) gives them
    backward_prefetch: Optional[str] = "BACKWARD_PRE"
    activation_checkpointing: bool = False
    count_saved: bool = False

    def with_(self, **changes) -> "WrapRun":
        return replace(self, **changes)


def build_wrapped(run: WrapRun) -> FSDP:
    base = build_gpt(config_for(run.preset))
    model = FSDP(base, sharding_strategy=run.strategy, auto_wrap_policy=policy_for(run.wrapping, base),
                 forward_prefetch=run.forward_prefetch, backward_prefetch=run.backward_prefetch)
    if run.activation_checkpointing:
        # each Block recomputed in backward (FSDP's hooks stay outside)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


class SavedBytes:
    """Bytes autograd keeps for backward (activations), storage counted once, parameters left out: the CPU
    stand-in for 'activation memory'. Used as torch.autograd.graph.saved_tensors_hooks(counter.pack, ...)."""

    def __init__(self, model: FSDP):
        self.model, self.seen, self.bytes = model, set(), 0

    def _param_storages(self) -> set:
        ptrs = set()
        for unit in self.model.units:
            for g in unit.flats:
                for t in (g.full, g.shard):
                    if t.untyped_storage().nbytes():
                        ptrs.add(t.untyped_storage().data_ptr())
        return ptrs

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in self.seen and ptr not in self._param_storages():
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def train_wrapped(rank: int, world_size: int, run: WrapRun) -> dict:
    """Train `run.steps` AdamW steps on this rank with tracing on; return plain data (events, times, units)."""
    model = build_wrapped(run)
    cfg = config_for(run.preset)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    tracer = trace_mod.Tracer(None, rank=rank, model=model, optimizer=opt)
    model.set_tracer(tracer)
    losses, times, saved = [], [], []
    try:
        for step in range(run.steps):
            x, y = batch_for_step(cfg, step, run.global_batch, run.seq_len)
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
            start = time.perf_counter()
            counter = SavedBytes(model)
            if run.count_saved:
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    loss = model(x, y)
            else:
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            saved.append(counter.bytes)
    finally:
        model.set_tracer(None)
        tracer.close()
    return {"rank": rank, "run": run, "losses": losses, "step_times": times, "saved_bytes": saved,
            "events": tracer.events, "units": unit_table(model)}


def summarize_wrapped(result: dict, step: Optional[int] = None) -> dict:
    """Peak gathered bytes, collectives and bytes sent in one step (default: the last), median step time."""
    events, rank = result["events"], result["rank"]
    step = result["run"].steps - 1 if step is None else step
    mine = [e for e in events if e["step"] == step and e["rank"] == rank]
    comm = comm_summary(mine)
    later = result["step_times"][1:] or result["step_times"]  # step 0 also pays for first-touch allocations
    return {"wrapping": result["run"].wrapping, "units": len({u["unit"] for u in result["units"]}),
            "peak_unsharded": max(e["mem"]["params_unsharded"] for e in mine),
            "peak_total": max(e["mem"]["total"] for e in mine),
            "collectives": comm.calls(rank=rank, step=step), "bytes_sent": comm.sent(rank=rank, step=step),
            "step_time_s": statistics.median(later), "losses": result["losses"]}


def _sweep_rank(rank: int, world_size: int, base: WrapRun, wrappings: tuple) -> dict:
    return {w: summarize_wrapped(train_wrapped(rank, world_size, base.with_(wrapping=w))) for w in wrappings}
