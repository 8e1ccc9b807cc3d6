"""FSDP2's layout: one fully_shard group's parameters, each sharded on dim 0 (or shard_placement_fn's dim) as a
DTensor, gathered in one go.

[Note: per-parameter shards] Each parameter of shape (d0, ...) is cut into N row blocks of c = ceil(d0/N) rows,
as torch.chunk and DTensor's Shard(0) cut it: rank r holds rows [r*c, min((r+1)*c, d0)), which may be fewer
than c or none at all. That block is the local tensor of a DTensor, wrapped in the nn.Parameter registered under
the parameter's own name, so `model.parameters()`, optimizers, clip_grad_norm_, `state_dict()` and
torch.distributed.checkpoint see ordinary DTensors. The padding rows (up to c per rank) exist only on the wire.
shard_placement_fn may put a parameter on another dim instead ([Note: sharding on another dim] in
fsdp_lab/runtime/fsdp2/shard_dim.py); what follows holds for it with "rows" read as slices along that dim.

[Note: copy-in, copy-out] The group's all-gather moves one buffer of S = sum(c_i * row_numel_i) elements per rank:
    copy-in   this rank's blocks, cast to the compute dtype, packed end to end into the send buffer (one foreach
              copy); the padding is left as is, since nobody reads it
    gather    rank-major output (N, S): row r is rank r's send buffer
    copy-out  one split-copy into `full`, laid out parameter-major: parameter i owns N*c_i rows, so its first d0
              rows are its unsharded tensor, contiguous
Gradients go back the other way: the gradient of `full` (parameter-major) is re-packed rank-major by one cat,
reduce-scattered, and this rank's part of the result is cut into one DTensor gradient per parameter (views of the
reduce-scatter output, no copy). At world size 1 both orders coincide: the gather writes `full` directly.

[Note: one leaf per group] torch FSDP2 gives every unsharded parameter its own tensor. Here they are views of one
autograd leaf `full`, as in the flat layout, so the unit's signal that the group's gradients are complete (one
post-accumulate-grad hook on `full`) is the same for both layouts. The memory is the same: N*S elements.
Frozen and trainable parameters of one fully_shard call form two groups (a leaf has one requires_grad), so such
a module issues two all-gathers where torch issues one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_lab.runtime.core.collectives import Collective, all_gather_flat
from fsdp_lab.runtime.core.layout import UnshardedViews
from fsdp_lab.runtime.core.misuse import mark_replaced, mark_sharded
from fsdp_lab.runtime.core.placement import Home, Placement
from fsdp_lab.runtime.features.hybrid import shard_coordinate, shard_placements
from fsdp_lab.runtime.fsdp2.shard_dim import copy_out_other_dims, other_dim_plan, rank_major_other_dims
from fsdp_lab.runtime.fsdp2.tensor_parallel import as_tp, is_tp_param, sharded_spec


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of a group: its names, global shape, and where its rows live in the buffers. "Rows" are
    slices along the shard dim: dim 0 unless shard_placement_fn chose another ([Note: sharding on another dim] in
    fsdp_lab/runtime/fsdp2/shard_dim.py)."""

    aliases: tuple  # ((module, attribute, qualified name), ...): a tied weight has several
    shape: torch.Size
    rows: int  # c: rows per rank, padded (ceil(shape[dim]/N))
    local_rows: int  # rows this rank holds: c, fewer for the last ranks, or 0
    row_numel: int  # elements per row: the product of the other dims
    spec: object  # the DTensorSpec of the sharded parameter (its gradient gets the same one)
    tp_spec: object = None  # placed by tensor parallel: its "tp" DTensorSpec ([Note: FSDP over tensor parallel])
    dim: int = 0  # the shard dim

    @property
    def local_shape(self) -> tuple:
        return (*self.shape[:self.dim], self.local_rows, *self.shape[self.dim + 1:])

    @property
    def name(self) -> str:
        return self.aliases[0][2]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def shard_numel(self) -> int:  # padded: this parameter's part of the send buffer
        return self.rows * self.row_numel

    def registered(self) -> nn.Parameter:
        """The sharded parameter as the module holds it now (to_empty or load_state_dict(assign=True) may have
        swapped it since fully_shard)."""
        module, attr, _name = self.aliases[0]
        return module._parameters[attr]


