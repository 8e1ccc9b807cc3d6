#!/usr/bin/env python3
"""The GPU checks of tests/test_gpu.py without pytest: one PASS/FAIL line per check, exit code 1 if any failed.

    PYTHONPATH=. python3 benchmarks/gpu_checks.py --out gpu_out/gpu_checks.txt      # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/gpu_checks.py --cpu-smoke                       # same code on CPU/gloo

World size 1 runs on NCCL (parity with FSDP2 in bf16 and fp32, unsharded memory released between units, gather
overlapping compute in a profile, no host sync in a step, resuming fused AdamW, ZeRO-1 with fused AdamW); then
two ranks share the GPU over gloo for the bf16 parity and ZeRO-1 checks (NCCL refuses two ranks on one GPU), which
run the collective path with CUDA tensors on the side streams. The checks live in fsdp_lab/bench/gpu_checks.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fsdp_lab.bench.gpu_checks import MULTI_RANK_CHECKS, WORLD1_CHECKS, run_checks  # noqa: E402
from fsdp_lab.training.launch import run_on_ranks  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU/gloo even if a GPU is present")
    p.add_argument("--out", default=None, help="also write the report to this file")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per launch before ranks are killed")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu_checks: no CUDA device; run with --cpu-smoke to exercise the same code on CPU", file=sys.stderr)
        return 2
    lines = [f"gpu_checks {time.strftime('%Y-%m-%d %H:%M:%S %Z')} torch {torch.__version__} "
             + (f"cuda {torch.version.cuda} {torch.cuda.get_device_name(0)}" if cuda else "cpu smoke")]
    launches = [("world 1, " + ("nccl" if cuda else "gloo"), 1, "nccl" if cuda else "gloo", list(WORLD1_CHECKS)),
                ("world 2, gloo" + (" on one GPU" if cuda else ""), 2, "gloo", list(MULTI_RANK_CHECKS))]
    failed = 0
    for label, world, backend, names in launches:
        start = time.perf_counter()
        if not cuda:  # the spawned ranks must not see the GPU either
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            results = run_on_ranks(run_checks, world, names, backend=backend, timeout_s=args.timeout)[0]
        except Exception as exc:  # a rank died or hung: every check of this launch failed
            results = [{"name": n, "ok": False, "detail": f"launch failed: {type(exc).__name__}: {exc}"[:2000],
                        "seconds": 0.0} for n in names]
        for r in results:
            failed += not r["ok"]
            lines.append(f"{'PASS' if r['ok'] else 'FAIL'} {r['name']} [{label}] ({r['seconds']:.1f} s): {r['detail']}")
        lines.append(f"-- {label}: {time.perf_counter() - start:.1f} s")
    lines.append(f"{'ALL PASS' if not failed else f'{failed} FAILED'}")
    report = "\n".join(lines)
    print(report, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
