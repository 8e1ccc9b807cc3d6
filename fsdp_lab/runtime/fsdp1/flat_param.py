"""One unit's parameters flattened into one padded buffer, of which this rank keeps a 1/N chunk.

[Note: flat buffers] Every parameter of a unit (of one requires_grad kind) is laid end to end in a single
1-D buffer, padded with zeros so its length divides by the world size N. Rank r keeps elements
[r*S, (r+1)*S) with S = padded/N as an `nn.Parameter` of its own: that shard is the fp32 master the optimizer
sees, so AdamW's state is sharded with no special code. While a unit is unsharded, `full` holds the whole
buffer (in the compute dtype) and the module's original attributes are views into it.

[Note: freeing by storage resize] `full` is created once and kept for the life of the unit. Freeing resizes its
storage to 0 bytes; gathering resizes it back and writes into it. Autograd's saved tensors are views of `full`,
so after a re-gather in backward they see valid data again without being re-created. Writes go through
`full.data`, whose version counter is separate, so autograd does not mistake a re-gather for an in-place edit.

[Note: aligned offsets] Each parameter starts at an offset that is a multiple of 16 bytes in every dtype the
buffer is held in (the fp32 master and the compute dtype: 4 elements in fp32, 8 when bf16 or fp16 is used too).
A view at an unaligned address pushes cuBLAS and vectorised kernels onto slower paths. The gaps are zeros, like
the end padding: their gradient is zero, so they stay zero. `numel` counts them (it is where the last parameter
ends), so the byte accounting (fsdp_lab/runtime/core/memory.py, fsdp_lab/theory/formulas.py) includes them.

[Note: the master is the parameters' own dtype] The shard keeps the dtype the parameters had when they were
wrapped: a model loaded in bf16 trains in bf16 (bf16 shard, gradients and reduce-scatter, bf16 optimizer state),
as torch FSDP1 does. Without a MixedPrecision field, the gather and the reduce carry that dtype too. The one
constraint is torch's: one flat buffer holds one dtype, so the parameters of a unit (of one requires_grad kind)
must share theirs; different units may differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lab.runtime.core.layout import UnshardedViews
from fsdp_lab.runtime.core.placement import Home, Placement


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the flat buffer. `aliases` lists every (module, attribute,
    qualified name) that referred to it: a tied weight has several aliases and one slot."""

    aliases: tuple
    shape: torch.Size
    offset: int
    numel: int

    @property
    def name(self) -> str:
        return self.aliases[0][2]


ALIGN_BYTES = 16


def align_elements(*dtypes: torch.dtype) -> int:
    """Elements per ALIGN_BYTES in the narrowest of `dtypes`: a multiple of it is 16-byte aligned in all of them."""
    return ALIGN_BYTES // min(torch.empty(0, dtype=d).element_size() for d in dtypes)


def check_flat_dtypes(unit_params) -> None:
    """One dtype per flat buffer ([Note: the master is the parameters' own dtype]); a mix is refused, naming the
    unit and its parameters' dtypes, as torch's FSDP1 refuses it."""
    for info in unit_params:
        for params in (info.trainable, info.frozen):
            dtypes = {}
            for param, aliases in params:
                dtypes.setdefault(param.dtype, aliases[0][2])
            if len(dtypes) > 1:
                seen = ", ".join(f"{dtype} ('{name}')" for dtype, name in dtypes.items())
                raise ValueError(f"FSDP unit '{info.name or '<root>'}': one flat parameter needs one dtype, got "
                                 f"{seen}. Must flatten tensors with uniform dtype: cast the module to one dtype "
                                 f"(a MixedPrecision policy casts what is gathered, not the parameters)")
            bad = [d for d in dtypes if not d.is_floating_point]
            if bad:
                raise ValueError(f"FSDP unit '{info.name or '<root>'}': parameter '{dtypes[bad[0]]}' has dtype "
                                 f"{bad[0]}, which is not floating")


