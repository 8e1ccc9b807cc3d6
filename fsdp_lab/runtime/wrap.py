"""Auto-wrap policies: which submodules become their own FSDP unit. Same names and call signature as
torch.distributed.fsdp.wrap, so a policy written for torch works here and vice versa.

A policy is called bottom-up as policy(module=..., recurse=False, nonwrapped_numel=...), where nonwrapped_numel
counts the parameters in that module's subtree not already claimed by a wrapped descendant.
"""
from __future__ import annotations

from typing import Callable, Iterable

from torch import nn


class ModuleWrapPolicy:
    """Wrap every module that is an instance of one of `module_classes` (e.g. the transformer block)."""

    def __init__(self, module_classes: Iterable[type]):
        classes = tuple(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ValueError(f"ModuleWrapPolicy takes nn.Module subclasses, got {bad!r}")
        self.module_classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)

    def __repr__(self):
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls=()) -> bool:
    """Use with functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules=None,
                                exclude_wrap_modules=None) -> bool:
    """Wrap a module once its not-yet-wrapped subtree holds at least `min_num_params` parameters."""
    exclude = tuple(exclude_wrap_modules or (nn.ModuleList, nn.ModuleDict))
    leaves = tuple(force_leaf_modules or (nn.MultiheadAttention,))
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def _as_callable(policy) -> Callable:
    if policy is None:
        return lambda module, recurse, nonwrapped_numel: recurse
    if callable(policy):
        return policy
    raise ValueError(f"unknown auto_wrap_policy {policy!r}: pass a ModuleWrapPolicy, or a callable "
                     f"(module, recurse, nonwrapped_numel) -> bool such as a functools.partial of "
                     f"transformer_auto_wrap_policy or size_based_auto_wrap_policy")


def select_units(root: nn.Module, policy) -> list[tuple[str, nn.Module]]:
    """Submodules (qualified name, module) the policy wraps, innermost first; the root is not included."""
    decide = _as_callable(policy)
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        """Returns the number of parameters under `module` that no wrapped descendant has claimed."""
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if not decide(module=module, recurse=True, nonwrapped_numel=own):
            return sum(p.numel() for p in module.parameters())
        free = own
        for child_name, child in module.named_children():
            free += visit(f"{name}.{child_name}" if name else child_name, child)
        if module is not root and decide(module=module, recurse=False, nonwrapped_numel=free):
            chosen.append((name, module))
            return 0
        return free

    visit("", root)
    return chosen
