"""Two torchrun launchers on one machine as two "nodes" (c10d rendezvous on 127.0.0.1), running chapter 06b's
measurements on their 2 × 2 ranks in one job.

    result = run_two_nodes(directory)      # both launchers' commands, and each rank's results in rank order
    python -m fsdp_lab.lessons.experiments.two_nodes --out DIR      # what every rank runs (under torchrun)

[Note: one job for the chapter] Each launcher is what a node runs in a real two-node job: `torchrun --nnodes 2
--nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:PORT --rdzv-id ID`. The c10d rendezvous gives each
launcher its node rank in the order they join (the launcher that binds the endpoint's port hosts the store; the
other connects to it). Starting 4 ranks and 2 launchers costs more than the tiny models' runs on a 2-core
machine, so every measurement the chapter needs on 4 ranks runs in this one job (as run_together does for
run_on_ranks, fsdp_lab/lessons/experiments/together.py). Each rank writes its results to `DIR/rank<R>.pt`. The
commands are those of course/multinode/torchrun_two_nodes.sh, with `python -m torch.distributed.run` for
`torchrun` (the same program, found without relying on PATH) and this module for `fsdp-lab train`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

NODES, PER_NODE = 2, 2
_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def commands(directory: str | os.PathLike, port: int, run_id: str = "06b") -> list[list[str]]:
    """The two launchers' command lines: the same on both nodes (the c10d rendezvous numbers the nodes)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
                str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--max-restarts", "0", "-m", "fsdp_lab.lessons.experiments.two_nodes", "--out", str(directory)]
    return [launcher, list(launcher)]


def shown(command: list[str]) -> str:
    """A command as a learner would type it: `torchrun` for the launcher, `fsdp_lab...two_nodes` for the script."""
    return shlex.join(["torchrun", *command[3:]])


def run_two_nodes(directory: str | os.PathLike, timeout_s: float = 150.0) -> dict:
    """Start both launchers, wait for both (within `timeout_s`, else kill both and raise), return
    {"commands", "seconds", "ranks": [each rank's results, rank order]}."""
    from fsdp_lab.training.launch import free_port

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cmds = commands(directory, free_port())
    env = {**os.environ, **_ENV}
    start = time.monotonic()
    logs = [open(directory / f"node{i}.log", "w", encoding="utf-8") for i in range(NODES)]
    procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for c, log in zip(cmds, logs)]
    try:
        for p in procs:
            p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the two torchrun launchers did not finish within {timeout_s:.0f} s; both killed "
                           f"(their output: {directory}/node*.log)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tail = "\n".join((directory / f"node{i}.log").read_text(encoding="utf-8")[-1500:] for i in range(NODES))
        raise RuntimeError(f"torchrun launchers exited {codes}:\n{tail}")
    ranks = [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(NODES * PER_NODE)]
    return {"commands": [shown(c) for c in cmds], "seconds": time.monotonic() - start, "ranks": ranks}


STORED = Path(__file__).resolve().parents[2] / "data" / "runs" / "06b-beyond-one-node"  # widgets/stored_runs.py


def record(target: str | os.PathLike = STORED, timeout_s: float = 300.0) -> dict:
    """Run the two-node job and store what chapter 06b shows: `run.json` (every rank's results, both commands,
    where and when it ran) and the 4-rank checkpoint the chapter reshards (`checkpoint/`)."""
    import json
    import platform
    import shutil
    import tempfile
    from datetime import datetime, timezone

    target = Path(target)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_two_nodes(tmp, timeout_s=timeout_s)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        shutil.copytree(Path(result["ranks"][0]["checkpoint"]["path"]), target / "checkpoint")
    for r in result["ranks"]:
        r["checkpoint"]["path"] = "checkpoint"
        r["where"].pop("launcher_pid")
    result["provenance"] = {
        "command": "python -m fsdp_lab.lessons.experiments.two_nodes --record", "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} when it finished", "backend": "gloo"}
    result["commands"] = [c.replace(tmp, "DIR") for c in result["commands"]]
    (target / "run.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def stored_run(path: str | os.PathLike = STORED) -> dict:
    """The stored two-node run (record's run.json), with `checkpoint` the absolute path of its checkpoint."""
    from fsdp_lab.lessons.widgets.stored_runs import stored_run as read

    path = Path(path)
    run = read(path.name, path.parent)
    run["checkpoint"] = str(path / "checkpoint")
    return run


def _rank_main(out: Path) -> None:
    import torch.distributed as dist

    from fsdp_lab.lessons.experiments import beyond_node as bn
    from fsdp_lab.training.launch import die_with_parent

    die_with_parent(os.getppid())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        where = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                 "launcher_pid": os.getppid()}
        result = {"where": where, "meta_init": bn.meta_init(rank, world_size),
                  "hybrid": bn.hybrid_bytes(rank, world_size, nodes=NODES),
                  "offload": bn.offload_cost(rank, world_size),
                  "checkpoint": bn.save_for_reshard(rank, world_size, str(out / "checkpoints"))}
        torch.save(result, out / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="(under torchrun) where this rank writes its results")
    parser.add_argument("--record", action="store_true", help="run both launchers and store the chapter's run")
    args = parser.parse_args()
    if args.record:
        print(record()["provenance"])
    elif args.out is None:
        parser.error("give --record, or --out DIR under torchrun")
    else:
        _rank_main(args.out)
