"""Chapter 06c: fully_shard composed as torchtitan composes it, on live ranks of a 2-D mesh ("dp", "tp").

torchtitan's `parallelize` runs, in this order: apply_tp (parallelize_module on mesh["tp"]), apply_ac
(checkpoint_wrapper around each block), apply_compile (each block compiled on its own) and apply_fsdp
(fully_shard on each block and on the root, on mesh["dp"]). The chapter's cells call the pieces below on each live
rank; the model is two tiny MLP blocks, so four ranks on two cores stay quick.

[Note: numbered weights] To show who owns which slice, `numbered` fills every weight with its own flat index
(0, 1, 2, ... in row-major order) before tensor parallel and fully_shard cut it. Whatever layout the runtime then
chose (Shard(1) on tp, _StridedShard on dp), the values a rank holds *are* the global positions it owns, read off
the local tensor itself rather than computed from a formula.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

D, HIDDEN, BATCH, SEQ = 8, 8, 4, 3  # every weight 8 × 8: each of the 4 ranks of a 2 × 2 mesh owns 16 elements
BLOCK_WEIGHTS = ("w1.weight", "w2.weight")


class Block(nn.Module):
    """x + w2(relu(w1(x))): w1 goes column-wise on "tp", w2 row-wise, as attention and MLP do in torchtitan."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(seed: int = 0, numbered: bool = False) -> Net:
    """The chapter's model, seeded; numbered: every weight holds its flat indices ([Note: numbered weights])."""
    torch.manual_seed(seed)
    model = Net()
    if numbered:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("weight"):
                    p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p))
    return model


def mesh_2d(world_size: int):
    """The ("dp", "tp") mesh: 2 data-parallel rows of world_size // 2 tensor-parallel ranks (2 × 2 on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % 2:
        raise ValueError(f"a ('dp', 'tp') mesh of 2 rows needs an even number of ranks, got {world_size}")
    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def tp_then_fsdp(model: Net, mesh, checkpoint: bool = False) -> Net:
    """apply_tp then apply_fsdp, the two steps the chapter starts from; checkpoint: apply_ac between them (tp's
    plan names the block's own submodules, which a checkpoint_wrapper would hide, so tp must come first)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp_lab import fully_shard

    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())
    if checkpoint:
        checkpointed(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 6] → "0-2, 5-6"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def owned(model: Net) -> dict:
    """name → (placements, mesh dim names, local shape, sorted global flat indices) for each block weight of a
    numbered model, read from this rank's local tensor ([Note: numbered weights])."""
    out = {}
    for name, p in model.named_parameters():
        if not name.endswith(BLOCK_WEIGHTS):
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = {"placements": tuple(str(x) for x in getattr(p, "placements", ())),
                     "mesh_dims": tuple(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else (),
                     "shape": tuple(p.shape), "local_shape": tuple(local.shape),
                     "indices": sorted(int(v) for v in local.detach().flatten().tolist())}
    return out


def owned_lines(model: Net, names=("layers.0.w1.weight", "layers.0.w2.weight")) -> str:
    """What this rank keeps of each weight in `names`: its placements, and the rows and columns it holds."""
    lines = []
    for name, o in owned(model).items():
        if name not in names:
            continue
        cols = o["shape"][1]
        rows = sorted({i // cols for i in o["indices"]})
        columns = sorted({i % cols for i in o["indices"]})
        lines.append(f"{name} {o['shape'][0]}×{cols} {'(' + ', '.join(o['placements']) + ')':16s} "
                     f"local {o['local_shape'][0]}×{o['local_shape'][1]}: rows {_ranges(rows)}, "
                     f"columns {_ranges(columns)}")
    return "\n".join(lines)


def batch(mesh, step: int = 0) -> torch.Tensor:
    """This dp rank's rows of the global batch of `step`; the tp ranks of one dp row see the same rows."""
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(BATCH, SEQ, D, generator=g)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    n = BATCH // dp
    return x[dp_rank * n:(dp_rank + 1) * n]


def traced_step(model: Net, mesh, step: int = 0) -> list[dict]:
    """One forward and backward under the lifecycle trace; its events (fully_shard's and DTensor's collectives)."""
    from fsdp_lab.observe import trace

    with trace.record(model) as tracer:
        model(batch(mesh, step)).pow(2).mean().backward()
    return tracer.events


def bytes_lines(events: list[dict]) -> str:
    """Bytes this rank sent per (mesh dimension, collective), and how many collectives made them."""
    from fsdp_lab.observe.mesh_traffic import bytes_by_mesh_dim

    counts: dict = {}
    for e in events:
        if e.get("bytes_sent"):
            key = (e["mesh_dim"], e.get("collective") or _collective_of(e["event"]))
            counts[key] = counts.get(key, 0) + 1
    by = bytes_by_mesh_dim(events, collective=True)
    return "  ".join(f"{dim} {kind} {by[(dim, kind)]:,} B ({counts[(dim, kind)]}×)" for dim, kind in sorted(by))


def _collective_of(event: str) -> str:
    from fsdp_lab.observe.traffic import BEAT_OF_EVENT, COLLECTIVE_OF_BEAT

    return COLLECTIVE_OF_BEAT[BEAT_OF_EVENT[event]]


def beats(events: list[dict]) -> list[tuple]:
    """(event, unit) of every gather, re-gather, free and reduce-scatter, in trace order."""
    return [(e["event"], e["unit"]) for e in events
            if e["event"] in ("gather_start", "regather_start", "free", "reduce_scatter")]


def gathers_per_unit(events: list[dict]) -> dict:
    out: dict = {}
    for e in events:
        if e["event"] in ("gather_start", "regather_start"):
            out[e["unit"]] = out.get(e["unit"], 0) + 1
    return out


def checkpointed(model: Net) -> Net:
    """apply_ac: each block inside torch's checkpoint_wrapper (non-reentrant), before fully_shard."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def saved_elements(model: Net, mesh) -> int:
    """Elements autograd saves for backward in one forward (outside checkpointed regions), this rank."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = model(batch(mesh)).pow(2).mean()
    loss.backward()
    return sum(saved)


def compiled_run(world_size: int, compiled: bool) -> dict:
    """fully_shard on a 1-D mesh of every rank, each block compiled before it (fullgraph=True; aot_eager traces
    with Dynamo and AOTAutograd as inductor does, without a C++ toolchain) or not: the trace of one step, Dynamo's
    graph and graph-break counts, and the wall time of the first (compiling) and second step."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab import fully_shard
    from fsdp_lab.observe import trace

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build()
    for block in model.layers:
        if compiled:
            block.compile(fullgraph=True, backend="aot_eager")
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    seconds = []
    with trace.record(model) as tracer:
        for _step in range(2):
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            seconds.append(time.perf_counter() - start)
    return {"beats": beats([e for e in tracer.events if e["step"] == 0]), "seconds": seconds,
            "graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values())}
