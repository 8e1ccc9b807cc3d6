"""HSDP: shard inside one process group, replicate across another (FSDP1's HYBRID_SHARD, FSDP2's 2-D mesh).

[Note: hybrid sharding] On M nodes of G ranks each, FULL_SHARD over all N = M·G ranks sends every all-gather and
reduce-scatter across the slow links between nodes. HYBRID_SHARD shards each unit G ways inside a node (the
*shard* group) and keeps the M nodes' copies identical (the *replicate* group):
    gather   all-gather inside the shard group only (G ranks)
    reduce   reduce-scatter inside the shard group, then all-reduce of the reduced shard (1/G of the unit)
             across the replicate group: the only traffic between nodes
The mean is over all N ranks: the reduce-scatter divides by G and the all-reduce by M. Each rank holds 1/G of the
parameters, gradients and optimizer state (16Φ/G, not 16Φ/N). _HYBRID_SHARD_ZERO2 is the same with SHARD_GRAD_OP
inside the group (the gathered parameters are kept from forward to backward).

The groups, as torch takes them (torch/distributed/fsdp/_init_utils.py):
    device_mesh  a 2-D DeviceMesh (replicate, shard): dim 0 is the replicate group, dim 1 the shard group
    process_group=(shard_pg, replicate_pg)   torch's tuple order: the intra-node group first
    neither      groups of torch.<device>.device_count() consecutive ranks shard, the ranks with the same local
                 index replicate; torch requires an auto_wrap_policy then (so every unit gets the same groups).
                 A count of 1 (always on CPU: torch.cpu.device_count() is 1) is refused: torch then gives each
                 rank a shard group of one, switches it to NO_SHARD inside that group, and never averages the
                 gradients across ranks (tests/test_hybrid_shard.py shows torch's ranks drifting apart).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp_lab.runtime.core.side_collectives import issue

SHARD, REPLICATE = "shard", "replicate"  # the group labels every traced collective carries


@dataclass(frozen=True)
class DataParallelGroups:
    """Where a model's collectives run: gathers and reduce-scatters in `shard`, the hybrid all-reduce in
    `replicate` (None unless hybrid); `mesh` is the DeviceMesh the caller gave, if any."""

    shard: Any
    replicate: Any = None
    mesh: Any = None

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(self.shard))

    @property
    def replicate_ranks(self) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(self.replicate)) if self.replicate is not None else ()


def fsdp1_groups(process_group, device_mesh, strategy, auto_wrap_policy, device_type: str) -> DataParallelGroups:
    """torch FSDP1's choice of groups for `strategy` ([Note: hybrid sharding]), with its errors."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("Cannot pass both process_group and device_mesh at the same time (as in torch FSDP1); "
                         "pass only one of them")
    if not strategy.is_hybrid:
        if isinstance(process_group, tuple):
            raise ValueError(f"process_group as a tuple of {len(process_group)} groups is for HYBRID_SHARD and "
                             f"_HYBRID_SHARD_ZERO2, not {strategy.name}; pass one process group")
        if device_mesh is not None:
            return DataParallelGroups(device_mesh.get_group(mesh_dim=0), mesh=device_mesh)
        return DataParallelGroups(process_group if process_group is not None else dist.group.WORLD)
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ValueError(f"{strategy.name} expects a device_mesh with ndim=2 (replicate, shard) but got "
                             f"ndim={device_mesh.ndim}")
        return check_grid(DataParallelGroups(None, None, device_mesh), strategy.name)
    if process_group is not None:
        if not (isinstance(process_group, tuple) and len(process_group) == 2
                and all(isinstance(pg, dist.ProcessGroup) for pg in process_group)):
            raise ValueError(f"{strategy.name} expects process_group as None or a tuple (shard_pg, replicate_pg) "
                             f"of two ProcessGroups, got {type(process_group).__name__}")
        return check_grid(DataParallelGroups(*process_group), strategy.name)
    if auto_wrap_policy is None:
        raise ValueError(f"Manual wrapping with {strategy.name} requires explicit specification of process group "
                         f"or device_mesh (as in torch FSDP1): pass device_mesh=init_device_mesh(device, "
                         f"(replicate, shard)) or process_group=(shard_pg, replicate_pg)")
    return _node_groups(_devices_per_node(device_type))


