"""A torch.profiler trace of one fsdp_lab training step, trimmed, merged with fsdp_lab's own lifecycle trace and
gzipped: the evidence that the all-gather of unit i+1 runs while unit i computes.

The runtime labels its work with profiler ranges (`fsdp_lab::gather blocks.3`, `fsdp_lab::regather ...`,
`fsdp_lab::reduce ...`; fsdp_lab.runtime.core.streams.label). A kernel belongs to a range when the CUDA runtime
call that launched it ran inside the range (same thread) — the profiler links launch and kernel by a correlation
id. From that, `overlap_summary` measures how much of the gather (and reduce) kernels' time coincides with compute
kernels running on another stream.

The written file is Chrome-trace JSON (open it in Perfetto or chrome://tracing). It also holds, under
"fsdp_lab", the lifecycle events of the same step (fsdp_lab.observe.trace format) and the overlap summary; the lifecycle
events are added to "traceEvents" too, as instant events on their own row, aligned to the first fsdp_lab range.
"""
from __future__ import annotations

import bisect
import gzip
import json
import tempfile
from pathlib import Path

import torch

KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
KEEP_CATS = KERNEL_CATS + ("user_annotation", "gpu_user_annotation", "cuda_runtime", "cuda_driver", "ac2g")
LIFECYCLE_PID = 990000


def _kind(annotation_name: str) -> str:
    return "reduce" if annotation_name.startswith("fsdp_lab::reduce") else "gather"


def _merge(intervals: list) -> list:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _covered(merged: list, starts: list, a: float, b: float) -> float:
    """Length of [a, b] covered by the merged, sorted intervals."""
    total, i = 0.0, max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(merged) and merged[i][0] < b:
        total += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
        i += 1
    return total


def overlap_summary(events: list[dict]) -> dict:
    """Which kernels the fsdp_lab ranges launched, on which streams, and how much of their time overlaps compute
    kernels (every other kernel) on other streams."""
    ranges = [e for e in events
              if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("fsdp_lab::")]
    by_thread: dict = {}
    for r in ranges:
        by_thread.setdefault((r.get("pid"), r.get("tid")), []).append((r["ts"], r["ts"] + r.get("dur", 0), r["name"]))
    owner = {}  # correlation id -> "gather" | "reduce"
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "correlation" not in e.get("args", {}):
            continue
        for start, end, name in by_thread.get((e.get("pid"), e.get("tid")), ()):
            if start <= e["ts"] <= end:
                owner[e["args"]["correlation"]] = _kind(name)
                break
    kernels = [e for e in events if e.get("cat") in KERNEL_CATS and "dur" in e]
    mine = {"gather": [], "reduce": []}
    compute = []
    for k in kernels:
        kind = owner.get(k.get("args", {}).get("correlation"))
        (mine[kind] if kind else compute).append(k)
    stream_time: dict = {}
    for k in compute:
        stream = k.get("args", {}).get("stream", k.get("tid"))
        stream_time[stream] = stream_time.get(stream, 0.0) + k["dur"]
    compute_stream = max(stream_time, key=stream_time.get) if stream_time else None
    busy = _merge([(k["ts"], k["ts"] + k["dur"]) for k in compute
                   if k.get("args", {}).get("stream", k.get("tid")) == compute_stream])
    starts = [m[0] for m in busy]
    out = {"fsdp_lab_ranges": len(ranges), "compute_stream": compute_stream, "compute_kernels": len(compute),
           "step_span_us": (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels))
           if kernels else 0.0}
    for kind, ks in mine.items():
        own = sum(k["dur"] for k in ks)
        overlapped = [_covered(busy, starts, k["ts"], k["ts"] + k["dur"]) for k in ks]
        out[kind] = {"kernels": len(ks), "streams": sorted({str(k.get("args", {}).get("stream", k.get("tid")))
                                                              for k in ks}),
                     "kernel_us": own, "overlapped_us": sum(overlapped),
                     "overlap_fraction": sum(overlapped) / own if own else 0.0,
                     "kernels_overlapping_compute": sum(1 for o in overlapped if o > 0)}
    return out


def _trim(events: list[dict], min_cpu_op_us: float) -> list[dict]:
    return [e for e in events if e.get("ph") == "M" or e.get("cat") in KEEP_CATS
            or (e.get("cat") == "cpu_op" and e.get("dur", 0) >= min_cpu_op_us)]


def lifecycle_rows(lifecycle: list[dict], events: list[dict]) -> list[dict]:
    """fsdp_lab lifecycle events as Chrome instant events, aligned so the first gather meets the first range."""
    if not lifecycle:
        return []
    ranges = sorted(e["ts"] for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("fsdp_lab::"))
    first = next((e for e in lifecycle if e["event"].endswith("gather_start")), lifecycle[0])
    anchor = ranges[0] if ranges else min((e["ts"] for e in events if "ts" in e), default=0.0)
    offset = anchor - first["t"] * 1e6
    rows = [{"name": "process_name", "ph": "M", "pid": LIFECYCLE_PID, "args": {"name": "fsdp_lab lifecycle"}}]
    for e in lifecycle:
        rows.append({"name": f"{e['event']} {e['unit']}", "ph": "i", "s": "t", "pid": LIFECYCLE_PID, "tid": 0,
                     "ts": e["t"] * 1e6 + offset, "args": {"phase": e["phase"], "mem": e.get("mem", {})}})
    return rows


def record_step_trace(runner, batch, path, write: bool = True, max_bytes: int = 6 << 20) -> dict:
    """Profile one training step of an fsdp_lab Runner (every rank must call it: the step communicates); rank
    `write` saves the trimmed, gzipped trace at `path` and returns the overlap summary."""
    from fsdp_lab.observe.trace import Tracer

    model = runner.model
    device = model._ctx.device
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    tracer = Tracer(None, rank=model.rank, model=model, optimizer=runner.optimizer)
    model.set_tracer(tracer)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            runner.step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        model.set_tracer(None)
        tracer.close()
    if not write:
        return {"written": False}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The profiler's own writer reports a failed write with a C++ log line, not an exception: export to a
    # temporary folder, and write the target in Python, so a full or read-only destination is our one-line error.
    with tempfile.TemporaryDirectory(prefix="fsdp_lab_trace_") as tmp:
        raw = Path(tmp) / "raw.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, encoding="utf-8") as fh:
            data = json.load(fh)
    events = data.get("traceEvents", [])
    summary = overlap_summary(events)
    lifecycle = [{k: v for k, v in e.items()} for e in tracer.events]
    for min_us in (20.0, 200.0, float("inf")):  # drop short CPU ops until the file is small
        data["traceEvents"] = _trim(events, min_us) + lifecycle_rows(lifecycle, events)
        data["fsdp_lab"] = {"summary": summary, "lifecycle": lifecycle, "device": str(device),
                            "torch": torch.__version__, "units": [u.name for u in model.units]}
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            json.dump(data, fh)
        if path.stat().st_size <= max_bytes:
            break
    return {**summary, "path": str(path), "bytes": path.stat().st_size}
