"""reshard_after_forward=k (1 < k < N): after forward keep the part of the unsharded parameters that this rank's
group of k consecutive ranks needs, so that backward's re-gather runs within that group only.

[Note: the post-forward shard] The mesh's N ranks split into N/k groups of k consecutive ranks ([0..k-1],
[k..2k-1], ...), as torch's post-forward mesh (the mesh viewed as (N/k, k)) splits them. After forward, the
unit's unsharded buffer `full` (parameter-major: parameter i owns N*c_i padded rows) is cut once more: each
parameter's padded rows into k equal blocks, and the rank in position j of its group keeps block j of every
parameter, end to end (N*S/k elements, against S for a plain shard and N*S unsharded). Every group holds a whole
copy between them, so backward's re-gather is an all-gather of those blocks within the group (k ranks, not N),
followed by the same rank-major → parameter-major copy-out as the mesh-wide gather, with k blocks instead of N.
The held bytes are torch's: it keeps 1/k of each parameter's padded all-gather output.

The groups are process groups of their own (dist.new_group). A new_group call is collective over every rank of
the default group, all groups in the same order, so they are made once per model, when its root is decided
(every rank runs that first forward), for each distinct k; and the mesh must cover every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PostForwardGroup:
    """This rank's group of `size` consecutive mesh ranks: who shares the post-forward shards with it."""

    pg: Any  # the process group of `ranks`
    ranks: tuple  # global ranks, in mesh order
    rank: int  # this rank's position in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)


def check_group_size(mesh, size: int) -> None:
    """The mesh must span the default group: the sub-groups are made by new_group, collective over all ranks."""
    ranks = dist.get_process_group_ranks(mesh.get_group())
    if len(ranks) != dist.get_world_size():
        raise ValueError(f"fully_shard option reshard_after_forward={size} needs a mesh over every rank of the default "
                         f"process group ({dist.get_world_size()}), but the mesh covers {len(ranks)}")


def make_post_forward_groups(mesh, sizes) -> dict[int, PostForwardGroup]:
    """{k: this rank's group of k} for every k in `sizes`: every rank makes every group, in one order."""
    if not sizes:
        return {}
    ranks = tuple(mesh.mesh.flatten().tolist())  # mesh order, as the shards are numbered
    me = dist.get_rank()
    timeout = _timeout_of(mesh.get_group())
    found = {}
    for size in sorted(set(sizes)):
        for start in range(0, len(ranks), size):
            members = ranks[start:start + size]
            pg = dist.new_group(list(members), timeout=timeout)
            if me in members:
                found[size] = PostForwardGroup(pg, members, members.index(me))
    return found


def _timeout_of(pg):
    """The mesh group's collective timeout, so a sub-group fails as soon as the mesh would (None: the default)."""
    try:
        return pg._get_backend(torch.device(_device_type(pg))).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _device_type(pg) -> str:
    return "cuda" if torch.device("cuda") in getattr(pg, "_device_types", ()) else "cpu"