def shard_parameter(param: nn.Parameter, mesh, rank: int, world_size: int, placement: Placement,
                    into: torch.Tensor | None = None, dim: int = 0) -> nn.Parameter:
    """The nn.Parameter wrapping rank `rank`'s block of `param` on `dim` (0, or shard_placement_fn's: [Note:
    sharding on another dim] in fsdp_lab/runtime/fsdp2/shard_dim.py) as a DTensor (on meta if `param` is), in
    its placement's home ([Note: host and device] in fsdp_lab/runtime/features/offload.py): rank and world size of the
    mesh's shard dimension; on a 2-D (HSDP) mesh it is replicated over the other. `into`: the block's place in
    the group's master buffer ([Note: one master buffer]), which becomes the local tensor. A DTensor placed by
    tensor parallel: its local tensor is what is cut ([Note: FSDP over tensor parallel])."""
    data = param._local_tensor if is_tp_param(param) else param
    rows = math.ceil(data.shape[dim] / world_size)
    start = min(rank * rows, data.shape[dim])
    local = data.detach()[start:start + rows] if dim == 0 else \
        data.detach().narrow(dim, start, rows).contiguous()  # even: every rank holds `rows`
    if into is not None:
        local = into.view(local.shape).copy_(local)
    elif local.device.type != "meta" and placement.offloaded:  # its own storage: the original can be freed
        local = placement.to_home(local, pin=True)
    elif local.device.type != "meta":
        local = local.to(placement.compute_device).clone()
    if is_tp_param(param):
        dtensor = DTensor(local, sharded_spec(param._spec, mesh, shard_placements(mesh)[-1]), requires_grad=False)
    else:
        dtensor = DTensor.from_local(local, mesh, shard_placements(mesh, dim), run_check=False, shape=param.shape,
                                     stride=param.stride())
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _local_rows(dim0: int, rank: int, world_size: int) -> int:
    """Rows of a dim-0 block rank `rank` holds ([Note: per-parameter shards])."""
    rows = math.ceil(dim0 / world_size)
    return max(0, min(dim0, (rank + 1) * rows) - rank * rows)


