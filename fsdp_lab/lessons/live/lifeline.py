"""Tie every live-rank process to the kernel's life: whatever a cell is doing, nothing outlives the kernel.

Two entry points, both run as `python .../lifeline.py ...` (by path: the package, and torch, stay unloaded):

- `guard PARENT_PID MODULE ARGS...` wraps the controller and each engine: it asks Linux to SIGKILL this process
  when its parent dies (prctl PR_SET_PDEATHSIG), checks the parent is still PARENT_PID (the kernel could have
  died between fork and prctl), makes every process it forks later do the same (the controller's schedulers),
  then runs MODULE as __main__ in this same process.
- `reap DIR...` is a tiny process the kernel starts first and keeps a pipe to. It reads lines "PID CREATE_TIME"
  (the processes the handle knows) until the pipe closes, which happens when the kernel stops the ranks or dies
  however it dies; it then kills what is left of those processes and removes DIR....

[Note: who cleans up after a SIGKILLed kernel] A watchdog thread in the engine cannot: a cell that holds the
GIL (`sum(range(10**13))`) never lets it run. The kernel's death has to be seen by the operating system, so the
engines and the controller carry a parent-death signal from their first instruction. PR_SET_PDEATHSIG fires when
the *thread* that forked the child ends, not the process: ipyparallel forks from the calling thread outside an
event loop, and inside a kernel (a running loop) from one daemon thread that lives as long as the kernel, so
both end only with the kernel. The signal is tied to the direct parent, hence the at-fork hook for the
controller's own children (forked by multiprocessing). Files are the one thing a signal cannot clean, so the
temporary directories are removed by the reaper, which sees the kernel go as the end of its pipe (the write end
is held only by the kernel: subprocesses do not inherit it) and needs no signal, thread or GIL of the kernel.
It also kills the processes it was told about, so a child that escaped the signal is still ended.
"""
from __future__ import annotations

import ctypes
import os
import runpy
import shutil
import signal
import sys

_PR_SET_PDEATHSIG = 1
_EXIT_PARENT_GONE = 70


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent ends; end now if the parent is not `parent_pid` any more. Only
    Linux has the parent-death signal: elsewhere (macOS) the reaper alone ends what outlives the kernel."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(_EXIT_PARENT_GONE)


def guard_command(parent_pid: int, module: str) -> list:
    """The argv that runs `python -m module` under the parent-death guard."""
    return [sys.executable, os.path.abspath(__file__), "guard", str(parent_pid), module]


def _guard(parent_pid: int, module: str, args: list) -> None:
    die_with_parent(parent_pid)
    forker = {}
    os.register_at_fork(before=lambda: forker.update(pid=os.getpid()),
                        after_in_child=lambda: die_with_parent(forker["pid"]))
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def reap_command(directories: list) -> list:
    """The argv of the reaper for `directories`."""
    return [sys.executable, os.path.abspath(__file__), "reap"] + [str(d) for d in directories]


def _reap(directories: list) -> None:
    import psutil

    known = []
    for line in sys.stdin:
        pid, created = line.split()
        known.append((int(pid), float(created)))
    procs = []
    for pid, created in known:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 1e-3:  # the same process, not a reused pid
                proc.kill()
                procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "guard":
        _guard(int(rest[0]), rest[1], rest[2:])
    elif command == "reap":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's stop button is not the kernel's end
        _reap(rest)
    else:
        raise SystemExit(f"lifeline: unknown command {command!r} (guard or reap)")
