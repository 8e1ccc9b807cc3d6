"""Lifecycle trace: one JSON line per event per rank, flushed as written so a notebook can follow a live job.

Off by default: a model without a tracer pays one `is None` check per event. Switch it on with
`with trace.record(model, path, optimizer=opt): ...` (or model.set_tracer(Tracer(...))). `model` is a model
wrapped by fsdp_lab.FSDP or the root of a fsdp_lab.fully_shard model: both front ends emit the same events.

Each line: {"t", "rank", "step", "unit", "phase", "event", "bytes_sent", "bytes_received", "mem": {...}}; an event
that issued collectives also has "group" ("shard", "replicate", or "post_forward": the sub-group an integer
reshard_after_forward re-gathers in) and "group_ranks" (that group's global ranks); on a mesh with
mesh_dim_names also "mesh_dim", the name of the dimension that group runs along ([Note: bytes per mesh dimension]
in fsdp_lab/observe/mesh_traffic.py, which also records DTensor's tensor-parallel collectives).
A gather_end or regather_end also has "unit_bytes": {"shard", "full"}, the unit's fp32 shard on this rank and its
gathered buffer, so a trace alone gives the potluck exact sizes (a live run's events reach it without a unit table).
"mem" holds the runtime's exact live bytes by kind (fsdp_lab.runtime.core.memory) and, on CUDA, "cuda_allocated" and
"cuda_reserved" from the caching allocator.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from fsdp_lab.observe.mesh_traffic import DTensorCollectives, mesh_dims, tensor_parallel_mesh
from fsdp_lab.observe.traffic import collective_bytes
from fsdp_lab.runtime.core.memory import memory_report
from fsdp_lab.runtime.core.observed import data_parallel_mesh, set_tracer, shared_state, units_of

_MASTER_BYTES = 4  # a shard is kept in fp32 (the master weights), whatever the gathered dtype
_SIZED_EVENTS = ("gather_end", "regather_end")


def unit_bytes(unit) -> dict:
    """A unit's fp32 shard on this rank and its gathered buffer, in bytes, under either front end."""
    shard = full = 0
    for flat in unit.flats:
        full += flat.full_bytes
        shard += (sum(t.numel() for t in flat.local_shards()) if hasattr(flat, "local_shards")
                  else flat.shard_numel) * _MASTER_BYTES
    return {"shard": int(shard), "full": int(full)}


class Tracer:
    def __init__(self, path: Optional[str | os.PathLike] = None, rank: int = 0, model=None, optimizer=None,
                 keep_in_memory: bool = True):
        self.rank, self.model, self.optimizer, self.step = rank, model, None, 0
        self.events: list[dict] = []
        self.keep_in_memory = keep_in_memory
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        self._hook = None
        self._unit_bytes: Optional[dict] = None  # unit name → unit_bytes, made at the first gather
        # this rank's group ranks → mesh dimension name, for a mesh with names ([Note: bytes per mesh dimension])
        self.mesh_dims = {ranks: name for name, ranks, _g in mesh_dims(data_parallel_mesh(model))} \
            if model is not None else {}
        if optimizer is not None:
            self.watch_optimizer(optimizer)

    def watch_optimizer(self, optimizer) -> None:
        """Count optimizer state in memory and close a step at each optimizer.step()."""
        self.optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(lambda *_: self._on_optimizer_step())

    def memory(self) -> dict:
        mem = memory_report(self.model, self.optimizer).as_dict() if self.model is not None else {}
        device = shared_state(self.model).device if self.model is not None else None
        if device is not None and device.type == "cuda":
            mem["cuda_allocated"] = torch.cuda.memory_allocated(device)
            mem["cuda_reserved"] = torch.cuda.memory_reserved(device)
        return mem

    def emit(self, event: str, unit: str, phase: str, collectives=(), **extra) -> dict:
        """One event from the runtime; the collectives it issued become bytes_sent/bytes_received."""
        comm = collective_bytes(collectives)
        bytes_sent, bytes_received = comm.sent, comm.received
        record = {"t": time.time(), "rank": self.rank, "step": self.step, "unit": unit, "phase": phase,
                  "event": event, "bytes_sent": int(bytes_sent), "bytes_received": int(bytes_received),
                  "mem": self.memory(), **extra}
        if event in _SIZED_EVENTS and self.model is not None:
            if self._unit_bytes is None:
                self._unit_bytes = {u.name: unit_bytes(u) for u in units_of(self.model)}
            if unit in self._unit_bytes:
                record["unit_bytes"] = self._unit_bytes[unit]
        if collectives:  # one beat's collectives run in one group: "shard" or "replicate", and its ranks
            record["group"], record["group_ranks"] = collectives[0].group, list(collectives[0].ranks)
            if "mesh_dim" not in record and self.mesh_dims:  # [Note: bytes per mesh dimension]
                dim = self.mesh_dims.get(tuple(collectives[0].ranks))
                if dim is not None:
                    record["mesh_dim"] = dim
        if self.keep_in_memory:
            self.events.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def _on_optimizer_step(self) -> None:
        self.emit("optimizer_step", unit="<root>", phase="optimizer")
        self.step += 1

    def on_backward_end(self) -> None:
        if self.optimizer is None:  # no optimizer to close the step: the backward does
            self.step += 1

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._file is not None:
            self._file.close()
            self._file = None


def attach(model, tracer: Optional[Tracer]) -> None:
    """Attach `tracer` (None: detach) to a model wrapped by FSDP or to the root of a fully_shard model."""
    set_tracer(model, tracer)


@contextlib.contextmanager
def record(model, path: Optional[str | os.PathLike] = None, optimizer=None, **kwargs) -> Iterator[Tracer]:
    """Trace `model` inside the block; the tracer is detached (and the file closed) however the block exits."""
    tracer = Tracer(path, rank=shared_state(model).rank, model=model, optimizer=optimizer, **kwargs)
    attach(model, tracer)
    mesh = data_parallel_mesh(model)
    try:
        with (DTensorCollectives(tracer, mesh_dims(mesh)) if tensor_parallel_mesh(mesh)
              else contextlib.nullcontext()):
            yield tracer
    finally:
        attach(model, None)
        tracer.close()


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.jsonl"


class FileCursor:
    """How far one rank's file has been read, and the incomplete line after that point (the one reader of trace
    files: `read_events`, `follow` and the live memory chart all read through it)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        events = []
        for line in lines:
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.path}: line ending at byte {self.offset - len(self.partial)} is not "
                                     f"valid JSON ({exc}): {line[:120]!r}") from exc
        return events


def read_events(path: str | os.PathLike) -> list[dict]:
    """Read one rank's JSONL; a half-written last line (the job is still running) is skipped, not an error."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no trace file {path}")
    return FileCursor(Path(path)).read_new()


def load_trace(directory: str | os.PathLike) -> list[dict]:
    """Merge every rank's file in `directory` into one timeline ordered by wall time (then rank)."""
    files = sorted(Path(directory).glob("rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no rank*.jsonl trace files in {directory}")
    merged = [e for f in files for e in read_events(f)]
    return sorted(merged, key=lambda e: (e["t"], e["rank"]))
