"""Run a function on N real processes joined by a gloo (or NCCL) process group, from a test, a notebook or the CLI.

Ranks are spawned (not forked), so the function must be importable by module path: define it in a package
module, not in a notebook cell. A rank that raises, dies or hangs fails the whole run within `timeout_s` with its
traceback or exit code in the message, and every other rank is killed: nothing is left running.

[Note: ranks die with their launcher] A launcher killed with SIGKILL runs no cleanup, and torchrun starts each
rank in a session of its own, so nothing would stop the ranks: they would train on as orphans, still writing
checkpoints. So each rank asks the kernel, first thing, for SIGKILL when its parent dies
(prctl(PR_SET_PDEATHSIG), Linux). The parent may already have died before that call, so the rank then checks
that its parent is still the launcher whose pid it was handed (FSDP_LAB_LAUNCHER_PID) and exits at once if not.
The kernel sends the signal when the parent *thread* that started the rank ends: both torchrun and
run_on_ranks start ranks from the thread that then waits for them.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

LAUNCHER_PID_ENV = "FSDP_LAB_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
ORPHAN_EXIT = 129      # what a rank exits with when it finds its launcher gone (128 + SIGHUP, as a lost terminal)


class RankFailed(RuntimeError):
    pass


def die_with_parent(launcher_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent dies ([Note: ranks die with their launcher]);
    if the parent is no longer `launcher_pid` (default: $FSDP_LAB_LAUNCHER_PID), it died already: exit now. Call
    it before anything slow. Returns False where prctl is unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if launcher_pid is None and os.environ.get(LAUNCHER_PID_ENV, "").isdigit():
        launcher_pid = int(os.environ[LAUNCHER_PID_ENV])
    if launcher_pid is not None and os.getppid() != launcher_pid:
        os._exit(ORPHAN_EXIT)
    return armed


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one): what a count of rank
    processes is checked against ([Note: no more ranks than cores] in fsdp_lab/commands/_ranks.py)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started inside ignore SIGINT: a child inherits the ignored disposition and Python keeps it,
    so Ctrl-C (sent by a terminal to the whole process group) reaches only the parent, which stops the
    children itself, instead of every rank printing its own KeyboardInterrupt traceback. The parent blocks
    SIGINT meanwhile rather than dropping it: a Ctrl-C pressed while the ranks start is delivered (as
    KeyboardInterrupt) once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def set_rank_device(local_rank: int, cuda=None):
    """Make GPU `local_rank` (modulo the GPUs there are) the current CUDA device, before anything is built: event
    waits, NCCL and DCP's object collectives use the current device. Returns it, or None without CUDA. `cuda` is
    torch.cuda; tests pass a stand-in."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available() or cuda.device_count() == 0:
        return None
    index = local_rank % cuda.device_count()
    cuda.set_device(index)
    return index


def _worker(fn, rank, world_size, port, backend, collective_timeout_s, threads, args, results, launcher_pid):
    die_with_parent(launcher_pid)
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        set_rank_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=collective_timeout_s))
        from fsdp_lab.runtime.core import collective_log

        try:
            out = fn(rank, world_size, *args)
        except BaseException as err:  # peers waiting on this rank name it by its last collective
            collective_log.post_all("raised", type(err).__name__)
            raise
        else:
            collective_log.post_all("finished")
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: torch's queue would share tensors by file descriptor, gone once the rank exits.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put(("error", rank, traceback.format_exc()))


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = 180.0, backend: str = "gloo",
                 collective_timeout_s: float = 60.0, threads_per_rank: int | None = None) -> list:
    """Call fn(rank, world_size, *args) on `world_size` processes; return their results ordered by rank."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, collective_timeout_s, threads,
                                                args, results, os.getpid()), daemon=True) for r in range(world_size)]
    with children_ignore_sigint():
        for p in procs:
            p.start()
    outputs, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankFailed(f"rank(s) {dead} died without reporting (exit codes {codes})")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s; all ranks killed")
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    return [outputs[r] for r in range(world_size)]


def node_mesh(strategy: str, device):
    """Under the hybrid strategies, the 2-D mesh (nodes, ranks per node): shard inside a node, replicate across
    nodes. The ranks per node are torchrun's LOCAL_WORLD_SIZE (one node when run alone); torchrun numbers a
    node's ranks consecutively, which is checked. None for the other strategies (one group of every rank)."""
    if strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node, local_rank = int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", rank))
    if world % local or rank != node * local + local_rank:
        raise ValueError(f"--strategy {strategy} shards inside a node: it needs every node to run the same number "
                         f"of ranks, numbered node by node, but rank {rank} of {world} is local rank {local_rank} "
                         f"of {local} on node {node}")
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))
