"""Rank functions for the training-loop tests: everyday loop patterns, each run the same way on FSDP ranks and in
one process (`Run.plain()`), so the test can compare the two.

The model has sizes that divide by nothing in particular (width 7, hidden 13, vocab 11), biases, LayerNorms and
dropout, as a new user's model would.
"""
from __future__ import annotations

import contextlib
import functools
import traceback

import torch
import torch.distributed as dist
from ranks_features import message_of
from torch import nn

from fsdp_lab import FSDP
from fsdp_lab.runtime.core.unit import UnitState
from fsdp_lab.training.models import rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

VOCAB, WIDTH, HIDDEN, DEPTH = 11, 7, 13, 3
GLOBAL_BATCH = 12  # divides by 1, 2 and 3
STEPS = 3
LR = 1e-2


class LoopBlock(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.fail_next_forward = False

    def forward(self, x):
        if self.fail_next_forward:  # inside the block: its unit is gathered when this raises
            self.fail_next_forward = False
            raise RuntimeError("simulated out of memory in forward")
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a backward that fails half-way, as an out-of-memory error would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated out of memory in backward")


class LoopNet(nn.Module):
    """Embedding, blocks, final norm and head. The blocks are built from their own seed, so a net assembled from
    blocks made elsewhere (FSDP1's manual nested wrap) starts from the same weights."""

    def __init__(self, blocks=None, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.blocks = nn.ModuleList(blocks if blocks is not None else make_blocks(dropout))
        self.fail_next_backward = False

    def forward(self, idx, targets):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and self.fail_next_backward:  # fails after the head and the later blocks ran backward
                x = _RaiseInBackward.apply(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_blocks(dropout: float = 0.0) -> list[LoopBlock]:
    torch.manual_seed(1)
    return [LoopBlock(dropout) for _ in range(DEPTH)]


def batch(step: int, size: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (size, 5), generator=g)
    return idx, (idx * 3 + 1) % VOCAB


def no_decay(name: str) -> bool:
    """nanoGPT-style groups by name: no weight decay on biases and norms."""
    return name.endswith("bias") or ".norm." in f".{name}"


class Run:
    """One way of running a loop: on FSDP ranks (wrap with these options) or in one process."""

    def __init__(self, rank=0, world_size=1, fsdp=None):
        self.rank, self.world_size, self.fsdp = rank, world_size, fsdp

    @classmethod
    def plain(cls):
        return cls()

    def wrap(self, net: nn.Module) -> nn.Module:
        if self.fsdp is None:
            return net
        options = dict(self.fsdp)
        options.setdefault("auto_wrap_policy", ModuleWrapPolicy({LoopBlock}))
        return FSDP(net, **options)

    def local(self, step: int):
        x, y = batch(step)
        if self.fsdp is None:
            return x, y
        return rank_slice(x, self.rank, self.world_size), rank_slice(y, self.rank, self.world_size)

    def mean_loss(self, loss: torch.Tensor) -> float:
        value = loss.detach().clone()
        if self.fsdp is not None:
            dist.all_reduce(value)
            value /= self.world_size
        return value.item()

    def full_params(self, model) -> dict:
        if self.fsdp is None:
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        with FSDP.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(run: Run, model, opt, steps=range(STEPS), before_backward=None, clip=None):
    losses = []
    for step in steps:
        loss = model(*run.local(step))
        if before_backward is not None:
            before_backward(model, step)
        loss.backward()
        if clip is not None:
            if run.fsdp is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(run.mean_loss(loss))
    return losses


def _states_clean(run: Run, model) -> bool:
    """Every unit SHARDED and, where parameters are sharded, no unsharded buffer left allocated."""
    if run.fsdp is None:
        return True
    sharded = model.sharding_strategy.shards_params
    return all(u.state is UnitState.SHARDED for u in model.units) and \
        (not sharded or all(size == 0 for u in model.units for size in u.full_storage_sizes()))


# -- the patterns: each returns (losses, full parameters, facts) -------------------------------------------------
def eval_whole_run(run: Run):
    """model.eval() for the whole run (dropout off), then forward/backward/step."""
    model = run.wrap(LoopNet(dropout=0.5))
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt)
    return losses, run.full_params(model), {"clean": _states_clean(run, model)}


def no_grad_eval_before_backward(run: Run):
    """Train forward, then an evaluation forward under no_grad (eval mode), then the backward of the first."""
    model = run.wrap(LoopNet())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    eval_losses = []

    def evaluate(m, step):
        m.eval()
        with torch.no_grad():
            eval_losses.append(run.mean_loss(m(*run.local(50 + step))))
        m.train()

    losses = _train(run, model, opt, before_backward=evaluate)
    return losses + eval_losses, run.full_params(model), {"clean": _states_clean(run, model)}


def inference_mode_first(run: Run):
    """A forward under torch.inference_mode() before any training."""
    model = run.wrap(LoopNet())
    with torch.inference_mode():
        first = run.mean_loss(model(*run.local(7)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt)
    return [first] + losses, run.full_params(model), {"clean": _states_clean(run, model)}


def failed_backward(run: Run):
    """Step 0 trains; step 1's backward raises half-way and the loop catches it, zeroes the gradients and goes
    on; steps 2 and 3 train."""
    net = LoopNet()
    model = run.wrap(net)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt, steps=[0])
    net.fail_next_backward = True
    loss = model(*run.local(1))
    caught = None
    try:
        loss.backward()
    except RuntimeError as err:
        caught = str(err)
    net.fail_next_backward = False
    opt.zero_grad(set_to_none=True)
    left_unsharded = 0 if run.fsdp is None else sum(u.state is not UnitState.SHARDED for u in model.units)
    losses += _train(run, model, opt, steps=[2, 3])
    facts = {"caught": caught, "left_unsharded": left_unsharded, "clean": _states_clean(run, model)}
    return losses, run.full_params(model), facts


def failed_forward(run: Run):
    """Step 0 trains; step 1's forward raises inside a block (its unit gathered) and the loop catches it; steps 2
    and 3 train."""
    net = LoopNet()
    model = run.wrap(net)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt, steps=[0])
    block = net.blocks[1]  # under FSDP1, the unit's FSDP instance: the flag goes on the block it wraps
    (block.module if isinstance(block, FSDP) else block).fail_next_forward = True
    caught = None
    try:
        model(*run.local(1))
    except RuntimeError as err:
        caught = str(err)
    left_unsharded = 0 if run.fsdp is None else sum(u.state is not UnitState.SHARDED for u in model.units)
    losses += _train(run, model, opt, steps=[2, 3])
    facts = {"caught": caught, "left_unsharded": left_unsharded, "clean": _states_clean(run, model)}
    return losses, run.full_params(model), facts


@contextlib.contextmanager
def _units_gathered_at_once():
    """The most units whose full masters model.state_dict() held at the same moment: it counts the flats (one per
    unit of LoopNet) whose original parameters are registered over gathered masters and not yet put back."""
    from fsdp_lab.runtime.fsdp1 import state_dict as module

    register, put_back = module.register_full_params, module.put_back
    live, peak = set(), [0]

    def counting_register(unit, flat, full):
        live.add(id(flat))
        peak[0] = max(peak[0], len(live))
        return register(unit, flat, full)

    def counting_put_back(flat, replaced):
        live.discard(id(flat))
        return put_back(flat, replaced)

    module.register_full_params, module.put_back = counting_register, counting_put_back
    try:
        yield peak
    finally:
        module.register_full_params, module.put_back = register, put_back


def state_dict_round_trip(run: Run):
    """torch FSDP1's default model.state_dict(): train 2 steps, take it on every rank and load it strictly into
    the unwrapped net; load it into a freshly wrapped net whose weights were zeroed, and train that one more step
    (SGD: the fresh optimizer has no state to carry)."""
    model = run.wrap(LoopNet())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt, steps=range(2))
    with _units_gathered_at_once() as peak:
        state = model.state_dict()
    plain = LoopNet()
    plain.load_state_dict(state, strict=True)
    net = LoopNet()
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    fresh = run.wrap(net)
    fresh.load_state_dict(state)
    losses += _train(run, fresh, torch.optim.SGD(fresh.parameters(), lr=LR), steps=[2])
    sums = [[v.double().sum().item() for v in state.values()]] * run.world_size
    rank0_only = {"rank0_only": [len(state)] * run.world_size, "same_as_default": True, "default_after": True}
    if run.fsdp is not None:
        dist.all_gather_object(sums, sums[0])
        # torch FSDP1's usual save, with torch's own enum and config: rank 0 gets it on the CPU, the others {}.
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            only = model.state_dict()
        dist.all_gather_object(rank0_only["rank0_only"], len(only))
        rank0_only["same_as_default"] = run.rank != 0 or (list(only) == list(state) and all(
            torch.equal(only[k], state[k]) and only[k].device.type == "cpu" for k in state))
        rank0_only["default_after"] = len(model.state_dict()) == len(state)
    facts = {"clean": _states_clean(run, fresh), "shapes": {k: tuple(v.shape) for k, v in state.items()},
             "plain_equal": all(torch.equal(v, state[k]) for k, v in plain.state_dict().items()),
             "same_on_every_rank": all(s == sums[0] for s in sums), "peak_units_gathered": peak[0],
             "units": len(model.units) if run.fsdp is not None else None, **rank0_only}
    return losses, run.full_params(fresh), facts


