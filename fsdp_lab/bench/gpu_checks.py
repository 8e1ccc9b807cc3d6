"""Checks that need a GPU to mean anything, written once for tests/test_gpu.py (pytest) and
benchmarks/gpu_checks.py (plain Python, for a machine without pytest). On CPU they run as a smoke test of the
same code: what only CUDA can show (host syncs, memory_allocated, kernel overlap) is skipped and said so.

Each check is `check(rank, world_size) -> str` (a one-line result with the measured numbers) and raises
AssertionError when the check fails. `run_checks` runs several on one process group and never raises.
"""
from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.bench.setups import build_runner
from fsdp_lab.runtime import FSDP, BackwardPrefetch, MixedPrecision, fully_shard
from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy
from fsdp_lab.training.models import PRESETS, Block, GPTConfig, batch_for_step, build_gpt, rank_slice

# Blocks of the 369M model's width (12.6M parameters each), few of them: quick to build; with 8x1024 tokens the
# GPU, not the host, sets the pace (needed to see overlap).
WIDE = GPTConfig(vocab_size=8192, block_size=1024, n_layer=4, n_head=16, n_embd=1024)
CPU_SMOKE = GPTConfig(vocab_size=512, block_size=1024, n_layer=4, n_head=4, n_embd=128)  # same code, CPU-sized
STEPS, LR = 3, 1e-3


def _wide(device: torch.device) -> GPTConfig:
    return WIDE if device.type == "cuda" else CPU_SMOKE


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _train(kind: str, dtype_name: str, device, rank, world_size):
    """A few AdamW steps of fsdp_lab or FSDP2 on the tiny GPT; losses (mean over ranks) and full parameters."""
    bf16 = dtype_name == "bf16"
    with torch.device(device):
        model = build_gpt("tiny")
    if kind == "fsdp_lab":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp, forward_prefetch=True,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    cfg = PRESETS["tiny"]
    for step in range(STEPS):
        x, y = batch_for_step(cfg, step, 4 * world_size)
        x, y = rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
    if kind == "fsdp_lab":
        with FSDP.summon_full_params(model):
            params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    else:
        params = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}
    return losses, params


def _parity(rank, world_size, dtype_name, loss_tol, max_tol, mean_tol) -> str:
    device = _device(rank)
    lab_losses, lab = _train("fsdp_lab", dtype_name, device, rank, world_size)
    ref_losses, ref = _train("fsdp2", dtype_name, device, rank, world_size)
    assert sorted(lab) == sorted(ref), f"parameter names differ: {sorted(set(lab) ^ set(ref))}"
    loss_diff = max(abs(a - b) for a, b in zip(lab_losses, ref_losses))
    diffs = {n: (lab[n] - ref[n]).abs() for n in lab}
    max_diff = max(d.max().item() for d in diffs.values())
    mean_diff = sum(d.sum().item() for d in diffs.values()) / sum(d.numel() for d in diffs.values())
    detail = (f"{dtype_name} {device.type} world {world_size}: loss diff {loss_diff:.2e} (tol {loss_tol:.0e}), "
              f"param max diff {max_diff:.2e} (tol {max_tol:.0e}), mean {mean_diff:.2e} (tol {mean_tol:.0e})")
    assert loss_diff <= loss_tol and max_diff <= max_tol and mean_diff <= mean_tol, detail
    return detail


def parity_bf16(rank, world_size) -> str:
    """bf16 compute, fp32 masters and reduction, against FSDP2 with the same policy. A max difference up to
    2·lr·steps is what Adam's normalised steps allow for a parameter whose tiny gradient rounded differently."""
    return _parity(rank, world_size, "bf16", 5e-3, 2 * LR * STEPS, 5e-5)


def parity_fp32(rank, world_size) -> str:
    return _parity(rank, world_size, "fp32", 1e-4, 1e-4, 1e-6)


