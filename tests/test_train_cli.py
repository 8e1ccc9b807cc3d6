"""`fsdp-lab train`: flags, exit codes, the per-step output, and resume across world sizes, through the real CLI.

The expensive part is starting ranks, so one 4-rank run (checkpoints, trace, JSON log, export) feeds several
tests, and one 2-rank run resumes it. Option coverage (activation checkpointing, prefetch options, strategies, bf16)
runs in-process on ranks from fsdp_lab.training.launch, where one spawn can train several configurations.
"""
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_lab import cli
from fsdp_lab.checkpoint import files as files
from fsdp_lab.commands import train as train_cmd
from fsdp_lab.observe.trace import rank_file, read_events
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.loop import TrainConfig, build, train
from fsdp_lab.training.models import build_gpt

REPO = Path(__file__).resolve().parents[1]


def fsdp_lab_train(*argv, env=None, timeout=150):
    """Run `python -m fsdp_lab train ...` in a fresh process; return (exit code, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "train", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def cli_exit(capsys, *argv):
    try:
        code = cli.main(["train", *map(str, argv)])
    except SystemExit as exit_:  # argparse rejects a flag by exiting 2
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--steps", "ten"], "--steps: expected a positive integer, got 'ten'"),
    (["--lr", "-1"], "--lr: expected a positive number, got '-1'"),
    (["--strategy", "ZERO4"], "invalid choice: 'ZERO4'"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--nproc-per-node", "4", "--global-batch", "6"], "--global-batch 6 does not divide by the world size 4"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--resume"], "--resume without a path needs --checkpoint-dir"),
    (["--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "head:29500"], "--node-rank 2 must be below --nnodes 2"),
    (["--rdzv-endpoint", "head"], "expected HOST:PORT"),
    (["--timeout", "0"], "--timeout: expected a positive number"),
])
def test_bad_flags_exit_2_and_name_the_flag(capsys, argv, needle):
    code, out = cli_exit(capsys, *argv)
    assert code == 2, out
    assert needle in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    code, out = cli_exit(capsys, "--device", "cuda")
    assert code == 2 and "torch.cuda.is_available() is False" in out


def test_checkpoint_problems_exit_4(capsys, tmp_path):
    code, out = cli_exit(capsys, "--resume", tmp_path / "missing")
    assert code == 4 and "does not exist" in out
    (tmp_path / "ck" / "step_00000003").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000003" / files.DCP_METADATA).write_bytes(b"")
    code, out = cli_exit(capsys, "--checkpoint-dir", tmp_path / "ck", "--resume")
    assert code == 4 and out.strip() == (f"fsdp-lab train: checkpoint error: no complete checkpoint in "
                                         f"{tmp_path / 'ck'}: found step_00000003 (not a complete checkpoint: no "
                                         f"fsdp_lab.json); 'latest' is missing"), out


def test_a_run_into_a_directory_of_checkpoints_without_resume_says_what_is_there(capsys, four_rank_run):
    tmp, (code, _out, err, _secs) = four_rank_run
    assert code == 0, err
    code, out = cli_exit(capsys, "--checkpoint-dir", tmp / "ck")
    assert code == 4 and (f"{tmp / 'ck'} already holds step_00000004 (complete and verified), newer than step 0 "
                          f"where this run starts; continue from its newest checkpoint with --resume") in out, out


def test_print_command_is_a_torchrun_line_that_round_trips(capsys):
    code, out = cli_exit(capsys, "--print-command", "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
                         "--rdzv-endpoint", "head:29500", "--preset", "369m", "--mixed-precision", "bf16",
                         "--forward-prefetch", "--backward-prefetch", "BACKWARD_POST", "--no-limit-all-gathers",
                         "--activation-checkpointing", "--global-batch", "16", "--resume",
                         "--checkpoint-dir", "/shared/ck", "--device", "cuda")
    assert code == 0, out
    argv = shlex.split(out.strip())
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    launcher = " ".join(argv[3:argv.index("fsdp_lab.commands.train")])
    assert "--nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-backend static --rdzv-endpoint head:29500" in launcher
    worker = argv[argv.index("fsdp_lab.commands.train") + 1:]
    parser = __import__("argparse").ArgumentParser()
    train_cmd.add_training_arguments(parser)
    cfg = train_cmd.config_from_args(parser.parse_args(worker))
    assert cfg == dataclasses.replace(TrainConfig(), preset="369m", mixed_precision="bf16", forward_prefetch=True,
                                      backward_prefetch="BACKWARD_POST", limit_all_gathers=False,
                                      activation_checkpointing=True, global_batch=16, resume="latest",
                                      checkpoint_dir="/shared/ck", device="cuda")


def test_prefetch_defaults_are_what_a_torch_fsdp1_user_gets():
    """No flags: backward_prefetch, forward_prefetch and limit_all_gathers take torch FSDP1's constructor
    defaults, and each flag changes exactly its option."""
    import inspect

    from torch.distributed.fsdp import FullyShardedDataParallel

    torch_defaults = {k: p.default for k, p in inspect.signature(FullyShardedDataParallel.__init__).parameters.items()}
    parser = __import__("argparse").ArgumentParser()
    train_cmd.add_training_arguments(parser)
    cfg = train_cmd.config_from_args(parser.parse_args([]))
    assert cfg == TrainConfig()
    assert cfg.backward_prefetch == torch_defaults["backward_prefetch"].name == "BACKWARD_PRE"
    assert cfg.forward_prefetch is torch_defaults["forward_prefetch"] is False
    assert cfg.limit_all_gathers is torch_defaults["limit_all_gathers"] is True
    assert train_cmd.config_from_args(parser.parse_args(["--backward-prefetch", "none"])) == \
        dataclasses.replace(TrainConfig(), backward_prefetch="none")


def test_the_built_model_gets_the_prefetch_options(options):
    """What build() hands FSDP (read back from the model): torch's defaults, and the flags' values."""
    assert options[0]["settings base"] == {"backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False,
                                           "limit_all_gathers": True}
    assert options[0]["settings no backward prefetch"]["backward_prefetch"] is None
    assert options[0]["settings every prefetch option"] == {"backward_prefetch": "BACKWARD_POST",
                                                            "forward_prefetch": True, "limit_all_gathers": False}


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train4")
    result = fsdp_lab_train("--nproc-per-node", 4, "--allow-oversubscribe", "--steps", 4, "--global-batch", 8,
                            "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 2, "--json-log", tmp / "log.jsonl", "--trace",
                            tmp / "trace", "--export", tmp / "gpt.pt", "--timeout", 60)
    return tmp, result


def test_four_ranks_train_and_report_every_step(four_rank_run):
    tmp, (code, out, err, _secs) = four_rank_run
    assert code == 0, err
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("loss" in line and "tok/s" in line and "fsdp state peak" in line for line in step_lines)
    assert "step/s" not in err and "train:   0%" not in err  # stderr is not a terminal: no tqdm frames
    assert "done: 4 steps of tiny on 4 rank(s)" in err
    assert out.splitlines()[0].startswith("fsdp-lab train: GPT 'tiny' (0.1M parameters), 4 rank(s) on cpu")
    log = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    for record in log:
        assert record["tokens_per_s"] > 0 and record["world_size"] == 4
        assert record["memory"]["total"] > 0 and record["memory"]["peak_total"] >= record["memory"]["params_sharded"]
    assert log[-1]["loss"] < log[0]["loss"]


def test_trace_and_checkpoints_are_written(four_rank_run):
    tmp, (code, _out, err, _secs) = four_rank_run
    assert code == 0, err
    for rank in range(4):
        events = read_events(rank_file(tmp / "trace", rank))
        names = {e["event"] for e in events}
        assert {"gather_start", "free", "reduce_scatter", "optimizer_step"} <= names
        assert {e["step"] for e in events} == {0, 1, 2, 3}  # the trace counts completed steps
    assert files.read_latest(tmp / "ck").name == "step_00000004"
    assert (tmp / "ck" / "step_00000002" / files.META_FILE).is_file()


def test_export_loads_into_the_plain_gpt(four_rank_run):
    tmp, (code, _out, err, _secs) = four_rank_run
    assert code == 0, err
    state = torch.load(tmp / "gpt.pt", weights_only=True)
    plain = build_gpt("tiny")
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state, strict=True)


def test_resume_on_two_ranks_continues_the_four_rank_loss_curve(four_rank_run, tmp_path):
    tmp, (code, _out, err, _secs) = four_rank_run
    assert code == 0, err
    code, out, err, _secs = fsdp_lab_train("--nproc-per-node", 2, "--steps", 4, "--global-batch", 8,
                                           "--resume", tmp / "ck" / "step_00000002", "--checkpoint-dir",
                                           tmp_path / "ck2", "--json-log", tmp_path / "log.jsonl", "--export",
                                           tmp_path / "gpt.pt", "--no-progress", "--timeout", 60)
    assert code == 0, err
    assert "resumed from step 2 (saved by 4 rank(s), FULL_SHARD), now 2 rank(s)" in out
    four = {r["step"]: r["loss"] for r in map(json.loads, (tmp / "log.jsonl").read_text().splitlines())}
    two = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())}
    assert sorted(two) == [3, 4]
    for step in (3, 4):
        assert two[step] == pytest.approx(four[step], rel=1e-5), (step, two[step], four[step])
    a, b = torch.load(tmp / "gpt.pt"), torch.load(tmp_path / "gpt.pt")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert files.read_latest(tmp_path / "ck2").name == "step_00000004"


def _options(rank, world_size, tmp):
    """Train the same 3 steps under several option sets on one 2-rank group; return losses, and how often each
    block's MLP ran (a recomputed block runs it twice per step: forward, and again inside backward)."""
    from fsdp_lab.training import models

    calls = {"mlp": 0}
    original = models.MLP.forward

    def counting_forward(self, x):
        calls["mlp"] += 1
        return original(self, x)

    models.MLP.forward = counting_forward
    base = TrainConfig(steps=3, global_batch=4, lr=1e-2, progress=False)
    variants = {"base": base,
                "activation_checkpointing": dataclasses.replace(base, activation_checkpointing=True),
                "no backward prefetch": dataclasses.replace(base, backward_prefetch="none"),
                "every prefetch option": dataclasses.replace(base, forward_prefetch=True,
                                                             backward_prefetch="BACKWARD_POST", limit_all_gathers=False),
                "SHARD_GRAD_OP": dataclasses.replace(base, strategy="SHARD_GRAD_OP"),
                "ZERO1": dataclasses.replace(base, strategy="ZERO1"),
                "NO_SHARD": dataclasses.replace(base, strategy="NO_SHARD"),
                "bf16": dataclasses.replace(base, mixed_precision="bf16")}
    out = {}
    try:
        with open(os.devnull, "w") as quiet:
            for name, cfg in variants.items():
                before = calls["mlp"]
                out[name] = [r["loss"] for r in train(rank, world_size, cfg, out=quiet)]
                out[name + " mlp runs"] = calls["mlp"] - before
                ctx = build(cfg, torch.device("cpu"))[0]._ctx
                out["settings " + name] = {"backward_prefetch": getattr(ctx.backward_prefetch, "name", None),
                                           "forward_prefetch": ctx.forward_prefetch,
                                           "limit_all_gathers": ctx.limit_all_gathers}
    finally:
        models.MLP.forward = original
    return out


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("options")
    return run_on_ranks(_options, 2, str(tmp), timeout_s=180, collective_timeout_s=60, threads_per_rank=1)


