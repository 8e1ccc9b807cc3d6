"""`fsdp-lab train`: train the course GPT with fsdp_lab on 1..N processes, one or many nodes, through torchrun.

The command checks every flag first (exit 2 with the flag named), then runs torchrun (`torch.distributed.run`,
in this process) which starts `python -m fsdp_lab.commands.train <flags>` once per rank and watches them. When a rank
dies, torchrun stops the others within about a second; a rank that hangs makes its peers' collectives fail after
--timeout seconds. Either way the job ends, and this command names the rank that caused it.

Exit codes (also in --help):
    0  ok                     2  bad flags / cannot run here     4  checkpoint could not be saved, found or loaded
    1  unexpected error (bug) 3  a rank died or hung, or a collective failed   130  Ctrl-C   143  SIGTERM
                              128+N  another signal N, named (129: SIGHUP, a closed terminal)

Ctrl-C or SIGTERM (`timeout`, a scheduler) stops every rank; checkpoints are atomic, so `latest` keeps naming
the last complete one. torchrun's own log lines (W.../E... from torch.distributed.elastic) are silenced unless
LOGLEVEL is set: this command prints one line saying what happened.
"""
from __future__ import annotations

import argparse
import enum
import logging
import os
import shlex
import signal
import sys
import traceback
from datetime import timedelta

from fsdp_lab.commands import _exit_codes as exit_codes
from fsdp_lab.commands import _rendezvous
from fsdp_lab.commands._argtypes import count, path_text, positive_float, positive_int
from fsdp_lab.commands._paths import first_problem, output_dir_problem, output_file_problem
from fsdp_lab.commands._ranks import (add_low_memory_flag, add_oversubscribe_flag, low_memory_problem,
                                     oversubscribe_problem)

NAME = "train"
HELP = "Train the course GPT with fsdp_lab on 1..N processes (torchrun), with sharded checkpoints."
EPILOG = """exit codes: 0 ok; 1 unexpected error (a bug, traceback printed); 2 bad flags or a configuration that
cannot run here; 3 a rank died, or a collective failed or timed out; 4 a checkpoint could not be saved, found or
loaded; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM); 128+N stopped by another signal N (129: SIGHUP).
Each rank can also be started directly: torchrun ... -m fsdp_lab.commands.train <training flags>."""


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1          # an unexpected Python error (a bug): its traceback is printed
    USAGE = exit_codes.USAGE  # bad flags, or a configuration that cannot run here
    RANK_FAILED = 3    # a rank died, or a collective failed or timed out (a peer is gone or stuck)
    CHECKPOINT = 4     # a checkpoint could not be saved, found or loaded
    INTERRUPTED = exit_codes.INTERRUPTED  # Ctrl-C; the signal codes every subcommand shares
    TERMINATED = exit_codes.TERMINATED    # SIGTERM, e.g. from `timeout` or a batch scheduler


# A rank's own exit code when a collective timed out (a peer stopped answering), so the launcher can tell a hung
# peer from a vanished one; the command itself then exits RANK_FAILED.
RANK_COLLECTIVE_TIMEOUT = 5


