"""FSDP1's manual nested wrap, FSDP(Net(blocks=[FSDP(b) for b in blocks])), on a runtime with one FSDP per model.

[Note: nested FSDP] FSDP1 scripts often wrap by hand. Each FSDP found inside the module being wrapped is taken
apart: its module gets its original parameters back (gathered from the shards), its hooks are removed, it takes
the FSDP's place in the tree, and every unit it had becomes a unit of the outer model, exactly as if the policy
had picked it. Its options must equal the outer one's: this runtime has one set of options per model, so a
different one would be silently ignored. Its old flat shards are marked replaced, so an optimizer built over the
inner FSDP is caught at its first step ([Note: traps that train nothing] in misuse.py).
"""
from __future__ import annotations

from torch import nn

from fsdp_lab.runtime.core.misuse import mark_replaced
from fsdp_lab.runtime.fsdp1.summon import flat_param_name, gather_master, register_full_params


def take_over_nested(outer, module: nn.Module, fsdp_class: type) -> list[nn.Module]:
    """Take apart every `fsdp_class` instance inside `module`; return their unit modules, innermost first."""
    found = []

    def visit(parent: nn.Module):
        for name, child in parent._modules.items():
            if isinstance(child, fsdp_class):
                found.append((parent, name, child))  # it already took over the FSDPs inside it
            elif child is not None:
                visit(child)

    visit(module)
    unit_modules = []
    for parent, name, inner in found:
        for option, ours in outer._settings.items():
            theirs = inner._settings[option]
            if theirs != ours:
                raise ValueError(f"nested FSDP '{name}' has {option}={theirs!r} but the outer FSDP has "
                                 f"{ours!r}: fsdp_lab applies one set of options to a whole model; pass the "
                                 f"same to both, or wrap once with an auto_wrap_policy")
        unit_modules.extend(hand_over_units(inner, outer))
        parent._modules[name] = inner.module
    return unit_modules


def hand_over_units(inner, outer) -> list[nn.Module]:
    """Give every unit's original parameters back and unhook it; return the unit modules, innermost first."""
    if inner._ctx.in_backward:
        raise RuntimeError("an FSDP cannot be nested into another while its backward is running")
    inner._reshard_all("summon")
    for unit in inner._units:
        for handle in unit.hook_handles:
            handle.remove()
        for flat in unit.flats:
            full = gather_master(unit, flat).detach().clone()
            register_full_params(unit, flat, full)
            for stale in [flat.shard] + (flat.orig_params or []):  # an optimizer over them trains nothing
                mark_replaced(stale, f"{unit.name}.{flat_param_name(flat)}")
    modules = [unit.module for unit in inner._units]
    inner._units, inner._nested_into = [], outer
    return modules
