"""Ranks for tests/test_tensor_parallel.py: tensor parallel on a 2-D mesh ("dp", "tp"), then fully_shard on
"dp", as torchtitan's apply_tp and apply_fsdp do, in a script where only the import differs (torch or fsdp_lab)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from ranks_fully_shard import api, full, reshard_all
from torch import nn
from torch.distributed.tensor import DTensor

D, HIDDEN, BATCH, SEQ = 8, 10, 8, 3  # HIDDEN/tp = 5 rows per tp rank: uneven on dp=2


class Block(nn.Module):
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


def mesh_2d(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def build(lib: str, dp: int, tp: int, seed: int = 0):
    """apply_tp then apply_fsdp: w1 column-wise, w2 row-wise on "tp"; fully_shard per block on "dp", then the
    root. lib="plain": one process, no parallelism."""
    torch.manual_seed(seed)
    model = Net()
    if lib == "plain":
        return model, None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = mesh_2d(dp, tp)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fsdp = api(lib)
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh["dp"])
    fsdp.fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def batch(step: int, dp_rank: int, dp: int):
    """The global batch of `step`, this dp rank's rows of it (tp ranks of one dp rank see the same rows)."""
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(BATCH, SEQ, D, generator=g)
    n = BATCH // dp
    return x[dp_rank * n:(dp_rank + 1) * n]


def train(model, opt, mesh, steps: int, first_step: int = 0, clip: bool = True) -> tuple[list, list]:
    """AdamW steps with clip_grad_norm_ over the gradients; returns the losses (mean over the global batch) and
    the gradient norms clip_grad_norm_ returned."""
    dp_rank, dp = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if mesh is not None else (0, 1)
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        x = batch(step, dp_rank, dp)
        loss = model(x).pow(2).mean()
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norms.append(full(norm).item())
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(value, group=mesh["dp"].get_group())
        losses.append(value.item() / dp)
    return losses, norms


def placements(t) -> tuple:
    return (tuple(str(p) for p in t.placements), t.device_mesh.mesh_dim_names) if isinstance(t, DTensor) else None


def _train_and_describe(lib, dp, tp, steps):
    model, mesh = build(lib, dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = train(model, opt, mesh, steps)
    reshard_all(model)
    return model, opt, mesh, {
        "losses": losses, "norms": norms,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "placements": {n: placements(p) for n, p in model.named_parameters()},
        "local_shapes": {n: tuple(getattr(p, "_local_tensor", p).shape) for n, p in model.named_parameters()}}


def run_train(rank, world_size, lib, dp=2, tp=2, steps=3):
    return _train_and_describe(lib, dp, tp, steps)[3]


def _described(state: dict) -> dict:
    """key → (placements, full value) for every tensor of a (possibly nested) state dict."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            out[prefix[:-1]] = (placements(value), full(value))
        else:
            out[prefix[:-1]] = value
    walk("", state)
    return out


def state_dicts(model, opt) -> dict:
    """get_model_state_dict and get_state_dict, full and sharded, each described key by key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    out = {}
    for kind, full_state_dict in (("full", True), ("sharded", False)):
        options = StateDictOptions(full_state_dict=full_state_dict)
        out[f"model_{kind}"] = _described(get_model_state_dict(model, options=options))
        msd, osd = get_state_dict(model, opt, options=options)
        out[f"both_{kind}"] = _described({"model": msd, "optim": osd})
    return out


def run_train_and_state_dicts(rank, world_size, lib, dp=2, tp=2, steps=3):
    model, opt, mesh, result = _train_and_describe(lib, dp, tp, steps)
    return {**result, "state_dicts": state_dicts(model, opt) if mesh is not None else None}


def build_1d(lib: str, world_size: int, seed: int = 0):
    """The same model with fully_shard on a 1-D mesh of every rank and no tensor parallel (dp=world_size)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model, fsdp = Net(), api(lib)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model, mesh


def run_dcp_resume(rank, world_size, lib, folder, steps=2):
    """Train on 2x2, save model and optimizer with DCP, train on; then load the checkpoint into a fresh 2x2 model
    and into a dp=4 model without tensor parallel (resharded), and train the same steps from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, mesh = build(lib, 2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before, _n = train(model, opt, mesh, steps)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    continued, _n = train(model, opt, mesh, steps, first_step=steps)
    reshard_all(model)
    expected = {n: full(p) for n, p in model.named_parameters()}
    out = {"before": before, "continued": continued, "expected": expected}
    for target in ("2x2", "dp4"):
        fresh, fresh_mesh = build(lib, 2, 2, seed=1) if target == "2x2" else build_1d(lib, world_size, seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        resumed, _n = train(fresh, fresh_opt, fresh_mesh, steps, first_step=steps)
        reshard_all(fresh)
        out[target] = {"resumed": resumed, "params": {n: full(p) for n, p in fresh.named_parameters()}}
    return out


def run_trace(rank, world_size):
    """One forward and backward of the 2x2 model under the lifecycle trace: bytes per mesh dimension."""
    from fsdp_lab.observe import trace
    from fsdp_lab.observe.mesh_traffic import bytes_by_mesh_dim

    model, mesh = build("fsdp_lab", 2, 2)
    with trace.record(model) as tracer:
        model(batch(0, mesh["dp"].get_local_rank(), 2)).pow(2).mean().backward()
    events = tracer.events
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as torch_count:  # torch's own count of DTensor's collectives, for the same pass
        model(batch(0, mesh["dp"].get_local_rank(), 2)).pow(2).mean().backward()
    return {"refusals": refusals(), "torch_counts": {str(op): n for op, n in torch_count.get_comm_counts().items()},
            "by_dim": bytes_by_mesh_dim(events), "by_dim_collective": bytes_by_mesh_dim(events, collective=True),
            "dtensor_events": [(e["phase"], e["collective"], e["mesh_dim"], e["group_ranks"], e["bytes_sent"])
                               for e in events if e["event"] == "dtensor_collective"],
            "fsdp_dims": sorted({(e["event"], e["mesh_dim"], tuple(e["group_ranks"])) for e in events
                                 if e.get("bytes_sent") and e["event"] != "dtensor_collective"})}


def refusals() -> dict:
    """What fsdp_lab refuses by name over tensor-parallel parameters: the ValueError messages."""
    import fsdp_lab
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh, out = mesh_2d(2, 2), {}
    for case, kwargs in (("hsdp", {"mesh": mesh}), ("offload", {"mesh": mesh["dp"],
                                                                 "offload_policy": fsdp_lab.CPUOffloadPolicy()})):
        block = Block()
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        try:
            fsdp_lab.fully_shard(block, **kwargs)
            out[case] = None
        except ValueError as err:
            out[case] = str(err)
    return out
