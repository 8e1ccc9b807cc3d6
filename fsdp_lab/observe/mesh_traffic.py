"""Bytes per mesh dimension: fully_shard's collectives on "dp" and DTensor's (tensor parallel's) on "tp".

[Note: bytes per mesh dimension] Under tensor parallel then fully_shard on a 2-D mesh ("dp", "tp")
([Note: FSDP over tensor parallel] in fsdp_lab/runtime/fsdp2/tensor_parallel.py) two kinds of collectives run:
    fully_shard's  all-gather and reduce-scatter of each group, on the dp group: the runtime hands them to the
                   tracer with its events, and the trace labels each with the mesh dimension whose group it ran
                   in ("mesh_dim": "dp"), found from the group's ranks
    DTensor's      the all-reduces (and all-gathers, reduce-scatters) parallelize_module's layouts issue inside
                   forward and backward, on the tp group, and whatever DTensor op a step runs (clip_grad_norm_'s
                   norm reduces over both). The runtime never sees them: while a trace records a model whose
                   fully_shard mesh is one dimension of a larger named mesh, a dispatch mode sees each functional
                   collective DTensor issues (it lets DTensor run first, as torch's CommDebugMode does) and
                   emits a "dtensor_collective" event with the same ring byte count ([Note: ring byte counts] in
                   traffic.py), labelled with its mesh dimension.
`bytes_by_mesh_dim` sums a trace's bytes sent per mesh dimension name (and per collective). The mode is only on
inside `trace.record` of such a model: every op pays a Python call there, which is why it is not always on.
A functional collective other than all-reduce, all-gather or reduce-scatter is refused by name.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.runtime.core.collectives import Collective

_FUNCOL = {  # functional collective → (kind, the output numel is the gathered buffer)
    "all_reduce": ("all_reduce", False), "all_reduce_": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce", False), "all_reduce_coalesced_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True), "all_gather_into_tensor_coalesced": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False), "reduce_scatter_tensor_coalesced": ("reduce_scatter", False),
}
_REFUSED = {"all_to_all_single", "broadcast", "broadcast_", "all_gather_into_tensor_out"}  # collectives not counted
# Every other _c10d_functional op (wait_tensor, _wrap_tensor_autograd, ...) moves nothing.


def mesh_dims(mesh) -> list[tuple[str, tuple, str]]:
    """(name, this rank's group ranks, the group's name) along each named dimension of `mesh`'s root mesh."""
    if mesh is None:
        return []
    root = mesh._get_root_mesh()
    if not root.mesh_dim_names:
        return []
    return [(name, tuple(dist.get_process_group_ranks(root.get_group(i))), root.get_group(i).group_name)
            for i, name in enumerate(root.mesh_dim_names)]


def tensor_parallel_mesh(mesh) -> bool:
    """Whether `mesh` (fully_shard's) is one dimension of a larger named mesh: other dimensions' DTensor
    collectives may run in the model's forward and backward."""
    if mesh is None:
        return False
    root = mesh._get_root_mesh()
    return root is not mesh and root.ndim > mesh.ndim and bool(root.mesh_dim_names)


class DTensorCollectives(TorchDispatchMode):
    """Emit one "dtensor_collective" event on `tracer` per functional collective DTensor issues."""

    def __init__(self, tracer, dims: list[tuple[str, tuple, str]]):
        super().__init__()
        self.tracer = tracer
        self.by_group_name = {group_name: (name, ranks) for name, ranks, group_name in dims}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run, and see the collectives it issues
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            op = func._overloadpacket.__name__
            if op in _FUNCOL or op in _REFUSED:
                self._record(op, args, out)
        return out

    def _record(self, op: str, args, out) -> None:
        if op not in _FUNCOL:
            raise NotImplementedError(f"the trace counts DTensor's all_reduce, all_gather_into_tensor and "
                                      f"reduce_scatter_tensor; it does not count _c10d_functional.{op}")
        kind, gathered = _FUNCOL[op]
        group_name = args[-1]
        name, ranks = self.by_group_name.get(group_name) or ("other", _ranks_of(group_name))
        tensors = (out if gathered else args[0])
        tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        calls = [Collective(kind, t.numel(), t.dtype, len(ranks), group=name, ranks=ranks) for t in tensors]
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.tracer.emit("dtensor_collective", unit="<dtensor>", phase=phase, collectives=calls, collective=kind,
                         mesh_dim=name)


def _ranks_of(group_name) -> tuple:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


def bytes_by_mesh_dim(events: Iterable[dict], rank: Optional[int] = None, step: Optional[int] = None,
                      collective: bool = False) -> dict:
    """Bytes sent per mesh dimension name ("dp", "tp", ...); collective=True: per (dimension, collective) with
    collective "all_gather", "reduce_scatter" or "all_reduce". DTensor's collectives and fully_shard's alike
    ([Note: bytes per mesh dimension])."""
    from fsdp_lab.observe.traffic import BEAT_OF_EVENT, COLLECTIVE_OF_BEAT

    totals: dict = defaultdict(int)
    for e in events:
        if not e.get("bytes_sent") or (rank is not None and e.get("rank") != rank) \
                or (step is not None and e.get("step") != step):
            continue
        if "mesh_dim" not in e:
            raise ValueError(f"event {e.get('event')!r} of unit {e.get('unit')!r} sent bytes but names no mesh "
                             f"dimension (its mesh has no mesh_dim_names, or the trace is older)")
        kind = e.get("collective") or COLLECTIVE_OF_BEAT[BEAT_OF_EVENT[e["event"]]]
        totals[(e["mesh_dim"], kind) if collective else e["mesh_dim"]] += int(e["bytes_sent"])
    return dict(totals)
