"""Where a model is wrapped: the process group it shards over, the device it lives on, meta modules."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def check_process_group(process_group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fsdp_lab.FSDP needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (fsdp_lab.training.launch.run_on_ranks "
                           "does it for you), or run the script under torchrun.")
    return process_group if process_group is not None else dist.group.WORLD


def resolve_device(module: nn.Module, device_id, backend: str) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices):
        names = [n for n, p in module.named_parameters() if p.device.type == "meta"][:3]
        raise ValueError(f"module has parameters on the meta device ({', '.join(names)}): materialise them "
                         f"(e.g. module.to_empty(device=...) and re-initialise) before wrapping with FSDP")
    if device_id is not None:
        target = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device_id={device_id!r} asks for CUDA but torch.cuda.is_available() is False")
        if devices - {torch.device("cpu"), target} and devices != {target}:
            raise ValueError(f"module is on {sorted(map(str, devices))} but device_id is {target}; "
                             f"move it to {target} or to CPU first")
        module.to(target)
        if target.type == "cuda":  # event waits, NCCL and DCP's object collectives use the current device
            torch.cuda.set_device(target)
        return target
    if len(devices) > 1:
        by_dev = {}
        for n, p in module.named_parameters():
            by_dev.setdefault(str(p.device), n)
        raise ValueError(f"module's parameters are on several devices: {by_dev}; FSDP needs one device "
                         f"per rank (move the module, or pass device_id)")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"module is on {device} but the process group's backend is nccl, which needs CUDA "
                         f"tensors: move the module to cuda or pass device_id")
    return device


def check_param_init_fn(module: nn.Module, param_init_fn) -> None:
    """torch FSDP1 calls param_init_fn only for a module with parameters or buffers on the meta device; for any
    other module it does nothing with it (accelerate passes one by default), and neither do we. Meta modules are
    refused with what to do instead."""
    if param_init_fn is None:
        return
    if not callable(param_init_fn):
        raise ValueError(f"param_init_fn must be callable, got {param_init_fn!r}")
    on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
    if on_meta:
        raise ValueError(f"FSDP option param_init_fn with modules on the meta device ({', '.join(on_meta[:3])}) is "
                         f"not supported by fsdp_lab: materialise the module first (module.to_empty(device=...) "
                         f"and re-initialise it), then wrap without param_init_fn")
