"""The article's four misconceptions (常见误区), each as a measurement that answers it.

    1. "FSDP is DDP plus a switch"       → same losses, different collectives, different memory lifecycle
    2. "wrapping is free"                → FSDP sends ~1.5x DDP's bytes per step, and the step time shows it
    3. "finer sharding is always better" → collectives per step and step time grow with the number of units
    4. "fp32 master weights are a waste" → with 2-byte masters, small updates round away and weights stall

1–3 run on real ranks in one launch (`run_misconceptions`); 4 is about number formats, not sharding (a shard is
only a slice of the masters), so it runs in the calling process (`master_precision`, `accumulate`).
"""
from __future__ import annotations

from typing import Iterable

import torch

from fsdp_lab.lessons.experiments.common import config_for
from fsdp_lab.lessons.experiments.granularity import WRAPPINGS, WrapRun, _sweep_rank, summarize_wrapped, train_wrapped
from fsdp_lab.observe.traffic import comm_summary
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import batch_for_step, build_gpt

STRATEGY_NAMES = {"FULL_SHARD": "FSDP (FULL_SHARD)", "NO_SHARD": "DDP (NO_SHARD)"}


def _strategy_run(rank: int, world_size: int, run: WrapRun) -> dict:
    result = train_wrapped(rank, world_size, run)
    comm = comm_summary(result["events"])
    last = run.steps - 1
    keep = ("t", "step", "unit", "phase", "event", "bytes_sent")
    return {**summarize_wrapped(result),
            "step_times": result["step_times"],
            "numel_padded_total": sum(u["padded_numel"] for u in result["units"]),
            "root_padded_numel": sum(u["padded_numel"] for u in result["units"] if u["is_root"]),
            "persistent_bytes": [e["mem"]["total"] for e in result["events"] if e["event"] == "optimizer_step"][-1],
            "per_collective": comm.per_collective(rank, step=last),
            "calls": {c: comm.calls(rank=rank, step=last, collective=c) for c in comm.per_collective(rank, step=last)},
            "events": [{k: e[k] for k in keep} | {"params_unsharded": e["mem"]["params_unsharded"],
                                                  "total": e["mem"]["total"]}
                       for e in result["events"] if e["step"] == last]}


def _misconceptions_rank(rank: int, world_size: int, base: WrapRun, wrappings: tuple) -> dict:
    return {"strategies": {s: _strategy_run(rank, world_size, base.with_(strategy=s)) for s in STRATEGY_NAMES},
            "granularity": _sweep_rank(rank, world_size, base, wrappings)}


def run_misconceptions(world_size: int = 2, preset: str = "small", steps: int = 5,
                       wrappings: Iterable[str] = WRAPPINGS, timeout_s: float = 150.0) -> list[dict]:
    """Per rank: {"strategies": {FULL_SHARD, NO_SHARD: summary + trace}, "granularity": {wrapping: summary}}.

    Backward prefetch is turned off (torch's default is BACKWARD_PRE, which holds a second unit in backward), so
    each wrapping's peak is the root plus one unit, the quantity chapter 09's misconceptions reason about."""
    base = WrapRun(wrapping="block", preset=preset, steps=steps, backward_prefetch=None)
    return run_on_ranks(_misconceptions_rank, world_size, base, tuple(wrappings), timeout_s=timeout_s)


def accumulate(update: float = 1e-3, steps: int = 1000, start: float = 1.0) -> dict:
    """Add the same small update `steps` times to a weight stored in fp32 and in bf16: {dtype: final value}."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.tensor(start, dtype=dtype)
        for _ in range(steps):
            w = w + torch.tensor(update, dtype=dtype)
        out[str(dtype).replace("torch.", "")] = w.item()
    return out


def _round_to_bf16_(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def master_precision(lr: float = 1e-4, steps: int = 30, preset: str = "tiny", global_batch: int = 8,
                     seq_len: int = 32) -> dict:
    """Train the same GPT twice with AdamW (fp32 moments both times): masters kept in fp32, or rounded to bf16
    after every step (2-byte masters). Compute is fp32 in both, so the only difference is the masters' format.

    Per run: losses, `frozen` (share of elements a step left unchanged, per step) and, for the last step,
    `frozen_by_kind` (LayerNorm weights, embeddings, other matrices)."""
    cfg = config_for(preset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy model: one thread is faster than several fighting over a small CPU
    try:
        return {name: _train_masters(cfg, bf16, lr, steps, global_batch, seq_len)
                for name, bf16 in (("fp32 masters", False), ("bf16 masters", True))}
    finally:
        torch.set_num_threads(threads)


KINDS = {
    "LayerNorm weights": lambda n: (".ln" in n or n.startswith("ln_f")) and n.endswith("weight"),
    "embeddings": lambda n: n.startswith(("wte.", "wpe.")),
    "other matrices": lambda n: n.endswith("weight") and ".ln" not in n and not n.startswith(("wte.", "wpe.", "ln_f")),
}


def _train_masters(cfg, bf16: bool, lr: float, steps: int, global_batch: int, seq_len: int) -> dict:
    model = build_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if bf16:
        _round_to_bf16_(model)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    losses, frozen, same = [], [], {}
    for step in range(steps):
        x, y = batch_for_step(cfg, step, global_batch, seq_len)
        loss = model(x, y)
        loss.backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bf16:
            _round_to_bf16_(model)
        same = {n: p.detach() == before[n] for n, p in params.items()}
        frozen.append(sum(int(s.sum()) for s in same.values()) / total)
        losses.append(loss.item())
    by_kind = {}
    for kind, match in KINDS.items():
        names = [n for n in params if match(n)]
        by_kind[kind] = sum(int(same[n].sum()) for n in names) / sum(params[n].numel() for n in names)
    return {"losses": losses, "frozen": frozen, "frozen_by_kind": by_kind}
