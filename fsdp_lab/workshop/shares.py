"""Which GPUs each learner's server sees.

[Note: GPU shares] The devices are cut into slots of `per_learner` GPUs each, in the order given; learner i of
the class list (in its order) gets slot i, for the whole workshop. The slots are disjoint by construction, so no
two learners' ranks land on the same GPU, and a learner who restarts their server gets the same GPUs back. A
class larger than the slots is refused, naming both numbers, unless the instructor chooses CPU ranks for the rest
(`cpu_for_rest`): those learners get CUDA_VISIBLE_DEVICES="" (no GPU at all, so their live ranks run on gloo
over CPU), never a GPU someone else holds. On a machine without GPUs every learner gets CPU ranks and nothing
is refused.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

CPU_ONLY = ""  # CUDA_VISIBLE_DEVICES for a learner without a share: no device visible


class TooFewShares(ValueError):
    """More learners than GPU shares, and CPU ranks for the rest were not chosen."""


@dataclass(frozen=True)
class Share:
    learner: str
    devices: tuple[str, ...]  # empty: CPU ranks only

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.devices) if self.devices else CPU_ONLY


def detect_gpus(nvidia_proc: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """Indices of this machine's NVIDIA GPUs (`nvidia-smi -L`, else the driver's /proc list); [] without any."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        found = [line for line in out.splitlines() if line.startswith("GPU ")]
        if found:
            return [str(i) for i in range(len(found))]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return [str(i) for i in range(len(os.listdir(nvidia_proc)))]
    except OSError:
        return []


def parse_devices(text: str) -> list[str]:
    """'0,1,2,3' -> ['0', '1', '2', '3']; a device named twice is refused (two shares would hold it)."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise ValueError(f"--gpus names device(s) {', '.join(repeated)} more than once")
    return devices


def assign(learners: Sequence[str], devices: Sequence[str], per_learner: int = 1,
           cpu_for_rest: bool = False) -> dict[str, Share]:
    """{learner: Share} per [Note: GPU shares]; TooFewShares when the class outnumbers the slots."""
    if per_learner < 1:
        raise ValueError(f"--gpus-per-learner must be >= 1, got {per_learner}")
    slots = [tuple(devices[i:i + per_learner]) for i in range(0, len(devices) - per_learner + 1, per_learner)]
    if devices and len(learners) > len(slots) and not cpu_for_rest:
        raise TooFewShares(
            f"{len(learners)} learners but only {len(slots)} GPU share(s) ({len(devices)} GPU(s), "
            f"{per_learner} per learner); pass --cpu-for-rest to give the other {len(learners) - len(slots)} "
            f"learner(s) CPU ranks, or --gpus-per-learner {max(1, len(devices) // max(1, len(learners)))}")
    return {name: Share(name, slots[i] if i < len(slots) else ()) for i, name in enumerate(learners)}
