"""fully_shard's shard_placement_fn: a parameter sharded on a dim other than 0 (Shard(1) for a weight's columns).

[Note: sharding on another dim] As torch's fully_shard (FSDPParam._init_sharded_param) does, shard_placement_fn
is called once per parameter with the original parameter and returns None (the default, Shard(0)) or Shard(dim);
a negative dim counts from the end (Shard(-1) of a 2-D weight is Shard(1)). On a dim d > 0 the size must divide
by the N ranks of the mesh's shard dimension (torch refuses uneven sharding there too; dim 0 may stay uneven).
Rank r then holds the contiguous block of shape[d] / N columns narrow(d, r*c, c), the local tensor of a DTensor
with placement Shard(d) ((Replicate(), Shard(d)) on an HSDP mesh), its gradient likewise. Nothing changes on
the wire: each rank's block is still one piece of the group's send buffer, so the all-gather and the
reduce-scatter are the dim-0 ones. Only the two places that turn the rank-major wire order into the parameter
and back differ, and only for such parameters (a group of dim-0 parameters runs exactly the dim-0 code):
    copy-out  the gathered blocks (N, pre, c*post) are written transposed into the unsharded tensor
              (pre, N*c, post), where pre = prod(shape[:d]) and post = prod(shape[d+1:]) (torch: chunk, then cat
              on dim d)
    reduce    the unsharded gradient is cut into N column blocks, which become the rank-major rows of the
              reduce-scatter input (torch: chunk on dim d, cat on dim 0); the reduced block is this rank's
              gradient as it stands
At world size 1 the one block is the whole parameter, so both are the identity and nothing is rearranged.

Refused by name: a ShardPlacementResult (torch 2.13's per-parameter mesh), anything else that is not a Shard,
a dim outside the parameter's dims, uneven sharding on a dim > 0 (as torch), a dim > 0 for a parameter tensor
parallel placed (not supported by fsdp_lab), and reshard_after_forward=int with a dim > 0 (torch's
re-gather of a post-forward shard assumes dim 0 and fails in backward; not supported by fsdp_lab).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard


def _placement_result_type():
    """torch 2.13's ShardPlacementResult (a Shard plus a mesh of its own), or None where torch has none."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        return None
    return ShardPlacementResult


def resolve_shard_dim(shard_placement_fn, param: torch.Tensor, name: str, world_size: int, tp_placed: bool) -> int:
    """The dim `param` (qualified name `name`) is sharded on: 0 without a shard_placement_fn or where it returns
    None, else its Shard's dim counted from 0, checked as [Note: sharding on another dim] says."""
    if shard_placement_fn is None:
        return 0
    result = shard_placement_fn(param)
    if result is None:
        return 0
    result_type = _placement_result_type()
    if result_type is not None and isinstance(result, result_type):
        raise NotImplementedError(f"fully_shard: shard_placement_fn returned a ShardPlacementResult for parameter "
                                  f"'{name}' (a mesh of its own for this parameter); fsdp_lab does not support "
                                  f"per-parameter meshes: return Shard(dim) or None")
    if type(result) is not Shard:
        raise ValueError(f"fully_shard: shard_placement_fn returned {result!r} for parameter '{name}': expected "
                         f"Shard(dim) or None")
    ndim = param.dim()
    dim = result.dim + ndim if result.dim < 0 else result.dim
    if not 0 <= dim < max(ndim, 1):
        raise ValueError(f"fully_shard: shard_placement_fn returned Shard({result.dim}) for parameter '{name}' of "
                         f"shape {tuple(param.shape)}: a {ndim}-D tensor has no dim {result.dim}")
    if dim == 0:
        return 0
    if tp_placed:
        raise NotImplementedError(f"fully_shard: shard_placement_fn returned Shard({result.dim}) for parameter "
                                  f"'{name}', which tensor parallel already placed; sharding a DTensor parameter "
                                  f"on a dim other than 0 is not supported by fsdp_lab: return None or Shard(0)")
    size = param.shape[dim]
    if size % world_size:
        raise NotImplementedError(f"fully_shard: parameter '{name}' of shape {tuple(param.shape)} cannot be sharded "
                                  f"on dim {dim}: its size {size} does not divide by the {world_size} ranks of "
                                  f"the shard mesh dimension (uneven sharding is supported on dim 0 only, as in "
                                  f"torch)")
    return dim


def refuse_post_forward_shard(other_dim_names: list[str], reshard_after_forward: int) -> None:
    """reshard_after_forward=int keeps a block of each parameter's dim-0 rows after forward: refused where
    `other_dim_names` (the parameters sharded on a dim other than 0) is not empty."""
    if other_dim_names:
        more = len(other_dim_names) - 1
        raise NotImplementedError(f"fully_shard: reshard_after_forward={reshard_after_forward} with parameters "
                                  f"sharded on a dim other than 0 by shard_placement_fn ('{other_dim_names[0]}'"
                                  f"{f' and {more} more' if more else ''}) is not supported by fsdp_lab (torch's "
                                  f"fully_shard fails on it in backward): use True or False")


def other_dim_plan(dim: int, shape: torch.Size, world_size: int) -> tuple[int, int]:
    """(pre, rest) of a parameter sharded on `dim` > 0 over `world_size` ranks: its unsharded tensor is
    (pre, N, rest) and the gathered blocks are (N, pre, rest) ([Note: sharding on another dim])."""
    pre = math.prod(shape[:dim])
    return pre, shape.numel() // (pre * world_size) if pre else 0


def copy_out_other_dims(output: torch.Tensor, full: torch.Tensor, plans: list, shard_sizes: list,
                        padded_sizes: list, world_size: int) -> None:
    """Copy-out of a group that has parameters sharded on a dim other than 0: rank-major `output` (N, S) into
    `full`, each dim-0 parameter's N blocks end to end and each other one's transposed. `plans[i]`: (pre, rest),
    or None for a dim-0 parameter."""
    n = world_size
    sources = torch.split(output.view(n, -1), shard_sizes, dim=1)
    targets, reads = [], []
    for plan, source, part in zip(plans, sources, torch.split(full, padded_sizes)):
        if plan is None:
            targets.append(part.view(n, -1))
            reads.append(source)
        else:
            pre, rest = plan
            targets.append(part.view(pre, n, rest))
            reads.append(source.view(n, pre, rest).transpose(0, 1))
    torch._foreach_copy_(targets, reads)


def rank_major_other_dims(grad: torch.Tensor, plans: list, padded_sizes: list, world_size: int) -> torch.Tensor:
    """The reduce-scatter input (N*S,) of a group that has parameters sharded on a dim other than 0: rank r's
    row holds its blocks of every parameter's gradient."""
    n = world_size
    rows = []
    for plan, part in zip(plans, torch.split(grad, padded_sizes)):
        if plan is None:
            rows.append(part.view(n, -1))
        else:
            pre, rest = plan
            rows.append(part.view(pre, n, rest).transpose(0, 1).reshape(n, -1))
    return torch.cat(rows, dim=1).view(-1)
