"""`fsdp-lab train` never loses or silently damages work: checkpoints are checksummed and verified, a non-finite
state is never saved, output paths are checked before any rank starts, and a full disk or a closed stdout
costs a warning, not the run. Every case runs the real command in a subprocess."""
import contextlib
import fcntl
import json
import os
import pty
import shutil
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


def test_a_checkpoint_without_checksums_is_refused_unless_allowed(saved, tmp_path):
    ck = copy_of(saved, tmp_path)
    step = ck / "step_00000002"
    meta_path = step / files.META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["checksums"]  # as written before checksums existed, or edited to switch verification off
    meta_path.write_text(json.dumps(meta))
    os.truncate(step / "__1_0.distcp", 1000)
    code, out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--checkpoint-dir", ck, "--resume",
                              "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert err.strip() == (f"fsdp-lab train: checkpoint error: {step} is unverifiable: fsdp_lab.json records no "
                           f"checksums, so a damaged shard could not be told from a good one. Refusing it; pass "
                           f"--allow-unverified to load it anyway"), err
    assert "step " not in out
    code, _out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--resume", step, "--allow-unverified",
                               "--checkpoint-dir", tmp_path / "new", "--timeout", 60)
    assert code == 4, err  # asked for: loaded, and the truncated shard still fails the load in one line
    no_traceback(err)
    assert f"loading {step} failed: rank" in err and len(err.strip().splitlines()) <= 3, err


def _latest_missing(ck):
    (ck / files.LATEST).unlink()


def _latest_binary(ck):
    (ck / files.LATEST).write_bytes(bytes(range(128, 256)))


def _latest_behind(ck):
    """The disk filled while `latest` was rewritten: it still names step 1, beside a torn staging file."""
    (ck / files.LATEST).write_text("step_00000001\n")
    (ck / "latest.tmp").write_bytes(b"step_000")


@pytest.mark.parametrize("damage, note", [
    (_latest_missing, "'latest' is missing"),
    (_latest_binary, "latest cannot be read as a step name (UnicodeDecodeError)"),
    (_latest_behind, "'latest' names step_00000001"),
], ids=["missing", "binary", "behind"])
def test_resume_takes_the_newest_complete_checkpoint_whatever_latest_says(saved, tmp_path, damage, note):
    ck = copy_of(saved, tmp_path)
    damage(ck)
    code, out, err, _ = train("--nproc-per-node", 1, "--steps", 3, "--checkpoint-dir", ck, "--resume",
                              "--timeout", 60)
    assert code == 0, err
    no_traceback(err)
    assert f"{note}; resuming from the newest complete checkpoint, step_00000002)" in out, out
    assert "resumed from step 2 (saved by 2 rank(s)" in out and "step     1/3" not in out
    assert files.read_latest(ck).name == "step_00000003" and not (ck / "latest.tmp").exists()


