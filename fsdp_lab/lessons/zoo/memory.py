"""Bytes, measured on each rank: what a full state dict holds, what no_sync keeps between micro-batches, what
wrapping only the root leaves on the table during forward, and parameters read outside forward.

The model is four Linear(64, 64) (16,640 elements each, 66,560 B in fp32), one FSDP unit each when wrapped.
Bytes come from fsdp_lab's memory_report (parameters and gradients by kind) and from the state dict's own tensors
(host bytes: every tensor a state dict holds here is on the CPU, as offload_to_cpu puts them on a GPU machine).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.lessons.zoo.common import WIDTH, loss_of, mine
from fsdp_lab.runtime.core.memory import memory_report
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.state_dict import StateDictType
from fsdp_lab.runtime.fsdp2.fully_shard import fully_shard
from fsdp_lab.wrap import ModuleWrapPolicy

HIDDEN = 64
FULL_BYTES = 4 * (HIDDEN * HIDDEN + HIDDEN) * 4  # the four Linear(64, 64) in fp32


def wide(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])


def wrapped(model: nn.Module = None, **kwargs) -> FSDP:
    return FSDP(model if model is not None else wide(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)


def rows(step: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return mine(x, rank, world_size), mine(y, rank, world_size)


def host_bytes(state) -> int:
    """Bytes of the distinct storages a state dict's tensors hold (a sharded entry: its local piece)."""
    seen, total = set(), 0
    for value in (state or {}).values():
        t = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


# -- full state dicts --------------------------------------------------------------------------------------------------
def full_everywhere(model: FSDP):
    """The default FULL_STATE_DICT: every rank gathers and keeps the whole model."""
    return model.state_dict()


def sharded_pieces(model: FSDP):
    """SHARDED_STATE_DICT, what torch.distributed.checkpoint (DCP) saves: each rank keeps its own pieces."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()


def state_dict_bytes(save: Callable) -> int:
    """Host bytes the state dict `save(model)` returns holds on this rank."""
    return host_bytes(save(wrapped()))


# -- no_sync during accumulation -----------------------------------------------------------------------------------------
def accumulate_no_sync(model: FSDP, micro: list) -> None:
    """Accumulation as usually written: no communication until the last micro-batch."""
    with model.no_sync():
        for x, y in micro[:-1]:
            (loss_of(model, x, y) / len(micro)).backward()
    x, y = micro[-1]
    (loss_of(model, x, y) / len(micro)).backward()


def grad_bytes_between(accumulate: Callable, micro_batches: int = 4) -> tuple[int, list]:
    """(the gradient bytes held after the next-to-last micro-batch, the full gradients at the end) of
    `accumulate(model, micro)`: the peak of held gradients comes just before the last backward. A parameter
    that ends without a gradient (nothing was reduce-scattered) gives None."""
    model = wrapped()
    micro = [rows(step) for step in range(micro_batches)]
    held = []

    def watch(*_):  # what the model holds after each backward, read before the next forward
        mem = memory_report(model)
        held.append(mem.grads_sharded + mem.grads_unsharded)

    accumulate(_Watched(model, watch), micro)
    with FSDP.summon_full_params(model, with_grads=True):
        grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return max(held[1:] or held), grads


class _Watched:
    """The model, with `watch` called before every forward after the first: the gradients then held are what the
    accumulation keeps between micro-batches."""

    def __init__(self, model, watch):
        self.model, self.watch, self.calls = model, watch, 0

    def __call__(self, *args):
        if self.calls:
            self.watch(*args)
        self.calls += 1
        return self.model(*args)

    def __getattr__(self, name):
        return getattr(self.model, name)


# -- wrapping only the root -----------------------------------------------------------------------------------------------
def forward_peak(model: FSDP) -> int:
    """The most parameter bytes this rank holds as any leaf module's forward starts (memory_report, read in a
    forward pre-hook, which runs after FSDP's own: the unit is gathered by then)."""
    peak = [0]

    def hook(*_):
        mem = memory_report(model)
        peak[0] = max(peak[0], mem.params_sharded + mem.params_unsharded)

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_pre_hook(hook) for m in leaves]
    x, y = rows()
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return peak[0]


def root_only() -> FSDP:
    """The bug: FSDP(model) without an auto_wrap_policy is one unit, gathered whole for the whole forward."""
    return FSDP(wide())


# -- parameters read outside forward --------------------------------------------------------------------------------------
class Generator(nn.Module):
    """A body Linear (its own fully_shard group) and a head the root owns; `generate` reads both, not through
    forward, as a language model's generate() does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    @torch.no_grad()
    def generate(self, x, steps: int = 3):
        for _ in range(steps):
            x = self.head(torch.relu(self.body(x)))
        return x


def sharded_generator() -> Generator:
    model = Generator()
    fully_shard(model.body)
    return fully_shard(model)


def generate_or_error(model: Generator):
    """(generate's output or None, the error's first line or "")."""
    x = torch.ones(2, WIDTH)
    try:
        return model.generate(x), ""
    except Exception as err:  # the learner sees what torch would show: the error, not a traceback
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"


def reference_generate():
    return Generator().generate(torch.ones(2, WIDTH))
