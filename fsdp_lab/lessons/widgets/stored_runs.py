"""Runs the chapters show from files: each one a directory under fsdp_lab/data/runs/ with its `run.json` (what
every rank measured, the command that recorded it, where and when) and any files it made (a checkpoint).

Read without importing torch: a chapter's kernel that only shows a stored run starts in a second, and the live
ranks, separate processes, import torch themselves. The command that records each run is in its `provenance`
(chapter 06b's: `python -m fsdp_lab.lessons.experiments.two_nodes --record`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RUNS = Path(__file__).resolve().parents[2] / "data" / "runs"


def stored_run(name: str, root: str | os.PathLike = RUNS) -> dict:
    """`root/name/run.json`, with `directory` set to that run's absolute directory."""
    path = Path(root) / name
    if not (path / "run.json").exists():
        known = sorted(p.name for p in Path(root).glob("*/run.json")) if Path(root).exists() else []
        raise FileNotFoundError(f"no stored run {name!r} in {root} (stored: {', '.join(known) or 'none'}); "
                                f"record it with the command its chapter names")
    run = json.loads((path / "run.json").read_text(encoding="utf-8"))
    run["directory"] = str(path)
    return run
