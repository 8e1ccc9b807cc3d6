"""CUDA memory snapshots: every allocation and free of a run, for PyTorch's memory viewer (pytorch.org/memory_viz).

    with record_memory_snapshot("step.pickle") as snap:
        train_one_step()
    print(snap.peak_allocated, snap.path)      # open snap.path in memory_viz: the potluck table, byte by byte

The trace (fsdp_lab.observe.trace) says *when* each unit is gathered and freed; the snapshot shows *which tensors* the
caching allocator holds at that moment (the gathered buffer, activations, gradients, Adam state). Recording
history slows allocation down, so it is off unless this context is entered, and it is switched off again however
the block exits.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch


def cuda_unavailable_reason() -> Optional[str]:
    """None when a CUDA device can be used, else a sentence saying why not (for errors and test skips)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} was built with CUDA {torch.version.cuda} but no CUDA device is visible"
    return None


@dataclass
class SnapshotInfo:
    """Filled in when the block exits: where the pickle is and what the allocator peaked at inside the block."""

    path: Path
    device: int
    peak_allocated: int = 0
    peak_reserved: int = 0
    file_bytes: int = 0


def cuda_memory(device: Optional[int] = None) -> dict:
    """The caching allocator's counters for one device: bytes allocated/reserved now and at their peaks."""
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "max_reserved": torch.cuda.max_memory_reserved(device)}


@contextlib.contextmanager
def record_memory_snapshot(path: str | os.PathLike, max_entries: int = 100_000, stacks: str = "python",
                           device: Optional[int] = None) -> Iterator[SnapshotInfo]:
    """Record the allocation history inside the block and write it to `path` (a pickle memory_viz opens).

    max_entries bounds the history kept (older events are dropped first), and so the file size; stacks="python"
    keeps Python frames only (smaller than "all", which adds C++ frames). Raises RuntimeError on a machine
    without CUDA, naming the reason.
    """
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"record_memory_snapshot needs a CUDA device: {reason}")
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got {max_entries}")
    device = torch.cuda.current_device() if device is None else device
    info = SnapshotInfo(path=Path(path), device=device)
    info.path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks,
                                             max_entries=max_entries)
    try:
        yield info
        torch.cuda.synchronize(device)
        torch.cuda.memory._dump_snapshot(str(info.path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = cuda_memory(device)
    info.peak_allocated, info.peak_reserved = stats["max_allocated"], stats["max_reserved"]
    info.file_bytes = info.path.stat().st_size
