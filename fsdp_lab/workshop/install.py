"""The workshop's own software: JupyterHub, its idle culler and configurable-http-proxy, at pinned versions.

[Note: where the hub is installed] As `course.sh` installs JupyterLab: with pip, into the Python that runs the
course (so the hub, its services and every learner's server share one environment, the one `fsdp-lab` runs
in), and configurable-http-proxy, a Node program, with npm into a project-local prefix (.workshop/node under
the checkout), never globally. The pins live here; pyproject.toml's `workshop` extra names the same Python
pins (tests/test_workshop.py keeps them equal) and scripts/env.sh the same proxy pin, so CI's fresh clone gets
exactly these.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

PIP_PINS = ("jupyterhub==6.1.1", "jupyterhub-idle-culler==2.0.0")
PROXY_PIN = "configurable-http-proxy@5.3.0"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = ROOT / ".workshop" / "node"
INSTALL_TIMEOUT_S = 900


def proxy_path(prefix: Path = DEFAULT_PREFIX) -> Path:
    return prefix / "node_modules" / ".bin" / "configurable-http-proxy"


def python_missing() -> list[str]:
    """The pinned Python packages this interpreter cannot import."""
    modules = {"jupyterhub==6.1.1": "jupyterhub", "jupyterhub-idle-culler==2.0.0": "jupyterhub_idle_culler"}
    return [pin for pin in PIP_PINS if importlib.util.find_spec(modules[pin]) is None]


def install(prefix: Path = DEFAULT_PREFIX, say=print) -> None:
    """Install what is missing (RuntimeError naming the step that failed)."""
    absent = python_missing()
    if absent:
        say(f"installing {' '.join(absent)} into {sys.executable} (pip)")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *absent], timeout=INSTALL_TIMEOUT_S)
        if done.returncode:
            raise RuntimeError(f"pip could not install {' '.join(absent)} (exit {done.returncode}; its output is "
                               f"above)")
    if not proxy_path(prefix).exists():
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(f"configurable-http-proxy is a Node program and npm is not on PATH; install Node.js "
                               f"20 or newer (with npm), or put the proxy at {proxy_path(prefix)}")
        say(f"installing {PROXY_PIN} into {prefix} (npm)")
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                               PROXY_PIN], timeout=INSTALL_TIMEOUT_S)
        if done.returncode or not proxy_path(prefix).exists():
            raise RuntimeError(f"npm could not install {PROXY_PIN} into {prefix} (exit {done.returncode}; its "
                               f"output is above)")
