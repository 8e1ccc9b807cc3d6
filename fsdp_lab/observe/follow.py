"""Follow a trace while the job that writes it is still running (the live chart's data source).

Every rank appends one JSON line per event to directory/rank{r}.jsonl and flushes it (fsdp_lab.observe.trace), so
another process can read the files as they grow. `follow` polls them, remembers how far it has read in each,
and yields each complete new line as an event dict. It copes with the two things a live reader meets:
a rank whose file does not exist yet (it has not started tracing), and a last line that is only half written
(the rank is in the middle of a write): that tail is kept and completed on a later poll.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterator, Optional

from fsdp_lab.observe.trace import FileCursor, rank_file


def follow(directory: str | os.PathLike, world_size: int, poll_s: float = 0.1, timeout_s: float = 60.0,
           idle_s: Optional[float] = None, stop: Optional[Callable[[], bool]] = None) -> Iterator[dict]:
    """Yield the events of `world_size` ranks' trace files in `directory` as they are written.

    Each poll reads every file from where the last one stopped and yields its new events ordered by (t, rank).
    The generator ends, after a last read, at the first of: `stop()` returns True (e.g. the job has finished),
    no new event for `idle_s` seconds, or `timeout_s` seconds since it started. Ending is quiet: the caller
    checks what it has seen (a follower in a notebook should not raise because a job ended early).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if poll_s <= 0 or timeout_s <= 0:
        raise ValueError(f"poll_s and timeout_s must be > 0, got {poll_s} and {timeout_s}")
    cursors = [FileCursor(rank_file(directory, r)) for r in range(world_size)]
    start = last_new = time.monotonic()
    while True:
        finishing = stop is not None and stop()
        batch = [e for c in cursors for e in c.read_new()]
        now = time.monotonic()
        if batch:
            last_new = now
            yield from sorted(batch, key=lambda e: (e.get("t", 0.0), e.get("rank", 0)))
        if finishing or now - start >= timeout_s or (idle_s is not None and now - last_new >= idle_s):
            return
        time.sleep(poll_s)
