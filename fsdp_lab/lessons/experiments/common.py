"""What every experiment shares: one picklable description of a run, and the training loop each rank executes.

Experiments run on real processes (fsdp_lab.training.launch.run_on_ranks), so everything handed to a rank is plain data
(a frozen dataclass of strings, numbers and torch dtypes) and everything a rank returns is plain data too
(lists and dicts of numbers and strings): a notebook, a test, the CLI and the GPU recording script can all call
the same experiment and print, plot or compare what comes back.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from fsdp_lab.observe import trace as trace_mod
from fsdp_lab.runtime import FSDP, MixedPrecision
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy, coerce_enum
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.models import PRESETS, Block, GPTConfig, batch_for_step, build_gpt, rank_slice

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
DTYPES = {"fp32": None, "bf16": BF16}


def mixed_precision_for(dtype: Union[str, MixedPrecision, None]) -> Optional[MixedPrecision]:
    """"fp32" → no policy, "bf16" → bf16 compute and communication with fp32 reduction; a policy passes through."""
    if dtype is None or isinstance(dtype, MixedPrecision):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or a MixedPrecision")
    return DTYPES[dtype]


def config_for(preset: Union[str, GPTConfig]) -> GPTConfig:
    if isinstance(preset, GPTConfig):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)} or a GPTConfig")
    return PRESETS[preset]


@dataclass(frozen=True)
class RunSpec:
    """One training run of the course GPT under FSDP, as every rank will execute it."""

    strategy: str = "FULL_SHARD"
    preset: Union[str, GPTConfig] = "tiny"
    mixed_precision: Union[str, MixedPrecision, None] = None  # "fp32", "bf16" or a policy; stored as a policy
    steps: int = 1
    global_batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    forward_prefetch: bool = False  # torch's defaults, as FSDP(...) gives them
    backward_prefetch: Optional[str] = "BACKWARD_PRE"
    trace: bool = True
    trace_dir: Optional[str] = None
    step_sleep_s: float = 0.0
    device: str = "cpu"
    cuda_snapshot: Optional[str] = None  # rank 0 writes a CUDA memory snapshot of the whole run here
    micro_batches: int = 1  # gradient accumulation: each rank's batch in K micro-batches, one optimizer step
    no_sync: bool = True  # the first K-1 micro-batches under model.no_sync() ([Note: accumulation and no_sync])

    def __post_init__(self):
        coerce_enum(self.strategy, ShardingStrategy, "sharding_strategy")
        coerce_enum(self.backward_prefetch, BackwardPrefetch, "backward_prefetch")
        object.__setattr__(self, "mixed_precision", mixed_precision_for(self.mixed_precision))
        config_for(self.preset)
        if self.steps < 1 or self.global_batch < 1 or self.seq_len < 1:
            raise ValueError(f"steps, global_batch and seq_len must be >= 1: {self.steps}, {self.global_batch}, "
                             f"{self.seq_len}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.cuda_snapshot and self.device != "cuda":
            raise ValueError(f"cuda_snapshot={self.cuda_snapshot!r} needs device='cuda', got {self.device!r}")

    def with_(self, **changes) -> "RunSpec":
        return replace(self, **changes)


def build_model(spec: RunSpec) -> FSDP:
    """The course GPT, one unit per Block plus the root, wrapped as `spec` says (same weights on every rank)."""
    base = build_gpt(config_for(spec.preset))
    device_id = None
    if spec.device == "cuda":
        device_id = torch.cuda.current_device()
    return FSDP(base, sharding_strategy=spec.strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                mixed_precision=spec.mixed_precision, forward_prefetch=spec.forward_prefetch,
                backward_prefetch=spec.backward_prefetch, device_id=device_id)


def unit_table(model: FSDP) -> list[dict]:
    """One row per unit (innermost first, root last): numel, padded numel, shard numel, bytes of the gathered copy."""
    rows = []
    for unit in model.units:
        for flat in unit.flats:
            rows.append({"unit": unit.name, "is_root": unit.is_root, "requires_grad": flat.requires_grad,
                         "numel": flat.numel, "padded_numel": flat.padded_numel,
                         "shard_numel": flat.shard_numel, "full_bytes": flat.full_bytes,
                         "full_dtype": str(flat.full.dtype).replace("torch.", "")})
    return rows


def step_tensor_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of AdamW's per-parameter 'step' counters (0-d tensors): state the 16Φ formulas do not count."""
    return sum(s["step"].untyped_storage().nbytes() for s in optimizer.state.values()
               if isinstance(s.get("step"), torch.Tensor))