def init_after_wrap(run: Run):
    """model.apply(init) after wrapping, as scripts written for torch FSDP1 do: the init sees 2-D weights (fan-in
    for kaiming_uniform_), and what it writes trains."""
    model = run.wrap(LoopNet())

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.kaiming_uniform_(module.weight, a=1.0)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.5)

    torch.manual_seed(5)
    model.apply(init)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt)
    return losses, run.full_params(model), {"clean": _states_clean(run, model)}


def nested_wrap(run: Run, manual: bool = True):
    """FSDP1's manual nested wrap, FSDP(Net(blocks=[FSDP(b) for b in blocks])); in one process the plain net.
    manual=False: the same loop with the blocks picked by the wrap policy instead."""
    if run.fsdp is None or not manual:
        model = run.wrap(LoopNet())
    else:
        options = {k: v for k, v in run.fsdp.items() if k != "auto_wrap_policy"}
        model = FSDP(LoopNet(blocks=[FSDP(b, **options) for b in make_blocks()]), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(run, model, opt)
    facts = {"clean": _states_clean(run, model), "optimizer_tensors": len(opt.param_groups[0]["params"])}
    params = run.full_params(model)
    if run.fsdp is not None:
        facts["units"] = [u.name for u in model.units]
        outer = FSDP(model)  # torch FSDP1 takes FSDP(FSDP(...)): the outer owns nothing, the model is its unit
        facts["rewrap"] = [(type(m.module).__name__, m.check_is_root()) for m in FSDP.fsdp_modules(outer)[:2]]
    return losses, params, facts


def grouped_by_name(run: Run, clip: float = 0.05):
    """Optimizer groups built from named_parameters() (no weight decay on biases and norms), with gradient
    clipping, as most recipes do. Under FSDP this needs use_orig_params=True."""
    model = run.wrap(LoopNet())
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR)
    losses = _train(run, model, opt, clip=clip)
    # torch FSDP1's names keep the _fsdp_wrapped_module level of each FSDP instance outside summon_full_params
    facts = {"clean": _states_clean(run, model), "names": [n.replace("_fsdp_wrapped_module.", "") for n, _ in named],
             "levels": [n.count("_fsdp_wrapped_module.") for n, _ in named],
             "group_sizes": [len(g["params"]) for g in groups]}
    if run.fsdp is not None:
        facts.update(_orig_param_facts(model, named))
    return losses, run.full_params(model), facts


