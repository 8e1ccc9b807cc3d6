"""Bytes that really cross the wire, beside the ring formula's count.

[Note: counting real bytes] The trace's bytes (fsdp_lab/observe/traffic.py) are computed: each collective's
size put through the ring formula. To see what gloo actually sends, the ranks run in a network namespace of
their own (`unshare -n`): on one machine they talk TCP over the loopback interface, and in a fresh namespace
nothing else uses it. So the transmit counter of `lo` in /proc/net/dev, read before and after a step, is every
byte all ranks sent in that step: the collectives' payload plus TCP/IP headers and ACKs, plus the two barriers
that bracket the reading (measured alone and subtracted). Linux only; the namespace needs root or user
namespaces. `isolation_problem()` says why it cannot run where it cannot.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Optional

PROC_NET_DEV = Path("/proc/net/dev")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_tx_bytes(path: Path = PROC_NET_DEV) -> int:
    """Bytes the loopback interface has transmitted (the 9th field of its /proc/net/dev line)."""
    for line in path.read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError(f"no loopback interface 'lo' in {path}")


def bring_loopback_up() -> None:
    """A new network namespace starts with `lo` down; set IFF_UP on it (what `ip link set lo up` does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _unshare_command() -> list[str]:
    return ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]


def isolation_problem() -> Optional[str]:
    """None when ranks can run in a private network namespace here, else why not (one line)."""
    if sys.platform != "linux" or not PROC_NET_DEV.exists():
        return "counting bytes on the wire needs Linux (/proc/net/dev)"
    if shutil.which("unshare") is None:
        return "counting bytes on the wire needs the `unshare` command (util-linux)"
    done = subprocess.run([*_unshare_command(), "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot make a network namespace ({' '.join(_unshare_command())}): {done.stderr.strip()[:200]}"
    return None


def run_isolated(module: str, args: list[str], timeout_s: float) -> str:
    """Run `python -m module args...` in a new network namespace; its stdout, or a RuntimeError with stderr."""
    cmd = [*_unshare_command(), sys.executable, "-m", module, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{module} in a network namespace exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout
