"""The collective log: each rank's last collectives on each process group, so a hang is named as where every rank was.

Every collective both front ends issue passes through fsdp_lab/runtime/core/collectives.py (the lifecycle's) or
fsdp_lab/runtime/core/side_collectives.py (construction checks, state dicts, checkpoints, the loss), which record
it here before issuing it and mark it done after. When one fails (a gloo or NCCL timeout, a peer that died), the
failing rank posts its records to the rendezvous store and reads its peers' ([Note: reporting through the store]);
`report` turns them into one line naming the mismatch, which CollectiveFailed carries.

[Note: a ring per process group] Sequence numbers count what one group carried, as NCCL's flight recorder does: the
k-th collective on a group must be the same on every rank of it, so the first k where two ranks' records differ
is where they went apart. The log therefore belongs to the group, not to a model: two models on one group share
its numbering, and HSDP's shard and replicate groups number apart. It is found from the group object (a weak
mapping, so a destroyed group takes its log with it) instead of being threaded through every call.

[Note: the log on the hot path] A record is one small list appended to a bounded deque, made from what the caller
already has (strings it holds, the tensor's shape object, the dtype): no formatting, no bytes worked out, no
lookups beyond the group's log. Its state is one slot set in place (ISSUED, then DONE; a collective issued ahead
is WAITED while the host waits for it). Everything readable is made at report time.
"""
from __future__ import annotations

import pickle
import time
import weakref
from collections import deque
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

RING = 32  # records kept per group: enough to see where ranks went apart, small enough to post in one store key
ISSUED, WAITED, DONE = "issued", "waited", "done"
OBJECTS = "object"  # the dtype recorded for an object collective (all_gather_object, ...): the shape counts them
# slots of a record (a list, for speed: [Note: the log on the hot path])
SEQ, OP, UNIT, PHASE, SHAPE, DTYPE, NUMEL, STATE, T_ISSUED = range(9)

# [Note: reporting through the store] The stuck group cannot carry the report, so ranks exchange their records
# through the rendezvous store (the default group's c10d store, which is a TCP connection of its own). A rank posts
# when its collective fails ("failed"), when it leaves a run or a cell ("finished"), or when it raises ("raised"):
# a peer that is idle, finished or dead is then named by what it posted last. The failing rank waits at most
# REPORT_WAIT_S for every peer of the group to post, and up to SILENT_PEER_WAIT_S while a peer has posted nothing
# at all: such a peer is most likely stuck in a collective of its own and fails after its own timeout, which on a
# loaded machine may end seconds after ours (it entered later, or was not scheduled). A peer that never posts is
# named as silent. Store calls get their own short timeout, so a store that is gone (its host rank died) costs
# seconds, never a hang.
REPORT_WAIT_S = 2.0
SILENT_PEER_WAIT_S = 4.0
STORE_TIMEOUT_S = 2.0
KEY = "fsdp_lab/collective_log/{group}/{rank}"


class CollectiveLog:
    """One rank's ring of its last collectives on one process group."""

    __slots__ = ("group_name", "rank", "ranks", "seq", "records", "failed_at", "patient_timeout_s", "__weakref__")

    def __init__(self, group_name: str, rank: int, ranks: tuple, size: int = RING):
        self.group_name, self.rank, self.ranks = group_name, rank, ranks
        self.seq = 0
        self.failed_at = -1  # seq when this rank posted a failure: a later "raised" post must not hide it
        self.records: deque = deque(maxlen=size)
        # the default group's: how long a patient collective may wait ([Note: patient collectives] in
        # side_collectives.py); None: as long as any other, the group's own timeout
        self.patient_timeout_s: Optional[float] = None

    def issue(self, op: str, unit: str, phase: str, shape, dtype, numel: int) -> list:
        """Record a collective about to be issued; the caller sets rec[STATE] as it progresses."""
        self.seq += 1
        rec = [self.seq, op, unit, phase, shape, dtype, numel, ISSUED, time.monotonic()]
        self.records.append(rec)
        return rec

    def snapshot(self, status: str, error: str = "") -> dict:
        """What this rank posts: its status and its records, made plain (picklable, no tensors)."""
        return {"rank": self.rank, "status": status, "error": error, "seq": self.seq, "posted": time.time(),
                "records": [(r[SEQ], r[OP], r[UNIT], r[PHASE], tuple(r[SHAPE]), str(r[DTYPE]).replace("torch.", ""),
                             r[NUMEL] * _itemsize(r[DTYPE]), r[STATE], time.monotonic() - r[T_ISSUED])
                            for r in self.records]}