def _endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. node001:29500), got {text!r}")
    return text


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_lab.runtime.core.strategy import ShardingStrategy
    from fsdp_lab.training.loop import BACKWARD_PREFETCH_CHOICES
    from fsdp_lab.training.models import PRESETS

    g = parser.add_argument_group("training")
    g.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size (default tiny)")
    g.add_argument("--strategy", "--sharding-strategy", dest="strategy", choices=list(ShardingStrategy.__members__),
                   default="FULL_SHARD", help="FULL_SHARD (ZeRO-3, default), SHARD_GRAD_OP (ZeRO-2), ZERO1, NO_SHARD "
                   "(DDP); HYBRID_SHARD / _HYBRID_SHARD_ZERO2: FULL_SHARD / SHARD_GRAD_OP inside each node "
                   "(--nproc-per-node ranks), replicated across the --nnodes nodes")
    g.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: gather and compute in bf16, reduce gradients in fp32, fp32 masters (default fp32)")
    g.add_argument("--backward-prefetch", choices=BACKWARD_PREFETCH_CHOICES, default="BACKWARD_PRE",
                   help="when backward issues the next unit's re-gather (default BACKWARD_PRE, torch FSDP's; none: "
                        "on demand)")
    g.add_argument("--forward-prefetch", action="store_true",
                   help="issue the next unit's gather before this unit's forward compute (torch's default: off)")
    g.add_argument("--no-limit-all-gathers", dest="limit_all_gathers", action="store_false",
                   help="do not bound the unsharded units alive at once (torch's default limit_all_gathers=True)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each Block's forward during backward (non-reentrant torch.utils.checkpoint)")
    g.add_argument("--steps", type=positive_int, default=10, help="train until this step (default 10)")
    g.add_argument("--global-batch", type=positive_int, default=8,
                   help="sequences per step over all ranks; must divide by the world size (default 8)")
    g.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    g.add_argument("--seed", type=count, default=0, help="weight initialisation seed (default 0)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo) or cuda (NCCL, one GPU per rank: device LOCAL_RANK) (default cpu)")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto: gloo on cpu, nccl on cuda. gloo with --device cuda runs several ranks on one GPU")
    g.add_argument("--timeout", type=positive_float, default=300.0,
                   help="collective timeout in seconds: a stuck or vanished peer fails the job after this long")
    g.add_argument("--trace", type=path_text, metavar="DIR",
                   help="write each rank's lifecycle trace to DIR/rank{r}.jsonl")
    g.add_argument("--json-log", type=path_text, metavar="PATH",
                   help="rank 0 writes one JSON line per step (loss, tokens/s, memory)")
    g.add_argument("--checkpoint-dir", type=path_text, metavar="DIR",
                   help="sharded checkpoints go to DIR/step_N, DIR/latest")
    g.add_argument("--checkpoint-every", type=count, default=0, metavar="K",
                   help="save every K steps (and after the last step); 0: only after the last step")
    g.add_argument("--resume", nargs="?", const="latest", type=path_text, metavar="PATH",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (starts at 0 if there is "
                        "none yet), or from PATH (a step directory, or a checkpoint directory's newest); the world "
                        "size and strategy may differ from the run that saved it. Every file is verified against "
                        "the checksums in its manifest first")
    g.add_argument("--allow-unverified", action="store_true",
                   help="resume even from a checkpoint whose manifest records no checksums (written by hand or by "
                        "an old fsdp_lab): its shards cannot be verified, so damage would load silently")
    g.add_argument("--export", type=path_text, metavar="PATH",
                   help="after training, write the full state dict (original names, fp32) for the plain GPT")
    g.add_argument("--keep-last", type=count, default=0, metavar="K",
                   help="after each save keep only the newest K checkpoints this run wrote (0: keep all); other "
                        "folders, links and other runs' checkpoints are never removed")
    g.add_argument("--log-every", type=count, default=0, metavar="N",
                   help="print a step line every N steps (and the first and last); 0: every step, or every "
                        "10 beside the progress bar")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no tqdm progress bar (it is only drawn on a terminal anyway)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    g = parser.add_argument_group("processes (passed to torchrun)")
    g.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks on this node (default 1)")
    add_oversubscribe_flag(g)
    add_low_memory_flag(g)
    g.add_argument("--nnodes", type=positive_int, default=1, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=count, default=0, help="this node's index, 0..nnodes-1 (default 0)")
    g.add_argument("--rdzv-endpoint", type=_endpoint, metavar="HOST:PORT",
                   help="rendezvous address, the same on every node (needed when --nnodes > 1)")
    g.add_argument("--rdzv-backend", choices=["static", "c10d"], default="static",
                   help="static: --node-rank decides each node's ranks (default); c10d: elastic rendezvous")
    g.add_argument("--rdzv-id", default="fsdp-lab", help="job id for the c10d rendezvous (default fsdp-lab)")
    g.add_argument("--rdzv-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="with --rdzv-endpoint: fail (exit 3) if this node's ranks have not started after this long, "
                        "e.g. the endpoint accepts connections but never answers (default 600, torch's join timeout)")
    g.add_argument("--print-command", action="store_true",
                   help="print the equivalent torchrun command line and exit")
    add_training_arguments(parser)


def config_from_args(args):
    from fsdp_lab.training.loop import TrainConfig

    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def torchrun_argv(args, cfg) -> list[str]:
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes)]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        argv += ["--standalone"]
    else:
        argv += ["--node-rank", str(args.node_rank), "--rdzv-backend", args.rdzv_backend,
                 "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    return argv + ["-m", "fsdp_lab.commands.train", *cfg.to_argv()]


def _usage(message: str) -> int:
    print(f"fsdp-lab train: error: {message}", file=sys.stderr)
    return int(ExitCode.USAGE)


def _check(args, cfg, machine: bool = True) -> int | None:
    """Everything that can be known before starting processes; returns an exit code or None. With
    machine=False (--print-command: the command may be meant for another machine) only the flags are checked."""
    import torch

    from fsdp_lab.checkpoint.files import CheckpointError
    from fsdp_lab.training.loop import check_checkpoints

    world = args.nproc_per_node * args.nnodes
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return _usage(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.node_rank >= args.nnodes:
        return _usage(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if cfg.global_batch % world:
        return _usage(f"--global-batch {cfg.global_batch} does not divide by the world size {world} "
                      f"({args.nnodes} node(s) x {args.nproc_per_node} process(es)); each rank needs equal rows")
    if not machine:
        return None
    problem = oversubscribe_problem(args.nproc_per_node, args.allow_oversubscribe)
    if problem:
        return _usage(problem)
    if args.rdzv_endpoint and args.node_rank == 0 and args.rdzv_backend == "static":
        problem = _rendezvous.port_problem("--rdzv-endpoint", args.rdzv_endpoint)  # node 0 hosts the store there
        if problem:
            return _usage(problem)
    problem = first_problem(output_dir_problem("--checkpoint-dir", cfg.checkpoint_dir),
                            output_file_problem("--export", cfg.export),
                            output_file_problem("--json-log", cfg.json_log),
                            output_dir_problem("--trace", cfg.trace))
    if problem:
        return _usage(problem)
    if cfg.device == "cpu":  # [Note: no more memory than is free] in fsdp_lab/commands/_ranks.py
        from fsdp_lab.training.host_memory import process_baseline, train_need

        problem = low_memory_problem(train_need(cfg, world, args.nproc_per_node, process_baseline()),
                                     args.allow_low_memory)
        if problem:
            return _usage(problem)
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            return _usage("--device cuda, but torch.cuda.is_available() is False on this machine; use --device cpu")
        gpus = torch.cuda.device_count()
        if cfg.backend in ("auto", "nccl") and args.nproc_per_node > gpus:
            return _usage(f"--nproc-per-node {args.nproc_per_node} but this node has {gpus} GPU(s), and NCCL "
                          f"refuses two ranks on one GPU; use at most {gpus} or add --backend gloo")
    try:
        check_checkpoints(cfg)
    except CheckpointError as err:
        print(f"fsdp-lab train: checkpoint error: {err}", file=sys.stderr)
        return int(ExitCode.CHECKPOINT)
    return None


def explain_failure(failures: dict, timeout_s: float | None = None) -> tuple[ExitCode, str]:
    """Pick the rank that caused a failed job from torchrun's {global rank: ProcessFailure}. torchrun's own
    "root cause" is the earliest exit, often a healthy rank that noticed its peer vanish, so prefer a rank that
    died unexplained, then a rank that hung (its peers' collectives timed out waiting for it; torchrun then
    stopped it with SIGTERM, or SIGKILL if it did not react), then one that crashed, then checkpoint and usage
    errors; SIGTERM alone is torchrun stopping a healthy rank."""
    def code(f):
        return f.exitcode

    def describe(rank, f):
        how = f"was killed by {f.signal_name()}" if code(f) < 0 else f"exited with code {code(f)}"
        return f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}"

    stopped = (-int(signal.SIGTERM), -int(signal.SIGKILL))
    timed_out = {r: f for r, f in failures.items() if code(f) == RANK_COLLECTIVE_TIMEOUT}
    hung = {r: f for r, f in failures.items() if timed_out and code(f) in stopped}
    if hung:
        rank, waiter = min(hung), min(timed_out)
        f = hung[rank]
        limit = f"--timeout {timeout_s:g} s" if timeout_s else "--timeout"
        return ExitCode.RANK_FAILED, (f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) hung: it stopped "
                                      f"answering, rank {waiter}'s collective timed out after {limit} waiting "
                                      f"for it, and the job was stopped")
    known = (1, 2, 3, 4, RANK_COLLECTIVE_TIMEOUT, 130, -int(signal.SIGTERM))
    died = {r: f for r, f in failures.items() if code(f) not in known}
    for pool, exit_code, why in (
            (died, ExitCode.RANK_FAILED, "it died without reporting an error; the other ranks were stopped"),
            ({r: f for r, f in failures.items() if code(f) == 1}, ExitCode.ERROR, "Python error, traceback above"),
            ({r: f for r, f in failures.items() if code(f) == 4}, ExitCode.CHECKPOINT, "checkpoint error above"),
            ({r: f for r, f in failures.items() if code(f) == 2}, ExitCode.USAGE, "configuration error above"),
            ({r: f for r, f in failures.items() if code(f) in (3, RANK_COLLECTIVE_TIMEOUT)}, ExitCode.RANK_FAILED,
             "a collective failed or timed out: a peer (maybe on another node) died or stopped answering"),
            ({r: f for r, f in failures.items() if code(f) == 130}, ExitCode.INTERRUPTED, "interrupted")):
        if pool:
            rank = min(pool)
            return exit_code, f"{describe(rank, pool[rank])}: {why}"
    rank = min(failures)
    return ExitCode.RANK_FAILED, f"{describe(rank, failures[rank])}: stopped"


def _quiet_torchrun_logs() -> None:
    """torchrun logs W/E lines ("Sending process 123 closing signal SIGTERM", "failed (exitcode: 3)") that
    duplicate, in torch's words, the one line this command prints. LOGLEVEL set by the user wins."""
    if "LOGLEVEL" in os.environ:
        return
    os.environ["LOGLEVEL"] = "CRITICAL"  # read by torch.distributed.elastic's loggers when they are created
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _last_checkpoint(cfg) -> str:
    from fsdp_lab.checkpoint.trust import published

    if not cfg.checkpoint_dir:
        return "no --checkpoint-dir, nothing was saved"
    newest = published(cfg.checkpoint_dir)
    return f"last complete checkpoint: {newest[0].path}" if newest else \
        f"no checkpoint was completed in {cfg.checkpoint_dir}"


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        return _usage(str(err))
    code = _check(args, cfg, machine=not args.print_command)
    if code is not None:
        return code
    argv = torchrun_argv(args, cfg)
    if args.print_command:
        print(shlex.join([sys.executable, "-m", "torch.distributed.run", *argv]))
        return int(ExitCode.OK)
    from fsdp_lab.training.launch import LAUNCHER_PID_ENV

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # torchrun runs in this process and starts the ranks
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    world = args.nproc_per_node * args.nnodes
    from fsdp_lab.training.estimate import banner

    print(banner(cfg, world), flush=True)
    _quiet_torchrun_logs()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    deadline = _rendezvous.watch(args.rdzv_endpoint, args.rdzv_timeout, int(ExitCode.RANK_FAILED)) \
        if args.rdzv_endpoint else None
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as err:
        exit_code, message = explain_failure(err.failures, cfg.timeout)
        print(f"fsdp-lab train: failed (exit {int(exit_code)}): {message}", file=sys.stderr, flush=True)
        return int(exit_code)
    except (KeyboardInterrupt, SignalException) as err:
        # torchrun turns SIGINT/SIGTERM/SIGHUP/SIGQUIT into SignalException after sending it to every rank
        exit_code, what = exit_codes.for_signal(getattr(err, "sigval", signal.SIGINT))
        print(f"fsdp-lab train: {what}: all ranks stopped; {_last_checkpoint(cfg)}", file=sys.stderr, flush=True)
        return exit_code
    except Exception as err:  # torchrun's own failures (the rendezvous, the store) are one line, not a traceback
        if not type(err).__module__.startswith("torch.distributed"):
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        where = f" at {args.rdzv_endpoint}" if args.rdzv_endpoint else ""
        print(f"fsdp-lab train: failed (exit {int(ExitCode.RANK_FAILED)}): torchrun could not start the ranks; the "
              f"rendezvous{where} failed: {type(err).__name__}: {first}", file=sys.stderr, flush=True)
        return int(ExitCode.RANK_FAILED)
    finally:
        if deadline is not None:
            deadline.set()
    print(f"fsdp-lab train: done: {cfg.steps} steps of {cfg.preset} on {world} rank(s), {cfg.strategy}",
          file=sys.stderr)
    return int(ExitCode.OK)


def _is_collective_error(err: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):  # fsdp_lab's CollectiveFailed is one too
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "nccl", "Connection", "Timed out", "timed out", "peer", "Socket"))