def _devices_per_node(device_type: str) -> int:
    module = getattr(torch, device_type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else None
    if not count or count == 1:
        raise ValueError(f"HYBRID_SHARD without device_mesh or process_group takes the ranks per node from "
                         f"torch.{device_type}.device_count(), which is {count}: each rank would be its own shard "
                         f"group and, as torch then runs it, no gradient would be averaged across ranks. This is not "
                         f"supported by fsdp_lab: pass device_mesh=init_device_mesh({device_type!r}, (nodes, "
                         f"ranks_per_node)) or process_group=(shard_pg, replicate_pg)")
    return int(count)


def _node_groups(per_node: int) -> DataParallelGroups:
    """Shard over each run of `per_node` consecutive ranks, replicate over the ranks with the same local index.
    Collective: every rank creates every group (torch.distributed requires it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % per_node:
        raise ValueError(f"HYBRID_SHARD needs the world size ({world}) to be a multiple of the ranks per node "
                         f"({per_node}, the device count)")
    nodes = world // per_node
    shard = replicate = None
    for node in range(nodes):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
        if rank // per_node == node:
            shard = group
    for local in range(per_node):
        group = dist.new_group([local + node * per_node for node in range(nodes)])
        if rank % per_node == local:
            replicate = group
    return DataParallelGroups(shard, replicate)


# [Note: a shard x replicate grid] HSDP is only right when the ranks form a grid: R rows of S ranks, each row a
# shard group, each column a replicate group, R * S = the world size. Then every rank holds 1/S of each unit and
# the all-reduce over its column averages the R copies of its shard. Anything else trains wrong without an error
# ((WORLD, WORLD): each rank's reduce-scatter leaves it a different chunk, and the all-reduce then averages
# those different chunks into one another) or fails on a rank left out (a (3, 1) mesh on 4 ranks: an
# IndexError from DeviceMesh on rank 3). So it is refused here, on every rank, with the sizes and ranks. A mesh
# is a grid by construction once it holds every rank once; two process groups are checked on each rank: both
# hold it, they share only it, and their sizes multiply to the world size (a check without collectives: a
# layout that passes it on every rank and is still no grid needs shard groups that overlap without being
# equal, which no node layout gives).
def check_grid(groups: DataParallelGroups, front: str) -> DataParallelGroups:
    """`groups` (two process groups, or a 2-D mesh (replicate, shard) with no groups yet) if they form a shard x
    replicate grid of the job's ranks, with the mesh's groups filled in; ValueError naming the sizes otherwise."""
    world, rank = dist.get_world_size(), dist.get_rank()
    start = f"{front} needs the shard and replicate groups to form a grid of the {world} ranks: "
    if groups.shard is None:
        mesh = groups.mesh
        ranks = mesh.mesh.flatten().tolist()
        if len(ranks) != world or sorted(ranks) != list(range(world)):
            raise ValueError(f"{start}the mesh {mesh.mesh.tolist()} (replicate {mesh.size(0)} x shard "
                             f"{mesh.size(1)}) holds {len(set(ranks))} ranks, not {world}")
        return DataParallelGroups(mesh.get_group(1), mesh.get_group(0), mesh)
    shard, replicate = list(groups.shard_ranks), list(groups.replicate_ranks)
    mine = f"rank {rank}'s shard group {shard} ({len(shard)} ranks)"
    if len(shard) * len(replicate) != world:
        raise ValueError(f"{start}{mine} times its replicate group {replicate} ({len(replicate)} ranks) is "
                         f"{len(shard) * len(replicate)} ranks, not {world}")
    if set(shard) & set(replicate) != {rank}:
        raise ValueError(f"{start}{mine} and its replicate group {replicate} must share exactly this rank, "
                         f"they share {sorted(set(shard) & set(replicate))}")
    return groups


# -- FSDP2: a 2-D mesh (replicate, shard) -----------------------------------------------------------------------
def mesh_groups(mesh) -> DataParallelGroups:
    """The groups of fully_shard's mesh: 1-D shards over all of it; 2-D (HSDP) replicates over dim 0 and shards
    over dim 1, as torch FSDP2 does."""
    if mesh.ndim == 1:
        return DataParallelGroups(mesh.get_group(), mesh=mesh)
    if mesh.ndim == 2:
        return check_grid(DataParallelGroups(None, None, mesh), "fully_shard")
    raise ValueError(f"fully_shard mesh with {mesh.ndim} dimensions is not supported by fsdp_lab; pass a 1-D mesh "
                     f"(FSDP) or a 2-D mesh (replicate, shard) (HSDP)")


def shard_placements(mesh, dim: int = 0) -> tuple:
    """A parameter's placements on fully_shard's mesh: (Shard(dim),), or (Replicate(), Shard(dim)) for HSDP; dim
    is 0 unless shard_placement_fn chose another."""
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def shard_coordinate(mesh) -> tuple[int, int]:
    """(this rank's index in the shard dimension, the shard dimension's size)."""
    return mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)


def checkpoint_mesh(groups: DataParallelGroups, device_type: str, world_pg: Optional[Any] = None):
    """A 2-D DeviceMesh (replicate, shard) over a hybrid model's groups, for DTensors that DCP saves once per
    shard group: the caller's mesh, or one built from the two groups (collective over `world_pg`)."""
    from torch.distributed.device_mesh import DeviceMesh

    if groups.mesh is not None and groups.mesh.ndim == 2:
        return groups.mesh
    pairs = [None] * dist.get_world_size(world_pg)
    replicas, shards = len(groups.replicate_ranks), len(groups.shard_ranks)
    if replicas * shards != len(pairs):
        raise ValueError(f"the shard groups ({shards} ranks) times the replicate groups ({replicas} ranks) cover "
                         f"{replicas * shards} ranks, not the job's {len(pairs)}: a hybrid checkpoint needs them to "
                         f"tile every rank")
    mine = (dist.get_rank(groups.replicate), dist.get_rank(groups.shard), dist.get_rank())
    issue(dist.all_gather_object, pairs, mine, group=world_pg, phase="checkpoint", patient=True)
    layout = torch.full((replicas, shards), -1, dtype=torch.int64)
    for r, s, g in pairs:
        layout[r, s] = g
    if (layout < 0).any():
        raise ValueError(f"the shard and replicate groups do not tile the ranks as a grid: {layout.tolist()}")
    return DeviceMesh.from_group([groups.replicate, groups.shard], device_type, mesh=layout,
                                 mesh_dim_names=(REPLICATE, SHARD))


# -- what the front ends hand the shared state ----------------------------------------------------------------
def hybrid_state(groups: DataParallelGroups) -> dict:
    """FSDPState's HSDP fields for `groups`: the replicate group, its size, and both groups' trace tags."""
    replicate = groups.replicate
    return {"replicate_pg": replicate, "replicate_size": dist.get_world_size(replicate) if replicate is not None else 1,
            "shard_tag": (SHARD, groups.shard_ranks), "replicate_tag": (REPLICATE, groups.replicate_ranks)}


def device_type_of(module, device_id) -> str:
    """The device type a module will run on (before it is moved): device_id's, else its parameters'."""
    if device_id is not None:
        return "cuda" if isinstance(device_id, int) else torch.device(device_id).type
    return next((p.device.type for p in module.parameters()), "cpu")
