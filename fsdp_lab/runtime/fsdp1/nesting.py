"""One FSDP instance per unit, as torch FSDP1 nests them, over one set of Units; and the manual nested wrap,
FSDP(Net(blocks=[FSDP(b) for b in blocks])).

[Note: one FSDP instance per unit] In torch FSDP1 every wrapped submodule is replaced in the tree by an FSDP
instance whose `.module` is the submodule, and accelerate and Lightning walk them (`FSDP.fsdp_modules(model)`,
`m.module`, `summon_full_params(m, recurse=False)`). Here the root FSDP object still builds and drives every
Unit (one unit state machine, one FSDPState, the hooks on the unit modules themselves); once they are built,
`install_unit_wrappers` puts an FSDP instance of the same class around each non-root unit's module. The seam
between such a wrapper and the core is five attributes, all set here (and `_summoning` by summon.py):

- `_root`: the root FSDP object (the root's own `_root` is itself): root duties (the forward's start and end,
  the end of backward, freeing every unit) always run on it; `check_is_root()` is `_root is self`;
- `_ctx`: the root's FSDPState, shared;
- `_units`: the Units inside this instance's subtree, innermost first, its own unit last (what summon,
  load_state_dict and apply on an inner instance act on);
- `_fsdp_wrapped_module`: the unit's module, a registered submodule, so `named_modules()` shows the
  `_fsdp_wrapped_module` levels torch shows, and `.module` is the original submodule;
- `_summoning`: inside a summon_full_params over this instance ([Note: names with and without the levels]).

A wrapper's forward only calls its module (whose hooks run the unit), so the hot path gains one nn.Module call
per unit, which torch's instances cost too. The state dict walks straight through a wrapper (its `state_dict`
hands the walk to its module with the same prefix), so its keys are the plain module's, and a load pre-hook on
each wrapper puts the level back into the keys it loads, as torch's does.

[Note: names with and without the levels] The names users see are torch's. `named_modules()` shows the
`_fsdp_wrapped_module.` levels, and so do `named_parameters()` and `named_buffers()`
(`_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._flat_param`, or with use_orig_params the original names
under those levels), except on an instance that is summoned: summon_full_params marks every instance it covers
(`_summoning`: the whole subtree, or the one instance with recurse=False, on every rank even with rank0_only),
and only those strip the levels from the names they give, as torch's do while their training state is
SUMMON_FULL_PARAMS. Code that keys by name outside a summon (optimizer groups by substring, checks by suffix)
reads the same either way; code that compares names with the plain module's strips the levels, as it must
with torch.

[Note: nested FSDP] FSDP1 scripts often wrap by hand. Each root FSDP found inside the module being wrapped is
taken apart first: its module gets its original parameters back (gathered from the shards), its hooks are
removed, its wrappers (and itself) leave the tree, and every unit it had becomes a unit of the outer model,
exactly as if the policy had picked it. Then the same FSDP objects go back into the tree as the outer model's
wrappers, so the tree, `fsdp_modules` and the identity of each inner object are what torch gives. Their options
must equal the outer one's: this runtime has one set of options per model, so a different one would be silently
ignored. Their old flat shards are marked replaced, so an optimizer built over an inner FSDP before the outer wrap
is caught at its first step ([Note: traps that train nothing] in misuse.py).
"""
from __future__ import annotations

from torch import nn

from fsdp_lab.runtime.core.misuse import mark_replaced
from fsdp_lab.runtime.fsdp1.summon import flat_param_name, gather_master, register_full_params

WRAPPED = "_fsdp_wrapped_module"


def plain_name(name: str) -> str:
    """`name` without its `_fsdp_wrapped_module.` levels: the plain module's name (state-dict keys, the original
    parameter names a unit records)."""
    return name.replace(WRAPPED + ".", "")


def refuse_nested_with_policy(module: nn.Module, auto_wrap_policy, fsdp_class: type) -> None:
    """torch FSDP1's check (_check_nested_wrapping in _wrap_utils.py), with its words: an auto_wrap_policy only
    over a module that has no FSDP applied yet, `module` itself included."""
    if auto_wrap_policy is None:
        return
    for name, sub in module.named_modules():
        if isinstance(sub, fsdp_class):
            what = f"whose '{name}' is wrapped in FSDP already" if name else "that is an FSDP already"
            raise ValueError(f"FSDP auto wrapping requires modules to not already have FSDP applied but found "
                             f"{name} in\n{module}\nFSDP(module, auto_wrap_policy=...) got a module {what}: wrap "
                             f"the plain module with the policy, or wrap by hand without one")


