"""Live ranks (fsdp_lab.lessons.live): ipyparallel engines as gloo ranks that keep their state across cells.

One handle serves the module (starting two engines costs about 10 s on a loaded 2-core machine); the tests run
in file order, and the ones that break the group restart it. Every wait inside Ranks has a deadline; the
deadlines here are generous, and the assertions check what was reported, not how fast.
"""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from fsdp_lab.lessons.live import Ranks, RanksFailed, RanksState, RankStatus
from fsdp_lab.lessons.live.magic import parse_args, register
from fsdp_lab.lessons.live.ranks import stack_of_current_thread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ranks():
    handle = Ranks(2, timeout_s=60, start_timeout_s=150)
    handle.start()
    yield handle
    handle.stop()


def alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_start_makes_every_engine_a_rank_of_one_gloo_group(ranks):
    assert ranks.state is RanksState.READY and ranks.startup_s > 0
    run = ranks.run("import torch, torch.distributed as dist\n"
                    "t = torch.tensor([rank + 1.0])\n"
                    "dist.all_reduce(t)\n"
                    "print(dist.get_rank(), dist.get_world_size(), t.item())")
    assert run.ok, run.failures()
    assert [o.stdout.split() for o in run.outputs] == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def test_state_lives_across_cells_and_output_is_labelled_by_rank(ranks):
    ranks.run("x = rank * 10")
    run = ranks.run("print('x is', x)\nx + 1")
    assert run.render().splitlines() == ["[rank 0] x is 0", "[rank 0] Out: 1", "[rank 1] x is 10",
                                         "[rank 1] Out: 11"]
    assert ranks.pull("x") == [0, 10]
    ranks.push(y=5)
    assert ranks.pull("y") == [5, 5]


def test_a_rank_that_raises_is_named_with_its_error_and_the_group_survives(ranks):
    run = ranks.run("print('before')\nif rank == 1:\n    raise ValueError('bad shard 42')\nprint('after')")
    assert run.by_rank(0).status is RankStatus.OK and run.by_rank(0).stdout.split() == ["before", "after"]
    assert run.by_rank(1).status is RankStatus.RAISED
    assert run.failures().startswith("rank 1 raised an exception: ValueError: bad shard 42")
    assert "raise ValueError" in run.failures()  # the learner's line, from the remote traceback
    assert ranks.state is RanksState.READY
    with pytest.raises(RanksFailed, match="rank 1 raised an exception: ValueError: bad shard 42"):
        ranks.run_or_raise("if rank == 1: raise ValueError('bad shard 42')")
    assert ranks.run("print(rank)").ok


