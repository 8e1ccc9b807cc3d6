"""Rank functions for the fully_shard tests: FSDP2-style scripts in which only the import differs.

`lib` is "torch" (torch.distributed.fsdp), "fsdp_lab" or "plain" (one process, no sharding, the whole batch).
Every case builds the same small language model with tied embeddings, a frozen layer and uneven row counts
(9 rows over 2 or 4 ranks), trains it a few steps and returns what the tests compare: losses averaged over ranks,
gradient norms, evaluation losses and the final full parameters under their plain names.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

D, VOCAB, SEQ, BATCH = 7, 11, 5, 8  # BATCH divides by 1, 2 and 4


class Block(nn.Module):
    def __init__(self, d: int, frozen: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, d + 2)  # 9 rows: uneven over 2 and 4 ranks
        self.down = nn.Linear(d + 2, d)
        self.gate = nn.Linear(d, d, bias=False)
        if frozen:  # frozen and trainable parameters in one fully_shard group
            self.gate.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.tanh(self.up(h))) * torch.sigmoid(self.gate(h))


class TiedLM(nn.Module):
    """Embedding tied to the output head (both in the root's group), three blocks, the middle one half frozen."""

    def __init__(self, n_layer: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(D, frozen=i == 1) for i in range(n_layer))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def generate(self, idx, steps: int = 2):
        """Greedy decoding that uses the root's own parameters outside forward (register_fsdp_forward_method)."""
        for _ in range(steps):
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x)
            nxt = self.head(self.norm(x))[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def api(lib: str):
    if lib == "torch":
        import torch.distributed.fsdp as fsdp
    else:
        import fsdp_lab as fsdp
    return fsdp


def mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def shard(model: TiedLM, lib: str, world_size: int, layer_kwargs=None, root_kwargs=None) -> TiedLM:
    """Per block, then the root, as torchtitan applies it."""
    if lib == "plain":
        return model
    fsdp = api(lib)
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh(world_size), **(layer_kwargs or {}))
    fsdp.fully_shard(model, mesh=mesh(world_size), **(root_kwargs or {}))
    return model


def batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = (idx * 3 + 1) % VOCAB
    n = BATCH // world_size
    return idx[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_of(model, idx, y):
    return nn.functional.cross_entropy(model(idx).float().reshape(-1, VOCAB), y.reshape(-1))


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().float().clone()
    if world_size > 1:
        dist.all_reduce(value)
    return value.item() / world_size


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def reshard_all(model) -> None:
    """torch keeps a root with reshard_after_forward=False unsharded after a no_grad forward (its registered
    parameters are then the unsharded bf16 ones); reshard so both read the fp32 shards."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()


def full_params(model) -> dict:
    reshard_all(model)
    return {name: full(p) for name, p in model.named_parameters()}


def train(model, opt, rank, world_size, steps, first_step=0, micro_batches=1, before_micro=None):
    """Steps of forward/backward (micro_batches of them, with before_micro(model, i) first), clip_grad_norm_,
    optimizer step, then an evaluation forward under no_grad. Returns (losses, grad norms, eval losses)."""
    losses, norms, evals = [], [], []
    for step in range(first_step, first_step + steps):
        total = 0.0
        for i in range(micro_batches):
            if before_micro is not None:
                before_micro(model, i, micro_batches)
            idx, y = batch(step * micro_batches + i, rank, world_size)
            loss = loss_of(model, idx, y) / micro_batches
            loss.backward()
            total += mean_over_ranks(loss, world_size)
        norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
        model.eval()
        with torch.no_grad():
            idx, y = batch(1000 + step, rank, world_size)
            evals.append(mean_over_ranks(loss_of(model, idx, y), world_size))
        model.train()
    return losses, norms, evals


def _result(model, opt, rank, world_size, steps=3, **kw):
    losses, norms, evals = train(model, opt, rank, world_size, steps, **kw)
    out = {"losses": losses, "norms": norms, "evals": evals, "params": full_params(model),
           "class": type(model).__name__, "frozen_grads": [p.grad for p in model.layers[1].gate.parameters()]}
    # Between forward and backward: is a block's weight the sharded DTensor (resharded after forward) or the
    # unsharded tensor (kept for backward)? And the root's?
    loss = loss_of(model, *batch(0, rank, world_size))
    out["between"] = [isinstance(model.layers[0].up.weight, DTensor), isinstance(model.embed.weight, DTensor)]
    loss.backward()
    opt.zero_grad()
    return out


# -- the cases ---------------------------------------------------------------------------------------------------
def case_fp32(rank, world_size, lib):
    """Default options (and the default mesh for the root), foreach AdamW."""
    torch.manual_seed(0)
    model = TiedLM()
    if lib != "plain":
        fsdp = api(lib)
        for layer in model.layers:
            fsdp.fully_shard(layer, mesh=mesh(world_size))
        fsdp.fully_shard(model)
    dtensors = [isinstance(p, DTensor) for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    out = _result(model, opt, rank, world_size)
    out["tied"] = model.head.weight is model.embed.weight
    out["dtensor"] = dtensors
    return out


def case_bf16(rank, world_size, lib):
    """MixedPrecisionPolicy(bf16 compute, fp32 reduction; the root's output cast to fp32), per-parameter AdamW
    (foreach=False)."""
    torch.manual_seed(0)
    model = TiedLM()
    if lib != "plain":
        mp = api(lib).MixedPrecisionPolicy
        policy = mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
        shard(model, lib, world_size, {"mp_policy": policy}, {"mp_policy": root})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return _result(model, opt, rank, world_size)


def case_no_reshard(rank, world_size, lib):
    """reshard_after_forward=False on the blocks (ZeRO-2), True on the root."""
    torch.manual_seed(0)
    model = shard(TiedLM(), lib, world_size, {"reshard_after_forward": False}, {"reshard_after_forward": True})
    return _result(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world_size)


def case_int_reshard(rank, world_size, lib):
    """reshard_after_forward as an int: the mesh size (True) on the blocks, 1 (False) on the root."""
    torch.manual_seed(0)
    model = shard(TiedLM(), lib, world_size, {"reshard_after_forward": world_size}, {"reshard_after_forward": 1})
    return _result(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world_size)


def case_group_reshard(rank, world_size, lib):
    """reshard_after_forward=2 on 4 ranks, blocks and root: after forward each rank keeps its pair's half of the
    unsharded parameters ([0, 1] and [2, 3]), and backward re-gathers within the pair."""
    torch.manual_seed(0)
    model = shard(TiedLM(), lib, world_size, {"reshard_after_forward": 2}, {"reshard_after_forward": 2})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = _result(model, opt, rank, world_size)
    if lib != "plain":
        loss = loss_of(model, *batch(0, rank, world_size))
        out["held"] = held_after_forward(model, lib)
        loss.backward()
        opt.zero_grad()
    if lib == "fsdp_lab":  # what the trace says of the re-gathers: within which ranks, and the bytes received
        from fsdp_lab.observe import trace

        with trace.record(model) as tracer:
            loss_of(model, *batch(0, rank, world_size)).backward()
        out["regathers"] = {e["unit"]: (e["group_ranks"], e["bytes_received"]) for e in tracer.events
                            if e["event"] == "regather_end"}
        out["frees"] = {e["unit"]: e.get("group_ranks") for e in tracer.events if e["event"] == "free"
                        and e["phase"] == "forward"}
        opt.zero_grad()
        out["shard1_refused"] = shard1_group_reshard_refusal(world_size)
    return out


def shard1_group_reshard_refusal(world_size: int) -> str | None:
    """fsdp_lab refuses reshard_after_forward=2 with a Shard(1) parameter (torch's backward fails on it): the
    message, or None if it was taken."""
    import fsdp_lab
    from torch.distributed.tensor import Shard

    try:
        fsdp_lab.fully_shard(nn.Linear(4, 4), mesh=mesh(world_size), reshard_after_forward=2,
                             shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    except NotImplementedError as err:
        return str(err)
    return None


def held_after_forward(model, lib: str) -> dict:
    """Bytes of parameters each fully_shard module holds between forward and backward, and (fsdp_lab) bytes of
    unsharded buffers still allocated. torch swaps each attribute for the post-forward DTensor; fsdp_lab keeps
    the post-forward shards beside the registered ones."""
    held = {}
    for name, module in model.named_modules():
        if not hasattr(module, "unshard"):
            continue
        if lib == "torch":
            own = [module.embed.weight, module.norm.weight, module.norm.bias] if module is model else \
                [getattr(sub, a) for sub in module.modules() for a, p in sub._parameters.items() if p is not None]
            # The local tensor is an unpadded view of the kept padded block: count the storage behind it, once.
            held[name or "<root>"] = sum({t.to_local().untyped_storage().data_ptr(): t.to_local().untyped_storage()
                                          .nbytes() for t in own}.values())
        else:
            layouts = module._fsdp_lab_state.unit.flats
            held[name or "<root>"] = sum(g.post_forward_shard.numel() * g.post_forward_shard.element_size()
                                         for g in layouts)
            held["unsharded"] = held.get("unsharded", 0) + sum(g.full.untyped_storage().size() for g in layouts)
    return held


def case_accumulate(rank, world_size, lib):
    """Two micro-batches per step; the first without gradient sync (FSDP2's no_sync)."""
    def before(model, i, n):
        if lib != "plain":
            model.set_requires_gradient_sync(i == n - 1)

    torch.manual_seed(0)
    model = shard(TiedLM(), lib, world_size)
    return _result(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world_size, micro_batches=2,
                   before_micro=before)


def case_methods(rank, world_size, lib):
    """Explicit prefetch lists, reshard_after_backward=False and is_last_backward=False on the first micro-batch,
    unshard()/reshard() and register_fsdp_forward_method(model, "generate")."""
    torch.manual_seed(0)
    model = shard(TiedLM(), lib, world_size)
    seen = {}
    if lib != "plain":
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        model.unshard()
        seen["unsharded_is_dtensor"] = isinstance(model.embed.weight, DTensor)
        seen["unsharded_shape"] = tuple(model.embed.weight.shape)
        model.reshard()
        seen["resharded_is_dtensor"] = isinstance(model.embed.weight, DTensor)
        handle = model.layers[0].unshard(async_op=True)
        handle.wait()
        seen["async_unsharded_is_dtensor"] = isinstance(model.layers[0].up.weight, DTensor)
        model.layers[0].reshard()
        api(lib).register_fsdp_forward_method(model, "generate")

    def before(model, i, n):
        if lib != "plain":
            last = i == n - 1
            model.set_reshard_after_backward(last)
            model.set_is_last_backward(last)

    out = _result(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world_size, micro_batches=2,
                  before_micro=before)
    with torch.no_grad():
        out["generated"] = model.generate(batch(7, 0, 1)[0][:2]).tolist()
    out.update(seen)
    return out


def case_meta(rank, world_size, lib):
    """Built on the meta device, fully_shard, to_empty, then reset_parameters(): each rank only ever allocates
    its shards (and one group's unsharded parameters while it computes)."""
    with torch.device("meta"):
        model = TiedLM()
    shard(model, lib, world_size)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    local = sum(p.to_local().numel() for p in model.parameters())
    out = _result(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world_size)
    out["local_numel"] = local
    return out


CASES = {"fp32": case_fp32, "bf16": case_bf16, "no_reshard": case_no_reshard, "int_reshard": case_int_reshard,
         "accumulate": case_accumulate, "methods": case_methods, "meta": case_meta, "group_reshard": case_group_reshard}


def run_cases(rank, world_size, lib, names):
    """Several cases in one launch of the ranks (each launch costs seconds on a 2-core machine)."""
    return {name: CASES[name](rank, world_size, lib) for name in names}


# -- state dicts and checkpoints ---------------------------------------------------------------------------------
def checkpoint_round_trips(rank, world_size, lib, folder):
    """Train 2 steps, save (DCP, sharded) and take full state dicts (get_state_dict with full_state_dict, with and
    without cpu_offload), train 2 more; then two fresh models with other weights load each and train the same 2 steps.
    Exact continuation means the same losses. Also: model.state_dict() is sharded DTensors and communicates
    nothing (only rank 0 calls it: a collective inside would leave it waiting)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def build(seed):
        torch.manual_seed(seed)
        model = shard(TiedLM(), lib, world_size)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)
    train(model, opt, rank, world_size, 2)
    out = {}
    if rank == 0:
        sd = model.state_dict()
        out["keys"] = list(sd)
        out["sharded"] = {k: (type(v).__name__, tuple(v.to_local().shape) if isinstance(v, DTensor) else None)
                          for k, v in sd.items()}
    dist.barrier()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{folder}/{lib}")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 holds it, on the CPU
    offloaded = get_state_dict(model, opt, options=options)[0]
    out["full"] = {k: v.clone() for k, v in offloaded.items()} if rank == 0 else None
    out["others_empty"] = rank == 0 or offloaded == {}
    full_msd, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    # Copies: a replicated entry (AdamW's step) is the live tensor, which the next steps would move on.
    full_msd, full_osd = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (full_msd, full_osd))
    out["full_plain"] = all(not isinstance(v, DTensor) for v in full_msd.values())
    out["continued"] = train(model, opt, rank, world_size, 2, first_step=2)[0]

    model, opt = build(1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{folder}/{lib}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["from_dcp"] = train(model, opt, rank, world_size, 2, first_step=2)[0]

    model, opt = build(2)
    set_state_dict(model, opt, model_state_dict=full_msd, optim_state_dict=full_osd,
                   options=StateDictOptions(full_state_dict=True))
    out["from_full"] = train(model, opt, rank, world_size, 2, first_step=2)[0]
    return out


def broadcast_loads(rank, world_size, lib):
    """set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): only rank 0 holds the weights (a
    plain model's, seed 5); the others pass {} ("empty"), or a state dict of meta tensors ("meta_dict"), or the
    model itself is still on the meta device when it loads ("meta_model", torchtitan's way). Then 3 steps of
    training. lib "plain": one process trained from the same weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(5)
    weights = TiedLM().state_dict()
    out = {}
    for variant in ("empty", "meta_dict", "meta_model"):
        torch.manual_seed(1)  # other weights than rank 0's: a load that did nothing shows
        if variant == "meta_model" and lib != "plain":
            with torch.device("meta"):
                model = TiedLM()
        else:
            model = TiedLM()
        if lib == "plain":
            model.load_state_dict(weights)
        else:
            shard(model, lib, world_size)
            given = {k: v.clone() for k, v in weights.items()} if rank == 0 else \
                {} if variant == "empty" else {k: torch.empty_like(v, device="meta") for k, v in weights.items()}
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, given, options=options)
        loaded = full_params(model)
        result = {"loaded_diff": max((loaded[k] - weights[k]).abs().max().item() for k in loaded),
                  "tied": model.head.weight is model.embed.weight, "count": len(list(model.parameters())),
                  "devices": sorted({p.device.type for p in model.parameters()})}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        result["losses"], result["norms"], result["evals"] = train(model, opt, rank, world_size, 3)
        result["params"] = full_params(model)
        out[variant] = result
    return out


# -- observing: the tracer and memory_report ---------------------------------------------------------------------
def trace_and_memory(rank, world_size, front_end):
    """One traced training step of the same model under fsdp_lab's FSDP (each Block a unit, then the root) or
    fully_shard (each block, then the root), through the same public calls (trace.record, memory_report).
    Returns each unit's event kinds in order, and memory_report's shard bytes against the local shards."""
    import fsdp_lab
    from fsdp_lab.observe import trace
    from fsdp_lab.runtime.core.memory import memory_report
    from fsdp_lab.runtime.fsdp1.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TiedLM()
    if front_end == "fsdp1":
        model = fsdp_lab.FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        shard(model, "fsdp_lab", world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with trace.record(model, optimizer=opt) as tracer:
        loss_of(model, *batch(0, rank, world_size)).backward()
        opt.step()
    kinds: dict = {}
    for event in tracer.events:
        kinds.setdefault(event["unit"], []).append(event["event"])
    report = memory_report(model, opt)
    out = {"kinds": kinds, "report": report.as_dict(), "last_mem": tracer.events[-1]["mem"]}
    from fsdp_lab.lessons.experiments.common import unit_table
    from fsdp_lab.lessons.experiments.fsdp2 import _fully_shard_unit_table
    from fsdp_lab.lessons.widgets.frames import sizes_from_unit_table, unit_sizes

    traced = unit_sizes(tracer.events)
    table = sizes_from_unit_table(unit_table(model) if front_end == "fsdp1" else _fully_shard_unit_table(model),
                                  world_size)
    out["sizes"] = {"exact": traced.exact, "traced": {u: (s.shard_bytes, s.full_bytes) for u, s in traced.units.items()},
                    "table": {u: (s.shard_bytes, s.full_bytes) for u, s in table.units.items()}}
    if front_end == "fully_shard":
        locals_ = [p.to_local() for p in model.parameters()]
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        out["local_shard_bytes"] = sum(t.numel() * t.element_size() for t in locals_)
        out["local_grad_bytes"] = sum(t.numel() * t.element_size() for t in grads)
        out["grad_storage_bytes"] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                         for t in grads if t.numel()}.values())
        out["optimizer_bytes"] = sum(v.to_local().numel() * v.element_size() if isinstance(v, DTensor)
                                     else v.numel() * v.element_size()
                                     for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return out


# -- the API's shape -------------------------------------------------------------------------------------------
def api_checks(rank, world_size):
    """What fully_shard returns and what it refuses (by name), in one process."""
    import fsdp_lab

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as err:
            return f"{type(err).__name__}: {err}"
        return None

    out = {}
    lin = nn.Linear(3, 5)
    got = fsdp_lab.fully_shard(lin)
    out["returned_same"] = got is lin
    out["class"] = type(lin).__name__
    out["mro"] = [c.__name__ for c in type(lin).__mro__[:3]]
    out["isinstance"] = isinstance(lin, fsdp_lab.FSDPModule) and isinstance(lin, nn.Linear)
    out["again"] = error(lambda: fsdp_lab.fully_shard(lin))
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fsdp_lab.fully_shard(seq)
    out["slice_class"] = type(seq[0:1]).__name__
    out["cpu_offload"] = error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2), offload_policy="cpu"))
    out["cpu_offload_ok"] = error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2),
                                                               offload_policy=fsdp_lab.CPUOffloadPolicy())) is None
    out["offload_default_ok"] = error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2),
                                                                   offload_policy=fsdp_lab.OffloadPolicy())) is None
    out.update(_placement_fn_checks(fsdp_lab, error))
    out["module_list"] = error(lambda: fsdp_lab.fully_shard([]))
    out["bad_int"] = error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2), reshard_after_forward=3))
    out["bad_mp"] = error(lambda: fsdp_lab.MixedPrecisionPolicy(param_dtype=torch.int8))
    tied = TiedLM()
    fsdp_lab.fully_shard(tied.embed)
    out["tied_across"] = error(lambda: fsdp_lab.fully_shard(tied))
    out["positional"] = error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2), None))
    ignored = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    keep = ignored[1].weight
    fsdp_lab.fully_shard(ignored, ignored_params={keep})
    out["ignored_kept"] = ignored[1].weight is keep and not isinstance(keep, DTensor)
    out["seam_missing"] = _seam_missing(lin)
    return out


