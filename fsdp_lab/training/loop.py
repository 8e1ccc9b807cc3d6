"""The training loop each rank runs: the course GPT under fsdp_lab.FSDP, AdamW, sharded checkpoints.

`fsdp-lab train` (fsdp_lab/commands/train.py) validates the flags and starts one process per rank through
torchrun; each runs `python -m fsdp_lab.commands.train <flags>` (fsdp_lab.commands.train.worker_entry). Tests and
notebooks call `train(rank, world_size, cfg)` directly on ranks started by fsdp_lab.training.launch.run_on_ranks.

[Note: same data on any world size] Step s trains on models.batch_for_step(cfg, s, global_batch): the same
global batch whatever N is; rank r takes rows [r·B/N, (r+1)·B/N). Each rank's loss is the mean over its rows,
the reduce-scatter averages the gradients over ranks, so every N computes the gradient of the same global mean
loss, and a run resumed on another world size continues the same loss curve (up to fp32 summation order).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_lab import checkpoint
from fsdp_lab.checkpoint.files import CheckpointError
from fsdp_lab.checkpoint.sharded import on_rank0
from fsdp_lab.checkpoint.ownership import RunLock, check_unlocked, output_problem, prunable, remove_checkpoint, \
    save_conflict
from fsdp_lab.observe.trace import Tracer, rank_file
from fsdp_lab.runtime.core.mixed_precision import MixedPrecision
from fsdp_lab.runtime.core.side_collectives import issue
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy
from fsdp_lab.runtime.features.activation_checkpointing import apply_activation_checkpointing
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.launch import node_mesh
from fsdp_lab.training.log_output import WarnOnceWriter
from fsdp_lab.training.models import PRESETS, Block, batch_for_step, build_gpt, rank_slice


BACKWARD_PREFETCH_CHOICES = ("BACKWARD_PRE", "BACKWARD_POST", "none")  # "none": backward_prefetch=None
NEGATED_FLAGS = {"progress": "--no-progress", "limit_all_gathers": "--no-limit-all-gathers"}  # on by default


@dataclass(frozen=True)
class TrainConfig:
    """Everything one rank needs to train; the flags of `fsdp-lab train` map one to one onto these fields."""
    preset: str = "tiny"
    strategy: str = "FULL_SHARD"
    mixed_precision: str = "fp32"
    # FSDP's prefetch options, with torch FSDP1's defaults (what a torch user gets without naming them)
    backward_prefetch: str = "BACKWARD_PRE"  # or "BACKWARD_POST", or "none" (backward_prefetch=None)
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    activation_checkpointing: bool = False
    steps: int = 10
    global_batch: int = 8
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    timeout: float = 300.0
    trace: Optional[str] = None
    json_log: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: Optional[str] = None  # "latest" (in checkpoint_dir) or a checkpoint path
    export: Optional[str] = None
    progress: bool = True
    log_every: int = 0  # 0: every step without a progress bar, every AUTO_LOG_EVERY steps beside one
    keep_last: int = 0  # 0: keep every checkpoint; K: remove all but the newest K after each save
    allow_unverified: bool = False  # resume from a checkpoint whose manifest records no checksums

    def __post_init__(self):
        for flag, value, allowed in (("preset", self.preset, tuple(PRESETS)),
                                     ("strategy", self.strategy, tuple(ShardingStrategy.__members__)),
                                     ("mixed-precision", self.mixed_precision, ("fp32", "bf16")),
                                     ("device", self.device, ("cpu", "cuda")),
                                     ("backend", self.backend, ("auto", "gloo", "nccl")),
                                     ("backward-prefetch", self.backward_prefetch, BACKWARD_PREFETCH_CHOICES)):
            if value not in allowed:
                raise ValueError(f"--{flag} {value!r}: expected one of {', '.join(allowed)}")
        for flag, value in (("steps", self.steps), ("global-batch", self.global_batch)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{flag} {value!r}: expected a positive integer")
        for flag, value in (("lr", self.lr), ("timeout", self.timeout)):
            if not 0 < value < float("inf"):
                raise ValueError(f"--{flag}: expected a positive number, got {value!r}")
        for flag, value in (("log-every", self.log_every), ("keep-last", self.keep_last)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"--{flag} {value!r}: expected 0 or a positive integer")
        if self.keep_last and not self.checkpoint_dir:
            raise ValueError("--keep-last needs --checkpoint-dir (where the checkpoints are)")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every}: expected 0 or a positive number of steps")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir (where to save)")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise ValueError("--resume without a path needs --checkpoint-dir (whose 'latest' to resume from)")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
        problem = output_problem({"--export": self.export, "--json-log": self.json_log, "--trace": self.trace},
                                 self.checkpoint_dir, self.resume)
        if problem:
            raise ValueError(problem)

    def save_steps(self, start: int) -> list[int]:
        """The steps after `start` whose state this run saves."""
        if not self.checkpoint_dir:
            return []
        every = self.checkpoint_every
        return [s for s in range(start + 1, self.steps + 1) if s == self.steps or (every and s % every == 0)]

    def to_argv(self) -> list[str]:
        """The flags that rebuild this config (what the launcher hands each rank)."""
        argv = []
        for name, value in asdict(self).items():
            flag = "--" + name.replace("_", "-")
            if name in NEGATED_FLAGS:  # on by default: the flag turns it off
                argv += [] if value else [NEGATED_FLAGS[name]]
            elif isinstance(value, bool):
                argv += [flag] if value else []
            elif value is not None:
                argv += [flag, str(value)]
        return argv


AUTO_LOG_EVERY = 10  # a log line every 10 steps when a progress bar shows the others

FAULT_ENV = "FSDP_LAB_FAULT"
FAULT_EXIT = 17


@dataclass(frozen=True)
class Fault:
    """A failure injected on purpose, for the robustness tests and the chapter 06 demo:
    FSDP_LAB_FAULT=KIND:RANK:STEP with KIND one of
      die          the rank exits (code 17) in the middle of step STEP, after forward, before backward
      hang         the rank stops answering in the middle of step STEP (its peers hit --timeout)
      die-in-save  the rank exits in the checkpoint save after step STEP, once its own files are written"""
    kind: str
    rank: int
    step: int

    @classmethod
    def from_env(cls, env=None) -> Optional["Fault"]:
        text = (env if env is not None else os.environ).get(FAULT_ENV, "")
        if not text:
            return None
        kind, *numbers = text.split(":")
        if kind not in ("die", "hang", "die-in-save") or len(numbers) != 2 or not all(n.isdigit() for n in numbers):
            raise ValueError(f"{FAULT_ENV}={text!r}: expected KIND:RANK:STEP with KIND die, hang or die-in-save")
        return cls(kind, int(numbers[0]), int(numbers[1]))

    def fire(self, kind: str, rank: int, step: int) -> None:
        if (kind, rank, step) != (self.kind, self.rank, self.step):
            return
        print(f"[rank {rank}] {FAULT_ENV}: simulating '{kind}' at step {step}", file=sys.stderr, flush=True)
        if kind == "hang":
            time.sleep(10 ** 6)
        os._exit(FAULT_EXIT)


def _dying_writer(fault: Fault, rank: int, step: int, path: str):
    from torch.distributed.checkpoint import FileSystemWriter

    class DieAfterWrite(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()  # this rank's files are on disk: now die, before the save is published
            fault.fire("die-in-save", rank, step)
            return future

    return DieAfterWrite(path)


class _PeakTracer(Tracer):
    """The step's highest count of FSDP's live bytes (params, grads, optimizer state; not activations) over its
    lifecycle events: the CPU stand-in for torch.cuda.max_memory_allocated."""

    peak = 0  # reset by each step; an int, so an instance's update never touches the class

    def emit(self, *args, **kwargs):
        record = super().emit(*args, **kwargs)
        self.peak = max(self.peak, record["mem"].get("total", 0))
        return record


def build(cfg: TrainConfig, device: torch.device):
    mp = MixedPrecision(torch.bfloat16, torch.float32) if cfg.mixed_precision == "bf16" else None
    model = FSDP(build_gpt(cfg.preset, seed=cfg.seed), sharding_strategy=cfg.strategy,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp,
                 device_mesh=node_mesh(cfg.strategy, device), device_id=device if device.type == "cuda" else None,
                 forward_prefetch=cfg.forward_prefetch,
                 backward_prefetch=None if cfg.backward_prefetch == "none" else BackwardPrefetch[cfg.backward_prefetch],
                 limit_all_gathers=cfg.limit_all_gathers)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return model, optimizer


def resume_from(cfg: TrainConfig, deep: bool = False):
    """The checkpoint --resume means (a trust.Found), or None when there is none yet (a first run with --resume
    and an empty or absent --checkpoint-dir). CheckpointError when what is there cannot be loaded."""
    if cfg.resume is None:
        return None
    if cfg.resume == "latest" and not os.path.lexists(cfg.checkpoint_dir):
        return None
    return checkpoint.find(cfg.checkpoint_dir if cfg.resume == "latest" else cfg.resume, cfg.allow_unverified, deep)


def check_checkpoints(cfg: TrainConfig) -> None:
    """What the launcher can know before any rank starts: the checkpoint to resume from, that no other run holds
    --checkpoint-dir, and that the saves ahead collide with nothing there. CheckpointError otherwise."""
    found = resume_from(cfg)
    if cfg.checkpoint_dir:
        check_unlocked(cfg.checkpoint_dir)
        start = found.meta["step"] if found else 0
        _refuse(save_conflict(cfg.checkpoint_dir, start, cfg.save_steps(start)))


def _claim(cfg: TrainConfig, lock: RunLock | None) -> str:
    """Lock the checkpoint directory on rank 0 ([Note: one run per checkpoint directory] in
    fsdp_lab/checkpoint/ownership.py); return a fresh run id, the same on every rank."""
    def claim():
        if lock is not None:
            lock.acquire()
        return uuid.uuid4().hex
    return on_rank0(claim)


def _resume(cfg: TrainConfig, model, optimizer, say) -> tuple[int, dict | None]:
    """(the step to continue from, the checkpoint's manifest or None), once the saves ahead are known not to
    collide with anything in --checkpoint-dir."""
    meta = None
    if cfg.resume is not None:
        path = cfg.checkpoint_dir if cfg.resume == "latest" else cfg.resume

        def newest() -> str | None:
            found = resume_from(cfg)
            return str(found.step_dir) if found else None

        def lock_source() -> None:
            if reading is not None:
                reading.acquire()

        found = on_rank0(newest)
        source = Path(found).parent if found else None
        reading = RunLock(source, reading=True) if source and dist.get_rank() == 0 \
            and not _same_dir(source, cfg.checkpoint_dir) else None
        if found:
            try:  # a run saving into the source directory must not prune the checkpoint while it is read
                on_rank0(lock_source)
                meta = checkpoint.load(model, optimizer, path, allow_unverified=cfg.allow_unverified)
            finally:
                if reading is not None:
                    reading.release()
        else:
            say(f"no checkpoint in {path} yet: starting at step 0")
    start = int(meta["step"]) if meta else 0
    if cfg.checkpoint_dir:
        on_rank0(lambda: _refuse(save_conflict(cfg.checkpoint_dir, start, cfg.save_steps(start))))
    if meta:
        saved = (meta.get("extra") or {}).get("train_config") or {}
        changed = {k: (saved[k], v) for k, v in asdict(cfg).items() if k in ("lr", "global_batch", "seed")
                   and k in saved and saved[k] != v}
        note = (f"; changed since the save: {changed}" if changed else "") + \
            (f" ({meta['note']})" if meta.get("note") else "")
        say(f"resumed from step {meta['step']} (saved by {meta['world_size']} rank(s), {meta['strategy']}), now "
            f"{model.world_size} rank(s), {model.sharding_strategy.name}{note}")
    return start, meta


def _same_dir(a: Path, b) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def _refuse(problem: str | None) -> None:
    if problem:
        raise CheckpointError(problem)


def _run_id(cfg: TrainConfig, meta: dict | None, fresh: str) -> str:
    """The run a resumed checkpoint belongs to, when it lies in --checkpoint-dir (the same run continues), else
    `fresh` ([Note: the run marker] in fsdp_lab/checkpoint/ownership.py)."""
    if meta and meta.get("run") and cfg.checkpoint_dir and cfg.resume:
        source = Path(cfg.checkpoint_dir if cfg.resume == "latest" else cfg.resume).resolve()
        if Path(cfg.checkpoint_dir).resolve() in (source, source.parent):
            return meta["run"]
    return fresh


def _memory(model, optimizer, tracer, device) -> dict:
    mem = model.memory_report(optimizer).as_dict()
    if model._ctx.tracer is tracer:  # per-event accounting is on (always on CPU)
        mem["peak_total"] = tracer.peak
    if device.type == "cuda":
        mem["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        mem["cuda_reserved"] = torch.cuda.memory_reserved(device)
    return mem


def _step(model, optimizer, cfg: TrainConfig, step: int, rank: int, world_size: int, device, tracer, fault) -> dict:
    """One optimizer step on this rank's slice of global batch number step-1; the loss is averaged over ranks."""
    t0 = time.perf_counter()
    tracer.peak = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x, y = batch_for_step(PRESETS[cfg.preset], step - 1, cfg.global_batch)
    x, y = rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)
    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)
    if fault:
        fault.fire("die", rank, step)
        fault.fire("hang", rank, step)
    loss.backward()
    optimizer.step()
    total = loss.detach().float().reshape(1).clone()
    issue(dist.all_reduce, total, phase="loss")
    loss_value = total.item() / world_size  # .item() waits for the GPU: the time below is the real step time
    dt = time.perf_counter() - t0
    return {"step": step, "loss": loss_value, "tokens_per_s": x.numel() * world_size / dt,
            "step_time_s": dt, "world_size": world_size, "t": time.time(),
            "memory": _memory(model, optimizer, tracer, device)}


