"""Pure state of the potluck (百家宴) at any point of a real trace: `frame(events, index) -> FrameState`.

The widgets only draw what this module computes, so tests can check the lifecycle without a browser.

Metaphor → runtime: a household is a rank; its fridge (冰箱) holds its 1/N shard of every unit (and, after a
reduce-scatter, that unit's gradient shard: the leftovers packed back home); the long table (长桌) holds the
units it has gathered to full size for the current computation. Each household lays out its own full copy: the
table is "long" because every household contributes a slice to it, not because it is shared memory.

Events come from fsdp_lab.observe.trace (merged across ranks by time). `frame(events, i)` is the state after
events[0..i].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Beat:
    """One beat of the lifecycle, in the article's words (zh) and ours (en)."""

    key: str
    zh: str
    en: str
    colour: str

    @property
    def label(self) -> str:
        return f"{self.zh} {self.en}"


BEATS = {
    "gather": Beat("gather", "聚合", "gather (all-gather)", "#2563eb"),
    "compute": Beat("compute", "计算", "compute", "#16a34a"),
    "free": Beat("free", "释放", "free", "#9ca3af"),
    "regather": Beat("regather", "再聚合", "re-gather (all-gather)", "#7c3aed"),
    "reduce_scatter": Beat("reduce_scatter", "归约回分", "reduce-scatter", "#ea580c"),
    "all_reduce": Beat("all_reduce", "全归约", "all-reduce (DDP, ZeRO-1)", "#ea580c"),
    "backward_end": Beat("backward_end", "反向结束", "backward done", "#0f766e"),
    "optimizer": Beat("optimizer", "优化器更新", "optimizer step", "#0f766e"),
}

_EVENT_BEAT = {
    "gather_start": "gather", "gather_end": "gather", "forward_start": "compute",
    "forward_end": "compute", "backward_start": "compute", "grad_ready": "compute", "free": "free",
    "regather_start": "regather",
    "regather_end": "regather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
    "backward_end": "backward_end", "optimizer_step": "optimizer",
}


def beat_of(event: dict) -> Beat:
    """The beat an event belongs to; an event name we do not know is an error that names it."""
    name = event["event"]
    if name not in _EVENT_BEAT:
        raise ValueError(f"unknown trace event {name!r} (rank {event.get('rank')}, unit {event.get('unit')}); "
                         f"known: {', '.join(_EVENT_BEAT)}")
    return BEATS[_EVENT_BEAT[name]]


@dataclass(frozen=True)
class UnitSize:
    """A unit's bytes on one rank: its fp32 shard (fridge) and its gathered buffer (table)."""

    shard_bytes: int
    full_bytes: int


@dataclass(frozen=True)
class Sizes:
    units: dict  # unit name → UnitSize
    world_size: int
    exact: bool  # True: from the run's own unit table; False: derived from memory deltas in the trace


def sizes_from_unit_table(rows: list, world_size: int, master_bytes: int = 4) -> Sizes:
    """Exact sizes from fsdp_lab.lessons.experiments.common.unit_table (one row per flat group; the shard is the fp32
    master chunk, the gathered buffer is in the compute dtype)."""
    shard, full = {}, {}
    for row in rows:
        shard[row["unit"]] = shard.get(row["unit"], 0) + row["shard_numel"] * master_bytes
        full[row["unit"]] = full.get(row["unit"], 0) + row["full_bytes"]
    return Sizes({u: UnitSize(shard[u], full[u]) for u in shard}, world_size, True)


