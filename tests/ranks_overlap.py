"""Rank functions for the overlap, prefetch and activation-checkpointing tests (spawned ranks import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab import FSDP, BackwardPrefetch
from fsdp_lab.runtime.core.unit import UnitState
from fsdp_lab.runtime.features.activation_checkpointing import apply_activation_checkpointing
from fsdp_lab.training.models import Block, GPTConfig, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy

GLOBAL_BATCH = 4
STEPS = 3


class Spy:
    """A tracer stand-in: records (step, event, unit, phase) and the state of every unit at each event."""

    def __init__(self, model):
        self.model, self.step, self.events = model, 0, []

    def emit(self, event, unit, phase, prefetch=None, **_):
        states = {u.name: u.state.name for u in self.model.units}
        self.events.append({"step": self.step, "event": event, "unit": unit, "phase": phase, "states": states,
                            "reduces_pending": len(self.model._ctx.reduces), "prefetch": prefetch})

    def on_backward_end(self):
        self.step += 1


def _train(rank, world_size, model, base, steps=STEPS, on_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = batch_for_step(base.cfg, step, GLOBAL_BATCH)
        loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses


def _full_params(model):
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_checkpointed(rank, world_size, order, prefetch=False, use_orig_params=False):
    """order: 'none' (no checkpointing), 'before' or 'after' FSDP wrapping. Returns losses, params, the spy's
    events, and the bytes autograd saved outside checkpointed regions in one forward."""
    base = build_gpt("tiny")
    if order == "before":
        apply_activation_checkpointing(base, check_fn=lambda m: isinstance(m, Block))
    model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({Block}), forward_prefetch=prefetch,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None,
                 use_orig_params=use_orig_params)
    if order == "after":
        names = apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        assert names == [f"blocks.{i}" for i in range(len(base.blocks))], names
    spy = Spy(model)
    model.set_tracer(spy)
    losses = _train(rank, world_size, model, base)
    model.set_tracer(None)
    saved = []
    x, y = batch_for_step(base.cfg, 0, GLOBAL_BATCH)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size))
    loss.backward()
    return losses, _full_params(model), spy.events, sum(saved)


def checkpoint_misuse(rank, world_size):
    model = FSDP(build_gpt("tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}))
    try:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, FSDP))
    except ValueError as exc:
        return str(exc)
    return None


def prefetch_trace(rank, world_size, forward_prefetch, backward_prefetch, limit=None):
    """Two steps with a spy, plus what a hook inside block 0's MLP saw of block 1 while block 0 computed."""
    base = build_gpt("tiny")
    model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({Block}), forward_prefetch=forward_prefetch,
                 backward_prefetch=backward_prefetch)
    if limit is not None:
        model._ctx.max_gathers_in_flight = limit
    seen = []
    unit0, unit1 = (next(u for u in model.units if u.name == f"blocks.{i}") for i in (0, 1))
    base.blocks[0].mlp.register_forward_hook(lambda *_: seen.append(unit1.state.name))
    # While block 1's MLP computes its gradients, what block 0's prefetched re-gather is ([Note: a prefetch on CPU])
    in_flight = []
    base.blocks[1].mlp.register_full_backward_pre_hook(lambda *_: in_flight.append(
        [(type(p).__name__, getattr(p, "done", None)) for p in unit0._pending]))
    spy = Spy(model)
    model.set_tracer(spy)
    losses = _train(rank, world_size, model, base, steps=2)
    model.set_tracer(None)
    return {"events": spy.events, "block1_during_block0": seen, "losses": losses, "block0_during_block1": in_flight,
            "max_in_flight": model._ctx.max_gathers_in_flight,
            "states_after": [u.state.name for u in model.units], "params": _full_params(model)}


def gathering_count(states: dict) -> int:
    return sum(1 for s in states.values() if s == UnitState.GATHERING.name)


