"""What each ipyparallel engine runs once to become a gloo rank, and the helpers a learner's cell finds there.

The kernel calls `join(...)` on every engine at once (fsdp_lab.lessons.live.ranks): the engine sets the
torch.distributed environment variables, joins the process group with a timeout, and registers a faulthandler
on SIGUSR1 writing every thread's stack to a file, so a cell that hangs can be reported with the line the rank
is stuck on. (An engine ends with its kernel by a parent-death signal set before it ran anything:
fsdp_lab.lessons.live.lifeline.)

[Note: one process group per engine lifetime] A rank that hung or died leaves its peers' collectives unmatched,
and gloo offers no way to cancel one. So the group is never repaired: `Ranks.restart()` replaces every engine.
"""
from __future__ import annotations

import faulthandler
import os
import signal
from datetime import timedelta
from typing import Optional

STACK_SIGNAL = signal.SIGUSR1


class ExitRefused:
    """What `exit()` and `quit()` are on a rank: ending an engine from a cell would break the group for a cell
    that looked like it finished, so they raise instead, naming the rank (the group stays usable)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:
        return f"exit() is refused on the live ranks (rank {self.rank})"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"exit() on rank {self.rank} would end its engine and break the group; the ranks "
                           f"keep running: stop them from the kernel with live_ranks.stop()")


def post_finished() -> None:
    """After a cell: post this rank's collective log as finished, so a peer stuck in a later collective names this
    rank by its last one ([Note: reporting through the store] in fsdp_lab/runtime/core/collective_log.py)."""
    from fsdp_lab.runtime.core import collective_log

    collective_log.post_all("finished")


def join(rank: int, world_size: int, port: int, timeout_s: float, parent_pid: int, stack_file: str,
         threads: int = 1, patient_timeout_s: Optional[float] = None) -> dict:
    """Join the gloo group as `rank`, whose collectives time out after `timeout_s` and its patient ones after
    `patient_timeout_s` ([Note: patient collectives] in fsdp_lab/runtime/core/side_collectives.py); return what
    the kernel needs to watch this engine (its pid)."""
    import torch
    import torch.distributed as dist

    if os.getppid() != parent_pid:
        raise RuntimeError(f"engine's parent is pid {os.getppid()}, not the kernel's {parent_pid}")
    handle = open(stack_file, "w", encoding="utf-8")  # kept open for the engine's life: faulthandler writes here
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    if patient_timeout_s is not None:
        set_patient_timeout(patient_timeout_s)
    return {"rank": rank, "pid": os.getpid()}


def set_patient_timeout(seconds: float) -> None:
    """This rank's patient collectives wait `seconds` from now on (the kernel sets it for each cell's deadline)."""
    from fsdp_lab.runtime.core import side_collectives

    side_collectives.set_patient_timeout(seconds)