def _master_pieces(master: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """`master` cut end to end into pieces of `numels` elements, each over a storage of its own that starts at
    the piece's first byte and keeps the master's memory alive ([Note: a piece's own storage])."""
    storage, itemsize = master.untyped_storage(), master.element_size()
    pieces, start = [], 0
    for numel in numels:
        own = storage[start * itemsize:(start + numel) * itemsize]
        pieces.append(master.new_empty(0).set_(own, 0, (numel,)))
        start += numel
    return pieces


class ParamGroup(UnshardedViews):
    """The DTensor shards of one fully_shard group (of one requires_grad kind) and its unsharded buffer."""

    def __init__(self, unit_name: str, entries: list, mesh, *, requires_grad: bool, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, placement: Placement | None = None,
                 shard_dims: list[int] | None = None):
        self.unit_name, self.requires_grad = unit_name, requires_grad
        self.placement = placement or Placement(Home.DEVICE, device)
        self.compute_device = device
        self.rank, self.world_size = shard_coordinate(mesh)
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.shard, self.orig_params, self.persistent_full, self.replica = None, None, False, None
        self.grad_stash = self.replica_grad = None
        self.post_forward_shard = None  # reshard_after_forward=int: what this rank keeps after forward
        n, slots = self.world_size, []
        for param, aliases in entries:
            if param.dim() == 0:
                raise ValueError(f"fully_shard: parameter '{aliases[0][2]}' is a scalar (0-dim); fsdp_lab shards "
                                 f"on dim 0, so give it shape (1,)")
        shapes = [p._local_tensor.shape if is_tp_param(p) else p.shape for p, _a in entries]  # what is cut
        dims = shard_dims or [0] * len(entries)  # per entry: shard_placement_fn's dim (shard_dim.py), else 0
        row_numels = [math.prod(shape[:d]) * shape[d + 1:].numel() for shape, d in zip(shapes, dims)]
        held_numels = [_local_rows(shape[d], self.rank, n) * row_numel
                       for shape, d, row_numel in zip(shapes, dims, row_numels)]
        self._master = None  # [Note: one master buffer]
        if (not self.placement.offloaded and len({p.dtype for p, _a in entries}) == 1
                and all(p.device.type != "meta" for p, _a in entries)):
            self._master = torch.empty(sum(held_numels), dtype=entries[0][0].dtype, device=device)
        pieces = _master_pieces(self._master, held_numels) if self._master is not None else [None] * len(entries)
        for (param, aliases), piece, shape, dim, row_numel in zip(entries, pieces, shapes, dims, row_numels):
            tp_spec = param._spec if is_tp_param(param) else None
            sharded = shard_parameter(param, mesh, self.rank, n, self.placement, into=piece, dim=dim)
            mark_replaced(param, aliases[0][2], "fully_shard")  # [Note: traps that train nothing] in misuse.py
            mark_sharded(sharded, unit_name, aliases[0][2])
            for module, attr, _q in aliases:
                module._parameters[attr] = sharded
            rows = math.ceil(shape[dim] / n)
            local_rows = sharded.to_local().shape[dim]
            slots.append(ShardedParam(tuple(aliases), shape, rows, local_rows, row_numel, sharded._spec, tp_spec,
                                      dim))
        self.slots: list[ShardedParam] = slots
        self._tp_picks = [i for i, s in enumerate(slots) if s.tp_spec is not None]
        self.master_dtype = entries[0][0].dtype
        self.shard_numel = sum(s.shard_numel for s in slots)  # S
        self._padded_sizes = [n * s.shard_numel for s in slots]
        self._held = [s for s in slots if s.local_rows]  # the parameters with rows on this rank
        self._held_keys = [(s.aliases[0][0]._parameters, s.aliases[0][1]) for s in self._held]  # registered()'s
        self._tied = [s for s in slots if len(s.aliases) > 1]
        # The send buffer cut into (held rows, padding) per parameter; picks: the pieces that take a parameter.
        self._send_sizes, self._send_picks = [], []
        for s in slots:
            held = s.local_rows * s.row_numel
            if held:
                self._send_picks.append(len(self._send_sizes))
                self._send_sizes.append(held)
            if s.shard_numel > held:
                self._send_sizes.append(s.shard_numel - held)
        self._local_shapes = [s.local_shape for s in slots]
        # [Note: sharding on another dim] in shard_dim.py: per parameter (pre, rest) if its dim is not 0, else None;
        # empty when every dim is 0 or N is 1, so such a group runs the dim-0 copy-out and reduce as they are.
        self._other_dims = [other_dim_plan(s.dim, s.shape, n) if s.dim else None for s in slots] \
            if n > 1 and any(s.dim for s in slots) else []
        # Copy-in is one copy of the master when no padding lies between its blocks in the send buffer.
        self._master_is_send_layout = all(s.shard_numel == s.local_rows * s.row_numel for s in slots)
        picks = iter(self._send_picks)  # per parameter: (slot, local shape, its piece of the split, or None)
        self._grad_plan = [(s, shape, next(picks) if s.local_rows else None)
                           for s, shape in zip(slots, self._local_shapes)]
        self._shard_sizes = [s.shard_numel for s in slots]
        self._sources_cache = self._targets_cache = None  # [Note: copy-in without per-step views]
        # The sources as made, views of the master: while _sources() still returns this list, nothing replaced them
        self._master_sources = self._sources() if self._master is not None else None
        # The unsharded buffer, parameter-major ([Note: copy-in, copy-out]); allocated only while unsharded.
        self.full = torch.empty(n * self.shard_numel, dtype=compute_dtype, device=device)
        self.full.requires_grad_(requires_grad)
        self.free_full()

    def local_shards(self) -> list[torch.Tensor]:
        """The local tensors of this group's sharded DTensor parameters (empty ones for ranks past the rows)."""
        return [slot.registered()._local_tensor for slot in self.slots]

    def local_grads(self) -> list[torch.Tensor]:
        grads = [slot.registered().grad for slot in self.slots]
        return [g._local_tensor for g in grads if g is not None]

    # -- gather ---------------------------------------------------------------------------------------------
    def copy_in(self) -> torch.Tensor:
        """This rank's blocks, cast to the compute dtype, end to end in one send buffer of S elements. At world
        size 1 the send buffer is `full` itself (the all-gather then has nothing to copy). Offloaded blocks are
        copied to the compute device from the host by the same foreach copy. One copy of the group's master
        buffer where the layout allows ([Note: one master buffer])."""
        self._retie()
        if not self.requires_grad:
            self._refuse_unfrozen()
        if self.copies_master():
            send = self.full.data if self.world_size == 1 else torch.empty(
                self.shard_numel, dtype=self.compute_dtype, device=self.full.device)
            torch._foreach_copy_([send], [self._master])
            return send
        if self.world_size == 1:
            send = self.full.data
            targets = self._targets(send)
        else:
            send = torch.empty(self.shard_numel, dtype=self.compute_dtype, device=self.full.device)
            parts = torch.split(send, self._send_sizes)
            targets = [parts[i] for i in self._send_picks]
        if targets:  # a rank past every parameter's rows sends padding only ([Note: per-parameter shards])
            torch._foreach_copy_(targets, self._sources())
        return send

    # [Note: requires_grad after fully_shard] torch's fully_shard reads each sharded parameter's requires_grad
    # when it builds the unsharded one, so `requires_grad_(False)` after fully_shard freezes it: no gradient,
    # and the optimizer skips it. Here the group's leaf `full` was made with the flag each parameter had at
    # fully_shard ([Note: one leaf per group]): a parameter frozen since still gets its part of the group's
    # gradient, reduced like the others, but none is stored on it (store_shard_grad), so it stays exactly where it
    # was and the other parameters train as torch's do. The other way (requires_grad_(True) on a parameter frozen
    # at fully_shard) would need a gradient the frozen group's leaf never computes: refused by name at the next
    # gather, as the FSDP front end refuses any change after wrapping (misuse.check_requires_grad).
    def _refuse_unfrozen(self) -> None:
        for slot in self.slots:
            if slot.registered().requires_grad:
                raise RuntimeError(
                    f"requires_grad of '{slot.name}' (fully_shard module '{self.unit_name}') was set to True after "
                    f"fully_shard; it was False when fully_shard grouped the module's frozen parameters, and "
                    f"that group computes no gradient. Call requires_grad_() on the plain module before "
                    f"fully_shard (freezing after fully_shard is supported)")

    # [Note: one master buffer] When fully_shard builds the shards on a real device (not meta, not offloaded),
    # the local tensors of one group are views of one buffer, this rank's blocks end to end (torch FSDP2 gives
    # each parameter a padded buffer of its own). Copy-in is then one copy, with the cast, of that buffer instead
    # of one per parameter, wherever the send buffer has no padding between blocks: always at world size 1, and
    # whenever every dim 0 divides by N. Whatever replaces a local tensor or its storage (to_empty,
    # load_state_dict(assign=True), `.data =`) ends that, and copy-in goes back to one piece per parameter:
    # nothing is copied back into the buffer behind the user's back.
    #
    # [Note: a piece's own storage] A DTensor takes its local tensor's storage offset as its own, while its
    # storage is a placeholder with no data. A local tensor cut from the master by torch.split or slicing starts
    # past offset 0 for every parameter but the first, and so would the DTensor wrapping it, and the DTensors
    # that state_dict(), detach() or any op make from it: torch.save and dcp.async_save then take such a DTensor
    # for a plain tensor with data and fail on the placeholder storage ("invalid python storage"). So each piece
    # is a tensor at offset 0 of its own storage, a slice of the master's storage (it holds a reference to the
    # master's memory): the same bytes, so the state dict's DTensors are still the parameters' memory and a load
    # into them in place (dcp.load, load_state_dict) reaches the master, while every DTensor starts at offset 0,
    # as torch's fully_shard's do. A copy in state_dict() would save, but turn those loads into silent no-ops.
    def copies_master(self) -> bool:
        """Copy-in is one copy of the master buffer: no padding between blocks, and the local tensors are still
        the views of it that fully_shard made (_sources() cuts a new list once any was replaced)."""
        return self._master_is_send_layout and self._master_sources is not None and \
            self._sources() is self._master_sources

    # [Note: copy-in without per-step views] A gather runs twice per step per group, so what copy-in reads and
    # writes is kept rather than cut again each time: the flattened local tensors of the held parameters (made
    # again when a registered parameter, its local tensor or that tensor's storage is replaced: to_empty,
    # load_state_dict(assign=True), `.data =`), and the per-parameter pieces of `full` the gather writes (copy-in's
    # at world size 1, copy-out's otherwise). Those are cut from `full.data`, which autograd does not track, and
    # stay valid across frees: the same storage is resized to 0 and back in place.
    # The local tensors are read directly: to_local() is an autograd op, and no gradient flows through a copy-in.
    def _sources(self) -> list[torch.Tensor]:
        tensors = [params[attr]._local_tensor for params, attr in self._held_keys]
        cache = self._sources_cache  # (tensors, their flat views, their ids, their data pointers then)
        if cache is not None and list(map(id, tensors)) == cache[2] and \
                list(map(torch.Tensor.data_ptr, tensors)) == cache[3]:  # ids: the cache keeps them alive
            return cache[1]
        flat = [t.reshape(-1) for t in tensors]
        self._sources_cache = (tensors, flat, list(map(id, tensors)), list(map(torch.Tensor.data_ptr, tensors))) \
            if all(t.is_contiguous() for t in tensors) else None
        return flat

    def _targets(self, full_data: torch.Tensor) -> list[torch.Tensor]:
        """Where the gather writes into `full`: copy-in's pieces at world size 1, else copy-out's (N, c_i * row)
        block per parameter."""
        storage = full_data.untyped_storage()._cdata
        cache = self._targets_cache
        if cache is None or cache[0] != storage:
            if self.world_size == 1:
                parts = torch.split(full_data, self._send_sizes)
                targets = [parts[i] for i in self._send_picks]
            else:
                targets = [part.view(self.world_size, -1) for part in torch.split(full_data, self._padded_sizes)]
            cache = self._targets_cache = (storage, targets)
        return cache[1]

    def _retie(self) -> None:
        """A load_state_dict(assign=True) assigns each name of a tied weight its own new parameter (torch's
        set_model_state_dict does, loading into a meta model): point every alias back at the first name's, as
        torch's fully_shard does when it next gathers, so the weight is one parameter again."""
        for slot in self._tied:
            param = slot.registered()
            for module, attr, _name in slot.aliases[1:]:
                if module._parameters.get(attr) is not param:
                    module._parameters[attr] = param

    def gather_output(self, full: torch.Tensor) -> torch.Tensor:
        """Where the all-gather writes: a rank-major staging buffer, or `full` itself at world size 1."""
        if self.world_size == 1:
            return full
        if self.all_gather_comm is not None:  # [Note: custom collectives] in collectives.py
            return self.all_gather_comm.allocate(full.shape, dtype=full.dtype, device=full.device)
        return torch.empty_like(full)

    def copy_out(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Rank-major (N, S) → parameter-major: parameter i's N blocks land one after the other in `full`."""
        if output is full:
            return
        if self._other_dims:  # [Note: sharding on another dim] in shard_dim.py
            copy_out_other_dims(output, full, self._other_dims, self._shard_sizes, self._padded_sizes,
                                self.world_size)
            return
        torch.split_with_sizes_copy(output.view(self.world_size, -1), self._shard_sizes, dim=1,
                                    out=self._targets(full))

    def _blocks_to_full(self, output: torch.Tensor, full: torch.Tensor, n: int) -> None:
        """`output` holds n equal blocks, block j being the j-th 1/n of every parameter's padded rows end to end;
        put each parameter's n parts one after the other in `full`."""
        targets = [part.view(n, -1) for part in torch.split(full, self._padded_sizes)]
        torch.split_with_sizes_copy(output.view(n, -1), [p // n for p in self._padded_sizes], dim=1, out=targets)

    # -- reshard_after_forward=int ([Note: the post-forward shard] in fsdp_lab/runtime/fsdp2/post_forward.py) ----------
    def keep_post_forward(self, group) -> None:
        """Keep block `group.rank` of `group.size` of every parameter's padded rows of `full` (one copy)."""
        parts = torch.split(self.full.detach(), self._padded_sizes)
        self.post_forward_shard = torch.cat([part.view(group.size, -1)[group.rank] for part in parts])

    def gather_in_group(self, full: torch.Tensor, group) -> Collective:
        """Refill `full` from the post-forward shards of `group`'s ranks (then dropped): one all-gather over the
        group, then the copy-out."""
        send, self.post_forward_shard = self.post_forward_shard, None
        output = torch.empty(group.size * send.numel(), dtype=send.dtype, device=send.device)
        call = all_gather_flat(output, send, group.pg, group.size, self.unit_name, ("post_forward", group.ranks))
        self._blocks_to_full(output, full, group.size)
        return call

    def views(self) -> list[torch.Tensor]:
        """Each parameter's unsharded tensor: the first d0 rows of its part of `full` (tracked by autograd)."""
        if self._view_plan is None:
            sizes, picks = [], []
            for slot, padded in zip(self.slots, self._padded_sizes):
                picks.append(len(sizes))
                sizes.append(slot.numel)
                if padded > slot.numel:
                    sizes.append(padded - slot.numel)
            self._view_plan = (sizes, picks, [tuple(s.shape) for s in self.slots])  # a tuple views faster
        views = self._split_views(*self._view_plan)
        for i in self._tp_picks:  # [Note: FSDP over tensor parallel] in tensor_parallel.py
            views[i] = as_tp(views[i], self.slots[i].tp_spec)
        return views

    @property
    def views_dropped_when_freed(self) -> bool:
        """Always: once freed, the module's attributes are the registered DTensor parameters again."""
        return True

    # -- reduce ---------------------------------------------------------------------------------------------
    def reduce_input(self, grad: torch.Tensor) -> torch.Tensor:
        """Parameter-major gradient → rank-major (N, S), flattened: rank r's chunk is its blocks' gradients."""
        if self.world_size == 1:
            return grad
        if self._other_dims:  # [Note: sharding on another dim] in shard_dim.py
            return rank_major_other_dims(grad, self._other_dims, self._padded_sizes, self.world_size)
        n = self.world_size
        return torch.cat([part.view(n, -1) for part in torch.split(grad, self._padded_sizes)], dim=1).view(-1)

    def store_shard_grad(self, out: torch.Tensor) -> None:
        """Cut this rank's reduced S elements into one DTensor gradient per parameter (views, added to a
        gradient already there)."""
        if self.placement.offloaded:  # [Note: host and device] in fsdp_lab/runtime/features/offload.py
            out = self.placement.to_home(out)
        if out.dtype != self.master_dtype:
            out = out.to(self.master_dtype)
        # One split cuts every piece (the send buffer's layout: held rows, then padding, per parameter); only a
        # parameter of more than one dim needs a view on top ([Note: copy-in, copy-out]).
        parts = torch.split_with_sizes(out, self._send_sizes)
        for slot, shape, pick in self._grad_plan:
            if pick is None:
                local = out[:0].view(shape)
            else:
                local = parts[pick] if len(shape) == 1 else parts[pick].view(shape)
            module, attr, _name = slot.aliases[0]
            param = module._parameters[attr]
            if not param.requires_grad:  # frozen after fully_shard ([Note: requires_grad after fully_shard])
                continue
            grad = param.grad
            if grad is None:
                # DTensor's own constructor with the parameter's spec: from_local would redo the checks and
                # build an autograd node for every parameter of every step. __new__ alone: DTensor.__init__ only
                # serves torch.export, and costs more than the construction itself.
                param.grad = DTensor.__new__(DTensor, local, slot.spec, requires_grad=False)
            else:
                grad._local_tensor.add_(local)
