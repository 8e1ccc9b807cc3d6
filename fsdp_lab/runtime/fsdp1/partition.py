"""Which unit owns which parameter. A parameter belongs to the innermost wrapped module that contains it.

A weight tied *inside* one unit becomes one slot with several names (one copy, gradients summed by autograd).
A weight tied *across* two units cannot be: each unit frees its own buffer on its own schedule, so the two copies
would drift. That case is refused with both units and names in the message.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from torch import nn

from fsdp_lab.runtime.fsdp1.nesting import plain_name


@dataclass
class UnitParams:
    name: str
    module: nn.Module
    trainable: list = field(default_factory=list)  # [(param, [(module, attr, qualified_name), ...]), ...]
    frozen: list = field(default_factory=list)


def _display(name: str) -> str:
    return name or "<root>"


def partition_params(root: nn.Module, unit_modules: list[tuple[str, nn.Module]], ignored=None) -> list[UnitParams]:
    """Return one UnitParams per unit (wrapped modules innermost first, the root last). Parameters in `ignored`
    (runtime/features/ignored.py) belong to no unit."""
    units = {id(m): UnitParams(n, m) for n, m in unit_modules}
    units[id(root)] = UnitParams("", root)
    owner_of_module: dict[int, UnitParams] = {}

    def walk(module: nn.Module, owner: UnitParams):
        owner = units.get(id(module), owner)
        owner_of_module.setdefault(id(module), owner)
        for child in module.children():
            walk(child, owner)

    walk(root, units[id(root)])
    seen: "OrderedDict[int, tuple]" = OrderedDict()  # id(param) -> (param, owner, aliases)
    for mod_name, module in root.named_modules(remove_duplicate=False):
        owner = owner_of_module[id(module)]
        for attr, param in module._parameters.items():
            if param is None or (ignored is not None and id(param) in ignored.params):
                continue
            qualified = plain_name(f"{mod_name}.{attr}" if mod_name else attr)  # FSDP(FSDP(block)): no levels
            if id(param) in seen:
                _param, first_owner, aliases = seen[id(param)]
                if first_owner is not owner:
                    raise ValueError(
                        f"parameter '{aliases[0][2]}' (unit '{_display(first_owner.name)}') is tied to "
                        f"'{qualified}' (unit '{_display(owner.name)}'): a weight shared across two FSDP units "
                        f"cannot be sharded. Put both modules in one unit (wrap their common parent) or untie it.")
                if all(a[0] is not module or a[1] != attr for a in aliases):
                    aliases.append((module, attr, qualified))
                continue
            seen[id(param)] = (param, owner, [(module, attr, qualified)])
    for param, owner, aliases in seen.values():
        (owner.trainable if param.requires_grad else owner.frozen).append((param, aliases))
    ordered = [units[id(m)] for _n, m in unit_modules] + [units[id(root)]]
    return ordered
