"""fully_shard over a list of modules: one parameter group, one unit, whose forward spans several modules.

[Note: one group over several modules] torch's `fully_shard([model.embed, model.head])` shards the listed
modules' parameters as one group (one all-gather, one reduce-scatter), for modules that are not each other's
parents: an embedding and an output head, the towers of a multi-modal model. Every listed module becomes an
FSDPModule sharing one state. The group is gathered when the first of its modules starts forward and is done
with forward when the last of them has run (torch counts the modules still to run in the same way); the
modules in between only cast their inputs and outputs per the MixedPrecisionPolicy. Outputs of the earlier
modules get the same pre-backward hook as the last one's, so whichever output backward reaches first re-gathers
the group. A module of the group that does not run in some forward would leave the group open: the root's
post-forward completes every open group with the outputs seen so far. A module that runs again after the group
completed starts a new pass, as in torch.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn


def root_modules(module) -> list[nn.Module]:
    """fully_shard's argument as a list of modules: one module, or a non-empty list or tuple of them."""
    if isinstance(module, (list, tuple)):
        if not module:
            raise ValueError("fully_shard expects an nn.Module or a non-empty list of them, got an empty "
                             f"{type(module).__name__}")
        bad = [type(m).__name__ for m in module if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"fully_shard expects a list of nn.Modules, got {bad}")
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard got the same module twice in one list")
        return list(module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    return [module]


class GroupHooks:
    """The forward hooks of a group of several modules over one FullyShardState
    ([Note: one group over several modules])."""

    def __init__(self, state, modules: Sequence[nn.Module]):
        self.state, self.modules = state, list(modules)
        self._to_run: set[int] = set()
        self._partial_outputs: list = []  # outputs of the modules that ran before the pass completed

    @property
    def open(self) -> bool:
        return bool(self._to_run)

    def pre_forward(self, module, args, kwargs):
        if not self._to_run:  # the first module of a pass: gather
            self._to_run = {id(m) for m in self.modules}
            self._partial_outputs = []
            return self.state.pre_forward(module, args, kwargs)
        return self.state.cast_inputs(args, kwargs)

    def post_forward(self, module, args, output):
        if id(module) not in self._to_run:  # a module that ran twice in one pass
            return self.state.cast_output(output)
        self._to_run.discard(id(module))
        if self._to_run:
            self._partial_outputs.append(output)
            return self.state.cast_output(output)
        return self._complete(module, args, output)

    def complete_open_pass(self) -> None:
        """The root's forward ended with some module of this group never run: finish the pass now."""
        if self._to_run:
            self._to_run.clear()
            self._complete(self.modules[0], (), None)

    def _complete(self, module, args, output):
        also, self._partial_outputs = self._partial_outputs, []
        return self.state.post_forward(module, args, output, also_hook=tuple(also))
