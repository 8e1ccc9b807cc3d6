"""What one cell did on each rank: its output, and whether it finished, raised, died or hung.

A cell run on live ranks ends one of four ways per rank (RankStatus). `CellRun.render()` is what the learner
reads: every rank's output labelled with its rank, then one line per rank that did not finish cleanly, saying
what happened. `RanksFailed` carries the same text and renders without a kernel-side traceback (the frames would
be this package's plumbing, not the learner's code).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Optional

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """Text without terminal colour codes (IPython colours remote tracebacks)."""
    return _ANSI.sub("", text or "")


class RankStatus(enum.Enum):
    OK = "finished"
    RAISED = "raised an exception"
    DIED = "died"
    HUNG = "did not finish in time"


@dataclass
class RankOutput:
    """One rank's share of a cell: what it printed, the value of its last expression, and how it ended."""

    rank: int
    status: RankStatus
    stdout: str = ""
    stderr: str = ""
    result: Optional[str] = None  # text/plain of the cell's last expression, as IPython would show it
    error: str = ""  # RAISED: the remote traceback's last lines; DIED: the exit code; HUNG: where it is stuck
    where: str = ""  # HUNG: the innermost frames of the rank's main thread (faulthandler)
    broke_group: bool = False  # RAISED: what it raised was a failed collective (the group is unusable after it)
    unwritten: Optional[str] = None  # RAISED by a learner's copy's stub: its NotImplementedError's message

    def lines(self) -> list:
        body = plain(self.stdout).rstrip("\n").splitlines() + plain(self.stderr).rstrip("\n").splitlines()
        if self.result is not None:
            body += [f"Out: {line}" for line in plain(self.result).splitlines()]
        return [f"[rank {self.rank}] {line}" for line in body]

    def summary(self, timeout_s: float) -> str:
        if self.status is RankStatus.OK:
            return ""
        if self.status is RankStatus.HUNG:
            text = f"rank {self.rank} {self.status.value}: still running after {timeout_s:g} s"
            return text + (f"; it is at\n{self.where}" if self.where else "")
        return f"rank {self.rank} {self.status.value}: {self.error}"


@dataclass
class CellRun:
    """Every rank's output for one cell, ordered by rank."""

    outputs: list = field(default_factory=list)
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(o.status is RankStatus.OK for o in self.outputs)

    @property
    def broke_the_group(self) -> bool:
        """A death, a hang or a failed collective leaves collectives unmatched: the ranks must be restarted."""
        return any(o.status in (RankStatus.DIED, RankStatus.HUNG) or o.broke_group for o in self.outputs)

    def by_rank(self, rank: int) -> RankOutput:
        for o in self.outputs:
            if o.rank == rank:
                return o
        raise KeyError(f"rank {rank} did not run this cell (ranks that did: {[o.rank for o in self.outputs]})")

    def failures(self) -> str:
        return "\n".join(s for s in (o.summary(self.timeout_s) for o in self.outputs) if s)

    def render(self) -> str:
        return "\n".join(line for o in self.outputs for line in o.lines())


_CELL_FILE = re.compile(r'File "[^"]*ipykernel_\d+[/\\](\d+)\.py", line (\d+)')


def stack_of_current_thread(dump: str, frames: int = 4) -> str:
    """The learner's frames, innermost first, of the thread faulthandler calls "Current thread" (the one running
    the cell): the frames before IPython's own, each cell file shown as "cell"."""
    block, out = False, []
    for line in dump.splitlines():
        if line.startswith("Current thread") or line.startswith("Thread "):
            block = line.startswith("Current thread")
            continue
        text = line.strip()
        if not (block and text.startswith("File ")):
            continue
        if "IPython" in text or "ipykernel" in text and not _CELL_FILE.search(text):
            break
        out.append("    " + _CELL_FILE.sub(r"cell, line \2", text))
    return "\n".join(out[:frames])


class RanksFailed(RuntimeError):
    """A cell did not finish cleanly on every rank; the message names each rank and what happened."""

    def __init__(self, message: str, run: Optional[CellRun] = None):
        super().__init__(message)
        self.run = run

    def _render_traceback_(self) -> list:  # IPython shows this instead of the kernel-side frames
        return [f"RanksFailed: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]
