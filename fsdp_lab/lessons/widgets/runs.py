"""Real runs for the widgets: a few traced training steps of the course GPT on N ranks.

The ranks run the course's shared training loop (fsdp_lab.lessons.experiments.common.train), the same one the lifecycle
tests and the GPU recording script use; this module only keeps what the widgets need from it: the merged events,
where the JSONL files are, and each unit's exact sizes as the rank's wrapped model reported them.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from fsdp_lab.lessons.experiments.common import RunSpec, merge_events, mixed_precision_for, train
from fsdp_lab.lessons.widgets.frames import Sizes, sizes_from_unit_table
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import PRESETS, build_gpt, count_params


def resolve_device(device: str = "auto") -> str:
    """"auto" → "cuda" when a GPU is visible, else "cpu"."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass
class LifecycleRun:
    """What a traced run leaves behind: the merged events, where the JSONL lives, and each rank's result
    (fsdp_lab.lessons.experiments.common.train's dict: losses, events, units, optimizer_params, step_tensor_bytes)."""

    events: list
    trace_dir: Path
    world_size: int
    strategy: str
    preset: str
    device: str
    ranks: list = field(default_factory=list)
    seq_len: Optional[int] = None  # tokens per sequence the ranks trained on (None: the preset's block size)
    micro_batch: Optional[int] = None  # sequences per rank per step (None: the default global batch / N)

    @property
    def sizes(self) -> Sizes:
        return sizes_from_unit_table(self.ranks[0]["units"], self.world_size)

    @property
    def numel_padded_total(self) -> int:
        return sum(row["padded_numel"] for row in self.ranks[0]["units"])

    @property
    def phi(self) -> int:
        return count_params(build_gpt(self.preset))


def record_lifecycle(world_size: int = 2, strategy: str = "FULL_SHARD", steps: int = 1, preset: str = "tiny",
                     trace_dir: Optional[str] = None, device: str = "auto", mixed_precision: Optional[str] = None,
                     step_sleep_s: float = 0.0, timeout_s: float = 120.0, **spec_fields) -> LifecycleRun:
    """Run `steps` traced AdamW steps on `world_size` real ranks (gloo; CUDA tensors when device is cuda).

    Each rank appends its events to trace_dir/rank{r}.jsonl as they happen (a live chart can follow them); with
    no trace_dir a fresh temporary directory is used, never a shared default. `step_sleep_s` pauses after each
    step so a live chart has something to follow on a model this small. Other RunSpec fields (global_batch,
    seq_len, forward_prefetch, backward_prefetch...) pass through. Backward prefetch is off unless they say
    otherwise (torch's default is BACKWARD_PRE), so the table holds one block at a time, as the article draws it."""
    spec_fields.setdefault("backward_prefetch", None)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of: {', '.join(PRESETS)}")
    device = resolve_device(device)
    trace_dir = Path(trace_dir) if trace_dir is not None else Path(tempfile.mkdtemp(prefix="fsdp-lab-trace-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.glob("rank*.jsonl"):
        old.unlink()  # the tracer appends: a re-run must not mix with an older run's lines
    spec = RunSpec(strategy=strategy, preset=preset, steps=steps, trace=True, trace_dir=str(trace_dir),
                   device=device, mixed_precision=mixed_precision_for(mixed_precision), step_sleep_s=step_sleep_s,
                   **spec_fields)
    results = run_on_ranks(train, world_size, spec, timeout_s=timeout_s)
    return LifecycleRun(merge_events([r["events"] for r in results]), trace_dir, world_size, strategy, preset,
                        device, results, spec.seq_len or PRESETS[preset].block_size, spec.global_batch // world_size)