@pytest.mark.parametrize("make, expected", [
    (lambda ck: (ck / files.LATEST).unlink() or (ck / files.LATEST).mkdir(), "latest is a directory, not the file"),
    (lambda ck: shutil.rmtree(ck / "step_00000001") or None, None),
], ids=["latest-a-directory", "resume-an-older-step"])
def test_what_would_collide_with_the_saves_is_named_before_training(saved, tmp_path, make, expected):
    ck = copy_of(saved, tmp_path)
    make(ck)
    resume = ["--resume"] if expected else ["--resume", saved / "step_00000001"]
    code, out, err, _ = train("--nproc-per-node", 1, "--steps", 3, "--checkpoint-dir", ck, *resume, "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert len(err.strip().splitlines()) == 1 and "step " not in out, (out, err)
    expected = expected or (f"{ck} already holds step_00000002 (complete and verified), newer than step 1 where "
                            f"this run starts; continue from its newest checkpoint with --resume (no PATH)")
    assert expected in err, err


def test_a_malformed_manifest_is_one_line(saved, tmp_path):
    ck = copy_of(saved, tmp_path)
    meta_path = ck / "step_00000002" / files.META_FILE
    meta_path.write_text(json.dumps(dict(json.loads(meta_path.read_text()), units=None)))
    code, out, err, _ = train("--nproc-per-node", 1, "--steps", 3, "--checkpoint-dir", ck, "--resume",
                              "--timeout", 60)
    assert code == 4 and "step " not in out, err
    no_traceback(err)
    assert err.strip() == (f"fsdp-lab train: checkpoint error: {meta_path.parent} cannot be loaded: malformed "
                           f"manifest {meta_path}: 'units' should be list, found NoneType None"), err


@pytest.mark.parametrize("flag, target", [
    ("--export", "latest"), ("--export", "step_00000002"), ("--export", "step_00000002/fsdp_lab.json"),
    ("--export", "gpt.pt"), ("--json-log", "step_00000001/__0_0.distcp"), ("--trace", "."),
])
def test_outputs_that_are_the_runs_own_data_are_refused(capsys, saved, tmp_path, flag, target):
    ck = copy_of(saved, tmp_path)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    code = cli.main(["train", "--steps", "3", "--checkpoint-dir", str(ck), "--resume", flag, str(ck / target)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{flag} {ck / target}: inside --checkpoint-dir {ck}, the run's own checkpoints" in err
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before


def test_two_outputs_on_one_file_are_refused(capsys, tmp_path):
    code = cli.main(["train", "--export", str(tmp_path / "x"), "--json-log", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and f"--json-log {tmp_path / 'x'}: the same file as --export" in err, err


def test_a_checkpoint_directory_in_use_by_another_run_is_refused(saved, tmp_path):
    from fsdp_lab.checkpoint.ownership import RunLock

    ck = copy_of(saved, tmp_path)
    with RunLock(ck):
        code, out, err, secs = train("--nproc-per-node", 1, "--steps", 3, "--checkpoint-dir", ck, "--resume",
                                     "--keep-last", 1, "--timeout", 60)
    assert code == 4 and "step " not in out, err
    assert f"checkpoint error: {ck} is in use by another run (pid {os.getpid()} on " in err
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step")) == ["step_00000001", "step_00000002"]


def test_a_non_finite_state_is_never_saved_nor_made_latest(tmp_path):
    ck = tmp_path / "ck"  # lr 1e30: step 1 is finite, its update overflows step 2's forward into NaN
    code, out, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--lr", 1e30, "--checkpoint-dir", ck,
                              "--checkpoint-every", 1, "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert "loss nan" in out
    assert ("checkpoint error: step 2 not saved: model/blocks.0/params holds NaN or inf on rank 0 (2 rank(s) "
            "affected); the newest checkpoint is still step_00000001") in err
    assert files.read_latest(ck).name == "step_00000001" and not (ck / "step_00000002").exists()


def test_keep_last_removes_only_the_runs_own_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    (ck / "step_00000001").mkdir(parents=True)  # the user's own folder, with a checkpoint's name
    (ck / "step_00000001" / "notes.txt").write_text("mine")
    (tmp_path / "kept").mkdir()
    (ck / "step_00000003").symlink_to(tmp_path / "kept")
    code, out, err, _ = train("--nproc-per-node", 1, "--steps", 6, "--checkpoint-dir", ck, "--checkpoint-every", 2,
                              "--keep-last", 2, "--timeout", 60)
    assert code == 0, err
    no_traceback(err)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step")) == [
        "step_00000001", "step_00000003", "step_00000004", "step_00000006"]
    assert "removed step_00000002 (--keep-last 2)" in out and files.read_latest(ck).name == "step_00000006"
    assert (ck / "step_00000001" / "notes.txt").read_text() == "mine" and (tmp_path / "kept").is_dir()


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


def test_a_non_finite_model_never_replaces_a_good_export(tmp_path):
    out = tmp_path / "model.pt"  # a good export of an earlier run: lr 1e30 must not turn it into NaN
    import torch
    torch.save({"w": torch.ones(3)}, out)
    before = out.read_bytes()
    code, stdout, err, _ = train("--nproc-per-node", 2, "--steps", 3, "--lr", 1e30, "--export", out,
                                 "--timeout", 60)
    assert code == 4, err
    no_traceback(err)
    assert "loss nan" in stdout and "exported" not in stdout
    assert (f"checkpoint error: {out} not written: NaN or inf in model/<root>/params, model/blocks.0/params, "
            f"model/blocks.1/params (on rank(s) 0, 1)") in err, err
    assert f"{out} is left as it was" in err
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left beside it
