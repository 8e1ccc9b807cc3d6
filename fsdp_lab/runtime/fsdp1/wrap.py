"""Auto-wrap policies: which submodules become their own FSDP unit. Same names and call signature as
torch.distributed.fsdp.wrap, so a policy written for torch works here and vice versa.

A policy is called bottom-up as policy(module=..., recurse=False, nonwrapped_numel=...), where nonwrapped_numel
counts the parameters in that module's subtree not already claimed by a wrapped descendant.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Iterable, Optional

from torch import nn


def _module_classes(where: str, value) -> tuple[type, ...]:
    """A set of nn.Module classes as a tuple. A bare class (`ModuleWrapPolicy(Block)`, an easy slip, since
    isinstance takes one) is named with the set to write, not met with "'type' object is not iterable"."""
    if isinstance(value, type):
        raise TypeError(f"{where} takes a set of classes, got the class {value.__name__} itself; "
                        f"write {{{value.__name__}}}")
    try:
        classes = tuple(value)
    except TypeError:
        raise TypeError(f"{where} takes a set of nn.Module classes, got {type(value).__name__} {value!r}") from None
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise ValueError(f"{where} takes nn.Module subclasses, got {bad!r}")
    return classes


class ModuleWrapPolicy:
    """Wrap every module that is an instance of one of `module_classes` (e.g. the transformer block)."""

    def __init__(self, module_classes: Iterable[type]):
        self.module_classes = _module_classes("ModuleWrapPolicy(module_classes)", module_classes)

    def __call__(self, module: nn.Module, recurse: bool, *args, **kwargs) -> bool:
        return True if recurse else isinstance(module, self.module_classes)

    def __repr__(self):
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


def always_wrap_policy(*args, **kwargs) -> bool:
    """Every submodule is its own unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable) -> bool:
    """Wrap the modules for which lambda_fn(module) is true (PEFT picks its LoRA layers this way)."""
    return True if recurse else bool(lambda_fn(module))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies) -> bool:
    """Wrap a module if any of `policies` would: functools.partial(_or_policy, policies=[p1, p2])."""
    return any(_as_callable(policy)(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
               for policy in policies)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls) -> bool:
    """Use with functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})."""
    if transformer_layer_cls is None:  # torch: a missing required argument
        raise TypeError(_missing_layer_cls_message(None))
    if not transformer_layer_cls:
        raise ValueError(_missing_layer_cls_message(None))
    classes = _module_classes("transformer_auto_wrap_policy(transformer_layer_cls)", transformer_layer_cls)
    return True if recurse else isinstance(module, classes)


def _likely_layer_class(root: Optional[nn.Module]) -> str:
    """The class that repeats most inside the model's ModuleLists/Sequentials: usually the transformer block."""
    counts = Counter(type(child).__name__ for m in (root.modules() if root is not None else ())
                     if isinstance(m, (nn.ModuleList, nn.Sequential)) for child in m.children())
    return counts.most_common(1)[0][0] if counts else "YourBlock"


def _missing_layer_cls_message(root: Optional[nn.Module]) -> str:
    block = _likely_layer_class(root)
    return (f"transformer_auto_wrap_policy needs the layer class to wrap; it cannot be passed bare. Write "
            f"auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{block}}})")


def _is_bare_transformer_policy(policy) -> bool:
    """transformer_auto_wrap_policy (ours or torch's) passed without a transformer_layer_cls."""
    func, keywords = (policy.func, policy.keywords) if isinstance(policy, functools.partial) else (policy, {})
    return getattr(func, "__name__", None) == "transformer_auto_wrap_policy" and \
        not keywords.get("transformer_layer_cls")


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules=None,
                                exclude_wrap_modules=None) -> bool:
    """Wrap a module once its not-yet-wrapped subtree holds at least `min_num_params` parameters."""
    exclude = tuple(exclude_wrap_modules or (nn.ModuleList, nn.ModuleDict))
    leaves = tuple(force_leaf_modules or (nn.MultiheadAttention,))
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def _as_callable(policy, root: Optional[nn.Module] = None) -> Callable:
    if _is_bare_transformer_policy(policy):
        # torch raises TypeError here (its policy's transformer_layer_cls is a required argument); so do we, with
        # the spelling that works. An empty set is legal in torch but wraps nothing: refused as a ValueError.
        kind = TypeError if not isinstance(policy, functools.partial) else ValueError
        raise kind(_missing_layer_cls_message(root))
    if policy is None:
        return lambda module, recurse, nonwrapped_numel: recurse
    if callable(policy):
        return policy
    raise ValueError(f"unknown auto_wrap_policy {policy!r}: pass a ModuleWrapPolicy, or a callable "
                     f"(module, recurse, nonwrapped_numel) -> bool such as a functools.partial of "
                     f"transformer_auto_wrap_policy or size_based_auto_wrap_policy")


def _is_ignored(param, ignored) -> bool:
    return ignored is not None and id(param) in ignored.params


def select_units(root: nn.Module, policy, forced: Iterable[nn.Module] = (),
                 ignored=None) -> list[tuple[str, nn.Module]]:
    """Submodules (qualified name, module) the policy wraps, innermost first; the root is not included.
    `forced` modules are units whatever the policy says (the units of FSDP instances nested in `root`). `ignored`
    (runtime/features/ignored.py): ignored modules are never visited and ignored parameters never counted, as in
    torch."""
    decide = _as_callable(policy, root)
    forced_ids = {id(m) for m in forced}
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        """Returns the number of parameters under `module` that no wrapped descendant has claimed."""
        if ignored is not None and id(module) in ignored.modules:
            return 0
        own = sum(p.numel() for p in module.parameters(recurse=False) if not _is_ignored(p, ignored))
        holds_forced = bool(forced_ids) and any(id(m) in forced_ids for m in module.modules())
        if not holds_forced and not decide(module=module, recurse=True, nonwrapped_numel=own):
            return sum(p.numel() for p in module.parameters() if not _is_ignored(p, ignored))
        free = own
        for child_name, child in module.named_children():
            free += visit(f"{name}.{child_name}" if name else child_name, child)
        if module is not root and (id(module) in forced_ids
                                   or decide(module=module, recurse=False, nonwrapped_numel=free)):
            chosen.append((name, module))
            return 0
        return free

    visit("", root)
    return chosen
