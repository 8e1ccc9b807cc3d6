"""The mixed-precision chapter's runs: what bf16 changes on the wire and in memory, and why the master weights
stay in fp32.

- `precision_runs`: the same FULL_SHARD training on N ranks, once in fp32 and once with bf16 parameters and
  gathers (fp32 reduction, fp32 masters), in one launch; each rank returns its full trace for both.
- `update_stall`: one process, no communication. The course GPT trained with the same small learning rate
  three ways: all fp32; bf16 compute on fp32 master weights (what FSDP's MixedPrecision does); and bf16 alone,
  where the weights, their updates and AdamW's state are all bf16. Each step records the loss and the share of
  weights whose stored value changed at all.

[Note: why pure bf16 stalls] bf16 keeps 8 significant bits, so neighbouring values near w are about
|w|·2⁻⁷ apart (`spacing`). An update smaller than half that gap rounds back to w: the step is lost, not
postponed. An fp32 master keeps 24 bits, so the same small updates add up and reach the bf16 copy once they
are large enough to show.
"""
from __future__ import annotations

import copy
import math
from typing import Iterable, Union

import torch

from fsdp_lab.lessons.experiments.common import RunSpec, config_for, mixed_precision_for, train
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import GPTConfig, batch_for_step, build_gpt

VARIANTS = ("fp32", "bf16 compute, fp32 masters", "bf16 only")


def spacing(value: float, dtype: torch.dtype) -> float:
    """Gap between `value` and the next larger number of `dtype` (a normal, non-zero value): eps·2^⌊log2|value|⌋."""
    if value == 0 or not math.isfinite(value):
        raise ValueError(f"spacing needs a finite non-zero value, got {value!r}")
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(value)))


def _precision_rank(rank: int, world_size: int, spec: RunSpec, dtypes: tuple) -> dict:
    out = {}
    for d in dtypes:
        result = train(rank, world_size, spec.with_(mixed_precision=mixed_precision_for(d)))
        out[d] = {k: result[k] for k in ("events", "units", "losses", "step_tensor_bytes")}
        if "cuda" in result:
            out[d]["cuda"] = result["cuda"]
    return out


def precision_runs(world_size: int = 2, dtypes: Iterable[str] = ("fp32", "bf16"), steps: int = 2,
                   preset: Union[str, GPTConfig] = "tiny", device: str = "cpu", timeout_s: float = 120.0,
                   **spec_fields) -> list[dict]:
    """Per rank, {dtype: {"events", "units", "losses", "step_tensor_bytes"}} of FULL_SHARD runs, every dtype in
    one launch. Backward prefetch is turned off unless spec_fields says otherwise (torch's default is
    BACKWARD_PRE), so the table holds one block at a time."""
    spec_fields.setdefault("backward_prefetch", None)
    dtypes = tuple(dtypes)
    for d in dtypes:
        mixed_precision_for(d)
    spec = RunSpec(strategy="FULL_SHARD", preset=preset, steps=steps, device=device, **spec_fields)
    return run_on_ranks(_precision_rank, world_size, spec, dtypes, timeout_s=timeout_s)


def _copy_into(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters()):
            d.copy_(s)


def update_stall(steps: int = 100, lr: float = 1e-5, preset: Union[str, GPTConfig] = "tiny",
                 variants: Iterable[str] = VARIANTS, global_batch: int = 4, seq_len: int = 16,
                 fixed_batch: bool = True, seed: int = 0, threads: int = 1) -> dict:
    """{variant: {"losses": [...], "moved": [...]}}: per step the loss and the fraction of weight elements whose
    stored value changed in the optimizer step (AdamW, no weight decay, same data and start for every variant).

    fixed_batch: train on one batch again and again, so the loss falls smoothly and a stall is plain to see
    (otherwise each step draws a fresh batch, as real training does, and the curves are noisy).

    "bf16 compute, fp32 masters" mirrors FSDP's MixedPrecision: a bf16 working copy is refreshed from the fp32
    masters before each step, its gradient is cast to fp32 and the optimizer updates the masters."""
    variants = tuple(variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    if steps < 1 or not lr > 0:
        raise ValueError(f"need steps >= 1 and lr > 0, got steps={steps}, lr={lr}")
    cfg = config_for(preset)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {v: _train_variant(v, cfg, steps, lr, global_batch, seq_len, fixed_batch, seed) for v in variants}
    finally:
        torch.set_num_threads(previous_threads)


def _train_variant(variant: str, cfg: GPTConfig, steps: int, lr: float, global_batch: int, seq_len: int,
                   fixed_batch: bool, seed: int) -> dict:
    master = build_gpt(cfg, seed=seed)
    if variant == "bf16 only":
        master = master.to(torch.bfloat16)
    work = copy.deepcopy(master).to(torch.bfloat16) if variant == "bf16 compute, fp32 masters" else master
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    total = sum(p.numel() for p in master.parameters())
    losses, moved = [], []
    for step in range(steps):
        x, y = batch_for_step(cfg, 0 if fixed_batch else step, global_batch, seq_len)
        if work is not master:
            _copy_into(work, master)  # the "all-gather": cast the fp32 masters to the bf16 working copy
        loss = work(x, y)
        loss.backward()
        if work is not master:
            for w, m in zip(work.parameters(), master.parameters()):
                m.grad, w.grad = w.grad.float(), None
        before = [p.detach().clone() for p in master.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        unchanged = sum(int((p.detach() == b).sum()) for p, b in zip(master.parameters(), before))
        losses.append(loss.item())
        moved.append(1.0 - unchanged / total)
    return {"losses": losses, "moved": moved}


def memory_points(events: Iterable[dict], rank: int = 0, step: int = 1, unit: str = "blocks.0") -> dict:
    """Three moments of one rank's step, each the trace's "mem" record (bytes by kind, and "total"):

    forward: just after `unit` was gathered for its forward (its working copy is on the table, no gradients yet);
    backward_peak: the event of the backward pass with the most bytes alive;
    after_backward: at the optimizer step (every gradient shard has arrived)."""
    mine = [e for e in events if e["rank"] == rank and e["step"] == step]
    if not mine:
        raise ValueError(f"no events for rank {rank}, step {step}")
    forward = [e for e in mine if e["event"] == "gather_end" and e["unit"] == unit and e["phase"] == "forward"]
    backward = [e for e in mine if e["phase"] == "backward"]
    stepped = [e for e in mine if e["event"] == "optimizer_step"]
    if not forward or not backward or not stepped:
        raise ValueError(f"rank {rank}, step {step}: need a forward gather of {unit!r}, backward events and an "
                         f"optimizer_step; got {len(forward)}, {len(backward)}, {len(stepped)}")
    return {"forward": forward[0]["mem"], "backward_peak": max(backward, key=lambda e: e["mem"]["total"])["mem"],
            "after_backward": stepped[0]["mem"]}