def show_progress_bar(cfg: TrainConfig, rank: int, stream=None) -> bool:
    """tqdm only on rank 0 and only on a terminal: in a log file or a pipe its frames are noise."""
    stream = stream or sys.stderr
    return rank == 0 and cfg.progress and hasattr(stream, "isatty") and stream.isatty()


def log_interval(cfg: TrainConfig, bar_shown: bool) -> int:
    return cfg.log_every or (AUTO_LOG_EVERY if bar_shown else 1)


def train(rank: int, world_size: int, cfg: TrainConfig, out=None) -> list[dict]:
    """Train on an initialised process group; return one record per step run (the same on every rank)."""
    fault = Fault.from_env()
    if cfg.global_batch % world_size:
        raise ValueError(f"--global-batch {cfg.global_batch} does not divide by the world size {world_size}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # one GPU per rank; with gloo, ranks may share GPUs
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cfg.device == "cuda" else None
    device = device or torch.device("cpu")
    console = WarnOnceWriter(out or sys.stdout, "the training log to stdout") if rank == 0 else WarnOnceWriter(None, "")
    lock = RunLock(cfg.checkpoint_dir) if cfg.checkpoint_dir and rank == 0 else None
    try:
        fresh_run = _claim(cfg, lock)
        model, optimizer = build(cfg, device)
        start, meta = _resume(cfg, model, optimizer, console.write_line)
        return _train_from(rank, world_size, cfg, model, optimizer, device, console, start,
                           _run_id(cfg, meta, fresh_run), fault)
    finally:
        if lock is not None:
            lock.release()


def _train_from(rank, world_size, cfg, model, optimizer, device, console, start, run, fault) -> list[dict]:
    """The steps after `start`, saving (as run `run`) and pruning as the flags say."""
    from tqdm import tqdm

    tracer = _PeakTracer(rank_file(cfg.trace, rank) if cfg.trace else None, rank=rank, model=model,
                         optimizer=optimizer, keep_in_memory=False)
    tracer.step = start
    if cfg.trace or device.type == "cpu":  # per-event memory accounting costs CPU time; on CUDA ask the allocator
        model.set_tracer(tracer)
    log = WarnOnceWriter(None, "")
    if cfg.json_log and rank == 0:
        Path(cfg.json_log).parent.mkdir(parents=True, exist_ok=True)
        log = WarnOnceWriter(open(cfg.json_log, "a" if start else "w", encoding="utf-8"), f"--json-log {cfg.json_log}")
    bar_shown = show_progress_bar(cfg, rank)
    every = log_interval(cfg, bar_shown)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not bar_shown)

    def say(text: str) -> None:
        with tqdm.external_write_mode(file=sys.stderr):  # lift the bar off the terminal while the line prints
            console.write_line(text)

    records, step = [], start
    if start >= cfg.steps:
        say(f"the checkpoint is at step {start} and --steps is {cfg.steps}: nothing to train")
    try:
        for step in range(start + 1, cfg.steps + 1):
            record = _step(model, optimizer, cfg, step, rank, world_size, device, tracer, fault)
            records.append(record)
            if rank == 0:
                mem = record["memory"]
                peak = f"cuda peak {mem['cuda_max_allocated'] / 2**20:,.1f} MiB" if "cuda_max_allocated" in mem \
                    else f"fsdp state peak {mem['peak_total'] / 2**20:,.2f} MiB"
                if step == start + 1 or step == cfg.steps or step % every == 0:
                    say(f"step {step:>5}/{cfg.steps}  loss {record['loss']:.4f}  {record['tokens_per_s']:>9,.0f} "
                        f"tok/s  {record['step_time_s'] * 1000:7.1f} ms  {peak}")
                log.write_line(json.dumps(record))
            bar.update(1)
            checkpoint_every = cfg.checkpoint_every
            if cfg.checkpoint_dir and (step == cfg.steps or (checkpoint_every and step % checkpoint_every == 0)):
                factory = functools.partial(_dying_writer, fault, rank, step) if fault else None
                t0 = time.perf_counter()
                path = checkpoint.save(model, optimizer, cfg.checkpoint_dir, step,
                                       extra={"train_config": asdict(cfg)}, writer_factory=factory, run=run)
                if rank == 0:
                    removed = prunable(cfg.checkpoint_dir, run, cfg.keep_last) if cfg.keep_last else []
                    for old in removed:
                        remove_checkpoint(old)
                    note = f"; removed {', '.join(p.name for p in removed)} (--keep-last {cfg.keep_last})" \
                        if removed else ""
                    say(f"saved {path} in {time.perf_counter() - t0:.2f} s{note}")
        if cfg.export:
            written = checkpoint.export_full_state_dict(model, cfg.export)
            if rank == 0:
                say(f"exported the full state dict ({written} tensors) to {cfg.export}")
    except BaseException as err:
        err.fsdp_lab_step = step  # the worker names the step in its one-line error
        raise
    finally:
        bar.close()
        model.set_tracer(None)
        tracer.close()
        log.close()
    return records