class _BlockStack(nn.Module):
    """Blocks and a head on float inputs: no embedding, whose CUDA backward may itself sync on some versions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().pow(2).mean()


def _sync_free_steps(step, device) -> str:
    if device.type != "cuda":
        step()
        return "cpu: steps ran (host syncs can only be checked on CUDA)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    except RuntimeError as exc:
        return f"SYNC: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return "no host sync"


def no_host_sync(rank, world_size) -> str:
    """A steady-state step (forward, backward, fused AdamW, zero_grad) under set_sync_debug_mode('error')."""
    device = _device(rank)
    cfg = _wide(device)
    torch.manual_seed(0)
    with torch.device(device):
        stack = _BlockStack(cfg)
    model = FSDP(stack, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")
    x = torch.randn(2, 256, cfg.n_embd, device=device)

    def step():
        model(x).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    stack_result = _sync_free_steps(step, device)
    assert not stack_result.startswith("SYNC"), f"fsdp_lab step on Blocks: {stack_result}"
    gpt = build_runner("fsdp_lab", cfg, device, "fused" if device.type == "cuda" else "foreach", LR)
    batch = [t.to(device) for t in batch_for_step(cfg, 0, 2, 256)]
    for _ in range(3):
        gpt.step(*batch)
    gpt_result = _sync_free_steps(lambda: gpt.step(*batch), device)
    if gpt_result.startswith("SYNC"):
        plain = build_runner("plain", cfg, device, "fused", LR)
        plain.step(*batch)
        plain_result = _sync_free_steps(lambda: plain.step(*batch), device)
        gpt_result += f" (plain training of the same GPT: {plain_result})"
        assert plain_result.startswith("SYNC"), f"whole GPT under fsdp_lab: {gpt_result}"
    return f"Blocks under fsdp_lab (with clip_grad_norm_): {stack_result}; whole GPT under fsdp_lab: {gpt_result}"


def memory_released(rank, world_size) -> str:
    """Freed buffers are released under limit_all_gathers' bound. On CUDA a freed block keeps its buffer until the
    gather stream has waited for its readers, which the next gather but one does: inside block k, blocks k-1 and
    k are allocated, block k-2 is not, and memory from inside block 2 to inside block 3 grows by less than a
    unit. On CPU, with nothing queued, the buffer goes at the free: inside block k only block k is allocated."""
    device = _device(rank)
    cfg = _wide(device)
    runner = build_runner("fsdp_lab", cfg, device, "foreach", LR)
    model, base = runner.model, runner.model.module
    model._ctx.forward_prefetch = False  # implicit prefetch only: what a default FSDP(...) does
    units = {u.name: u for u in model.units}
    blocks = [units[f"blocks.{i}"] for i in range(len(base.blocks))]
    unit_bytes = sum(g.full_bytes for g in units["blocks.1"].flats)
    seen = {}

    def alloc():
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else None

    def look(k):
        seen[k] = (alloc(), [i for i, u in enumerate(blocks) if u.full_storage_sizes()[0] > 0])

    for k in (1, 2, 3):
        base.blocks[k].mlp.register_forward_hook(lambda *_, k=k: look(k))
    batch = [t.to(device) for t in batch_for_step(cfg, 0, 1, 256)]
    runner.step(*batch)
    held = device.type == "cuda"
    alive = {k: seen[k][1] for k in seen}
    expected = {k: [k - 1, k] if held else [k] for k in (1, 2, 3)}
    assert alive == expected, f"blocks allocated inside block k: {alive}, expected {expected}"
    if not held:
        return f"cpu: blocks allocated inside blocks 1-3: {alive} (memory_allocated needs CUDA)"
    growth = seen[3][0] - seen[2][0]
    detail = (f"unit {unit_bytes / 2**20:.1f} MiB; blocks allocated inside blocks 1-3: {alive}; from inside block 2 "
              f"to inside block 3 memory grew {growth / 2**20:.1f} MiB")
    assert growth < unit_bytes, detail + " (block 1's buffer not released?)"
    return detail


def overlap(rank, world_size, trace_dir=None) -> str:
    """Profile one step: the gather kernels run on a side stream and overlap compute kernels."""
    device = _device(rank)
    cfg = _wide(device)
    runner = build_runner("fsdp_lab", cfg, device, "fused" if device.type == "cuda" else "foreach", LR)
    tokens = (8, 1024) if device.type == "cuda" else (2, 64)
    batch = [t.to(device) for t in batch_for_step(cfg, 0, *tokens)]
    for _ in range(3):
        runner.step(*batch)
    from fsdp_lab.bench.profile import record_step_trace

    path = Path(trace_dir or tempfile.mkdtemp()) / "check_overlap_trace.json.gz"
    s = record_step_trace(runner, batch, path, write=rank == 0)
    if rank != 0:
        return "traced (rank 0 writes)"
    g = s["gather"]
    detail = (f"{g['kernels']} gather kernels on stream(s) {g['streams']} (compute stream {s['compute_stream']}), "
              f"{g['kernels_overlapping_compute']} overlap compute, {100 * g['overlap_fraction']:.0f}% of their "
              f"time; reduce: {s['reduce']['kernels']} kernels, {100 * s['reduce']['overlap_fraction']:.0f}%")
    if device.type != "cuda":
        assert s["fsdp_lab_ranges"] > 0, "no fsdp_lab ranges in the profile"
        return f"cpu: {s['fsdp_lab_ranges']} fsdp_lab ranges profiled (kernel overlap needs CUDA)"
    assert g["kernels"] >= len(runner.model.units), detail
    assert str(s["compute_stream"]) not in g["streams"], detail
    assert g["kernels_overlapping_compute"] >= 1, detail
    return detail


def _state_dict_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def resume_fused_adamw(rank, world_size) -> str:
    """Save after 2 steps, load into a fresh model and optimizer, step once more: fused AdamW needs its `step`
    on the GPU, which only a restore through optimizer.load_state_dict gives it. Against 3 straight steps."""
    from fsdp_lab.checkpoint.sharded import full_state_dict, load, save

    device = _device(rank)
    kind = "fused" if device.type == "cuda" else "foreach"
    cfg = PRESETS["tiny"]
    batches = [[t.to(device) for t in batch_for_step(cfg, i, 4)] for i in range(3)]
    directory = tempfile.mkdtemp() if rank == 0 else None
    box = [directory]
    dist.broadcast_object_list(box, src=0)
    first = build_runner("fsdp_lab", cfg, device, kind, LR)
    for x, y in batches[:2]:
        first.step(x, y)
    save(first.model, first.optimizer, box[0], step=2)
    first.step(*batches[2])
    straight = full_state_dict(first.model)
    second = build_runner("fsdp_lab", cfg, device, kind, LR)
    load(second.model, second.optimizer, box[0])
    steps = {str(s["step"].device) for s in second.optimizer.state.values()}
    second.step(*batches[2])
    resumed = full_state_dict(second.model)
    if rank != 0:
        return "resumed (rank 0 compares)"
    diff = _state_dict_diff(resumed, straight)
    detail = f"{kind} AdamW, restored step on {sorted(steps)}, resumed vs straight max diff {diff:.2e} (tol 1e-5)"
    assert diff <= 1e-5, detail
    return detail


def zero1_fused(rank, world_size) -> str:
    """ZERO1 with fused AdamW (which bumps no version counter) against one process on the whole batch, fp32:
    with several ranks this runs the reduce-scatter and the replica all-gather on CUDA tensors."""
    from fsdp_lab.checkpoint.sharded import full_state_dict
    from fsdp_lab.runtime import ShardingStrategy

    device = _device(rank)
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    cfg = PRESETS["tiny"]
    with torch.device(device):
        model = FSDP(build_gpt("tiny"), sharding_strategy=ShardingStrategy.ZERO1,
                     auto_wrap_policy=ModuleWrapPolicy({Block}))
        ref = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **kind)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, **kind)
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch_for_step(cfg, step, 4 * world_size))
        model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    exported = full_state_dict(model)
    if rank != 0:
        return "trained (rank 0 compares)"
    diff = _state_dict_diff(exported, {k: v.cpu() for k, v in ref.state_dict().items()})
    detail = f"ZERO1 {list(kind)[0]} AdamW, world {world_size} vs one process: max diff {diff:.2e} (tol 1e-5)"
    assert diff <= 1e-5, detail
    return detail


def _skipped_forward(rank, world_size, front_end: str) -> str:
    """With CUDA tensors on the side streams (a collective issued ahead is WAITED while the host waits), rank 0
    runs a forward its peers skip, under `front_end` ("FSDP" or "fully_shard"): the collective log names it and
    their last collective. It runs on a group of its own with a 3 s timeout, so the hang costs seconds and the
    other checks keep the default group."""
    from datetime import timedelta

    from fsdp_lab.runtime.core import collective_log
    from fsdp_lab.runtime.core.collectives import CollectiveFailed

    device = _device(rank)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    store, released = dist.distributed_c10d._get_default_store(), f"gpu_checks/collective_log/{front_end}/released"
    torch.manual_seed(0)
    with torch.device(device):
        net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if front_end == "FSDP":
        model = FSDP(net, process_group=group, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, device.type)
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    x = torch.ones(8, 64, device=device)
    model(x).sum().backward()
    if rank != 0:  # done, and alive: post, then wait (with a deadline) until rank 0 has its report
        collective_log.post_all("finished")
        store.wait([released], timedelta(seconds=60))
        return "skipped the forward (rank 0 reports)"
    t0 = time.monotonic()
    try:
        model(x)
        message = None
    except CollectiveFailed as err:
        message = err.collective_log
    finally:
        store.set(released, b"1")
    took = time.monotonic() - t0
    want = "rank 0 waits in all_gather"
    detail = f"{front_end}: {message!r} after {took:.1f} s on {device.type} tensors"
    assert message and message.startswith(want) and "which rank 1 never entered" in message, detail
    assert took < 3 + 5, detail
    return detail


def collective_log_names_a_skipped_forward(rank, world_size) -> str:
    """_skipped_forward under FSDP1's wrapper."""
    return _skipped_forward(rank, world_size, "FSDP")