def unit_sizes(events: list) -> Sizes:
    """Sizes read from a trace alone: exact when its gathers carry "unit_bytes" (fsdp_lab.observe.trace), else (an
    older trace, e.g. a shipped GPU one) derived: a unit's gathered size is the jump in the rank's
    params_unsharded at its gather_end; its fp32 shard is the rank's params_sharded split in proportion to those
    sizes (exact when every unit gathers in one dtype). Prefer sizes_from_unit_table when the run is at hand."""
    ranks = sorted({e["rank"] for e in events})
    sized = [e for e in events if e["event"] in ("gather_end", "regather_end")]
    if sized and all("unit_bytes" in e for e in sized):  # the tracer recorded each unit's exact sizes
        exact = {e["unit"]: UnitSize(e["unit_bytes"]["shard"], e["unit_bytes"]["full"]) for e in sized}
        return Sizes(exact, len(ranks), True)
    full, previous = {}, {}
    for e in events:
        before = previous.get(e["rank"], {}).get("params_unsharded", 0)
        if e["event"] in ("gather_end", "regather_end"):
            grown = e["mem"].get("params_unsharded", 0) - before
            full[e["unit"]] = max(full.get(e["unit"], 0), grown)
        previous[e["rank"]] = e["mem"]
    sharded = max((e["mem"].get("params_sharded", 0) for e in events), default=0)
    total = sum(full.values()) or 1
    units = {u: UnitSize(round(sharded * b / total), b) for u, b in full.items()}
    return Sizes(units, len(ranks), False)


@dataclass(frozen=True)
class Household:
    """One rank at one instant."""

    rank: int
    fridge: dict  # unit → fp32 shard bytes (always all units)
    grad_shards: dict  # unit → gradient shard bytes packed back after reduce-scatter / all-reduce
    table: dict  # unit → bytes of the gathered (unsharded) buffer, gathers finished
    arriving: tuple  # units whose gather has started but not finished
    busy: tuple  # units whose forward/backward is running, outermost first (the root encloses the blocks)
    memory: dict  # this rank's latest memory record by kind (bytes); cuda_allocated on GPU
    step: int
    last_event: Optional[dict] = None
    reducing: Optional[str] = None  # the unit whose gradient is being reduce-scattered (its compute is over)

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's moments for this rank's shards: in the fridge too, once the first optimizer step made them."""
        return int(self.memory.get("optimizer_state", 0))

    @property
    def computing(self) -> Optional[str]:
        """The innermost unit in use: the one whose layers are computing right now."""
        return self.busy[-1] if self.busy else None

    @property
    def fridge_bytes(self) -> int:
        return sum(self.fridge.values()) + sum(self.grad_shards.values()) + self.optimizer_bytes

    @property
    def table_bytes(self) -> int:
        return sum(self.table.values())


@dataclass(frozen=True)
class FrameState:
    index: int
    total: int
    event: dict
    beat: Beat
    seconds: float  # since the first event of the trace
    households: tuple = field(default_factory=tuple)
    sizes_exact: bool = True

    @property
    def label(self) -> str:
        return self.beat.label

    @property
    def phase(self) -> str:
        """forward, backward or optimizer: where in the training step this event falls."""
        return PHASE_OF.get(self.event.get("phase", ""), self.event.get("phase", ""))

    def household(self, rank: int) -> Household:
        for h in self.households:
            if h.rank == rank:
                return h
        raise KeyError(f"rank {rank} not in this trace (ranks {[h.rank for h in self.households]})")


PHASE_OF = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}
PHASES = (("forward", "前向 forward"), ("backward", "反向 backward"), ("optimizer", "优化器 optimizer step"))


def _fresh(rank: int, sizes: Sizes, first: Optional[dict]) -> dict:
    """A household before its first event of the trace: what it holds then is what its first record says it
    held (shards, and the optimizer state of earlier steps), with nothing gathered yet."""
    memory = dict(first.get("mem", {})) if first else {}
    for key in ("params_unsharded", "grads_unsharded"):
        if memory.get(key):
            memory["total"] = memory.get("total", 0) - memory[key]
            memory[key] = 0
    return {"rank": rank, "fridge": {u: s.shard_bytes for u, s in sizes.units.items()}, "grad_shards": {},
            "table": {}, "arriving": [], "busy": [], "memory": memory, "step": first.get("step", 0) if first else 0,
            "last_event": None, "reducing": None}


def _apply(h: dict, e: dict, sizes: Sizes) -> None:
    """Advance one household by one of its own events. `busy` is a stack: the root's forward encloses the
    blocks' forwards, so the innermost unit in use is the one computing now."""
    name, unit = e["event"], e["unit"]
    size = sizes.units.get(unit, UnitSize(0, 0))
    h["memory"], h["step"], h["last_event"] = e.get("mem", {}), e.get("step", h["step"]), e
    busy = h["busy"]
    if h["reducing"] == unit and name != "reduce_scatter":
        h["reducing"] = None
    if name in ("gather_start", "regather_start"):
        if unit not in h["arriving"]:
            h["arriving"].append(unit)
    elif name in ("gather_end", "regather_end"):
        if unit in h["arriving"]:
            h["arriving"].remove(unit)
        h["table"][unit] = size.full_bytes
    elif name in ("forward_start", "backward_start"):
        if unit in busy:
            busy.remove(unit)
        busy.append(unit)
    elif name in ("forward_end", "free"):
        if unit in busy:
            busy.remove(unit)
        if name == "free":
            h["table"].pop(unit, None)
    elif name in ("reduce_scatter", "all_reduce"):
        h["grad_shards"][unit] = size.shard_bytes
        if unit in busy:  # its gradient is computed; the leftovers are on their way home, not being cooked
            busy.remove(unit)
        h["reducing"] = unit
    elif name in ("backward_end", "optimizer_step"):
        busy.clear()
        h["reducing"] = None
    mem = h["memory"]
    if mem and not mem.get("grads_sharded", 0) and not mem.get("grads_unsharded", 0):
        h["grad_shards"] = {}  # zero_grad(set_to_none=True) has emptied the leftovers


