"""Where each FSDP1 unit's first values come from: a module built on the meta device, and sync_module_states.

[Note: materialising one unit at a time] A 7B model in fp32 is 28 GB: a rank that builds it whole before
wrapping needs that much however few shards it keeps. Built under torch.device("meta") it costs nothing, and
FSDP gives each unit its values just before flattening it, innermost unit first, the root last (the order torch
FSDP1's recursive wrapping takes, so a seeded init draws the same numbers):

  1. the unit's FlatParam allocates this rank's shard (and briefly its unsharded buffer, to size it: before the
     originals exist, so the two are never alive together);
  2. the unit is materialised: param_init_fn(m) for each module m of the unit (breadth first, not entering other
     units or ignored modules), or without one, m.to_empty(device=..., recurse=False) and m.reset_parameters()
     for each such module that has parameters or buffers of its own, as torch FSDP1 does;
  3. with sync_module_states, rank 0 broadcasts this unit's parameters and not-yet-synced buffers;
  4. the shard copies its part of each parameter, and the originals are dropped.

So at any moment a rank holds its shards plus one unit's unsharded parameters (torch FSDP1 also holds a
concatenated copy of the unit: tests/test_deferred_init.py measures both). sync_module_states runs on the same
schedule whether or not the module was on meta (rank 0 may hold real weights and the others meta ones), so no
rank ever receives more than one unit before it is sharded.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.runtime.core.side_collectives import issue


def own_modules(unit_module: nn.Module, stop_at: frozenset) -> list[nn.Module]:
    """`unit_module` and the modules below it, breadth first, not entering a module whose id is in `stop_at`
    (other units, ignored modules): the modules torch FSDP1 materialises for one unit."""
    found, queue, seen = [], collections.deque([unit_module]), {id(unit_module)}
    while queue:
        module = queue.popleft()
        found.append(module)
        for child in module.children():
            if id(child) not in seen and id(child) not in stop_at:
                seen.add(id(child))
                queue.append(child)
    return found


def _one_tensor(unit_name: str, slot) -> torch.Tensor:
    """The tensor a slot's attributes hold now. A tie the init broke (to_empty gives each module its own tensor,
    where torch FSDP1 would go on with two untied weights) is refused: re-tie it in param_init_fn."""
    tensors = {id(t): t for t in (owner._parameters.get(attr) for owner, attr, _q in slot.aliases)}
    if len(tensors) > 1:
        raise ValueError(f"FSDP unit '{unit_name}': initialising it untied {', '.join(q for *_x, q in slot.aliases)}"
                         f" (to_empty gives each module its own tensor); tie them again inside param_init_fn, or "
                         f"build the model off the meta device")
    return next(iter(tensors.values()))


def _states(module: nn.Module):
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


@dataclass
class UnitInit:
    """How each unit gets its values before it is flattened ([Note: materialising one unit at a time])."""
    param_init_fn: Optional[Callable[[nn.Module], None]]
    device: torch.device  # where meta modules are materialised (to_empty)
    sync_module_states: bool
    groups: tuple  # sync_module_states broadcasts over each in turn: (replicate, shard) when hybrid, else (shard,)
    unit_modules: frozenset  # ids of every unit's module: a unit does not materialise another's
    ignored: frozenset  # ids of ignored modules: never materialised, their parameters never broadcast
    ignored_params: frozenset
    synced_buffers: set = field(default_factory=set)  # ids of buffers already broadcast (an outer unit skips them)

    def modules_of(self, unit_module: nn.Module) -> list[nn.Module]:
        return own_modules(unit_module, (self.unit_modules - {id(unit_module)}) | self.ignored)

    def prepare(self, unit_name: str, unit_module: nn.Module, flats) -> None:
        """Steps 2–4 of [Note: materialising one unit at a time] for one unit whose FlatParams are built."""
        modules = self.modules_of(unit_module)
        on_meta = any(t.is_meta for m in modules for t in _states(m) if id(t) not in self.ignored_params)
        if on_meta:
            self._materialize(unit_name, modules)
        if self.sync_module_states:
            self._broadcast(unit_name, unit_module, flats)
        if on_meta or self.sync_module_states:
            for flat in flats:
                flat.load_params([_one_tensor(unit_name, slot) for slot in flat.slots])

    def _materialize(self, unit_name: str, modules: list[nn.Module]) -> None:
        if self.param_init_fn is not None:
            for module in modules:
                self.param_init_fn(module)
        else:
            with torch.no_grad():
                for module in modules:
                    if not _states(module):
                        continue
                    if not callable(getattr(module, "reset_parameters", None)):
                        raise ValueError(f"FSDP unit '{unit_name}': {type(module).__name__} is on the meta device "
                                         f"and has no reset_parameters() to initialise it after to_empty; give it "
                                         f"one, or pass param_init_fn=")
                    module.to_empty(device=self.device, recurse=False)
                    module.reset_parameters()
        left = [f"{type(m).__name__}.{name}" for m in modules
                for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
                if t.is_meta and id(t) not in self.ignored_params]
        if left:
            how = "param_init_fn" if self.param_init_fn is not None else "to_empty + reset_parameters"
            raise ValueError(f"FSDP unit '{unit_name}': {how} left {len(left)} tensors on the meta device "
                             f"({', '.join(left[:3])}); it must materialise every parameter and buffer of the "
                             f"module it is given")

    def _broadcast(self, unit_name: str, unit_module: nn.Module, flats) -> None:
        """sync_module_states: rank 0's values of this unit's parameters and of the buffers in its subtree not
        synced yet (inner units went first; an ignored module's buffers go with the unit around it), as torch.
        Patient ([Note: patient collectives] in fsdp_lab/runtime/core/side_collectives.py): rank 0 may have
        spent longer materialising the unit than its peers."""
        tensors = [_one_tensor("", slot) for flat in flats for slot in flat.slots]
        for buf in unit_module.buffers():
            if id(buf) not in self.synced_buffers:
                self.synced_buffers.add(id(buf))
                tensors.append(buf)
        with torch.no_grad():
            for group in self.groups:  # hybrid: across the nodes first, so each shard group's rank 0 has rank 0's
                source = dist.get_global_rank(group, 0)
                for tensor in tensors:
                    issue(dist.broadcast, tensor.detach(), src=source, group=group, unit=unit_name or "root", phase="init",
                          patient=True)