def padded_size(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size if numel else world_size


class FlatParam(UnshardedViews):
    """The flat buffer of one unit's trainable (or one unit's frozen) parameters."""

    def __init__(self, unit_name: str, entries: list, world_size: int, rank: int, *, requires_grad: bool,
                 compute_dtype: torch.dtype | None, keep_replica: bool, shard_storage: bool,
                 reduce_dtype: torch.dtype | None = None, device: torch.device | None = None,
                 placement: Placement | None = None):
        self.unit_name = unit_name
        self.requires_grad = requires_grad
        self.world_size, self.rank = world_size, rank
        originals = [param for param, _aliases in entries]
        self.master_dtype = originals[0].dtype  # [Note: the master is the parameters' own dtype]
        self.compute_dtype = compute_dtype = compute_dtype or self.master_dtype  # None: no MixedPrecision field
        self.reduce_dtype = reduce_dtype or compute_dtype
        device = device if device is not None else originals[0].device
        # [Note: host and device] in fsdp_lab/runtime/features/offload.py: where the shard lives and where it computes
        self.placement = placement or Placement(Home.DEVICE, device)
        self.compute_device = self.placement.compute_device
        align = align_elements(self.master_dtype, compute_dtype)
        offset, slots = 0, []
        for param, aliases in entries:
            offset = -(-offset // align) * align  # [Note: aligned offsets]
            slots.append(ParamSlot(tuple(aliases), param.shape, offset, param.numel()))
            offset += param.numel()
        self.slots: list[ParamSlot] = slots
        self.numel = offset
        self.padded_numel = padded_size(offset, world_size) if shard_storage or keep_replica else offset
        self.shard_numel = self.padded_numel // world_size if (shard_storage or keep_replica) else offset
        start = rank * self.shard_numel
        self.shard_offset = start if (shard_storage or keep_replica) else 0  # where the shard starts in `flat`
        self.orig_params = None  # use_orig_params: one Parameter per slot ([Note: original parameters])
        self.replica = None
        self.post_forward_shard = None  # fully_shard's reshard_after_forward=int only: never set here
        self.replica_epoch = 0  # ZeRO-1: the FSDPState.param_epoch whose masters the replica holds (None: stale)
        # [Note: no whole flat buffer at wrap time] Only what this rank keeps is allocated (its chunk, or all of it
        # where it keeps a replica); load_params copies each parameter's overlap with it in. So wrapping a unit
        # needs its shard beside the original parameters, not a second unsharded copy of them.
        sharded = shard_storage and not keep_replica
        flat = torch.zeros(self.shard_numel if sharded else self.padded_numel, dtype=self.master_dtype, device=device)
        if keep_replica:  # ZeRO-1: a replicated fp32 copy stays; the shard is a window onto it
            self.replica = flat
            self.shard = nn.Parameter(flat.data[start:start + self.shard_numel], requires_grad=requires_grad)
        else:  # this rank's chunk; NO_SHARD: the "shard" is the whole replicated master; offloaded, on the host
            home = self.placement.to_home(flat, pin=True) if self.placement.offloaded else flat
            self.shard = nn.Parameter(home, requires_grad=requires_grad)
        self.full = self._make_full_tensor(flat, keep_replica, shard_storage)
        self.persistent_full = self.full is self.shard or self.full is self.replica
        if not self.persistent_full:
            self.free_full()
        if not any(p.is_meta for p in originals):  # on meta: the caller loads them once they are materialised
            self.load_params(originals)

    def load_params(self, tensors) -> None:
        """Copy each slot's values (one tensor per slot, in slot order) into the master this rank keeps: its chunk
        of the flat buffer, or all of it (NO_SHARD, ZeRO-1's replica)."""
        master = (self.replica if self.replica is not None else self.shard).data
        base = 0 if self.replica is not None else self.shard_offset  # where master[0] is in the flat buffer
        with torch.no_grad():
            for tensor, slot in zip(tensors, self.slots):
                if tuple(tensor.shape) != tuple(slot.shape) or tensor.is_meta:
                    raise ValueError(f"FSDP unit '{self.unit_name}': '{slot.name}' is {tuple(tensor.shape)} on "
                                     f"{tensor.device} after initialisation, expected {tuple(slot.shape)} off the "
                                     f"meta device")
                lo, hi = max(slot.offset, base), min(slot.offset + slot.numel, base + master.numel())
                if hi > lo:
                    master[lo - base:hi - base].copy_(tensor.detach().reshape(-1)[lo - slot.offset:hi - slot.offset])

    def _make_full_tensor(self, flat, keep_replica, shard_storage) -> torch.Tensor:
        same_dtype = self.compute_dtype == self.master_dtype and not self.placement.offloaded
        if not shard_storage and not keep_replica and same_dtype:
            return self.shard
        if keep_replica and same_dtype:
            return self.replica.requires_grad_(self.requires_grad)
        full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=flat.device)
        return full.requires_grad_(self.requires_grad)

    def local_shards(self) -> list[torch.Tensor]:
        """The master this rank holds: its flat shard (under NO_SHARD, the whole buffer)."""
        return [self.shard]

    def local_grads(self) -> list[torch.Tensor]:
        return [] if self.shard.grad is None else [self.shard.grad]

    # -- the collectives' copy-in and copy-out ([Note: two layouts] in fsdp_lab/runtime/core/layout.py) -------------
    def copy_in(self) -> torch.Tensor:
        """The all-gather's input: the shard itself (the collective casts it), no copy; offloaded, its copy on the
        compute device, cast on the way ([Note: host and device] in fsdp_lab/runtime/features/offload.py)."""
        if self.placement.offloaded:
            return self.placement.to_compute(self.shard.detach(), self.compute_dtype)
        return self.shard.detach()

    def gather_output(self, full: torch.Tensor) -> torch.Tensor:
        """The all-gather writes straight into `full`: rank r's chunk is elements [r*S, (r+1)*S) of the buffer."""
        return full

    def copy_out(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Nothing to do: the gathered buffer is the unsharded one."""

    def reduce_input(self, grad: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter's input: the flat gradient, whose chunks are already in rank order."""
        return grad

    def store_shard_grad(self, out: torch.Tensor) -> None:
        """Put this rank's reduced chunk on the fp32 shard's .grad, adding to one already there (offloaded: copied
        to the host first, [Note: accumulating offloaded gradients] in fsdp_lab/runtime/features/offload.py)."""
        if self.placement.offloaded:
            out = self.placement.to_home(out)
        if self.shard.grad is not None:
            self.shard.grad.add_(out)
        else:
            self.shard.grad = out if out.dtype == self.shard.dtype else out.to(self.shard.dtype)

    # -- original parameters as views ----------------------------------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """Views of `full` for each slot, tracked by autograd when grad is enabled (gradients flow to `full`).
        One split (not one slice per parameter): backward then builds the flat gradient with a single cat."""
        if self._view_plan is None:
            sizes, picks, end = [], [], 0
            for s in self.slots:
                if s.offset > end:  # an alignment gap
                    sizes.append(s.offset - end)
                picks.append(len(sizes))
                sizes.append(s.numel)
                end = s.offset + s.numel
            if self.padded_numel > end:
                sizes.append(self.padded_numel - end)
            self._view_plan = (sizes, picks, [tuple(s.shape) for s in self.slots])  # a tuple views faster
        return self._split_views(*self._view_plan)

    @property
    def views_dropped_when_freed(self) -> bool:
        """A buffer that is freed: its views are replaced once it is freed ([Note: an attribute while sharded]),
        so they must be installed again before the next compute."""
        return not self.persistent_full

    def install_views(self, reuse: bool = False) -> None:
        """Point every original attribute at its view of `full`; while `full` is freed, at what stands in for it
        then ([Note: an attribute while sharded]). reuse: as in UnshardedViews.install_views."""
        if not self.is_full_allocated():
            self.hide_freed_views()
            return
        for slot, view in zip(self.slots, self.unsharded_views(reuse)):
            for module, attr, _name in slot.aliases:
                # A plain instance attribute (the name left module._parameters at wrap time); writing the
                # instance dict skips nn.Module.__setattr__'s checks, which run for every parameter every step.
                module.__dict__[attr] = view

    def my_chunk(self, full_flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full flat buffer (a view)."""
        start = self.rank * self.shard_numel
        return full_flat[start:start + self.shard_numel]

    # -- use_orig_params -----------------------------------------------------------------------------------
    # [Note: original parameters] With use_orig_params=True every original parameter stays registered under its
    # own name as an nn.Parameter that is a 1-D view of this rank's part of the shard (empty when the rank
    # holds none of it), as in torch FSDP1. The optimizer updates those views, so it updates the shard; the
    # views share the shard's version counter (a view of shard.detach()). Their .grad are views of shard.grad,
    # pointed there at the end of each backward; before a unit's next backward whatever the optimizer or the
    # user did to them (set_to_none, zero_, a new tensor) is folded back into shard.grad. During forward the
    # module's attribute is the unsharded view instead (an instance attribute, which shadows the registered
    # parameter, see install_views).
    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """(start in this rank's shard, length) of `slot`'s elements that this rank holds; length may be 0."""
        lo = max(slot.offset, self.shard_offset)
        hi = min(slot.offset + slot.numel, self.shard_offset + self.shard_numel)
        start = min(max(lo - self.shard_offset, 0), self.shard_numel)
        return start, max(0, hi - lo)

    def make_orig_params(self) -> list[nn.Parameter]:
        base = self.shard.detach()
        self.orig_params = [nn.Parameter(base[start:start + length], requires_grad=self.requires_grad)
                            for start, length in map(self.local_range, self.slots)]
        return self.orig_params

    def orig_grads_to_shard(self) -> None:
        """Fold the original parameters' .grad into shard.grad before a backward adds to it."""
        held = [(p, self.local_range(slot)) for p, slot in zip(self.orig_params, self.slots)
                if self.local_range(slot)[1] > 0]
        if all(p.grad is None for p, _ in held):
            self.shard.grad = None
            return
        with torch.no_grad():
            if self.shard.grad is None:
                self.shard.grad = torch.zeros_like(self.shard)
            for p, (start, length) in held:
                target = self.shard.grad[start:start + length]
                if p.grad is None:
                    target.zero_()
                elif p.grad.data_ptr() != target.data_ptr():
                    target.copy_(p.grad)

    def shard_grad_to_orig(self) -> None:
        """Point every original parameter's .grad at its part of shard.grad (None where this rank holds none)."""
        grad = self.shard.grad
        for p, slot in zip(self.orig_params, self.slots):
            start, length = self.local_range(slot)
            if grad is None or length == 0:
                p.grad = None
            elif grad.dtype == p.dtype:
                p.grad = grad[start:start + length]
            else:  # keep_low_precision_grads: a gradient of another dtype can only be set through .data
                p.grad = torch.empty_like(p)
                p.grad.data = grad[start:start + length]

    def uninstall_views(self) -> None:
        """At the free: with use_orig_params the attribute becomes the registered (sharded) original parameter at
        once. Other views stay until the forward or backward is over (hide_freed_views), so forward hooks that run
        after the unit's own see what torch FSDP1's see ([Note: an attribute while sharded])."""
        if self.orig_params is not None:
            self.hide_freed_views()

    def hide_freed_views(self) -> None:
        """While `full` is freed, replace every view of it: the registered original parameter (use_orig_params),
        otherwise a ShardedAttribute."""
        if self.is_full_allocated():
            return
        for slot in self.slots:
            stand_in = None if self.orig_params is not None else ShardedAttribute(slot, self)
            for module, attr, _name in slot.aliases:
                if stand_in is None:
                    module.__dict__.pop(attr, None)
                else:
                    module.__dict__[attr] = stand_in


# [Note: an attribute while sharded] Outside forward and backward a unit's unsharded buffer has 0 bytes. A view of
# it left on the module would still claim its shape, and reading it (`model.module.fc.weight.sum()`) would read
# freed memory: a segfault, or garbage. So each view is replaced once the unit is freed and the forward (the
# root module's forward hook) or the backward (the end-of-backward callback) is over; inside a forward a hook
# that runs after a unit's own sees the freed view, as in torch FSDP1. With use_orig_params the attribute is then
# the registered original parameter, this rank's 1-D part of it, as in torch FSDP1. Otherwise it is a
# ShardedAttribute: it answers what does not need the values (shape, dtype, device, requires_grad) and raises an
# error that says where the values are for anything else, whether reached as a method, an operator or a torch
# function (through __torch_function__, which torch consults for any argument that defines it).
class ShardedAttribute:
    """Stands in for an original parameter while its unit is sharded (use_orig_params=False)."""

    def __init__(self, slot: ParamSlot, flat: "FlatParam"):
        self.name, self.unit_name = slot.name, flat.unit_name
        self.shape = slot.shape
        self.dtype, self.device = flat.compute_dtype, flat.shard.device
        self.requires_grad = flat.requires_grad

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def message(self) -> str:
        return (f"'{self.name}' is sharded: outside forward and backward this rank holds only its shard of FSDP "
                f"unit '{self.unit_name}', so the full {tuple(self.shape)} tensor does not exist. Read it inside "
                f"`with FSDP.summon_full_params(model):`, or from model.state_dict(); with use_orig_params=True "
                f"the attribute is this rank's part of it")

    def __getattr__(self, attr):
        raise AttributeError(f"cannot use .{attr}: {self.message()}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        stand_in = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)) if args or kwargs \
            else None
        raise RuntimeError(stand_in.message() if stand_in is not None else "a sharded FSDP parameter was used")

    def __repr__(self):
        return f"ShardedAttribute({self.name!r}, shape={tuple(self.shape)}, unit={self.unit_name!r})"

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(self.message())

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _refuse
    __truediv__ = __rtruediv__ = __pow__ = __neg__ = __getitem__ = __setitem__ = __iter__ = __len__ = _refuse
    __float__ = __int__ = __bool__ = __array__ = _refuse
