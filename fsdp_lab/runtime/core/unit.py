"""One wrapped unit: its state machine and the hooks that drive the article's four beats.

    forward:  gather (all-gather) → compute → free          (free only under FULL_SHARD)
    backward: re-gather → compute gradients → reduce-scatter → free

[Note: when a unit's backward is over] The unsharded trainable buffer `full` is an autograd leaf; every original
parameter is a view of it. Autograd calls the leaf's post-accumulate-grad hook once per backward, after every use
of the unit (also when it ran several forwards) has produced its gradient: that is when the gradient is complete,
so that is when we reduce it and free the parameters. A unit with frozen parameters also waits until the
gradients of its inputs exist (a pass-through autograd node on its inputs), since computing those still reads
the frozen weights. If neither signal can fire, the root's end-of-backward callback frees the unit.

[Note: overlap] On CUDA forward gathers overlap compute without any option: the gather stream waits for compute
once per iteration, so the all-gather the host issues in unit i+1's pre-forward can run while the GPU still
computes unit i (torch's implicit forward prefetching). A gather is issued (state GATHERING) and waited for
(state UNSHARDED) in two separate places, so that explicit prefetch can issue a gather earlier still, before this
unit's compute is queued: forward_prefetch in pre_forward, BACKWARD_PRE (the default) when a unit's backward
starts, BACKWARD_POST once its gradients are reduced and it is freed. At most ctx.max_gathers_in_flight gathers
are issued and not yet waited for; limit_all_gathers also bounds the unsharded buffers still allocated, as
torch's rate limiter does (at most one freed buffer is held when a new one is allocated: streams.FreeQueue).
The copy-in and the collective run on the gather stream and the reduce-scatter on the reduce stream; a freed
buffer's storage is held until the gather stream has waited for its readers (fsdp_lab/runtime/core/streams.py
explains the ordering and the memory rules). On CPU the same code runs with null streams: a gather issued early
runs on gloo's thread until the unit waits for it ([Note: a prefetch on CPU] in streams.py), every other
collective completes before its call returns. Reductions are waited for at the latest by the root's
end-of-backward callback.
"""
from __future__ import annotations

import enum

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_lab.runtime.core.strategy import BackwardPrefetch
from fsdp_lab.runtime.core.reduction import ReduceOptions, reduce_flat_param
from fsdp_lab.runtime.core.streams import gather_flat_param, label


class UnitState(enum.Enum):
    # Every transition looks up (state, event) in _TRANSITIONS: hash by identity (C), not Enum's Python-level
    # hash of the name. Members are singletons, so equal states are the same object either way.
    __hash__ = object.__hash__

    SHARDED = "SHARDED"
    """Only this rank's shard is live; the unsharded buffer has 0 bytes (or, for replicated strategies, must be
    refreshed from the masters before the next compute)."""
    GATHERING = "GATHERING"
    """An all-gather into the unsharded buffer is in flight (prefetch); wait before computing."""
    UNSHARDED = "UNSHARDED"
    """The unit's full parameters are live and the module's attributes are views of them."""
    SHARDED_POST_FORWARD = "SHARDED_POST_FORWARD"
    """fully_shard's reshard_after_forward=int after forward: the unsharded buffer is freed, and this rank keeps
    its group's part of it for backward's re-gather within the group (fsdp_lab/runtime/fsdp2/post_forward.py)."""


_TRANSITIONS = {
    (UnitState.SHARDED, "gather"): UnitState.GATHERING,
    (UnitState.GATHERING, "gathered"): UnitState.UNSHARDED,
    (UnitState.UNSHARDED, "free"): UnitState.SHARDED,
    (UnitState.UNSHARDED, "reshard_to_group"): UnitState.SHARDED_POST_FORWARD,
    (UnitState.SHARDED_POST_FORWARD, "gather"): UnitState.GATHERING,
    (UnitState.SHARDED_POST_FORWARD, "free"): UnitState.SHARDED,
}
_GATHERABLE = (UnitState.SHARDED, UnitState.SHARDED_POST_FORWARD)
# A gather's trace events and profiler label, by whether it is backward's re-gather: named once, not per call.
_GATHER_NAMES = {False: ("gather", "gather_start", "gather_end", "fsdp_lab::gather "),
                 True: ("regather", "regather_start", "regather_end", "fsdp_lab::regather ")}


class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's whole backward is done."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit._on_inputs_grad_ready()
        return (None, *grads)


