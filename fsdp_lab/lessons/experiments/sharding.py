"""The sharding chapter's runs: how each unit's flat buffer is padded and cut into one chunk per rank, what one
all-gather costs, and how the wrap granularity trades the number of gathers against the size of the table
(the wrappings and their training loop are fsdp_lab.lessons.experiments.granularity's).

[Note: measured, not recomputed] Every layout figure here is read off the wrapped model inside a real rank
(FlatParam: numel, padded_numel, shard_numel, slots) and every byte count off that rank's trace, so the
chapter can hold them up against fsdp_lab.theory.formulas instead of printing the same arithmetic twice.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch

from fsdp_lab.lessons.experiments.common import config_for
from fsdp_lab.lessons.experiments.granularity import WrapRun, policy_for, summarize_wrapped, train_wrapped
from fsdp_lab.runtime import FSDP
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import Block, GPTConfig, build_gpt

_EVENT_KEYS = ("event", "unit", "phase", "step", "bytes_sent", "bytes_received")


def shard_sizes(rank: int, world_size: int, preset: Union[str, GPTConfig] = "tiny", device: str = "cpu") -> dict:
    """Wrap the course GPT (one unit per Block) and report what this rank keeps: one row per unit.

    The smallest multi-rank program of the course: run it with run_on_ranks(shard_sizes, 2)."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = FSDP(build_gpt(config_for(preset)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=torch.cuda.current_device() if device == "cuda" else None)
    units = [{"unit": u.name, "numel": g.numel, "padded_numel": g.padded_numel, "shard_numel": g.shard_numel,
              "shard_bytes": g.shard.numel() * g.shard.element_size()} for u in model.units for g in u.flats]
    return {"rank": rank, "world_size": world_size, "device": str(next(model.parameters()).device), "units": units}


def _unit_layout(model: FSDP, keep_values: bool) -> list[dict]:
    rows = []
    for unit in model.units:
        for g in unit.flats:
            row = {"unit": unit.name, "numel": g.numel, "padded_numel": g.padded_numel,
                   "shard_numel": g.shard_numel, "shard_start": g.rank * g.shard_numel,
                   "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": tuple(s.shape)}
                             for s in g.slots]}
            if keep_values:
                row["shard_values"] = g.shard.detach().cpu().tolist()
            rows.append(row)
    return rows


def _layout_rank(rank: int, world_size: int, preset, wrappings: tuple, global_batch: int, seq_len: int,
                 keep_values: bool) -> dict:
    """The per-Block layout before any training, then one traced AdamW step per wrapping, with backward prefetch
    turned off (torch's default is BACKWARD_PRE), so the table holds exactly what the wrapping puts on it."""
    model = FSDP(build_gpt(config_for(preset)), auto_wrap_policy=ModuleWrapPolicy({Block}))
    layout = _unit_layout(model, keep_values)
    runs = {}
    for name in wrappings:
        result = train_wrapped(rank, world_size, WrapRun(wrapping=name, preset=preset, steps=1,
                                                         global_batch=global_batch, seq_len=seq_len,
                                                         backward_prefetch=None))
        runs[name] = {"summary": summarize_wrapped(result), "units": result["units"],
                      "events": [{k: e[k] for k in _EVENT_KEYS} | {"params_unsharded": e["mem"]["params_unsharded"]}
                                 for e in result["events"]]}
    return {"rank": rank, "world_size": world_size, "layout": layout, "runs": runs}


def sharding_layout(world_size: int = 3, preset: Union[str, GPTConfig] = "tiny",
                    wrappings: Iterable[str] = ("whole", "block", "sublayer"), global_batch: int = 6,
                    seq_len: int = 16, keep_values: bool = True, timeout_s: float = 120.0) -> list[dict]:
    """Per rank, from one launch:

    layout: the per-Block wrapping before training, one row per unit: numel, padded_numel, shard_numel, this
        rank's shard_start, the slots (parameter name, offset, numel, shape) and, with keep_values, this rank's
        shard values (so the chapter can check that the chunks put end to end are the parameters plus zeros).
    runs: per wrapping (fsdp_lab.lessons.experiments.granularity names), one traced step: summarize_wrapped's summary,
        the unit table, and the events with the bytes each collective sent and the gathered bytes after each."""
    wrappings = tuple(wrappings)
    for name in wrappings:
        policy_for(name, build_gpt(config_for(preset)))
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must divide by world_size={world_size}")
    return run_on_ranks(_layout_rank, world_size, preset, wrappings, global_batch, seq_len, keep_values,
                        timeout_s=timeout_s)


def gather_summary(events: Iterable[dict]) -> dict:
    """From one rank's step: all-gathers run (forward gathers + backward re-gathers), bytes they sent, and the
    most gathered-parameter bytes alive at once."""
    events = list(events)
    gathers = [e for e in events if e["event"] in ("gather_end", "regather_end")]
    return {"all_gathers": len(gathers), "gather_bytes_sent": sum(e["bytes_sent"] for e in gathers),
            "peak_gathered_bytes": max((e["params_unsharded"] for e in events), default=0)}