def _itemsize(dtype) -> int:
    return getattr(dtype, "itemsize", 0)


_LOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # [Note: a ring per process group]


def log_of(pg) -> Optional[CollectiveLog]:
    """The log of process group `pg` (None: the default group), made at its first collective; None when
    torch.distributed is not initialised (nothing to log)."""
    log = _LOGS.get(pg) if pg is not None else None
    if log is not None:
        return log
    if not dist.is_initialized():
        return None
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    log = _LOGS.get(group)
    if log is None:
        log = _LOGS[group] = CollectiveLog(group.group_name, dist.get_rank(),
                                           tuple(dist.get_process_group_ranks(group)))
    return log


def logs() -> list[CollectiveLog]:
    """Every group's log in this process."""
    return list(_LOGS.values())


# -- the store ---------------------------------------------------------------------------------------------------
def _store():
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except (RuntimeError, AttributeError):
        pass
    return store


def post(log: CollectiveLog, status: str, error: str = "", store=None) -> bool:
    """Post this rank's records of `log` to the store ([Note: reporting through the store]); False if it failed."""
    store = store or _store()
    if store is None:
        return False
    try:
        store.set(KEY.format(group=log.group_name, rank=log.rank), pickle.dumps(log.snapshot(status, error)))
        return True
    except (RuntimeError, OSError, ValueError):
        return False


def post_all(status: str, error: str = "") -> None:
    """Post every group's records: a rank leaving a run ("finished") or raising ("raised") tells its peers."""
    if not dist.is_initialized():
        return
    store = _store()
    for log in logs():
        if log.failed_at != log.seq:
            post(log, status, error, store)


def gather(log: CollectiveLog, wait_s: float = REPORT_WAIT_S, store=None,
           silent_wait_s: float = SILENT_PEER_WAIT_S) -> dict:
    """Every peer's last post for `log`'s group {rank: snapshot or None}. Reads until every peer has posted a
    failure of its own or `wait_s` has passed (`silent_wait_s` while a peer has posted nothing yet: [Note:
    reporting through the store]): a peer whose last post says "finished" may be stuck since (a cell later) and
    will post its failure shortly."""
    store = store or _store()
    found: dict = {}
    began = time.monotonic()
    while True:
        for rank in log.ranks:
            if rank == log.rank or (found.get(rank) or {}).get("status") in ("failed", "raised"):
                continue
            key = KEY.format(group=log.group_name, rank=rank)
            try:
                if store is not None and store.check([key]):
                    found[rank] = pickle.loads(store.get(key))
            except (RuntimeError, OSError, ValueError, pickle.UnpicklingError):
                pass
            found.setdefault(rank, None)
        peers = [found.get(r) for r in log.ranks if r != log.rank]
        settled = all((p or {}).get("status") in ("failed", "raised") for p in peers)
        waited = time.monotonic() - began
        if settled or store is None or waited > max(wait_s, silent_wait_s if None in peers else 0.0):
            return found
        time.sleep(0.05)


# -- the report ----------------------------------------------------------------------------------------------------
def describe(rec) -> str:
    """`all_gather #12 (blocks.3, forward)`."""
    seq, op, unit, phase = rec[0], rec[1], rec[2] or "?", rec[3] or "?"
    return f"{op} #{seq} ({unit}, {phase})"


