"""Wrong numbers that still train: nothing hangs or raises, and a check against one process (or against the model
each rank built) is what shows them.

- a gradient norm taken from the local shards (FSDP2 DTensor grads read with to_local(); under FSDP1,
  torch.nn.utils.clip_grad_norm_ over the flat shards);
- a loss summed over the local rows, which FSDP's average turns into a gradient rows-per-rank times too large;
- a different init on each rank without sync_module_states: the shards of N models make one that none built;
- an optimizer built before FSDP replaced the parameters: it steps tensors the model no longer uses;
- buffers cast to bf16 by MixedPrecision(buffer_dtype=...): a step counter stops at 256;
- a DistributedSampler without set_epoch: every epoch in the same order.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from fsdp_lab.lessons.zoo.common import WIDTH, batch, loss_of, mine, one_process, tiny
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp2.fully_shard import fully_shard
from fsdp_lab.wrap import ModuleWrapPolicy


def sharded(model: nn.Module) -> nn.Module:
    """`model` under FSDP2: each Linear its own fully_shard group, then the root."""
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    return fully_shard(model)


def wrapped(model: nn.Module, **kwargs) -> FSDP:
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)


def norm_of(grads) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def reference_grads(model: nn.Module) -> list:
    """The gradients of one step on the whole global batch, unwrapped, in this process."""
    x, y = batch(0)
    model.zero_grad()
    loss_of(model, x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


# -- the gradient norm from local shards ------------------------------------------------------------------------------
def local_grad_norm(model) -> float:
    """The bug: the norm of this rank's shards only, each DTensor gradient read with to_local()."""
    return norm_of([p.grad.to_local() for p in model.parameters()])


def backward_once(loss_fn: Callable = None) -> nn.Module:
    """An FSDP2 tiny model after one backward of this rank's rows (loss_fn(model, x, y), default the mean)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = sharded(tiny())
    x, y = batch(0)
    (loss_fn or loss_of)(model, mine(x, rank, world_size), mine(y, rank, world_size)).backward()
    return model


def grad_norms(grad_norm: Callable) -> tuple[float, float]:
    """(grad_norm(model) after one backward, the one-process norm)."""
    return grad_norm(backward_once()), norm_of(reference_grads(tiny()))


def grad_norm_parts(grad_norm: Callable) -> tuple[float, float, float]:
    """(grad_norm(model) after one backward, the norm of this rank's shards of the same gradients, the
    one-process norm): what a check needs to say which norm a wrong answer took."""
    model = backward_once()
    local = local_grad_norm(model)  # before grad_norm, which may clip the gradients
    return float(grad_norm(model)), local, norm_of(reference_grads(tiny()))


def fsdp1_grad_norms() -> tuple[float, float, float]:
    """FSDP1's form of the same bug, after one backward of this rank's rows of the same model under the wrapper:
    (torch.nn.utils.clip_grad_norm_ over model.parameters(), which are this rank's flat shards; the wrapper's
    model.clip_grad_norm_, which adds the ranks' squares before the root; the one-process norm). max_norm is
    infinite, so both only measure."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = wrapped(tiny())
    x, y = batch(0)
    loss_of(model, mine(x, rank, world_size), mine(y, rank, world_size)).backward()
    local = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    total = model.clip_grad_norm_(float("inf")).item()
    return local, total, norm_of(reference_grads(tiny()))


# -- a summed loss --------------------------------------------------------------------------------------------------------
def summed_loss(model, x, y):
    """The bug: the loss summed over this rank's rows (reduction="sum"), though FSDP averages over ranks."""
    return loss_of(model, x, y, reduction="sum")


def elements_per_rank() -> int:
    """The loss's elements on each rank (rows × columns of a rank's part of the global batch)."""
    _, y = batch(0)
    return mine(y, dist.get_rank(), dist.get_world_size()).numel()


def grad_ratio(loss_fn: Callable) -> float:
    """FSDP's full gradients after one backward of loss_fn, divided by one process's (1.0 is right)."""
    model = backward_once(loss_fn)
    full = [p.grad.full_tensor() for p in model.parameters()]
    return norm_of(full) / norm_of(reference_grads(tiny()))


# -- a different init on each rank --------------------------------------------------------------------------------------
def built_by_rank(**fsdp_kwargs) -> FSDP:
    """The bug as users write it: each rank builds the model from its own seed (here: its rank)."""
    return wrapped(tiny(seed=dist.get_rank()), **fsdp_kwargs)


def whose_weights(model: FSDP) -> str:
    """Which rank's own model the full parameters are, read with summon_full_params."""
    with FSDP.summon_full_params(model):
        full = [p.detach().clone() for p in model.parameters()]
    owners = [r for r in range(dist.get_world_size())
              if all(torch.equal(a, b) for a, b in zip(full, tiny(seed=r).parameters()))]
    return f"rank {owners[0]}'s model" if owners else "no rank's model (a mix of their shards)"


# -- an optimizer built before wrapping -------------------------------------------------------------------------------
def optimizer_then_wrap():
    """The bug: the optimizer is given the parameters, then FSDP replaces them with its flat shards."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return wrapped(model), opt


def step_once(model: FSDP, opt) -> float:
    """Largest difference between the full parameters after one SGD step and one process's; 0.0 is right."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = batch(0)
    loss_of(model, mine(x, rank, world_size), mine(y, rank, world_size)).backward()
    opt.step()
    opt.zero_grad()
    with FSDP.summon_full_params(model):
        full = [p.detach().clone() for p in model.parameters()]
    return max((a - b).abs().max().item() for a, b in zip(full, one_process(tiny()).parameters()))


def moved(model: FSDP, opt) -> float:
    """How far one step moved the full parameters (0.0: the optimizer stepped nothing the model uses)."""
    with FSDP.summon_full_params(model):
        before = [p.detach().clone() for p in model.parameters()]
    step_once(model, opt)
    with FSDP.summon_full_params(model):
        return max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))


# -- buffers under mixed precision --------------------------------------------------------------------------------------
class Counted(nn.Module):
    """A Linear that counts its forwards in a float buffer, as models count steps or positions; it was resumed at
    step 256."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("steps", torch.tensor(256.0))

    def forward(self, x):
        self.steps += 1
        return self.lin(x)


def count_after(mixed_precision, forwards: int = 4) -> float:
    """The step buffer after `forwards` forwards of Counted under FSDP with `mixed_precision` (260.0 is right)."""
    model = FSDP(Counted(), mixed_precision=mixed_precision)
    x, _ = batch(0)
    with torch.no_grad():
        for _ in range(forwards):
            model(x)
    return float(model.module.steps)


# -- DistributedSampler without set_epoch ----------------------------------------------------------------------------
class _Told(DistributedSampler):
    """A DistributedSampler that keeps the epochs it was told, in order (`told`), for the check's answer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.told = []

    def set_epoch(self, epoch: int) -> None:
        self.told.append(epoch)
        super().set_epoch(epoch)


def sampler(samples: int = 8) -> DistributedSampler:
    return _Told(range(samples), num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0)


def orders_without_set_epoch(s: DistributedSampler, epochs: int) -> list:
    """The bug: each epoch iterates the sampler without telling it the epoch."""
    return [list(s) for _ in range(epochs)]
