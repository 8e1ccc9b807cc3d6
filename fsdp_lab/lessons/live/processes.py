"""The processes a live-ranks handle started: finding, signalling and ending them, and remembering them.

`KnownProcesses` keeps every process the handle has seen as (pid, create time), so stop() can end the ones whose
parent died before them (the schedulers of a SIGKILLed controller) and never a stranger that got a reused pid.
It also starts the lifeline reaper and tells it the same processes ([Note: who cleans up after a SIGKILLed
kernel] in fsdp_lab.lessons.live.lifeline).
"""
from __future__ import annotations

import os
import signal
import subprocess

from fsdp_lab.lessons.live import lifeline


class KnownProcesses:
    def __init__(self, directories: list):
        self.entries: list = []  # (pid, create time)
        self.reaper = subprocess.Popen(lifeline.reap_command(directories), stdin=subprocess.PIPE, text=True,
                                       start_new_session=True)

    def remember(self, pids: list) -> None:
        """Note `pids` and their descendants, here and with the reaper."""
        import psutil

        for pid in with_descendants(pids):
            try:
                entry = (pid, psutil.Process(pid).create_time())
            except psutil.NoSuchProcess:
                continue
            if entry in self.entries:
                continue
            self.entries.append(entry)
            try:
                self.reaper.stdin.write(f"{entry[0]} {entry[1]!r}\n")
                self.reaper.stdin.flush()
            except (BrokenPipeError, ValueError):  # it has ended: the parent-death signal still covers them
                pass

    def alive(self) -> list:
        """The remembered processes still running as themselves (a pid the system reused is not ours)."""
        import psutil

        out = []
        for pid, created in self.entries:
            try:
                if psutil.Process(pid).create_time() == created:
                    out.append(pid)
            except psutil.NoSuchProcess:
                continue
        return out

    def close(self) -> None:
        """Close the reaper's pipe (its cue) and wait for it; call after everything it knows of has ended."""
        self.reaper.stdin.close()
        try:
            self.reaper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
            self.reaper.wait(timeout=10)


def running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def with_descendants(pids: list) -> list:
    import psutil

    out = list(dict.fromkeys(pids))
    for pid in pids:
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True) if c.pid not in out]
        except psutil.NoSuchProcess:
            continue
    return out


def kill(pids: list) -> None:
    """SIGKILL what is still running, then wait (bounded) until each has gone."""
    import psutil

    procs = []
    for pid in set(pids):
        if pid == os.getpid() or pid <= 0:
            continue
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.send_signal(signal.SIGKILL)
            procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)
