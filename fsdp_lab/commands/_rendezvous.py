"""The rendezvous of `fsdp-lab train`, where torchrun gathers the nodes before any rank starts: refuse a port that
is already taken, and give the wait a deadline.

[Note: a rendezvous deadline] torchrun's c10d rendezvous connects to HOST:PORT and waits for the store there to
answer. A listener that accepts the connection and never answers (another program on that port, a half-dead
head node) keeps it waiting forever: its own join and read timeouts do not cover that wait. The launcher
therefore watches from a thread: if no rank of this node has started within --rdzv-timeout seconds, it prints one
line naming the endpoint and exits (3, a rank could not start). Ranks are detected as child processes of the launcher
(/proc/PID/task/*/children), which is how torchrun starts them once the rendezvous is done.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from pathlib import Path


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def port_problem(flag: str, endpoint: str) -> str | None:
    """Why this node cannot host the rendezvous store on `endpoint` (its port taken), or None. An endpoint that
    is not an address of this machine is another node's business: None."""
    host, port = split_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        return f"{flag} {endpoint}: cannot resolve {host!r} ({err.strerror or err})"
    family, _type, _proto, _name, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return (f"{flag} {endpoint}: port {port} is already in use on this machine (another job, or an "
                        f"earlier run still ending); pick a free port")
            return None  # EADDRNOTAVAIL: not an address of this machine
    return None


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def can_watch() -> bool:
    """Whether this kernel lists child processes (CONFIG_PROC_CHILDREN); without it there is no watchdog."""
    return Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children").exists()


def watch(endpoint: str, timeout_s: float, exit_code: int, poll_s: float = 0.2) -> threading.Event:
    """Start the watchdog of [Note: a rendezvous deadline]; set the returned event to stop it."""
    done = threading.Event()
    pid, deadline = os.getpid(), time.monotonic() + timeout_s

    def run():
        while not done.wait(poll_s):
            if _children(pid):
                return
            if time.monotonic() > deadline:
                print(f"fsdp-lab train: failed (exit {exit_code}): the rendezvous at {endpoint} did not complete "
                      f"within --rdzv-timeout {timeout_s:g} s: nothing there answered, or the other nodes never "
                      f"joined",
                      file=sys.stderr, flush=True)
                os._exit(exit_code)

    if can_watch():
        threading.Thread(target=run, name="rendezvous-deadline", daemon=True).start()
    return done
