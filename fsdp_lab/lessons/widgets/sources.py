"""Where a widget's trace comes from: a live run's directory, or a GPU trace shipped with the package.

Shipped GPU traces live under fsdp_lab/data/gpu_traces/, one per directory (rank*.jsonl, as fsdp_lab.observe.trace
writes them) or one merged `<name>.jsonl` file, each with its provenance beside it (provenance.json in the
directory, or `<name>.provenance.json`): GPU, torch version, date and the command that recorded it. A CPU-only
learner sees real GPU memory and can check where it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdp_lab.observe import trace

GPU_TRACE_DIR = Path(__file__).resolve().parents[2] / "data" / "gpu_traces"


NO_TRACE_LINE = ("no GPU trace ships with the course yet: they are recorded on a GPU machine with "
                 "scripts/record_gpu_traces.py; until then the CPU run above shows the same lifecycle with exact "
                 "byte counts.")


def gpu_trace_note() -> str:
    """One line for a chapter: which GPU recorded the shipped traces, or that none ship yet."""
    names = list_gpu_traces()
    if not names:
        return "No GPU trace ships with the course yet: record them on a GPU machine with scripts/record_gpu_traces.py."
    described = [load_gpu_trace(name).describe() for name in names]
    return "GPU traces shipped with the course: " + "; ".join(described)


class NoShippedTrace(FileNotFoundError):
    """No GPU trace is shipped (yet): the message says where we looked and how to record one."""


@dataclass
class ShippedTrace:
    name: str
    path: Path
    events: list
    provenance: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line for a learner: what recorded this trace, where and when."""
        p = self.provenance
        if not p:
            return f"{self.name}: no provenance file beside {self.path}"
        parts = [str(p[k]) for k in ("gpu", "device", "torch", "date", "recorded_at") if p.get(k)]
        cmd = p.get("command")
        return f"{self.name}: " + ", ".join(parts) + (f" — recorded with `{cmd}`" if cmd else "")


def _candidates(root: Path) -> dict:
    found = {}
    if not root.is_dir():
        return found
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if any(d.glob("rank*.jsonl")):
            found[d.name] = d
    for f in sorted(root.glob("*.jsonl")):
        found.setdefault(f.stem, f)
    return found


def list_gpu_traces(root: Optional[Path] = None) -> list:
    """Names of the shipped GPU traces (empty when none are shipped)."""
    return list(_candidates(Path(root) if root else GPU_TRACE_DIR))


def _provenance(path: Path) -> dict:
    beside = [path / "provenance.json"] if path.is_dir() else [path.with_suffix(".provenance.json"),
                                                               path.parent / "provenance.json"]
    for p in beside:
        if p.is_file():
            return json.loads(p.read_text(encoding="utf-8"))
    return {}


def load_gpu_trace(name: Optional[str] = None, root: Optional[Path] = None) -> ShippedTrace:
    """Load a shipped GPU trace by name (the first one when name is None), merged across ranks by time."""
    root = Path(root) if root else GPU_TRACE_DIR
    found = _candidates(root)
    if not found:
        raise NoShippedTrace(NO_TRACE_LINE)
    if name is None:
        name = next(iter(found))
    if name not in found:
        raise NoShippedTrace(f"no GPU trace named {name!r} in {root}; shipped: {', '.join(found)}")
    path = found[name]
    if path.is_dir():
        events = trace.load_trace(path)
    else:
        events = sorted(trace.read_events(path), key=lambda e: (e["t"], e["rank"]))
    return ShippedTrace(name, path, events, _provenance(path))
