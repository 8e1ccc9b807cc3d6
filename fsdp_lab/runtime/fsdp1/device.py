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
    """The device this rank's shards live on; the module is moved there (what is on the meta device stays there
    until its unit is materialised: [Note: materialising one unit at a time] in deferred_init.py)."""
    devices = {p.device for p in module.parameters()}
    on_meta = any(d.type == "meta" for d in devices)
    devices.discard(torch.device("meta"))
    if device_id is not None:
        target = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device_id={device_id!r} asks for CUDA but torch.cuda.is_available() is False")
        if devices - {torch.device("cpu"), target} and devices != {target}:
            raise ValueError(f"module is on {sorted(map(str, devices))} but device_id is {target}; "
                             f"move it to {target} or to CPU first")
        if on_meta:
            module._apply(lambda t: t if t.is_meta else t.to(target))
        else:
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
    if devices:
        device = next(iter(devices))
    elif on_meta and backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # torch FSDP1: the current device
    else:
        device = torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"module is on {device} but the process group's backend is nccl, which needs CUDA "
                         f"tensors: move the module to cuda or pass device_id")
    return device


def check_param_init_fn(param_init_fn) -> None:
    """torch FSDP1 calls param_init_fn only for a unit with parameters or buffers on the meta device (see
    deferred_init.py); for any other it does nothing with it (accelerate passes one by default), and neither do
    we."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"param_init_fn must be callable, got {param_init_fn!r}")