def take_over_nested(outer, module: nn.Module, fsdp_class: type) -> tuple[list[nn.Module], dict]:
    """Take apart every root `fsdp_class` instance inside `module` (`module` itself too: FSDP(FSDP(block)), where
    the outer owns nothing of its own, as in torch); return their unit modules, innermost first, and
    {id(unit module): FSDP object} of the objects to put back as wrappers. A wrapper of another model is left
    where it is: its flat shards make refuse_wrapped_inside name it."""
    found = [(None, "", module)] if isinstance(module, fsdp_class) and module._root is module else []

    def visit(parent: nn.Module):
        for name, child in parent._modules.items():
            if isinstance(child, fsdp_class):
                if child._root is child:
                    found.append((parent, name, child))  # it already took over the FSDPs inside it
            elif child is not None:
                visit(child)

    if not found:
        visit(module)
    unit_modules, objects = [], {}
    for parent, name, inner in found:
        for option, ours in outer._settings.items():
            theirs = inner._settings[option]
            if theirs != ours:
                raise ValueError(f"nested FSDP '{name or 'module'}' has {option}={theirs!r} but the outer FSDP has "
                                 f"{ours!r}: fsdp_lab applies one set of options to a whole model; pass the "
                                 f"same to both, or wrap once with an auto_wrap_policy")
        unit_modules.extend(hand_over_units(inner))
        for wrapper in remove_wrappers(inner, fsdp_class):
            objects[id(wrapper.module)] = wrapper
        objects[id(inner.module)] = inner
        if parent is not None:  # FSDP(FSDP(block)): the given FSDP stays the outer's module
            parent._modules[name] = inner.module
    return unit_modules, objects


def hand_over_units(inner) -> list[nn.Module]:
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
    inner._units = []
    return modules


def remove_wrappers(root, fsdp_class: type) -> list:
    """Put each wrapper of `root` back to its plain module in the tree; return the wrappers."""
    removed = []

    def visit(parent: nn.Module):
        for name, child in list(parent._modules.items()):
            if isinstance(child, fsdp_class) and child._root is root and child is not root:
                parent._modules[name] = child.module
                removed.append(child)
                child = child.module
            if child is not None:
                visit(child)

    visit(root.module)
    return removed


def set_seam(wrapper, root, units) -> None:
    """The attributes of [Note: one FSDP instance per unit]; `_root` bypasses nn.Module's registration (it
    is not a submodule: the root would contain itself)."""
    wrapper.__dict__["_root"] = root
    wrapper._ctx = root._ctx
    wrapper._units = units
    wrapper._summoning = False
    wrapper._state_dict_walk = False  # the root's: its state_dict() is walking the tree ([Note: an inner ...])


def install_unit_wrappers(root, fsdp_class: type, objects: dict) -> None:
    """Replace each non-root unit's module in the tree by an FSDP instance around it ([Note: one FSDP instance per
    unit]); `objects` are hand-nested FSDP objects to reuse for their modules."""
    units = root._units
    for i, unit in enumerate(units):  # innermost first: no wrapper yet on the path to this unit
        if unit.module is root.module:
            continue
        parent_name, _, attr = unit.name.rpartition(".")
        parent = root.module.get_submodule(parent_name)
        if parent._modules.get(attr) is not unit.module:
            raise RuntimeError(f"FSDP unit '{unit.name}' is not at its place in the module tree")
        wrapper = objects.get(id(unit.module))
        if wrapper is None:
            wrapper = fsdp_class.__new__(fsdp_class)
            nn.Module.__init__(wrapper)
            wrapper._register_load_state_dict_pre_hook(_add_wrapped_level)
            setattr(wrapper, WRAPPED, unit.module)
        elif not getattr(wrapper, "_load_hook_added", False):
            wrapper._register_load_state_dict_pre_hook(_add_wrapped_level)
        wrapper._load_hook_added = True
        inside = {id(m) for m in unit.module.modules()}
        set_seam(wrapper, root, [u for u in units[:i + 1] if id(u.module) in inside])
        for option in ("_settings", "_placement", "_groups", "_use_orig_params", "_state_dict_settings"):
            setattr(wrapper, option, getattr(root, option))
        wrapper._buffer_dtypes = {}  # the root restores buffer dtypes for the whole tree
        wrapper.training = unit.module.training
        if wrapper is not parent:  # FSDP(FSDP(block)): the inner instance is the outer's module already
            parent._modules[attr] = wrapper


def _add_wrapped_level(state_dict, prefix, *_args) -> None:
    """Load pre-hook of a wrapper: the keys under it (torch's names) reach its module under `_fsdp_wrapped_module`,
    as torch's own pre-hook does."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + WRAPPED + ".")]:
        state_dict[prefix + WRAPPED + "." + key[len(prefix):]] = state_dict.pop(key)