class Unit:
    def __init__(self, name: str, module: torch.nn.Module, flats: list, ctx, is_root: bool):
        self.name, self.module, self.flats, self.ctx, self.is_root = name, module, flats, ctx, is_root
        self.state = UnitState.SHARDED
        self._pending = []  # gathers issued and not yet waited for: their events (None on CPU)
        self._backward_pending = False
        self._reduced = False
        self._reduced_flats = set()
        self._inputs_marker = False
        self._inputs_grad_ready = False
        self._backward_started = False
        self.summoned = False  # inside summon_full_params: forward uses the summoned parameters ([Note: recurse=False])
        self.hook_handles = []  # the module's forward hooks, removed if an outer FSDP takes this unit over
        # Per-unit settings of the fully_shard front end (FSDPModule.set_*); FSDP1 leaves them to the strategy.
        self.reshard_after_forward = None  # None: the strategy decides (FULL_SHARD frees all but the root)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.forward_prefetch_units = None  # None: the neighbour in the recorded order (if prefetch is on)
        self.backward_prefetch_units = None
        self.unshard_in_backward = True  # False: backward never re-gathers (an embedding's weight is not read)
        self.reduce_options = ReduceOptions()  # how gradients are reduced (fully_shard's set_* methods)
        self._ever_gathered = False  # torch reduces an unused unit's zeros only once it has been unsharded
        self.post_forward_group = None  # reshard_after_forward=int: the PostForwardGroup to reshard to
        self._held_group = None  # the group whose shards this unit holds (state SHARDED_POST_FORWARD)
        # A unit's flats and their requires_grad are fixed when it is made; the hooks read these every step.
        self._trainable = [g for g in flats if g.requires_grad]
        self._frozen = [g for g in flats if not g.requires_grad]
        for flat in self.trainable_flats:
            flat.full.register_post_accumulate_grad_hook(lambda full, g=flat: self._on_grad_ready(g))
        for flat in flats:
            flat.grad_stash = None  # no_sync: the local unsharded gradient summed over micro-batches
            flat.partial_reduce = None  # HSDP with set_requires_all_reduce(False): the reduce-scattered sum
            flat.replica_grad = None  # ZeRO-1: the replicated fp32 gradient (its own chunk reduced)
        if any(g.persistent_full for g in flats):
            for g in flats:
                g.install_views()

    @property
    def trainable_flats(self):
        return self._trainable

    @property
    def frozen_flats(self):
        return self._frozen

    def full_storage_sizes(self) -> list[int]:
        """Bytes of storage behind each flat's unsharded buffer: 0 once freed."""
        return [g.full.untyped_storage().size() for g in self.flats]

    def __repr__(self):
        return f"Unit({self.name!r}, {self.state.name})"

    # -- the state machine ---------------------------------------------------------------------------------
    def _transition(self, event: str) -> None:
        nxt = _TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise RuntimeError(f"FSDP unit '{self.name}': event '{event}' is not allowed in state "
                               f"{self.state.name}")
        self.state = nxt

    def gather(self, phase: str, wait: bool = True) -> None:
        """Issue the all-gather of every flat (copy-in casts the fp32 shard to the compute dtype); with
        wait=False (prefetch) the unit stays GATHERING until wait_gathered()."""
        if self.state not in _GATHERABLE:
            return
        group, self._held_group = self._held_group, None  # set: re-gather within it, from the kept shards
        self._transition("gather")
        self._ever_gathered = True
        names = _GATHER_NAMES[phase == "backward"]
        extra = {} if group is None else {"group": "post_forward", "group_ranks": list(group.ranks)}
        ctx = self.ctx
        ctx.emit(names[1], self.name, phase, prefetch=not wait, **extra)
        calls = []
        with label(names[3], self.name):
            for flat in self.flats:
                gathered, comm = gather_flat_param(ctx, flat, group, ahead=not wait, phase=phase)
                self._pending.append(gathered)
                if comm is not None:
                    calls.append(comm)
        self._gather_comm = (names, phase, tuple(calls), extra)
        if wait:
            self.wait_gathered()

    def wait_gathered(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        for event in self._pending:
            self.ctx.streams.compute_waits(event)
        self._pending.clear()
        self._transition("gathered")
        names, phase, calls, extra = self._gather_comm
        self.ctx.emit(names[2], self.name, phase, calls, **extra)

    def ensure_unsharded(self, phase: str) -> None:
        if self.state in _GATHERABLE:
            self.gather(phase)
        self.wait_gathered()

    def free(self, phase: str) -> None:
        if self.state is UnitState.GATHERING:
            self.wait_gathered()
        if self.state is UnitState.SHARDED_POST_FORWARD:  # drop the kept shards: nothing re-gathers from them
            for flat in self.flats:
                flat.post_forward_shard = None
            self._held_group = None
            self._transition("free")
            self.ctx.emit("free", self.name, phase)
            return
        if self.state is not UnitState.UNSHARDED:
            return
        for flat in self.flats:
            if flat.views_dropped_when_freed:
                flat.uninstall_views()
        self.ctx.frees.push(self.flats)  # storage kept until its readers are done ([Note: memory across streams])
        self._transition("free")
        self.ctx.emit("free", self.name, phase)

    def reshard_to_group(self) -> None:
        """reshard_after_forward=int: free the unsharded buffer as free() does, keeping this rank's part of it for
        its group ([Note: the post-forward shard] in fsdp_lab/runtime/fsdp2/post_forward.py). The copy runs on the
        gather stream, which wrote `full` and reads the kept shards again."""
        group = self.post_forward_group
        with torch.no_grad(), self.ctx.streams.side("gather"):
            for flat in self.flats:
                flat.keep_post_forward(group)
        for flat in self.flats:
            flat.uninstall_views()
        self.ctx.frees.push(self.flats)
        self._held_group = group
        self._transition("reshard_to_group")
        self.ctx.emit("free", self.name, "forward", group="post_forward", group_ranks=list(group.ranks))

    # -- forward -------------------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if self.summoned:
            return None
        recompute = self.ctx.in_backward  # activation checkpointing re-runs forward inside backward
        if self.is_root and not recompute:
            self.ctx.begin_iteration()
        self.ensure_unsharded("backward" if recompute else "forward")
        if not recompute:
            self.ctx.record_forward(self)
            self._prefetch_all(self.forward_prefetch_units, +1, self.ctx.forward_prefetch, "forward")
        for flat in self.flats:
            flat.install_views()
        self.ctx.emit("forward_start", self.name, "backward" if recompute else "forward")
        if self.frozen_flats and torch.is_grad_enabled() and not recompute:
            return self._mark_inputs(args, kwargs)
        return None

    def _mark_inputs(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        self._inputs_marker = bool(idx)
        if not idx:
            return None
        marked = _InputsGradReady.apply(self, *[flat[i] for i in idx])
        marked = marked if isinstance(marked, tuple) else (marked,)
        for i, t in zip(idx, marked):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, module, args, output):
        if self.summoned:
            return output
        recompute = self.ctx.in_backward
        self.ctx.emit("forward_end", self.name, "backward" if recompute else "forward")
        if recompute:
            return output
        self.ctx.record_post_forward(self)
        hooked = False
        if torch.is_grad_enabled():
            for t in (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
                    hooked = True
        if hooked:
            self._backward_pending = True
            self._reduced = self._inputs_grad_ready = self._backward_started = False
            self._reduced_flats.clear()
        if hooked and self.frees_after_forward and self.post_forward_group is not None:
            self.reshard_to_group()
        elif not hooked or self.frees_after_forward:
            self.free("forward")
        return output

    # -- backward ------------------------------------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        if not self._backward_pending:
            raise RuntimeError(
                f"FSDP unit '{self.name}': a second backward reached parameters that were freed and whose "
                f"gradients were already reduce-scattered by the first backward. Run forward again before each "
                f"backward (retain_graph=True cannot bring freed shards back).")
        if self.ctx.on_backward_start is not None:
            self.ctx.on_backward_start()
        if not self._backward_started:
            self._backward_started = True
            for flat in self.trainable_flats:
                if flat.orig_params is not None:
                    flat.orig_grads_to_shard()
            if not self.unshard_in_backward:  # FSDPModule.set_unshard_in_backward(False)
                self.ctx.emit("backward_start", self.name, "backward")
                return grad
            self.ensure_unsharded("backward")
            # A forward checkpointed inside the unit (hooks outside, as apply_activation_checkpointing does it;
            # Hugging Face checkpoints the layer's __call__, hooks inside) is recomputed without pre_forward: the
            # attributes must point at the re-gathered buffer now. Only use_orig_params drops them at the free;
            # otherwise they are views of the buffer the re-gather refilled. Grad mode on, so the recomputation
            # saves what the forward saved.
            with torch.enable_grad():
                for flat in self.flats:
                    if flat.views_dropped_when_freed:
                        flat.install_views(reuse=True)  # [Note: views cut once per forward] in layout.py
            self.ctx.emit("backward_start", self.name, "backward")
            self._prefetch_all(self.backward_prefetch_units, -1,
                               self.ctx.backward_prefetch is BackwardPrefetch.BACKWARD_PRE, "backward")
        return grad

    @property
    def frees_after_forward(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.ctx.strategy.frees_after_forward and not self.is_root

    def _prefetch_all(self, explicit, step: int, implicit: bool, phase: str) -> None:
        """Prefetch the units set by FSDPModule.set_modules_to_*_prefetch, else the recorded neighbour. An empty
        list is no list, as in torch: set_modules_to_backward_prefetch([]) brings the default prefetch back."""
        if explicit:
            for unit in explicit:
                self._prefetch(unit, phase)
        elif implicit:
            self._prefetch(self.ctx.neighbour(self, step), phase)

    def _prefetch(self, unit, phase):
        if unit is None or unit.state not in _GATHERABLE:
            return
        if phase == "backward" and not (unit._backward_pending and unit.unshard_in_backward):
            return
        in_flight = sum(1 for u in self.ctx.forward_order if u.state is UnitState.GATHERING)
        if in_flight < self.ctx.max_gathers_in_flight:
            unit.gather(phase, wait=False)

    def _on_grad_ready(self, flat) -> None:
        # Traced while the unsharded gradient is still alive: the article's second 2Φ_layer of M_peak.
        self.ctx.emit("grad_ready", self.name, "backward")
        grad, flat.full.grad = flat.full.grad, None
        self._reduce(flat, grad)
        self._reduced_flats.add(id(flat))
        if len(self._reduced_flats) == len(self.trainable_flats):
            self._reduced = True
            self._maybe_finish_backward()  # free first: BACKWARD_POST trades overlap for a lower peak
            if self.ctx.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
                self._prefetch_all(self.backward_prefetch_units, -1, True, "backward")

    def _on_inputs_grad_ready(self) -> None:
        self._inputs_grad_ready = True
        self._maybe_finish_backward()

    def _maybe_finish_backward(self) -> None:
        needs_reduce = bool(self.trainable_flats) and not self._reduced
        needs_inputs = bool(self.frozen_flats) and self._inputs_marker and not self._inputs_grad_ready
        if self._backward_pending and not needs_reduce and not needs_inputs:
            self._backward_pending = False
            if self.reshard_after_backward:
                self.free("backward")

    def finish_backward(self, wait_reduces: bool = True) -> None:
        """Root's end-of-backward duty: wait for every reduction (unless more backwards follow before the
        optimizer: FSDPModule.set_is_last_backward(False)), free whatever no hook could free (unused or
        frozen-only units)."""
        self._reduce_unused()
        if wait_reduces:
            self.ctx.reduces.drain()
        if self.state is not UnitState.SHARDED and self.reshard_after_backward:
            self.free("backward")
        self.ctx.frees.drain()
        self._backward_pending = False
        self._reduced_flats.clear()

    # [Note: unused parameters] A unit whose parameters got no gradient on this rank (an MoE expert no token was
    # routed to, a tower this batch skipped) reduces nothing, so the ranks that did use it wait in a
    # reduce-scatter this rank never enters. With set_reduce_scatter_unused_params(True), as in torch, such a
    # unit reduces zeros at the end of backward: each trainable flat that reduced nothing this backward, if the
    # unit was ever unsharded (torch's condition: before that it has no unsharded parameter to give a zero
    # gradient). Ranks must still reach these reductions in the same order, which the root's fixed order of
    # units gives when every rank skips the same way; a unit used on one rank and unused on another reduces in
    # its hook on the first and here on the second, which matches only if nothing else reduces in between.
    def _reduce_unused(self) -> None:
        if not (self.reduce_options.reduce_unused and self._ever_gathered and self.ctx.sync_gradients
                and self.requires_gradient_sync):
            return
        for flat in self.trainable_flats:
            if id(flat) not in self._reduced_flats:
                zeros = torch.zeros(flat.full.shape, dtype=flat.compute_dtype, device=flat.full.device)
                self._reduce(flat, zeros)
                self._reduced_flats.add(id(flat))
        if self._backward_pending and len(self._reduced_flats) == len(self.trainable_flats):
            self._reduced = True

    def reset_abandoned_backward(self) -> None:
        """Forget a backward that raised half-way ([Note: per-iteration state is reset at the root's
        pre-forward] in api.py): free the parameters, drop the half-built gradients, clear the flags."""
        self.free("reset")
        for flat in self.trainable_flats:
            flat.grad_stash = flat.partial_reduce = None
            if flat.full is not flat.shard:
                flat.full.grad = None
        self._backward_pending = self._backward_started = False
        self._reduced = self._inputs_grad_ready = False
        self._reduced_flats.clear()

    def _reduce(self, flat, grad) -> None:
        ctx = self.ctx
        if grad is None:
            return
        if not (ctx.sync_gradients and self.requires_gradient_sync):  # no_sync(): keep it, communicate nothing
            if flat.full is flat.shard:
                flat.shard.grad = grad
            else:
                stash = flat.grad_stash
                flat.grad_stash = grad.float() if stash is None else stash.add_(grad)
            return
        if flat.grad_stash is not None:
            grad, flat.grad_stash = flat.grad_stash.add_(grad), None
        reduce_flat_param(ctx, flat, grad, self.name, self.reduce_options)
