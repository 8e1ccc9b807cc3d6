"""fully_shard over parameters tensor parallel already placed: FSDP on "dp" of a 2-D mesh ("dp", "tp").

[Note: FSDP over tensor parallel] torchtitan's apply_tp runs `parallelize_module(model, mesh["tp"], plan)` first:
each parallelized weight becomes a DTensor on the "tp" mesh (ColwiseParallel: Shard(0), RowwiseParallel: Shard(1),
its bias Replicate()). apply_fsdp then calls fully_shard(block, mesh=mesh["dp"]). As torch's fully_shard does
(FSDPParam._init_sharding_spec_tp), the group shards the *local* tensor of each such DTensor, this tp rank's
slice, on dim 0 across dp, exactly as it shards a plain parameter; nothing about the gather, the reduce-scatter
or the padding changes, since every rank of one dp group holds the same tp slice. Only the labels change:
    sharded parameter  a DTensor on the 2-D mesh (dp, tp) with placements (dp's, tp's): (Shard(0), Shard(1))
                       when tp cut another dim, and _StridedShard(0, split_factor=tp) when tp cut dim 0 too,
                       since dp's rows are then rows of tp's slice, not of the whole weight (torch's strided
                       sharding); its global shape is the weight's. Gradients get the same spec.
    unsharded view     what the gather rebuilds is tp's local slice again, so the module sees it wrapped back
                       in the "tp" DTensor it had (DTensor.from_local, through which autograd brings the local
                       gradient back to the group's buffer), and parallelize_module's forward runs unchanged.
Parameters tp left alone (plain tensors) shard on dp as before. The tp collectives are DTensor's, issued inside
the module's forward and backward on the "tp" group; fully_shard's run on the "dp" group only.

Not supported, refused by name: an HSDP (2-D) fully_shard mesh under tensor parallel, a DTensor with more than
one placement (EP+TP), CPU offload of such parameters, a shard_placement_fn dim other than 0 for them
(fsdp_lab/runtime/fsdp2/shard_dim.py), and reshard_after_forward=int (torch refuses the last one as well:
"Resharding to smaller mesh is not supported for DTensor parameters yet").
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard


def is_tp_param(param) -> bool:
    """Whether `param` was placed by tensor parallel before fully_shard (it is a DTensor)."""
    return isinstance(param, DTensor)


def check_tp_param(param: DTensor, name: str, dp_mesh, offloaded: bool, post_forward_size) -> None:
    """ValueError naming what fsdp_lab does not support for a DTensor parameter `name`."""
    spec = param._spec
    if dp_mesh.ndim != 1:
        raise ValueError(f"fully_shard on a {dp_mesh.ndim}-D (HSDP) mesh over the DTensor parameter '{name}' "
                         f"(placed by tensor parallel on {spec.mesh.mesh_dim_names}) is not supported by "
                         f"fsdp_lab: pass the 1-D data-parallel mesh, e.g. mesh['dp']")
    if len(spec.placements) != 1:
        raise ValueError(f"fully_shard over the DTensor parameter '{name}' with {len(spec.placements)} placements "
                         f"{spec.placements} is not supported by fsdp_lab: only 1-D tensor parallel")
    if spec.mesh.device_type != dp_mesh.device_type:
        raise ValueError(f"the DTensor parameter '{name}' lives on a {spec.mesh.device_type!r} mesh, fully_shard's "
                         f"mesh is {dp_mesh.device_type!r}")
    if offloaded:
        raise ValueError(f"fully_shard offload_policy=CPUOffloadPolicy() over the DTensor parameter '{name}' "
                         f"(tensor parallel) is not supported by fsdp_lab")
    if post_forward_size:
        raise ValueError(f"fully_shard reshard_after_forward={post_forward_size} over the DTensor parameter "
                         f"'{name}' is not supported (torch: resharding to a smaller mesh is not supported for "
                         f"DTensor parameters)")


def sharded_spec(tp_spec: DTensorSpec, dp_mesh, dp_placement: Shard) -> DTensorSpec:
    """The spec of the dp-sharded parameter on the 2-D mesh (dp, tp) ([Note: FSDP over tensor parallel])."""
    from torch.distributed.device_mesh import DeviceMesh

    split = tp_spec.num_shards_map[dp_placement.dim]
    first = _StridedShard(dp_placement.dim, split_factor=split) if split > 1 else dp_placement
    return DTensorSpec(DeviceMesh._concatenate([dp_mesh, tp_spec.mesh]), (first, *tp_spec.placements),
                       tensor_meta=tp_spec.tensor_meta)


def as_tp(view: torch.Tensor, tp_spec: DTensorSpec) -> DTensor:
    """The unsharded local slice `view` as the "tp" DTensor the module had, differentiable back to `view`."""
    return DTensor.from_local(view, tp_spec.mesh, tp_spec.placements, run_check=False, shape=tp_spec.shape,
                              stride=tp_spec.stride)