@contextlib.contextmanager
def gradient_sync_off(model):
    """No gradient communication for the backwards inside: FSDP1's and DDP's `no_sync()`, or an FSDP2 model's
    `set_requires_gradient_sync(False)` until the context ends."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def accumulation_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                      micro_batches: int = 1, no_sync: bool = True) -> torch.Tensor:
    """One optimizer step over this rank's batch cut into `micro_batches` equal micro-batches; the mean loss
    (a 0-d tensor: the caller's .item() is what waits for the GPU).

    [Note: accumulation and no_sync] Each micro-batch's loss is divided by K, so the summed gradients are the
    whole batch's mean. With no_sync the first K-1 backwards run under `model.no_sync()` (torch FSDP1; FSDP2's
    `set_requires_gradient_sync(False)`; DDP's `no_sync()`; `model` may be any of them: see gradient_sync_off):
    gradients accumulate locally, unsharded, and only the last backward reduces. FULL_SHARD still frees its
    parameters after each forward and backward (torch's default, `reshard_after_backward=True`; the root alone stays
    gathered between its forward and backward), so every micro-batch gathers twice: 2K gathers and one
    reduce-scatter per step, against DDP's one all-reduce, (2K+1)/2 of DDP's bytes. Without no_sync every
    micro-batch also reduces (FSDP 3K passes, DDP 2K): the ratio stays 1.5 whatever K is. tests/test_wire.py
    measures both on the wire, for fsdp_lab and for torch's own fully_shard and DistributedDataParallel."""
    k = micro_batches
    if x.shape[0] % k:
        raise ValueError(f"this rank's batch of {x.shape[0]} does not split into micro_batches={k} equal parts; "
                         f"use a global batch divisible by world_size x {k}")
    total = torch.zeros(())
    for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
        quiet = no_sync and i < k - 1
        with gradient_sync_off(model) if quiet else contextlib.nullcontext():
            loss = model(xs, ys)
            (loss / k).backward()
        total = total.to(loss.device) + loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / k


def train(rank: int, world_size: int, spec: RunSpec) -> dict:
    """Run `spec.steps` AdamW steps on this rank; return losses, trace events, unit table and optimizer facts.

    Called inside a rank process (the process flat already exists). With spec.trace_dir, each rank also
    appends its events to trace_dir/rank{r}.jsonl as they happen, for a live follower.
    """
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = build_model(spec)
    device = next(model.parameters()).device
    cfg = config_for(spec.preset)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    path = trace_mod.rank_file(spec.trace_dir, rank) if spec.trace_dir else None
    losses: list[float] = []
    step_times: list[float] = []
    tracer = trace_mod.Tracer(path, rank=rank, model=model, optimizer=opt) if spec.trace else None
    model.set_tracer(tracer)
    snapshot = contextlib.nullcontext()
    if spec.cuda_snapshot and rank == 0:
        from fsdp_lab.observe.cuda_memory import record_memory_snapshot

        snapshot = record_memory_snapshot(spec.cuda_snapshot)
    try:
        with snapshot:
            for step in range(spec.steps):
                start = time.perf_counter()
                x, y = batch_for_step(cfg, step, spec.global_batch, spec.seq_len)
                x, y = rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)
                loss = accumulation_step(model, opt, x, y, spec.micro_batches, spec.no_sync)
                losses.append(loss.item())  # .item() waits for the GPU, so the step time is complete
                step_times.append(time.perf_counter() - start)
                if spec.step_sleep_s:
                    time.sleep(spec.step_sleep_s)
    finally:
        model.set_tracer(None)
        if tracer is not None:
            tracer.close()
    result = {"rank": rank, "losses": losses, "step_times": step_times, "events": tracer.events if tracer else [],
              "units": unit_table(model), "optimizer_params": len(opt.state),
              "step_tensor_bytes": step_tensor_bytes(opt)}
    if device.type == "cuda":
        from fsdp_lab.observe.cuda_memory import cuda_memory

        result["cuda"] = cuda_memory(device)
    return result


def merge_events(per_rank: list[list[dict]]) -> list[dict]:
    """Every rank's events in one timeline, ordered by wall time then rank (as trace.load_trace orders files)."""
    return sorted((e for events in per_rank for e in events), key=lambda e: (e["t"], e["rank"]))
