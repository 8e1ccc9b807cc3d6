"""Communication accounting: bytes per collective, per step and per rank, computed from trace events.

[Note: ring byte counts] We count what a ring algorithm moves per rank, the convention the article's formulas
use: an all-gather or reduce-scatter of a T-byte buffer sends (N-1)/N·T bytes per rank (and receives as much);
an all-reduce sends 2·(N-1)/N·T. World size 1 moves nothing. The runtime hands each collective to the tracer as
(kind, numel, dtype, world size); `collective_bytes` turns that into bytes, put on one event per beat:
    gather_end      the forward all-gather of a unit (ZeRO-1: the all-gather of the updated fp32 masters)
    regather_end    the backward re-gather (all-gather) of a unit freed after forward
    reduce_scatter  a unit's gradient reduce-scatter
    all_reduce      a unit's gradient all-reduce (NO_SHARD; ZERO1 reduce-scatters, as the ZeRO paper does)
Every other event carries 0 bytes. A collective event that moved nothing (NO_SHARD's "gather" is a local copy;
a world of one rank skips its collectives) is not communication and is left out. Summing these per (rank, step)
gives what the article calls C_step (FSDP ≈ 3Φ) and C_DDP (≈ 2Φ); `CommSummary.ratio` puts two runs side by
side (interview question 8).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

COLLECTIVE_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class CommBytes:
    sent: int
    received: int


def ring_bytes(kind: str, total_bytes: int, world_size: int) -> CommBytes:
    """Bytes one rank sends and receives in a ring collective of a `total_bytes` buffer."""
    if kind not in COLLECTIVE_FACTOR:
        raise ValueError(f"unknown collective kind {kind!r}; known: {sorted(COLLECTIVE_FACTOR)}")
    if world_size == 1:
        return CommBytes(0, 0)
    one_pass = total_bytes * (world_size - 1) // world_size * COLLECTIVE_FACTOR[kind]
    return CommBytes(one_pass, one_pass)


def collective_bytes(collectives) -> CommBytes:
    """Sum of ring_bytes over the runtime's Collective records (anything with kind, numel, dtype, world_size)."""
    sent = received = 0
    for c in collectives:
        b = ring_bytes(c.kind, c.numel * c.dtype.itemsize, c.world_size)
        sent, received = sent + b.sent, received + b.received
    return CommBytes(sent, received)


BEAT_OF_EVENT = {"gather_end": "gather", "regather_end": "regather", "reduce_scatter": "reduce_scatter",
                 "all_reduce": "all_reduce"}
COLLECTIVE_OF_BEAT = {"gather": "all_gather", "regather": "all_gather", "reduce_scatter": "reduce_scatter",
                      "all_reduce": "all_reduce"}


@dataclass(frozen=True)
class CommRecord:
    """All collectives of one beat (gather, regather, reduce_scatter, all_reduce) on one rank in one step."""

    rank: int
    step: int
    beat: str
    calls: int
    sent: int
    received: int

    @property
    def collective(self) -> str:
        return COLLECTIVE_OF_BEAT[self.beat]