def test_activation_checkpointing_recomputes_and_matches(options):
    for result in options:
        assert result["base mlp runs"] == 3 * 2  # 3 steps x 2 blocks
        assert result["activation_checkpointing mlp runs"] == 2 * 3 * 2  # each block recomputed in backward
        assert result["activation_checkpointing"] == pytest.approx(result["base"], rel=1e-6)


@pytest.mark.parametrize("variant", ["no backward prefetch", "every prefetch option", "SHARD_GRAD_OP", "ZERO1",
                                     "NO_SHARD"])
def test_options_that_must_not_change_the_math(options, variant):
    assert options[0][variant] == pytest.approx(options[0]["base"], rel=1e-5)


def test_bf16_trains_close_to_fp32(options):
    bf16, base = options[0]["bf16"], options[0]["base"]
    assert bf16 != base and bf16 == pytest.approx(base, rel=2e-2)
    assert bf16[-1] < bf16[0]


@pytest.fixture
def silent_listener():
    """A port that accepts connections and never answers: another program, or a head node that hung."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_a_rendezvous_port_in_use_is_one_line_before_any_rank_starts(silent_listener):
    code, out, err, _secs = fsdp_lab_train("--steps", 1, "--rdzv-endpoint", silent_listener)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == (f"fsdp-lab train: error: --rdzv-endpoint {silent_listener}: port "
                           f"{silent_listener.rsplit(':', 1)[1]} is already in use on this machine (another job, or "
                           f"an earlier run still ending); pick a free port"), err


def test_a_c10d_rendezvous_against_a_silent_listener_ends_at_its_deadline(silent_listener):
    code, out, err, secs = fsdp_lab_train("--steps", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint", silent_listener,
                                          "--rdzv-timeout", 5, timeout=120)
    assert code == 3 and "Traceback" not in err, err
    assert err.strip() == (f"fsdp-lab train: failed (exit 3): the rendezvous at {silent_listener} did not complete "
                           f"within --rdzv-timeout 5 s: nothing there answered, or the other nodes never joined"), err
    assert "step " not in out


def test_a_c10d_rendezvous_that_answers_trains(tmp_path):
    from fsdp_lab.training.launch import free_port

    code, out, err, _secs = fsdp_lab_train("--steps", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                           f"127.0.0.1:{free_port()}", "--rdzv-timeout", 120, "--no-progress")
    assert code == 0, err
    assert "step     1/1" in out


def test_a_preset_too_big_for_this_machines_memory_is_refused_with_both_numbers():
    """The real machine, in a fresh process (tests/test_host_memory.py fakes a small one)."""
    from fsdp_lab.training.host_memory import available_memory, process_baseline, train_need
    from fsdp_lab.training.loop import TrainConfig

    need = train_need(TrainConfig(preset="1.3b", steps=1), 1, 1, process_baseline())
    assert need.state >= 16 * 1.3e9  # 16 bytes per parameter, one rank holding all of them
    free = available_memory()
    if free is None or need.total <= free.bytes:
        pytest.skip(f"this machine has {free} available: 1.3b fits")
    code, out, err, secs = fsdp_lab_train("--preset", "1.3b", "--steps", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "this run needs about " in err and " GB of host memory" in err and " GB is available (" in err, err
    assert err.strip().endswith("or add --allow-low-memory"), err
    assert "fsdp-lab train: GPT" not in out  # refused before the banner, before any rank