def _orig_param_facts(model, named) -> dict:
    """What use_orig_params promises: 1-D views of this rank's part of the shard, grads views of shard.grad."""
    x, y = batch(0, model.world_size)
    model(rank_slice(x, model.rank, model.world_size), rank_slice(y, model.rank, model.world_size)).backward()
    by_id = {id(p): (flat, slot) for u in model.units for flat in u.flats
             for p, slot in zip(flat.orig_params or [], flat.slots)}
    views, grads, shapes = True, True, {}
    for name, p in named:
        flat, slot = by_id[id(p)]
        start, length = flat.local_range(slot)
        shard_ptr = flat.shard.data_ptr() + start * flat.shard.element_size()
        views &= p.dim() == 1 and p.numel() == length and (length == 0 or p.data_ptr() == shard_ptr)
        if length:
            grad_ptr = flat.shard.grad.data_ptr() + start * flat.shard.grad.element_size()
            grads &= p.grad is not None and p.grad.data_ptr() == grad_ptr
        else:
            grads &= p.grad is None
        shapes[name.replace("_fsdp_wrapped_module.", "")] = p.numel()  # torch's levels off: the plain name
    after_summon = [id(p) for _n, p in model.named_parameters()]
    with FSDP.summon_full_params(model):
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"views_of_shard": views, "grads_views_of_shard_grad": grads, "local_numels": shapes,
            "full_shapes": full_shapes, "same_objects_after_summon":
                after_summon == [id(p) for _n, p in model.named_parameters()] == [id(p) for _n, p in named]}