@dataclass(frozen=True)
class CommSummary:
    """`records` hold the bytes; `rank_steps` every (rank, step) the events mention, so a step that sent nothing
    (world size 1, or a step of pure local work) still counts as a step with 0 bytes."""

    records: tuple[CommRecord, ...]
    rank_steps: tuple[tuple[int, int], ...] = ()

    def _pairs(self) -> set[tuple[int, int]]:
        return set(self.rank_steps) | {(r.rank, r.step) for r in self.records}

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for rank, _ in self._pairs()})

    @property
    def steps(self) -> list[int]:
        return sorted({step for _, step in self._pairs()})

    def _select(self, rank, step, beat, collective) -> list[CommRecord]:
        return [r for r in self.records if (rank is None or r.rank == rank) and (step is None or r.step == step)
                and (beat is None or r.beat == beat) and (collective is None or r.collective == collective)]

    def sent(self, rank: Optional[int] = None, step: Optional[int] = None, beat: Optional[str] = None,
             collective: Optional[str] = None) -> int:
        """Bytes sent, summed over whatever is left as None (e.g. sent(rank=0, step=1): rank 0's step 1)."""
        return sum(r.sent for r in self._select(rank, step, beat, collective))

    def received(self, rank: Optional[int] = None, step: Optional[int] = None, beat: Optional[str] = None,
                 collective: Optional[str] = None) -> int:
        return sum(r.received for r in self._select(rank, step, beat, collective))

    def calls(self, rank: Optional[int] = None, step: Optional[int] = None, beat: Optional[str] = None,
              collective: Optional[str] = None) -> int:
        return sum(r.calls for r in self._select(rank, step, beat, collective))

    def per_step(self, rank: int) -> dict[int, int]:
        """{step: bytes sent by `rank` in that step}."""
        return {s: self.sent(rank=rank, step=s) for s in self.steps}

    def per_collective(self, rank: int, step: Optional[int] = None) -> dict[str, int]:
        """{collective: bytes sent} for one rank (one step, or all steps)."""
        return {c: self.sent(rank=rank, step=step, collective=c)
                for c in sorted({r.collective for r in self._select(rank, step, None, None)})}

    def per_beat(self, rank: int, step: Optional[int] = None) -> dict[str, int]:
        return {b: self.sent(rank=rank, step=step, beat=b)
                for b in sorted({r.beat for r in self._select(rank, step, None, None)})}

    def mean_sent_per_step(self, rank: Optional[int] = None) -> float:
        """Bytes sent per rank per step, averaged over the (rank, step) pairs the events mention."""
        pairs = [p for p in self._pairs() if rank is None or p[0] == rank]
        return self.sent(rank=rank) / len(pairs) if pairs else 0.0

    def ratio(self, other: "CommSummary") -> float:
        """This run's bytes per rank per step divided by `other`'s (e.g. FULL_SHARD over NO_SHARD ≈ 1.5)."""
        theirs = other.mean_sent_per_step()
        if theirs == 0:
            raise ValueError("the other run sent 0 bytes per step (world size 1, or no collectives traced)")
        return self.mean_sent_per_step() / theirs

    def table(self) -> list[dict]:
        """One plain dict per record, for printing or a DataFrame."""
        return [{"rank": r.rank, "step": r.step, "beat": r.beat, "collective": r.collective, "calls": r.calls,
                 "sent": r.sent, "received": r.received} for r in self.records]


def comm_summary(events: Iterable[dict]) -> CommSummary:
    """Sum the bytes of every collective in `events` (one rank's, or a merged timeline) by rank, step and beat."""
    acc: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    seen: set[tuple[int, int]] = set()
    for e in events:
        if "rank" in e and "step" in e:
            seen.add((int(e["rank"]), int(e["step"])))
        beat = BEAT_OF_EVENT.get(e.get("event"))
        if beat is None:
            if e.get("bytes_sent", 0) or e.get("bytes_received", 0):
                raise ValueError(f"event {e.get('event')!r} of unit {e.get('unit')!r} carries bytes "
                                 f"({e.get('bytes_sent')} sent, {e.get('bytes_received')} received) but is not a "
                                 f"collective; known collective events: {sorted(BEAT_OF_EVENT)}")
            continue
        sent, received = int(e["bytes_sent"]), int(e["bytes_received"])
        if sent < 0 or received < 0:
            raise ValueError(f"negative byte count in event {e!r}")
        if sent == 0 and received == 0:
            continue
        slot = acc[(int(e["rank"]), int(e["step"]), beat)]
        slot[0] += 1
        slot[1] += sent
        slot[2] += received
    return CommSummary(tuple(CommRecord(rank, step, beat, calls, sent, received)
                             for (rank, step, beat), (calls, sent, received) in sorted(acc.items())),
                       tuple(sorted(seen)))


def bytes_by_group(events: Iterable[dict], rank: Optional[int] = None, step: Optional[int] = None,
                   key: str = "group", collective: bool = False) -> dict:
    """Bytes sent, summed per process group: inside a node ("shard") and across nodes ("replicate") under HSDP
    ([Note: hybrid sharding] in fsdp_lab/runtime/features/hybrid.py). key="ranks" keys by the group's global ranks
    instead of its label; collective=True splits each group by collective ((group, collective) keys). Events of
    one rank or a merged timeline; `rank`/`step` select."""
    if key not in ("group", "ranks"):
        raise ValueError(f"bytes_by_group key must be 'group' or 'ranks', got {key!r}")
    totals: dict = defaultdict(int)
    for e in events:
        beat = BEAT_OF_EVENT.get(e.get("event"))
        if beat is None or not e.get("bytes_sent") or (rank is not None and e.get("rank") != rank) \
                or (step is not None and e.get("step") != step):
            continue
        if "group" not in e:
            raise ValueError(f"event {e.get('event')!r} of unit {e.get('unit')!r} sent bytes but names no group "
                             f"(a trace written before groups were recorded)")
        group = e["group"] if key == "group" else tuple(e["group_ranks"])
        totals[(group, COLLECTIVE_OF_BEAT[beat]) if collective else group] += int(e["bytes_sent"])
    return dict(totals)
