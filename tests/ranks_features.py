"""Rank functions for the feature and sharding tests: small models with what real models have."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import FSDP
from fsdp_lab.observe.traffic import collective_bytes
from fsdp_lab.training.models import Block, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy


class Inner(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.frozen = nn.Linear(d, d)  # frozen weights mixed with trainable ones in one unit
        self.trainable = nn.Linear(d, d + 1)  # 7·8 + 8 = 64 elements... sizes chosen not to divide by 3 or 4
        self.back = nn.Linear(d + 1, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.back(torch.tanh(self.trainable(self.frozen(x) * self.scale)))


class Outer(nn.Module):
    """Nested units (Inner inside Wrapped), a frozen/trainable mix, buffers and a tied head."""

    def __init__(self, d=7, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.wrapped = nn.Sequential(Inner(d), nn.Linear(d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied inside the root unit

    def forward(self, idx):
        return self.head(self.wrapped(self.embed(idx)))


def _outer_policy(module, recurse, nonwrapped_numel):
    return True if recurse else isinstance(module, (Inner, nn.Sequential))


def _outer_batch(step, global_batch=24):  # even halves per rank at world sizes 1-4
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 11, (global_batch, 5), generator=g)
    return idx, (idx * 3 + 1) % 11


def _loss(model, idx, y):
    return nn.functional.cross_entropy(model(idx).reshape(-1, 11), y.reshape(-1))


def train_outer(rank, world_size, mode, steps=3):
    """mode: 'plain' (single process), or an FSDP strategy; also exercises two forwards before one backward."""
    torch.manual_seed(0)
    model = Outer()
    if mode != "plain":
        model = FSDP(model, sharding_strategy=mode, auto_wrap_policy=_outer_policy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        idx, y = _outer_batch(step)
        if mode != "plain":
            idx, y = rank_slice(idx, rank, world_size), rank_slice(y, rank, world_size)
        half = idx.shape[0] // 2
        loss = _loss(model, idx[:half], y[:half]) + _loss(model, idx[half:], y[half:])  # two forwards
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    info = {}
    if mode != "plain":
        info["states"] = [u.state for u in model.units]
        info["frozen_grads"] = [g.shard.grad for u in model.units for g in u.flats if not g.requires_grad]
        info["opt_numels"] = sorted({v.numel() for s in opt.state.values() for v in s.values() if v.dim()})
        info["shard_numels"] = sorted({g.shard_numel for u in model.units for g in u.flats if g.requires_grad})
        info["tied_aliases"] = [len(s.aliases) for u in model.units for g in u.flats for s in g.slots]
        with FSDP.summon_full_params(model):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        info["buffers"] = {n.replace("_fsdp_wrapped_module.", ""): b.clone() for n, b in model.named_buffers()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    all_losses = torch.tensor(losses)
    if mode != "plain":
        dist.all_reduce(all_losses)
        all_losses /= world_size
    return all_losses.tolist(), params, info


def sharding_facts(rank, world_size, strategy="FULL_SHARD"):
    """What each rank holds, and storage sizes observed while other units compute."""
    base = build_gpt("tiny")
    total = sum(p.numel() for p in {id(p): p for p in base.parameters()}.values())
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    seen_during_block1 = {}

    def spy(module, args, output):
        seen_during_block1.update({u.name: u.full_storage_sizes() for u in model.units})

    base.blocks[1].mlp.register_forward_hook(spy)  # fires while block 1 computes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_for_step(base.cfg, 0, 4 * world_size)
    model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    opt.step()
    groups = [g for u in model.units for g in u.flats]
    return {
        "total_numel": total,
        "groups": [(g.numel, g.padded_numel, g.shard_numel, g.shard.numel()) for g in groups],
        "opt_numels": [[v.numel() for v in opt.state[g.shard].values() if v.dim()] for g in groups],
        "after_backward": {u.name: u.full_storage_sizes() for u in model.units},
        "during_block1": seen_during_block1,
        "states": {u.name: u.state for u in model.units},
    }


def no_grad_and_eval(rank, world_size):
    base = build_gpt("tiny")
    model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, _ = batch_for_step(base.cfg, 0, 2 * world_size)
    x = rank_slice(x, rank, world_size)
    gathers = []
    model.set_tracer(type("T", (), {"emit": lambda self, e, **k: gathers.append((e, k["unit"], k["phase"])),
                                    "on_backward_end": lambda self: None})())
    with torch.no_grad():
        model(x)
    after_no_grad = {u.name: u.state for u in model.units}
    model.eval()
    model(x)
    after_eval = {u.name: u.state for u in model.units}
    model.train()
    return after_no_grad, after_eval, [g for g in gathers if g[0].startswith("regather")]


def no_sync_step(rank, world_size, strategy):
    """Two micro-batches: the first backward under no_sync (no communication), the second syncs."""
    base = build_gpt("tiny")
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_for_step(base.cfg, 0, 12)
    comm = []
    model.set_tracer(type("T", (), {"emit": lambda self, e, **k: comm.append(collective_bytes(k["collectives"]).sent),
                                    "on_backward_end": lambda self: None})())
    with model.no_sync():
        model(rank_slice(x[:6], rank, world_size), rank_slice(y[:6], rank, world_size)).backward()
    bytes_in_no_sync = sum(comm)
    model(rank_slice(x[6:], rank, world_size), rank_slice(y[6:], rank, world_size)).backward()
    model.set_tracer(None)
    opt.step()
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, bytes_in_no_sync


def no_sync_reference():
    model = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_for_step(model.cfg, 0, 12)
    (model(x[:6], y[:6]) + model(x[6:], y[6:])).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def summon_writeback(rank, world_size, strategy):
    base = build_gpt("tiny")
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    with FSDP.summon_full_params(model):
        names = [n for n, _ in model.named_parameters()]
        with torch.no_grad():
            dict(model.named_parameters())["blocks.0.ln1.weight"].fill_(2.0)
            dict(model.named_parameters())["wte.weight"][0].fill_(0.5)
    x, _ = batch_for_step(base.cfg, 0, world_size)
    logits = model(rank_slice(x, rank, world_size)).detach()
    with FSDP.summon_full_params(model):
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [u.state for u in model.units]
    return names, after["blocks.0.ln1.weight"], after["wte.weight"][0], logits, states


def message_of(fn) -> str | None:
    """What a user sees when `fn` fails: "ValueError: ..." (None when it does not fail)."""
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def error_cases(rank, world_size):
    """Each misuse, with the message the user sees."""
    messages = {}

    def capture(key, fn):
        messages[key] = message_of(fn)

    def tied_across():
        m = build_gpt("tiny")
        m.blocks[1].mlp.fc.weight = m.blocks[0].mlp.fc.weight
        FSDP(m, auto_wrap_policy=ModuleWrapPolicy({Block}))

    def meta_device():  # on meta, with nothing that says how to initialise it
        class NoReset(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.empty(4))

        with torch.device("meta"):
            m = NoReset()
        FSDP(m)

    def mixed_device():
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        m[1].to("meta")
        FSDP(m)

    def second_backward():
        m = build_gpt("tiny")
        model = FSDP(m, auto_wrap_policy=ModuleWrapPolicy({Block}))
        x, y = batch_for_step(m.cfg, 0, 2)
        loss = model(x, y)
        loss.backward(retain_graph=True)
        loss.backward()

    capture("tied_across", tied_across)
    capture("meta_device", meta_device)
    capture("mixed_device", mixed_device)
    capture("unknown_strategy", lambda: FSDP(build_gpt("tiny"), sharding_strategy="HYBRID_ZERO9"))
    capture("unknown_policy", lambda: FSDP(build_gpt("tiny"), auto_wrap_policy=42))
    capture("second_backward", second_backward)
    return messages


def clipped_gradients(rank, world_size, strategy, max_norm):
    """Global gradient norm and clipped gradients (full, original names) after one backward."""
    base = build_gpt("tiny")
    model = FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, y = batch_for_step(base.cfg, 0, 12)
    model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    norm = model.clip_grad_norm_(max_norm).item()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # p - grad: the clipped gradient, read back in full
    opt.step()
    with FSDP.summon_full_params(model):
        stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    return norm, stepped


def clipped_reference(max_norm):
    model = build_gpt("tiny")
    x, y = batch_for_step(model.cfg, 0, 12)
    model(x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return norm, {n: p.detach().clone() for n, p in model.named_parameters()}


class Branchy(nn.Module):
    """A data-dependent branch: unit `branch` runs only when the batch asks for it."""

    def __init__(self, d=7):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.branch = nn.Sequential(nn.Linear(d, d))
        self.out = nn.Linear(d, 3)

    def forward(self, x, take_branch: bool):
        h = self.inp(x)
        return self.out(self.branch(h) if take_branch else h).pow(2).mean()


def unit_on_one_rank_only(rank, world_size):
    """Rank 0 takes the branch, the others do not: their collectives no longer pair up. What each rank raises."""
    model = FSDP(Branchy(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    try:
        model(torch.randn(4, 5), take_branch=rank == 0).backward()
    except Exception as err:
        return type(err).__name__, isinstance(err, dist.DistError), str(err)
    return None
