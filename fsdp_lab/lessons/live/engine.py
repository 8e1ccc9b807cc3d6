"""What each ipyparallel engine runs once to become a gloo rank, and the helpers a learner's cell finds there.

The kernel calls `join(...)` on every engine at once (fsdp_lab.lessons.live.ranks): the engine sets the
torch.distributed environment variables, joins the process group with a timeout, and gets two guards:

- a watchdog thread that ends the engine (and the ipyparallel controller) when the kernel that started it is
  gone, so a kernel killed without running its atexit hooks leaves no orphaned ranks behind;
- a faulthandler on SIGUSR1 writing every thread's stack to a file, so a cell that hangs can be reported with
  the line the rank is stuck on.

[Note: one process group per engine lifetime] A rank that hung or died leaves its peers' collectives unmatched,
and gloo offers no way to cancel one. So the group is never repaired: `Ranks.restart()` replaces every engine.
"""
from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import threading
import time
from datetime import timedelta

STACK_SIGNAL = signal.SIGUSR1


def _watch_parent(parent_pid: int, controller_pid: int, leftovers: tuple, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    try:  # the kernel is gone: take the controller and the handle's temporary directories with us
        os.kill(controller_pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    for directory in leftovers:
        shutil.rmtree(directory, ignore_errors=True)
    os._exit(70)


def join(rank: int, world_size: int, port: int, timeout_s: float, parent_pid: int, controller_pid: int,
         stack_file: str, threads: int = 1, leftovers: tuple = ()) -> dict:
    """Join the gloo group as `rank`; return what the kernel needs to watch this engine (its pid). `leftovers`:
    directories to remove if the kernel dies without stopping the ranks."""
    import torch
    import torch.distributed as dist

    if os.getppid() != parent_pid:
        raise RuntimeError(f"engine's parent is pid {os.getppid()}, not the kernel's {parent_pid}")
    watchdog = threading.Thread(target=_watch_parent, args=(parent_pid, controller_pid, tuple(leftovers), 0.5),
                                name="fsdp-lab-kernel-watchdog", daemon=True)
    watchdog.start()
    handle = open(stack_file, "w", encoding="utf-8")  # kept open for the engine's life: faulthandler writes here
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return {"rank": rank, "pid": os.getpid()}

