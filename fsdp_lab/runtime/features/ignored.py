"""FSDP1's `ignored_modules` / `ignored_states`: what the wrapper leaves alone.

[Note: ignored modules] As in torch FSDP1, an ignored module (and its whole subtree) is neither a unit nor part of
one: its parameters stay the module's own plain, unsharded nn.Parameters, are left out of every all-gather and
reduce-scatter (so their gradients are this rank's local ones, never averaged) and of the auto-wrap policy's
counts, and `state_dict()` holds them as the plain module's state dict does. `ignored_states` takes either
parameters (only those are ignored) or modules (as `ignored_modules`), not a mix, and not together with
`ignored_modules`. Ignoring the root itself, which torch calls "not well supported", is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Ignored:
    """Ids of the ignored modules (whole subtrees) and of every ignored parameter."""
    modules: frozenset = field(default_factory=frozenset)
    params: frozenset = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return bool(self.modules or self.params)


def resolve_ignored(root: nn.Module, ignored_modules, ignored_states, fsdp_cls: type) -> Ignored:
    """Check FSDP's ignored_modules / ignored_states as torch does and expand them to subtrees."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("FSDP options ignored_modules and ignored_states cannot be passed together (as in torch "
                         "FSDP1): pass ignored_states only")
    params, modules = [], []
    if ignored_states is not None:
        states = list(ignored_states)
        if all(isinstance(s, nn.Parameter) for s in states):
            params = states
        elif all(isinstance(s, nn.Module) for s in states):
            modules = states
        else:
            kinds = sorted({type(s).__name__ for s in states})
            raise ValueError(f"ignored_states should be all nn.Parameters or all nn.Modules, got {kinds}")
    elif ignored_modules is not None:
        try:
            modules = list(ignored_modules)
        except TypeError:
            raise TypeError(f"ignored_modules should be an iterable of nn.Modules, got "
                            f"{type(ignored_modules).__name__}") from None
        bad = sorted({type(m).__name__ for m in modules if not isinstance(m, nn.Module)})
        if bad:
            raise TypeError(f"ignored_modules should be an iterable of nn.Modules, got an iterable with {bad}")
    if any(isinstance(m, fsdp_cls) for m in modules):
        raise ValueError("ignored_modules should not include FSDP modules")
    subtree = {id(sub): sub for m in modules for sub in m.modules() if not isinstance(sub, fsdp_cls)}
    if id(root) in subtree:
        raise ValueError(f"FSDP would ignore its own root {type(root).__name__}: every parameter would be "
                         f"ignored (torch calls it not well supported); wrap only what should be sharded")
    ignored_params = {id(p) for p in params} | {id(p) for sub in subtree.values() for p in sub.parameters()}
    return Ignored(frozenset(subtree), frozenset(ignored_params))
