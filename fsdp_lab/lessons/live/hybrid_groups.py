"""The check of chapter 06b's exercise: `hsdp_groups(rank, nodes, per_node)`, the global ranks a rank shares its
HSDP shard group and its replicate group with, against the groups the learner's HYBRID_SHARD model really uses and
against grids of more nodes than the live ranks have.

The layout is torch's DeviceMesh: `init_device_mesh(device, (nodes, per_node))` lays the ranks out as
`torch.arange(nodes * per_node).view(nodes, per_node)`, dim 0 the replicate dimension and dim 1 the shard one. A
rank's shard group is its row (the ranks of its node, consecutive as torchrun numbers them), its replicate group
its column (the ranks with the same local index on every node)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fsdp_lab.lessons.live.verdict import FSDP1, Verdict, not_written, unwritten_function, wrong_model

GRIDS = ((2, 2), (2, 4), (4, 2), (3, 2))  # (nodes, ranks per node): the stored run's, and bigger ones


def hsdp_cases(grids: Sequence[tuple] = GRIDS) -> list:
    """(nodes, per_node, rank, shard ranks, replicate ranks) for every rank of every grid, from DeviceMesh's layout."""
    cases = []
    for nodes, per_node in grids:
        mesh = torch.arange(nodes * per_node).view(nodes, per_node)
        for rank in range(nodes * per_node):
            node, local = divmod(rank, per_node)
            cases.append((nodes, per_node, rank, tuple(mesh[node].tolist()), tuple(mesh[:, local].tolist())))
    return cases


def hsdp_groups_of(fn: Callable[[int, int, int], tuple], cases: Sequence[tuple]) -> Verdict:
    """`fn(rank, nodes, per_node) -> (shard ranks, replicate ranks)` against each case; the first wrong one is
    explained."""
    for nodes, per_node, rank, shard, replicate in cases:
        try:
            got = fn(rank, nodes, per_node)
        except NotImplementedError as err:
            return not_written("hsdp_groups", err)
        where = f"rank {rank} of {nodes} nodes × {per_node} ranks"
        try:
            got_shard, got_replicate = (tuple(int(r) for r in group) for group in got)
        except (TypeError, ValueError):
            return Verdict(False, f"{where}: hsdp_groups must return (shard ranks, replicate ranks), two lists of "
                                  f"global ranks; got {got!r}")
        if (got_shard, got_replicate) == (shard, replicate):
            continue
        if (got_shard, got_replicate) == (replicate, shard):
            why = ("the two are swapped: the shard group is the node's own ranks (the all-gathers stay on the "
                   "node's fast links); the replicate group crosses the nodes")
        elif set(got_shard) == set(range(per_node)) or set(got_replicate) == set(range(nodes)):
            why = "those are local indices; the groups hold global ranks (node · per_node + local index)"
        elif len(got_shard) != per_node or len(got_replicate) != nodes:
            why = (f"a shard group has one rank per GPU of a node ({per_node}), a replicate group one per node "
                   f"({nodes})")
        else:
            why = (f"rank r is on node r // {per_node} with local index r % {per_node}: its node's ranks are "
                   f"consecutive, its replicas {per_node} apart")
        return Verdict(False, f"{where}: you say shard {list(got_shard)}, replicate {list(got_replicate)}; "
                              f"DeviceMesh gives shard {list(shard)}, replicate {list(replicate)}; {why}")
    return Verdict(True, f"all {len(cases)} ranks' groups are where you said")


def hsdp_groups(fn: Callable[[int, int, int], tuple], model, nodes: int) -> Verdict:
    """`fn` against the groups of the learner's HYBRID_SHARD model on `nodes` nodes (this rank), then GRIDS."""
    wrong = unwritten_function("hsdp_groups", fn, 0, nodes, 1) or wrong_model("hsdp_groups", model, FSDP1)
    if wrong:
        return wrong
    shard, replicate = model._settings["process_group"], model._settings["replicate_group"]
    if not replicate:
        return Verdict(False, "this model has no replicate group: wrap it with sharding_strategy=HYBRID_SHARD and a "
                              "2-D device_mesh")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = [(nodes, world // nodes, rank, tuple(shard), tuple(replicate))]
    verdict = hsdp_groups_of(fn, mine + hsdp_cases())
    if not verdict.ok:
        return verdict
    return Verdict(True, f"rank {rank}: shard {list(shard)}, replicate {list(replicate)} as your model uses them, "
                         f"and every rank of {len(GRIDS)} larger grids")
