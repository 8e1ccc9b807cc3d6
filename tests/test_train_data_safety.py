"""`fsdp-lab train` never loses or silently damages work: checkpoints are checksummed and verified, a non-finite
state is never saved, output paths are checked before any rank starts, and a full disk or a closed stdout
costs a warning, not the run. Every case runs the real command in a subprocess."""
import contextlib
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.checkpoint import files

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 150


def train(*argv, timeout=TIMEOUT):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "train", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def no_traceback(err: str) -> None:
    assert "Traceback" not in err and "torch/distributed/elastic" not in err, err


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "64k"):
    """A 64 KiB file system: the real ENOSPC a full disk gives. Needs root (mount); skipped otherwise."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two complete checkpoints (steps 1 and 2) of a 2-rank run."""
    tmp = tmp_path_factory.mktemp("saved")
    code, _out, err, _ = train("--nproc-per-node", 2, "--steps", 2, "--checkpoint-dir", tmp / "ck",
                               "--checkpoint-every", 1, "--timeout", 60)
    assert code == 0, err
    return tmp / "ck"


def copy_of(ck: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ck, tmp_path / "ck"))


def test_checksums_are_recorded_for_every_file(saved):
    meta = json.loads((saved / "step_00000002" / files.META_FILE).read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(meta["checksums"])
    assert all(len(c["sha256"]) == 64 and c["bytes"] > 0 for c in meta["checksums"].values())


def test_garbage_in_a_shard_is_refused_naming_the_file(saved, tmp_path):
    ck = copy_of(saved, tmp_path)
    shard = ck / "step_00000002" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:  # 20 KB of garbage inside the file, its size unchanged
        fh.seek(max(0, size // 2 - 10_000))
        fh.write(os.urandom(min(20_000, size)))
    assert shard.stat().st_size == size
    code, out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--checkpoint-dir", ck, "--resume",
                              "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert f"{shard}: contents changed since the save (SHA-256 differs from fsdp_lab.json)" in err
    assert "step     3/3" not in out and files.read_latest(ck).name == "step_00000002"  # nothing trained or saved
    assert len([line for line in err.splitlines() if "[rank" in line]) == 1  # rank 0 says it, once


def test_truncated_shards_give_one_line_each_naming_the_file(saved, tmp_path):
    ck = copy_of(saved, tmp_path)
    step = ck / "step_00000002"
    for name in ("__0_0.distcp", "__1_0.distcp"):
        os.truncate(step / name, 1000)
    code, _out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--resume", step, "--checkpoint-dir",
                               tmp_path / "new", "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert sum(f"{step / name}: 1000 bytes, the save wrote" in line for line in err.splitlines()) == 1, err
    assert len(err.strip().splitlines()) <= 5, err  # the problems, the advice and the summary: no loader dump


def test_a_truncated_shard_of_an_old_checkpoint_without_checksums_is_still_short(saved, tmp_path):
    ck = copy_of(saved, tmp_path)
    step = ck / "step_00000002"
    meta_path = step / files.META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["checksums"]  # as written before checksums existed
    meta_path.write_text(json.dumps(meta))
    os.truncate(step / "__1_0.distcp", 1000)
    code, _out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--resume", step, "--checkpoint-dir",
                               tmp_path / "new", "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert f"loading {step} failed: rank" in err and len(err.strip().splitlines()) <= 3, err


def test_a_non_finite_state_is_never_saved_nor_made_latest(tmp_path):
    ck = tmp_path / "ck"  # lr 1e30: step 1 is finite, its update overflows step 2's forward into NaN
    code, out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--lr", 1e30, "--checkpoint-dir", ck,
                              "--checkpoint-every", 1, "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert "loss nan" in out
    assert ("checkpoint error: step 2 not saved: model/blocks.0/params holds NaN or inf on rank 0 (2 rank(s) "
            "affected); 'latest' still names step_00000001") in err
    assert files.read_latest(ck).name == "step_00000001" and not (ck / "step_00000002").exists()


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    code, out, err, _ = train("--nproc-per-node", 1, "--steps", 4, "--checkpoint-dir", ck, "--checkpoint-every", 1,
                              "--keep-last", 2, "--timeout", 60)
    assert code == 0, err
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step_00000003", "step_00000004"]
    assert "removed step_00000001 (--keep-last 2)" in out and files.read_latest(ck).name == "step_00000004"


@pytest.mark.parametrize("flag, make, expected", [
    ("--checkpoint-dir", lambda t: (t / "f").write_text("x") and t / "f", "is a file, not a directory"),
    ("--export", lambda t: (t / "f").write_text("x") and t / "f" / "gpt.pt", "is a file, not a directory"),
    ("--json-log", lambda t: (t / "d").mkdir() or t / "d", "is a directory; give a file path"),
    ("--trace", lambda t: (t / "f").write_text("x") and t / "f", "is a file, not a directory"),
])
def test_output_paths_are_checked_before_any_rank_starts(capsys, tmp_path, flag, make, expected):
    path = make(tmp_path)
    code = cli.main(["train", "--nproc-per-node", "2", "--steps", "50", flag, str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"fsdp-lab train: error: {flag} {path}: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_an_unwritable_checkpoint_dir_fails_in_seconds_not_after_training(tmp_path):
    (tmp_path / "file").write_text("x")
    code, out, err, secs = train("--nproc-per-node", 2, "--steps", 500, "--checkpoint-dir", tmp_path / "file" / "ck")
    assert code == 2 and "step " not in out
    assert err.strip() == f"fsdp-lab train: error: --checkpoint-dir {tmp_path / 'file' / 'ck'}: {tmp_path / 'file'} " \
                          f"is a file, not a directory"
    assert secs < 30


def test_json_log_on_a_full_disk_warns_once_and_training_goes_on(tmp_path):
    code, out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--json-log", "/dev/full", "--checkpoint-dir",
                              tmp_path / "ck", "--timeout", 60)
    assert code == 0, err
    no_traceback(err)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: cannot write --json-log /dev/full (OSError: No space left on device); training "
                        "goes on without it"]
    assert "step     3/3" in out and files.read_latest(tmp_path / "ck").name == "step_00000003"


def test_checkpoints_on_a_full_disk_still_fail_loudly(tmp_path):
    with tiny_tmpfs(tmp_path / "small") as small:
        code, out, err, _ = train("--nproc-per-node", 2, "--steps", 2, "--checkpoint-dir", small / "ck",
                                  "--json-log", small / "log.jsonl", "--timeout", 60)
        assert code == 4, err
        no_traceback(err)
        assert "checkpoint error: saving step 2 into" in err and "No space left on device" in err
        assert files.read_latest(small / "ck") is None
        assert "step     2/2" in out  # the JSON log filling the disk did not stop training before the save


def test_train_piped_into_head_warns_once_and_finishes(tmp_path):
    ck = tmp_path / "ck"
    argv = " ".join(map(str, [sys.executable, "-m", "fsdp_lab", "train", "--nproc-per-node", 2, "--steps", 4,
                              "--checkpoint-dir", ck, "--timeout", 60]))
    done = subprocess.run(["bash", "-c", f"{argv} | head -1; echo \"exit ${{PIPESTATUS[0]}}\" >&2"],
                          capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.startswith("fsdp-lab train: GPT 'tiny'") and len(done.stdout.splitlines()) == 1
    err = done.stderr
    assert err.strip().splitlines()[-1] == "exit 0", err
    no_traceback(err)
    assert "BrokenPipeError" in err and err.count("warning: cannot write the training log to stdout") == 1
    assert files.read_latest(ck).name == "step_00000004"


def test_log_every_and_the_progress_bar_only_on_a_terminal():
    """On a terminal (a pty) tqdm draws and a line comes every 10 steps; --log-every sets N."""
    def on_a_pty(*argv):
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
        proc = subprocess.Popen([sys.executable, "-m", "fsdp_lab", "train", "--nproc-per-node", "1", *map(str, argv)],
                                stdout=follower, stderr=follower, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the pty closes when the process ends
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=TIMEOUT) == 0
        os.close(leader)
        text = b"".join(chunks).decode(errors="replace")
        return text, [int(line.split()[1].split("/")[0]) for line in text.replace("\r", "\n").splitlines()
                      if line.startswith("step ")]

    text, steps = on_a_pty("--steps", 12)
    assert steps == [1, 10, 12] and "step/s" in text  # the first, every 10th and the last, beside the bar
    text, steps = on_a_pty("--steps", 6, "--log-every", 2, "--no-progress")
    assert steps == [1, 2, 4, 6] and "step/s" not in text