def collective_log_names_a_skipped_forward_fully_shard(rank, world_size) -> str:
    """_skipped_forward under fully_shard (FSDP2's front end)."""
    return _skipped_forward(rank, world_size, "fully_shard")


WORLD1_CHECKS = {"parity_bf16": parity_bf16, "parity_fp32": parity_fp32, "memory_released": memory_released,
                 "overlap": overlap, "no_host_sync": no_host_sync,
                 "resume_fused_adamw": resume_fused_adamw, "zero1_fused": zero1_fused}
COLLECTIVE_LOG_CHECKS = {"collective_log_names_a_skipped_forward": collective_log_names_a_skipped_forward,
                         "collective_log_names_a_skipped_forward_fully_shard":
                             collective_log_names_a_skipped_forward_fully_shard}  # one per front end
CHECKS = {**WORLD1_CHECKS, **COLLECTIVE_LOG_CHECKS}
# two gloo ranks sharing one GPU (NCCL refuses two ranks on one device)
MULTI_RANK_CHECKS = ["parity_bf16", "zero1_fused", *COLLECTIVE_LOG_CHECKS]


def run_checks(rank: int, world_size: int, names: list[str]) -> list[dict]:
    """Run the named checks in order; each result: name, ok, detail (numbers or the failure), seconds."""
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            detail, ok = CHECKS[name](rank, world_size), True
        except Exception as exc:  # report and go on to the next check
            ok = False
            detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, AssertionError) else \
                traceback.format_exc(limit=4)
        results.append({"name": name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - start})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results