def _who(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _last_done(snap: dict):
    done = [r for r in snap["records"] if r[7] == DONE]
    return done[-1] if done else None


def report(snaps: dict) -> str:
    """One line naming the mismatch among the ranks' posts {rank: snapshot or None}: where each rank waits, which
    collective some ranks entered and others never did, and the first sequence number where their records differ."""
    waiting, left, silent = {}, {}, []
    for rank in sorted(snaps):
        snap = snaps[rank]
        if snap is None:
            silent.append(rank)
            continue
        open_ = [r for r in snap["records"] if r[7] != DONE]
        if snap["status"] == "failed" and open_:
            waiting.setdefault(describe(open_[-1]), (open_[-1], []))[1].append(rank)
        else:
            last = _last_done(snap)
            key = (snap["status"], snap["error"], describe(last) if last else "")
            left.setdefault(key, (last, []))[1].append(rank)
    parts = []
    groups = sorted(waiting.values(), key=lambda g: g[1][0])
    entered = groups[0][0] if groups else None
    never, outside = [], []
    for (status, error, _), (last, ranks) in sorted(left.items(), key=lambda kv: kv[1][1][0]):
        how = {"raised": f" (it raised {error})" if error else " (it raised)", "finished": ""}.get(status,
                                                                                                 f" ({status})")
        after = (f"{'its' if len(ranks) == 1 else 'their'} last was {describe(last)}" if last else
                 f"{'it' if len(ranks) == 1 else 'they'} issued none on this group")
        if entered is not None and (last is None or last[0] < entered[0]):
            never.append(f"{_who(ranks)} never entered{how}: {after}")
        else:
            outside.append(f"{_who(ranks)} {'is' if len(ranks) == 1 else 'are'} outside any collective{how}: {after}")
    for i, (rec, ranks) in enumerate(groups):
        verb = ("waits in" if len(ranks) == 1 else "wait in") if i == 0 else ("is in" if len(ranks) == 1 else "are in")
        part = f"{_who(ranks)} {verb} {describe(rec)}"
        if i == 0 and never:
            part += ", which " + "; ".join(never)
        parts.append(part)
    parts += outside
    if silent:
        parts.append(f"{_who(silent)} did not report (dead, or stuck outside a collective)")
    diverged = first_difference(snaps)
    if diverged:
        parts.append(diverged)
    return "; ".join(parts)


def first_difference(snaps: dict) -> str:
    """`the ranks first differ at #k: rank 0 ran all_gather #k (root, state_dict), rank 1 all_gather #k (root,
    forward)`, for the lowest k both rings still hold at which two ranks' records disagree; "" if none."""
    by_seq: dict = {}
    for rank, snap in sorted(snaps.items()):
        for rec in (snap or {}).get("records", ()):
            by_seq.setdefault(rec[0], {})[rank] = rec
    for seq in sorted(by_seq):
        recs = by_seq[seq]
        kinds: dict = {}
        for rank, rec in recs.items():
            kinds.setdefault((rec[1], rec[2], rec[3], rec[5], rec[6]), []).append(rank)
        if len(kinds) > 1:
            shown = [f"{_who(ranks)} {describe(recs[ranks[0]])}" for ranks in
                     sorted(kinds.values(), key=lambda rs: rs[0])]
            return f"the ranks first differ at #{seq}: " + ", ".join(shown)
    return ""


def details(snaps: dict) -> str:
    """Each rank's ring, one line per record, for the lines after the report."""
    lines = []
    for rank, snap in sorted(snaps.items()):
        if snap is None:
            continue
        for seq, op, unit, phase, shape, dtype, nbytes, state, age in snap["records"][-4:]:
            size = f"{nbytes:,} B" if dtype != OBJECTS else "pickled"  # objects: their bytes are not known
            lines.append(f"  rank {rank}: #{seq} {op} ({unit or '?'}, {phase or '?'}) shape {list(shape)} {dtype} "
                         f"{size} {state}, issued {age:.1f} s before the post")
    return "\n".join(lines)


def on_failure(log: Optional[CollectiveLog]) -> tuple[str, str, bool]:
    """A collective of `log` failed: post, gather the peers' posts, return (the report, each rank's last records,
    whether this rank is the lowest that failed: the one that prints the report where every rank's output is
    shown, so it is printed once)."""
    if log is None:
        return "", "", False
    store = _store()
    post(log, "failed", store=store)
    log.failed_at = log.seq
    snaps = gather(log, store=store)
    snaps[log.rank] = log.snapshot("failed")
    first = min(r for r, s in snaps.items() if s is not None and s["status"] == "failed")
    return report(snaps), details(snaps), first == log.rank