def checkpoint_resume(run: Run, directory: str):
    """use_orig_params with name groups: train 2 steps, save, build a fresh model and optimizer, load, train 1
    more. The result must equal 3 uninterrupted steps."""
    from fsdp_lab import checkpoint

    def build():
        model = run.wrap(LoopNet())
        named = list(model.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
                                 {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}], lr=LR)
        return model, opt

    model, opt = build()
    losses = _train(run, model, opt, steps=range(2))
    if run.fsdp is not None:
        checkpoint.save(model, opt, directory, step=2)
        model, opt = build()
        checkpoint.load(model, opt, directory)
    losses += _train(run, model, opt, steps=[2])
    return losses, run.full_params(model), {"clean": _states_clean(run, model)}


PATTERNS = {
    "eval_whole_run": (eval_whole_run, {}),
    "no_grad_eval_before_backward": (no_grad_eval_before_backward, {}),
    "inference_mode_first": (inference_mode_first, {}),
    "failed_backward": (failed_backward, {}),
    "failed_forward": (failed_forward, {}),
    "init_after_wrap": (init_after_wrap, {}),
    "init_after_wrap_orig_params": (init_after_wrap, {"use_orig_params": True}),
    "nested_wrap": (nested_wrap, {}),
    "policy_wrap": (functools.partial(nested_wrap, manual=False), {}),
    **{f"orig_params_{s}": (grouped_by_name, {"sharding_strategy": s, "use_orig_params": True})
       for s in ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD")},
    **{f"state_dict_{s}_{orig}": (state_dict_round_trip, {"sharding_strategy": s, "use_orig_params": orig})
       for s, orig in (("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("ZERO1", False), ("NO_SHARD", True))},
}


def run_patterns(rank, world_size, names, checkpoint_dir=None):
    """Every named pattern on these ranks (one process group: spawning ranks is the slow part)."""
    runs = {name: functools.partial(PATTERNS[name][0], Run(rank, world_size, PATTERNS[name][1])) for name in names}
    if checkpoint_dir is not None:
        runs["checkpoint_resume"] = functools.partial(
            checkpoint_resume, Run(rank, world_size, {"use_orig_params": True}), checkpoint_dir)
    out = {}
    for name, fn in runs.items():
        try:  # one broken pattern fails its own test, not all of them
            out[name] = fn()
        except Exception:
            out[name] = traceback.format_exc()
    return out if rank == 0 else None


def reference(name):
    fn, _options = PATTERNS[name] if name in PATTERNS else (checkpoint_resume, {})
    if fn is checkpoint_resume:
        return fn(Run.plain(), None)
    return fn(Run.plain())


def wrap_errors(rank, world_size):
    """The messages users see for what this runtime does not do, or does not do that way."""
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_transformer_policy

    messages = {}

    def capture(key, fn):
        messages[key] = message_of(fn)

    capture("bare_transformer_policy", lambda: FSDP(LoopNet(), auto_wrap_policy=transformer_auto_wrap_policy))
    capture("bare_torch_transformer_policy", lambda: FSDP(LoopNet(), auto_wrap_policy=torch_transformer_policy))
    capture("empty_partial", lambda: FSDP(LoopNet(), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls=set())))
    capture("cpu_offload", lambda: FSDP(LoopNet(), cpu_offload=CPUOffload(offload_params=True),
                                        sharding_strategy="ZERO1"))
    capture("cpu_offload_bad", lambda: FSDP(LoopNet(), cpu_offload=True))
    capture("cpu_offload_off", lambda: FSDP(LoopNet(), cpu_offload=CPUOffload(offload_params=False)))
    capture("nested_other_strategy", lambda: FSDP(LoopNet(blocks=[FSDP(b, sharding_strategy="NO_SHARD")
                                                                 for b in make_blocks()])))

    def call_nested_inner():
        inner = FSDP(make_blocks()[0])
        FSDP(nn.Sequential(inner))
        inner(torch.zeros(2, WIDTH))

    capture("call_nested_inner", call_nested_inner)

    from torch.distributed.fsdp import FullOptimStateDictConfig, ShardedStateDictConfig
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    def state_dict_under(*settings):
        model = FSDP(LoopNet())
        with FSDP.state_dict_type(model, *settings):
            model.state_dict()

    capture("local_state_dict", lambda: state_dict_under("LOCAL_STATE_DICT"))
    capture("sharded_config", lambda: state_dict_under(TorchStateDictType.FULL_STATE_DICT,
                                                       ShardedStateDictConfig()))
    capture("optim_config", lambda: state_dict_under(TorchStateDictType.SHARDED_STATE_DICT, None,
                                                     FullOptimStateDictConfig()))  # a FULL config with SHARDED
    capture("assign", lambda: FSDP(LoopNet()).load_state_dict(LoopNet().state_dict(), assign=True))
    capture("no_fsdp_inside", lambda: FSDP.set_state_dict_type(LoopNet(), "FULL_STATE_DICT"))
    return messages
