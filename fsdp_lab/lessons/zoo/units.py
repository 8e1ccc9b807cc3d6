"""Which parameters share a unit: a weight tied across two units, and frozen and trainable parameters in one.

Both entries run torch's FSDP1 (device_id=cpu, on the same gloo ranks) beside fsdp_lab's FSDP, because the two
differ where users report trouble:

- a tied weight (an embedding and an LM head sharing one matrix) split across two units: torch's FSDP1 flattens
  it into both units, so it trains on with two copies that drift apart; fsdp_lab refuses at wrap time and names
  both units;
- a frozen base and a trainable adapter in one unit with use_orig_params=False: torch's FSDP1 refuses (one
  FlatParameter has one requires_grad); fsdp_lab keeps one flat buffer per requires_grad group (DESIGN.md).

A fix is a function `wrap(FSDP, model)` that both front ends run, and it must give one process's step with each.

[Note: torch's warnings] torch's FSDP1 constructor warns that it is deprecated, and warns about frozen parameters
when use_orig_params=True; the zoo runs it with those warnings silenced so a cell shows the symptom alone.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_lab.lessons.zoo.common import WIDTH, mine
from fsdp_lab.runtime.fsdp1.api import FSDP

VOCAB = 8
LR = 0.1


def torch_fsdp1(module: nn.Module, **kwargs):
    """torch's FullyShardedDataParallel on the CPU ranks ([Note: torch's warnings])."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"), **kwargs)