def _placement_fn_checks(fsdp_lab, error) -> dict:
    """shard_placement_fn: Shard(1) taken; what it may not return refused by name (tests/test_shard_placement.py
    runs it on 2 ranks against torch)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Replicate, Shard

    lin = fsdp_lab.fully_shard(nn.Linear(2, 4), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    return {"placement_fn_ok": ([str(p) for p in lin.weight.placements], [str(p) for p in lin.bias.placements]),
            "placement_replicate": error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2),
                                                                      shard_placement_fn=lambda p: Replicate())),
            "placement_dim": error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2),
                                                                shard_placement_fn=lambda p: Shard(2))),
            "placement_mesh": error(lambda: fsdp_lab.fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p:
                                                                 ShardPlacementResult(Shard(0), None)))}


def _seam_missing(sharded_linear) -> dict:
    """Names of the layout seam (fsdp_lab.runtime.core.layout.ShardLayout) that either layout lacks."""
    from fsdp_lab.runtime.core.layout import ShardLayout
    from fsdp_lab.runtime.fsdp1.flat_param import FlatParam

    plain = nn.Linear(3, 5)
    flat = FlatParam("u", [(plain.weight, [(plain, "weight", "weight")])], 1, 0, requires_grad=True,
                     compute_dtype=torch.float32, keep_replica=False, shard_storage=True)
    flat.grad_stash = flat.partial_reduce = flat.replica_grad = None  # what the Unit sets
    group = sharded_linear._fsdp_lab_state.unit.flats[0]
    names = set(ShardLayout.__annotations__) | {n for n in vars(ShardLayout) if not n.startswith("_")}
    return {type(layout).__name__: sorted(n for n in names if not hasattr(layout, n)) for layout in (flat, group)}