def _print_collective_log(err: BaseException) -> None:
    """The collective log's report of where every rank was (fsdp_lab/runtime/core/collective_log.py), printed by
    the lowest rank that failed, so the job shows it once."""
    while err is not None and not getattr(err, "collective_log", ""):
        err = err.__cause__ or err.__context__
    if err is not None and getattr(err, "prints_collective_log", False):
        try:
            print(f"collective log: {err.collective_log}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass


def _exit(code: int, message: str | None) -> None:
    """Leave now: a rank whose peers are gone could hang in destroy_process_group or in atexit handlers."""
    for stream, text in ((sys.stderr, message), (sys.stdout, None)):
        try:
            if text:
                print(text, file=stream)
            stream.flush()
        except (OSError, ValueError):  # a closed pipe must not turn this exit into a traceback
            pass
    os._exit(int(code))


def worker_entry(argv: list[str]) -> int:
    """One rank: `python -m fsdp_lab.commands.train <training flags>` under torchrun (or alone: a world of one)."""
    from fsdp_lab.training.launch import die_with_parent

    if "RANK" in os.environ:  # started by a launcher: end with it ([Note: ranks die with their launcher])
        die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m fsdp_lab.commands.train", epilog=EPILOG)
    add_training_arguments(parser)
    try:
        cfg = config_from_args(parser.parse_args(argv))
    except ValueError as err:
        return _usage(str(err))
    import torch
    import torch.distributed as dist

    from fsdp_lab.checkpoint.files import CheckpointError
    from fsdp_lab.training.loop import train

    if "RANK" not in os.environ:
        from fsdp_lab.training.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count()))
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cfg.device == "cuda" else "gloo")
    from fsdp_lab.runtime.core import collective_log

    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout))
        try:
            train(rank, world_size, cfg)
        except BaseException as err:  # peers still waiting name this rank by its last collective
            collective_log.post_all("raised", type(err).__name__)
            raise
        collective_log.post_all("finished")
    except CheckpointError as err:  # an error every rank raised is printed once, by rank 0
        _exit(ExitCode.CHECKPOINT, f"[rank {rank}] checkpoint error: {err}" if rank == 0 or not err.every_rank
              else None)
    except ValueError as err:
        _exit(ExitCode.USAGE, f"[rank {rank}] {err}")
    except KeyboardInterrupt:  # the launcher prints the one line
        _exit(ExitCode.INTERRUPTED, None)
    except Exception as err:  # every failure must become an exit code, never a hang
        where = f" in step {err.fsdp_lab_step}" if getattr(err, "fsdp_lab_step", None) else ""
        if _is_collective_error(err):
            first = (str(err).strip().splitlines() or [""])[-1]
            _print_collective_log(err)
            if "timed out" in str(err).lower():
                _exit(RANK_COLLECTIVE_TIMEOUT, f"[rank {rank}] a collective timed out{where}: a peer did not "
                                               f"answer within --timeout {cfg.timeout:g} s ({first})")
            _exit(ExitCode.RANK_FAILED, f"[rank {rank}] a collective failed{where} (a peer rank died, or did not "
                                        f"answer within --timeout {cfg.timeout:g} s): {first}")
        traceback.print_exc()
        _exit(ExitCode.ERROR, f"[rank {rank}] crashed{where}: {type(err).__name__}: {err}")
    dist.destroy_process_group()
    # The work is done and flushed. Skip interpreter teardown: a native thread dying there (seen once as
    # "terminate called without an active exception", SIGABRT after a complete run) would turn a finished job
    # into a failed one.
    _exit(ExitCode.OK, None)


if __name__ == "__main__":
    sys.exit(worker_entry(sys.argv[1:]))