class FakeCuda:
    """Stands in for torch.cuda in fsdp_lab.runtime.core.streams.CommStreams on CPU: streams and events that only record
    what waited for what, in one log shared with a Spy (so the log interleaves with lifecycle events)."""

    def __init__(self, log):
        self.log, self._current, self._events = log, None, 0
        self.default = self.Stream(name="compute")
        self._current = self.default

    def Stream(self, device=None, priority=0, name=None):  # noqa: N802 (mirrors torch.cuda.Stream)
        fake = self
        index = sum(1 for e in self.log if e.get("kind") == "new_stream")
        self.log.append({"kind": "new_stream", "index": index, "priority": priority})

        class _Stream:
            label = name or ("gather" if index == 1 else "reduce")

            def wait_stream(self, other):
                fake.log.append({"kind": "wait_stream", "stream": self.label, "on": other.label})

            def record_event(self):
                fake._events += 1
                event = _Event(fake, self.label, fake._events)
                fake.log.append({"kind": "record", "stream": self.label, "id": event.id})
                return event

        return _Stream()

    def current_stream(self, device=None):
        return self._current

    def stream(self, stream):
        fake = self

        class _Ctx:
            def __enter__(self):
                self.previous, fake._current = fake._current, stream

            def __exit__(self, *exc):
                fake._current = self.previous

        return _Ctx()


class _Event:
    def __init__(self, fake, stream, index):
        self.fake, self.stream, self.id = fake, stream, index

    def wait(self, stream=None):
        """torch.cuda.Event.wait: without a stream, the *current* stream waits. Logged as None: the runtime must
        always name the stream that waits."""
        waiter = stream.label if stream is not None else None
        self.fake.log.append({"kind": "wait_event", "stream": waiter, "id": self.id, "of": self.stream})

    def query(self):
        """Never complete: the stand-in GPU is always behind the host, the worst case for memory."""
        return False


class LoggingSpy(Spy):
    def __init__(self, model, log):
        super().__init__(model)
        self.log = log

    def emit(self, event, unit, phase, **kw):
        super().emit(event, unit, phase, **kw)
        self.log.append({"kind": "lifecycle", **self.events[-1]})


def _log_storage(flat, unit, log, fake):
    """Log every real allocation of `flat`'s unsharded storage (with the stream current then) and every real
    release (storage resized to 0), by wrapping the two methods on this one object."""
    alloc, free = flat.alloc_full, flat.free_full

    def logged_alloc():
        fresh = not flat.is_full_allocated()
        log.append({"kind": "alloc", "unit": unit, "flat": id(flat), "fresh": fresh, "stream": fake._current.label})
        return alloc()

    def logged_free():
        if flat.is_full_allocated():
            log.append({"kind": "release", "unit": unit, "flat": id(flat)})
        free()

    flat.alloc_full, flat.free_full = logged_alloc, logged_free


FOUR_BLOCKS = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=2, n_embd=32)  # room for a bound of 2


def fake_stream_run(rank, world_size, strategy="FULL_SHARD", options=None):
    """Train two steps of a 4-block GPT with the CUDA code path switched on over fake streams, with torch's
    default options unless `options` says otherwise; return the log (waits, events, storage allocations and
    releases, lifecycle events, in the order they happened), the results, and those of the same run on CPU's
    null streams."""
    from fsdp_lab.runtime.core.streams import CommStreams

    def build():
        base = build_gpt(FOUR_BLOCKS)
        return base, FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                          **(options or {}))

    ref_base, ref = build()
    ref_losses = _train(rank, world_size, ref, ref_base, steps=2)
    base, model = build()
    log = []
    fake = FakeCuda(log)
    ctx = model._ctx
    ctx.use_streams(CommStreams(torch.device("cpu"), cuda=fake))
    for unit in model.units:
        for flat in unit.flats:
            _log_storage(flat, unit.name, log, fake)
    model.set_tracer(LoggingSpy(model, log))
    losses = _train(rank, world_size, model, base, steps=2)
    model.set_tracer(None)
    freed_after = [size for u in model.units for size in u.full_storage_sizes()]
    return {"log": log, "losses": losses, "params": _full_params(model), "limit": ctx.max_reduces_in_flight,
            "all_gather_limit": ctx.frees.limit, "units": [u.name for u in model.units],
            "freed_after": freed_after, "ref_losses": ref_losses, "ref_params": _full_params(ref)}