def _summon(model):
    if isinstance(model, FSDP):
        return FSDP.summon_full_params(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel.summon_full_params(model)


def _module(model: nn.Module, name: str) -> nn.Module:
    """The submodule `name` of the user's model, read through either front end's wrappers."""
    for qualified, module in model.named_modules():
        plain = qualified.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").strip(".")
        if plain == name and not hasattr(module, "_fsdp_wrapped_module"):
            return module
    raise KeyError(f"no module {name!r} in the wrapped model")


def sgd_step(model: nn.Module, loss: Callable) -> None:
    """One SGD step of this rank's rows: the optimizer gets the trainable parameters only (as PEFT builds it)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loss(model).backward()
    opt.step()


def front_ends() -> list:
    """(name, class) of the front ends a fix runs on: torch's FSDP1 first, then fsdp_lab's."""
    return [("torch's FSDP1", torch_fsdp1), ("fsdp_lab", FSDP)]


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


# -- a weight tied across two units ---------------------------------------------------------------------------------
class Block(nn.Module):
    """The body's layer: the unit a transformer block would be."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.lin(x))


class TiedLM(nn.Module):
    """An embedding, two blocks, and an LM head whose weight is the embedding's (head.weight = embed.weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000)
    return torch.randint(0, VOCAB, (8,), generator=g), torch.randint(0, VOCAB, (8,), generator=g)


def lm_loss(model, whole: bool = False):
    x, y = tokens()
    if not whole:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        x, y = mine(x, rank, world_size), mine(y, rank, world_size)
    return F.cross_entropy(model(x), y)


def one_process_lm() -> nn.Module:
    ref = TiedLM()
    sgd_step(ref, lambda m: lm_loss(m, whole=True))
    return ref


def every_layer(FSDP, model):
    """The bug: every layer its own unit, the head (a Linear) in one and the embedding in another."""
    return FSDP(model, auto_wrap_policy=_policy({nn.Embedding, nn.Linear}))


def _policy(classes):
    from fsdp_lab.wrap import ModuleWrapPolicy  # a callable policy: torch's FSDP1 takes it too
    return ModuleWrapPolicy(classes)


def tied_step(wrap: Callable, FSDP) -> dict:
    """wrap(FSDP, TiedLM()) and one step: {"error"} if it raised, else the units, how far the head's weight is
    from the embedding's, and how far both are from one process's step."""
    try:
        model = wrap(FSDP, TiedLM())
        sgd_step(model, lm_loss)
    except NotImplementedError:  # the learner's stub: the check says "not written yet"
        raise
    except (ValueError, RuntimeError) as err:
        return {"error": _first_line(err)}
    ref = one_process_lm().embed.weight
    with _summon(model):
        embed, head = _module(model, "embed").weight.detach(), _module(model, "head").weight.detach()
        return {"units": sum(1 for m in model.modules() if hasattr(m, "_fsdp_wrapped_module")),
                "untied": (embed - head).abs().max().item(),
                "gap": max((embed - ref).abs().max().item(), (head - ref).abs().max().item())}


def tied_report(wrap: Callable = every_layer) -> str:
    """What each front end does with `wrap`, one line each."""
    lines = []
    for name, front_end in front_ends():
        got = tied_step(wrap, front_end)
        if "error" in got:
            lines.append(f"{name}: {got['error']}")
        else:
            lines.append(f"{name}: trained one step in {got['units']} units; head.weight - embed.weight: "
                         f"{got['untied']:.2e}; off one process's step by {got['gap']:.2e}")
    return "\n".join(lines)


def untie(FSDP, model):
    """A wrong fix: give the head its own copy of the weight, then wrap every layer."""
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return every_layer(FSDP, model)


# -- frozen and trainable parameters in one unit ----------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank adapter (down, then up), as PEFT's LoRA builds it."""

    def __init__(self, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.down = nn.Linear(WIDTH, rank, bias=False)
        self.up = nn.Linear(rank, WIDTH, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def adapted() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(), nn.ReLU(), LoRALinear())


def rows(whole: bool = False):
    g = torch.Generator().manual_seed(4000)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    if whole:
        return x, y
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return mine(x, rank, world_size), mine(y, rank, world_size)


def lora_loss(model, whole: bool = False):
    x, y = rows(whole)
    return F.mse_loss(model(x), y)


def lora_units(FSDP, model):
    """The bug as PEFT users write it: each LoRA layer one unit, base and adapter together, flat parameters."""
    return FSDP(model, auto_wrap_policy=_policy({LoRALinear}))


def unfreeze(FSDP, model):
    """A wrong fix: make every parameter trainable so the unit is uniform, then wrap as before."""
    model.requires_grad_(True)
    return lora_units(FSDP, model)


def lora_step(wrap: Callable, FSDP) -> dict:
    """wrap(FSDP, adapted()) and one step: {"error"} if it raised, else how far the frozen bases moved and how far
    the full parameters are from one process's step (the bases frozen)."""
    try:
        model = wrap(FSDP, adapted())
        sgd_step(model, lora_loss)
    except NotImplementedError:  # the learner's stub: the check says "not written yet"
        raise
    except (ValueError, RuntimeError) as err:
        return {"error": _first_line(err)}
    start, ref = adapted(), copy.deepcopy(adapted())
    sgd_step(ref, lambda m: lora_loss(m, whole=True))
    names = [n for n, _ in ref.named_parameters()]
    moved = gap = 0.0
    with _summon(model):
        for name in names:
            owner, attr = name.rsplit(".", 1)
            got = getattr(_module(model, owner), attr).detach()
            gap = max(gap, (got - ref.get_parameter(name)).abs().max().item())
            if ".base." in f".{name}":
                moved = max(moved, (got - start.get_parameter(name)).abs().max().item())
    return {"moved": moved, "gap": gap}


def lora_report(wrap: Callable = lora_units) -> str:
    lines = []
    for name, front_end in front_ends():
        got = lora_step(wrap, front_end)
        lines.append(f"{name}: {got['error']}" if "error" in got else
                     f"{name}: trained one step; frozen bases moved {got['moved']:.2e}, off one process's step "
                     f"by {got['gap']:.2e}")
    return "\n".join(lines)


def flat_buffers(model) -> list:
    """(name, requires_grad, elements on this rank) of each parameter the wrapped model registers."""
    return [(n.replace("_fsdp_wrapped_module.", ""), p.requires_grad, p.numel()) for n, p in model.named_parameters()]