def test_the_magic_runs_the_cell_on_every_rank_and_raises_naming_the_rank(ranks, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    register(ranks, shell=shell)
    ok = shell.run_cell("%%ranks\nprint('hello from', rank)")
    assert ok.success and capsys.readouterr().out.splitlines() == ["[rank 0] hello from 0",
                                                                   "[rank 1] hello from 1"]
    only = shell.run_cell("%%ranks --rank 1\nprint('only', rank)")
    assert only.success and capsys.readouterr().out.splitlines() == ["[rank 1] only 1"]
    bad = shell.run_cell("%%ranks\nif rank == 0: 1/0")
    assert isinstance(bad.error_in_exec, RanksFailed)
    assert str(bad.error_in_exec).startswith("rank 0 raised an exception: ZeroDivisionError")


def test_magic_arguments_are_checked():
    assert parse_args("--timeout 5 --rank 0 --rank 1").rank == [0, 1]
    with pytest.raises(ValueError, match="does not know '--timout 5'"):
        parse_args("--timout 5")
    with pytest.raises(ValueError, match="must be positive, got -1"):
        parse_args("--timeout -1")


def test_a_rank_that_hangs_is_reported_by_rank_and_line_within_the_timeout(ranks):
    began = time.monotonic()
    run = ranks.run("import time\nprint('started')\nif rank == 1:\n    time.sleep(600)\nprint('done')",
                    timeout_s=4)
    waited = time.monotonic() - began
    assert waited < 60, f"a 4 s timeout took {waited:.0f} s to report"
    hung = run.by_rank(1)
    assert hung.status is RankStatus.HUNG and run.by_rank(0).status is RankStatus.OK
    assert "rank 1 did not finish in time: still running after 4 s" in run.failures()
    assert "cell, line 4 in <module>" in hung.where, hung.where  # the sleep, from the rank's own stack
    assert ranks.state is RanksState.BROKEN
    with pytest.raises(RanksFailed, match=r"broken since an earlier cell:\nrank 1 did not finish"):
        ranks.run("print(rank)")
    old = list(ranks.pids[:2])
    ranks.restart()
    assert ranks.state is RanksState.READY and not alive(old)
    run = ranks.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
    assert run.ok and [o.stdout.strip() for o in run.outputs] == ["2.0", "2.0"]


def test_interrupting_the_cell_interrupts_the_ranks_and_asks_for_a_restart(ranks):
    """The notebook's stop button raises KeyboardInterrupt in the kernel: the ranks are interrupted as well."""
    import os
    import signal
    import threading

    timer = threading.Timer(3.0, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ranks.run("import time\ntime.sleep(600)", timeout_s=120)
    finally:
        timer.cancel()
    assert ranks.state is RanksState.BROKEN and "interrupted while rank(s) [0, 1]" in ranks.broken_because
    ranks.restart()
    assert ranks.run("print(rank)").ok


def test_a_rank_that_dies_is_reported_with_its_exit_code(ranks):
    run = ranks.run("import os\nif rank == 0:\n    os._exit(7)\nprint('still here')", timeout_s=30)
    assert run.by_rank(0).status is RankStatus.DIED
    assert "rank 0 died: its process ended with exit code 7" in run.failures()
    assert run.by_rank(1).stdout.strip() == "still here"
    assert ranks.state is RanksState.BROKEN
    ranks.restart()
    assert ranks.run("print(rank)").ok


def test_a_peer_stuck_in_a_collective_is_reported_too(ranks):
    """Rank 1 dies before the all-reduce; rank 0 is then waiting on it: both are reported, neither blocks."""
    run = ranks.run("import os, torch, torch.distributed as dist\n"
                    "if rank == 1:\n    os._exit(3)\n"
                    "dist.all_reduce(torch.ones(1))", timeout_s=8)
    assert run.by_rank(1).status is RankStatus.DIED
    assert run.by_rank(0).status in (RankStatus.HUNG, RankStatus.RAISED)  # gloo may notice the closed socket
    ranks.restart()
    assert ranks.run("print(rank)").ok


def test_stop_leaves_no_process_and_a_stopped_handle_refuses_cells():
    handle = Ranks(2, start_timeout_s=150).start()
    pids = handle.all_pids()
    assert len(handle.pids) == 3 and len(alive(pids)) == len(pids) > 3  # 2 engines, the controller, their helpers
    trace_dir = handle.trace_dir
    assert trace_dir.is_dir()
    handle.stop()
    assert alive(pids) == [] and handle.state is RanksState.STOPPED and not trace_dir.exists()
    with pytest.raises(RanksFailed, match="not running"):
        handle.run("print(1)")


def test_stop_removes_the_output_files_before_ipyparallel_does_and_logs_no_error():
    """[Note: output files go first]: when ipyparallel's stop runs, the controller's and the engines' output files
    are already gone, so neither of its two removers can fail and log "Failed to remove ...log"."""
    import logging

    handle = Ranks(2, start_timeout_s=150).start()
    cluster = handle._cluster
    files = [launcher.output_file for launcher in [cluster.controller, *handle._launchers()]]
    assert files and all(Path(f).is_file() for f in files)
    left_at_stop = []
    real_stop = cluster.stop_cluster_sync
    cluster.stop_cluster_sync = lambda: (left_at_stop.extend(f for f in files if Path(f).exists()), real_stop())
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    cluster.log.addHandler(handler)
    try:
        handle.stop()
    finally:
        cluster.log.removeHandler(handler)
    assert left_at_stop == [] and not any(Path(f).exists() for f in files)
    assert [r.getMessage() for r in records] == []


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        Ranks(0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        Ranks(2, timeout_s=0)


def test_the_stack_reader_keeps_the_learners_frames_only():
    dump = ('Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 1 in wait\n\n'
            'Current thread 0x02 (most recent call first):\n'
            '  File "/tmp/ipykernel_9/123.py", line 3 in f\n'
            '  File "/tmp/ipykernel_9/456.py", line 7 in <module>\n'
            '  File "/v/IPython/core/interactiveshell.py", line 3823 in run_code\n')
    assert stack_of_current_thread(dump).splitlines() == ["    cell, line 3 in f", "    cell, line 7 in <module>"]


def test_a_kernel_killed_without_cleanup_leaves_no_ranks_behind(tmp_path):
    """SIGKILL skips atexit: each engine's watchdog sees its parent go and ends itself and the controller."""
    import json
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text("import json, sys, time\n"
                      "from fsdp_lab.lessons.live import Ranks\n"
                      "r = Ranks(2, start_timeout_s=150).start()\n"
                      "print(json.dumps([r.all_pids(), str(r.trace_dir)]), flush=True)\n"
                      "time.sleep(600)\n")
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = kernel.stdout.readline()  # bounded by the pytest timeout; Ranks.start has its own deadline
        pids, trace_dir = json.loads(line)
        assert len(alive(pids)) == len(pids) > 3
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(timeout=30)
    deadline = time.monotonic() + 60
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == [], f"left running 60 s after the kernel died: {alive(pids)}"
    assert not Path(trace_dir).exists(), "the ranks' temporary directory outlived the kernel"
