"""Rank functions for the CPU offload tests: the same training run with torch's FSDP1 CPUOffload or fully_shard
CPUOffloadPolicy, fsdp_lab's with offload, and fsdp_lab's without, returning what tests/test_offload.py compares.

torch's offload pins host memory and synchronises the CPU "stream" at the end of backward, and both raise on a
machine without an accelerator; `torch_offload_on_cpu` makes both no-ops for torch's runs only (pinning changes no
value, and on CPU there is nothing to wait for), so torch's own offload code runs here.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from ranks_fully_shard import VOCAB, Block, TiedLM, batch, full, mean_over_ranks, mesh
from torch import nn
from torch.distributed.fsdp import CPUOffload

class LM(TiedLM):
    """TiedLM (embedding tied to the head in the root unit, uneven rows) with two blocks, all trainable: torch
    FSDP1 without use_orig_params needs one requires_grad per unit."""

    def __init__(self):
        super().__init__(n_layer=2)
        self.layers[1].gate.requires_grad_(True)


@contextlib.contextmanager
def torch_offload_on_cpu():
    pin = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.cpu.Stream.synchronize = lambda self: None  # torch.cpu.Stream has none
    try:
        yield
    finally:
        torch.Tensor.pin_memory = pin
        del torch.cpu.Stream.synchronize


def loss_of(model, idx, y):
    return nn.functional.cross_entropy(model(idx).float().reshape(-1, VOCAB), y.reshape(-1))


def wrap_fsdp1(lib: str, offload: bool, options: dict, seed: int = 0):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        options = {"device_id": torch.device("cpu"), **options}
    else:
        from fsdp_lab import FSDP, MixedPrecision
    if options.pop("bf16", False):
        options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(seed)
    return FSDP(LM(), cpu_offload=CPUOffload(offload_params=offload), auto_wrap_policy=ModuleWrapPolicy({Block}),
                **options)


def wrap_fsdp2(lib: str, offload, _options: dict):
    import fsdp_lab
    import torch.distributed.fsdp as torch_fsdp

    fsdp = torch_fsdp if lib == "torch" else fsdp_lab
    policy = fsdp.CPUOffloadPolicy(pin_memory=offload == "pinned") if offload else fsdp.OffloadPolicy()
    torch.manual_seed(0)
    model = LM()
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh(dist.get_world_size()), offload_policy=policy)
    fsdp.fully_shard(model, mesh=mesh(dist.get_world_size()), offload_policy=policy)
    return model


def report(model, optimizer) -> dict:
    mem = model.memory_report(optimizer)
    return {**mem.as_dict(), "host": mem.host, "device": mem.device}


def where_bytes_live(model, optimizer, rank: int, world_size: int) -> dict:
    """fsdp_lab FSDP1 only: memory_report inside block 0's forward (its unit and the root gathered) and after the
    step, with the bytes that must be on the device then (the gathered units' buffers)."""
    from fsdp_lab.runtime.core.unit import UnitState

    seen = {}

    def during(_module, _args, _output):
        gathered = [u for u in model.units if u.state is UnitState.UNSHARDED]
        seen["forward"] = report(model, optimizer)
        seen["forward_gathered"] = sum(f.full_bytes for u in gathered for f in u.flats)
        seen["forward_units"] = sorted(u.name for u in gathered)

    handle = model.module.layers[0].up.register_forward_hook(during)  # inside block 0, after its gather
    loss_of(model, *batch(0, rank, world_size)).backward()
    handle.remove()
    seen["after_backward"] = report(model, optimizer)
    optimizer.step()
    seen["after_step"] = report(model, optimizer)
    optimizer.zero_grad()
    seen["homes"] = sorted({f.placement.home.value for u in model.units for f in u.flats})
    seen["state_devices"] = sorted({v.device.type for s in optimizer.state.values() for v in s.values()
                                    if isinstance(v, torch.Tensor)})
    return seen


def run(rank, world_size, front: str, lib: str, offload, options: dict, steps: int = 3) -> dict:
    """Train `steps` steps (AdamW, clip_grad_norm_ at 0.5) and return losses, norms, final full parameters and,
    for fsdp_lab, where the state lives."""
    shim = torch_offload_on_cpu() if lib == "torch" and offload else contextlib.nullcontext()
    with shim:
        model = (wrap_fsdp1 if front == "fsdp1" else wrap_fsdp2)(lib, offload, dict(options))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, norms, norm_devices = [], [], set()
        for step in range(steps):
            loss = loss_of(model, *batch(step, rank, world_size))
            loss.backward()
            norm = model.clip_grad_norm_(0.5) if front == "fsdp1" else \
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norm_devices.add(full(norm).device.type if front == "fsdp2" else norm.device.type)
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss, world_size))
            norms.append(full(norm).item())
        out = {"losses": losses, "norms": norms, "norm_devices": sorted(norm_devices)}
        if front == "fsdp1":
            out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            out["params"] = {k: full(v) for k, v in model.named_parameters()}
            if lib == "fsdp_lab":
                out["homes"] = sorted({layout.placement.home.value for m in model.modules()
                                       if hasattr(m, "_fsdp_lab_state") for layout in m._fsdp_lab_state.unit.flats})
            out["local_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
            out["grad_after_backward"] = _fsdp2_grads_are_dtensors(model, rank, world_size)
        if front == "fsdp1" and lib == "fsdp_lab":
            out["where"] = where_bytes_live(model, opt, rank, world_size)
    return out


def _fsdp2_grads_are_dtensors(model, rank, world_size) -> bool:
    from torch.distributed.tensor import DTensor

    loss_of(model, *batch(0, rank, world_size)).backward()
    ok = all(isinstance(p.grad, DTensor) for p in model.parameters() if p.requires_grad)
    for p in model.parameters():
        p.grad = None
    return ok


def run_all(rank, world_size, cases: tuple) -> dict:
    """cases: (key, front, lib, offload, options) tuples."""
    return {key: run(rank, world_size, front, lib, offload, options) for key, front, lib, offload, options in cases}


class WideBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def gpu_peak(rank, world_size, offload: bool, width: int = 1024, blocks: int = 6) -> dict:
    """On CUDA: torch.cuda.memory_allocated at rest and at the peak of a steady-state step, for one FSDP1 model
    with or without CPU offload, and what memory_report says lives where."""
    from fsdp_lab import FSDP
    from fsdp_lab.runtime.features.offload import CPUOffload
    from fsdp_lab.wrap import ModuleWrapPolicy

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[WideBlock(width) for _ in range(blocks)]), device_id=device,
                 cpu_offload=CPUOffload(offload_params=offload), auto_wrap_policy=ModuleWrapPolicy({WideBlock}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device=device)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state exists from here on
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    report = model.memory_report(opt)
    unit_bytes = max(f.full_bytes for u in model.units for f in u.flats)
    return {"rest": rest, "peak": torch.cuda.max_memory_allocated(), "input": x.nbytes, "unit": unit_bytes,
            "report": {**report.as_dict(), "host": report.host, "device": report.device},
            "param_devices": sorted({p.device.type for p in model.parameters()}),
            "state_devices": sorted({v.device.type for s in opt.state.values() for v in s.values()
                                     if isinstance(v, torch.Tensor) and v.dim() > 0})}