def frame(events: list, index: int, sizes: Optional[Sizes] = None) -> FrameState:
    """State of every household after events[0..index] (inclusive). `sizes` may be passed to skip recomputing."""
    if not events:
        raise ValueError("frame() needs a non-empty trace; record one with fsdp_lab.lessons.widgets.record_lifecycle")
    if not 0 <= index < len(events):
        raise IndexError(f"frame index {index} out of range: the trace has {len(events)} events (0..{len(events) - 1})")
    sizes = sizes or unit_sizes(events)
    ranks = sorted({e["rank"] for e in events})
    first = {r: next(e for e in events if e["rank"] == r) for r in ranks}
    state = {r: _fresh(r, sizes, first[r]) for r in ranks}
    for e in events[:index + 1]:
        _apply(state[e["rank"]], e, sizes)
    homes = tuple(Household(h["rank"], dict(h["fridge"]), dict(h["grad_shards"]), dict(h["table"]),
                            tuple(h["arriving"]), tuple(h["busy"]), dict(h["memory"]), h["step"], h["last_event"],
                            h["reducing"])
                  for h in state.values())
    event = events[index]
    return FrameState(index, len(events), event, beat_of(event), event["t"] - events[0]["t"], homes, sizes.exact)


def step_bytes_sent(events: list, rank: int, step: int = 0) -> dict:
    """Bytes rank `rank` sent in `step`, by beat: C_fwd (gather), C_bwd (re-gather), C_grad (reduce-scatter or
    all-reduce). The article's C_step = C_fwd + C_bwd + C_grad, measured."""
    out = {"C_fwd": 0, "C_bwd": 0, "C_grad": 0}
    key = {"gather_end": "C_fwd", "regather_end": "C_bwd", "reduce_scatter": "C_grad", "all_reduce": "C_grad"}
    for e in events:
        if e["rank"] == rank and e.get("step") == step and e["event"] in key and e.get("phase") != "summon":
            out[key[e["event"]]] += e["bytes_sent"]
    out["C_step"] = out["C_fwd"] + out["C_bwd"] + out["C_grad"]
    return out
