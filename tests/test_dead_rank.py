"""A rank that dies or hangs mid-step ends the whole job quickly with a message naming it: never a hang.

The failures are injected with FSDP_LAB_FAULT=KIND:RANK:STEP (see fsdp_lab.training.loop.Fault). Each job gets a hard
subprocess timeout far above what it should need; the assertions on wall time are the real check.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from fsdp_lab import checkpoint
from fsdp_lab.checkpoint import files as files
from fsdp_lab.training.loop import FAULT_EXIT

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = 150  # the subprocess is killed after this; the job must end far sooner


def fsdp_lab_train(*argv, env, timeout):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "train", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, **env})
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def test_a_rank_that_dies_mid_step_stops_the_job_and_is_named(tmp_path):
    code, out, err, secs = fsdp_lab_train("--nproc-per-node", 2, "--steps", 5, "--json-log", tmp_path / "log.jsonl",
                                          "--no-progress", "--timeout", 120,
                                          env={"FSDP_LAB_FAULT": "die:1:2"}, timeout=JOB_TIMEOUT)
    assert code == 3, err
    assert "rank 1 (local rank 1, pid" in err and f"exited with code {FAULT_EXIT}" in err
    assert "it died without reporting an error; the other ranks were stopped" in err
    # rank 0 is stopped as soon as torchrun sees rank 1's death; whether it first noticed the broken collective is a
    # race, so its line is optional, but whatever it printed must be that one-line report, never a traceback
    rank0_lines = [line for line in err.splitlines() if line.startswith("[rank 0]")]
    assert all(line.startswith("[rank 0] a collective failed in step 2") for line in rank0_lines), err
    assert "Traceback" not in err, err
    assert "torch/distributed/elastic" not in err  # torchrun's W/E lines do not pad the one-line error
    # torchrun notices the death at once: the 120 s collective timeout is never waited for
    assert secs < 60, f"the job took {secs:.0f} s to end"
    assert [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == [1]
    assert "step     1/5" in out and "step     2/5" not in out


def test_a_rank_that_hangs_is_reported_as_hung_after_the_collective_timeout():
    code, _out, err, secs = fsdp_lab_train("--nproc-per-node", 2, "--steps", 5, "--no-progress", "--timeout", 3,
                                           env={"FSDP_LAB_FAULT": "hang:1:2"}, timeout=JOB_TIMEOUT)
    assert code == 3, err
    assert "[rank 0] a collective timed out in step 2: a peer did not answer within --timeout 3 s" in err
    # the collective log is on by default in fsdp-lab train: rank 0 names where it waits and the silent rank
    assert re.search(r"^collective log: rank 0 waits in (all_gather|reduce_scatter) #\d+ \([\w.]+, (forward|"
                     r"backward)\); rank 1 did not report \(dead, or stuck outside a collective\)$", err, re.M), err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("fsdp-lab train: failed (exit 3): rank 1 (local rank 1, pid"), err
    assert "hung: it stopped answering, rank 0's collective timed out after --timeout 3 s" in summary
    assert "SIGKILL" not in err and "SIGTERM" not in err and "torch/distributed/elastic" not in err
    assert secs < 60, f"the job took {secs:.0f} s to end"


def test_explain_failure_names_a_hung_rank_that_had_to_be_killed():
    """torchrun escalates to SIGKILL when a hung rank ignores SIGTERM: still a hang, not a mysterious kill."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from fsdp_lab.commands.train import RANK_COLLECTIVE_TIMEOUT, explain_failure

    def failure(rank, exitcode):
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")

    code, message = explain_failure({0: failure(0, RANK_COLLECTIVE_TIMEOUT), 1: failure(1, -9)}, 30.0)
    assert code == 3 and message.startswith("rank 1 (local rank 1, pid 101) hung: it stopped answering, rank 0's "
                                            "collective timed out after --timeout 30 s")
    code, message = explain_failure({0: failure(0, 3), 1: failure(1, -9)}, 30.0)  # kill -9 without a timeout
    assert code == 3 and "rank 1 (local rank 1, pid 101) was killed by SIGKILL: it died" in message


def test_a_rank_killed_inside_a_save_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    code, _out, err, secs = fsdp_lab_train("--nproc-per-node", 2, "--steps", 4, "--checkpoint-dir", ck,
                                           "--checkpoint-every", 2, "--no-progress", "--timeout", 120,
                                           env={"FSDP_LAB_FAULT": "die-in-save:1:4"}, timeout=JOB_TIMEOUT)
    assert code == 3, err
    assert "rank 1 (local rank 1" in err and secs < 60
    assert files.read_latest(ck).name == "step_00000002"
    half = files.tmp_dir(ck, 4)
    assert (half / "__1_0.distcp").is_file() and not (half / files.DCP_METADATA).exists()
    meta = checkpoint.export_checkpoint(ck, tmp_path / "gpt.pt")  # the previous checkpoint still loads
    assert meta["step"] == 2
