"""How much host memory a CPU run of rank processes needs, and how much this machine can give it: the memory half
of the check `fsdp-lab train`, `bench`, `demo` and the live ranks run before any rank process starts.

[Note: what a rank holds on the host] Per rank, at its peak (the backward of the first step, once AdamW's state
exists from then on), in the terms of fsdp_lab.theory.formulas:
- state: `runtime_state_bytes` (fp32 parameter shard, gradient shard, AdamW's two moments; replicated under
  NO_SHARD, half replicated under ZERO1), and never less than the 4Φ of the full fp32 model every rank builds
  before it is sharded;
- unsharded: the gathered units alive at once, `unsharded_peak_bytes` (the root stays gathered from forward to
  backward; a block, twice with prefetch; every unit under SHARD_GRAD_OP, which does not free after forward),
  plus the unsharded gradient of the largest unit before its reduce-scatter;
- activations: `activation_bytes_per_layer` for every block (in the compute dtype), plus the logits, their
  log-softmax and their gradient in fp32 (B·T·vocab each: the largest tensors of a small-width GPT);
- baseline: the resident memory of a Python process that has imported torch, MEASURED (not assumed): a rank
  imports the same before it builds anything.
Times the ranks on this node, since CPU ranks share its memory. Other allocator slack comes on top; the test
against a real run's peak RSS (tests/test_host_memory.py) states how close this is.

[Note: what is free] MemAvailable (what the kernel can hand out without swapping), and no more than the room left
under a cgroup limit (memory.max minus memory.current, v2; memory.limit_in_bytes minus usage, v1), since a
container is OOM-killed at its limit whatever the host has free.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.theory.formulas import GB, activation_bytes_per_layer, runtime_state_bytes, unsharded_peak_bytes

BASELINE_TIMEOUT_S = 120.0  # a fresh `import torch` on a loaded 2-core machine takes a few seconds


@dataclass(frozen=True)
class HostMemoryNeed:
    """The host bytes one CPU run needs on this node, and what they are made of (each per rank)."""
    ranks: int
    baseline: int      # a Python process with torch imported, measured
    state: int         # parameters, gradients and optimizer state (or the full model built before sharding)
    unsharded: int     # gathered units and the unsharded gradient of one unit
    activations: int   # activations kept for backward, logits and their gradient

    @property
    def per_rank(self) -> int:
        return self.baseline + self.state + self.unsharded + self.activations

    @property
    def total(self) -> int:
        return self.per_rank * self.ranks

    def parts(self) -> str:
        return (f"{self.ranks} rank(s) x {self.per_rank / GB:,.2f} GB: {self.state / GB:,.2f} state, "
                f"{self.unsharded / GB:,.2f} gathered, {self.activations / GB:,.2f} activations, "
                f"{self.baseline / GB:,.2f} process")


@dataclass(frozen=True)
class Available:
    """Bytes this process's ranks may still take, and where that limit comes from."""
    bytes: int
    source: str        # "MemAvailable" or "cgroup memory.max"


# -- what this machine has free ---------------------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def mem_available(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, or None where the kernel does not report it."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    return None


def cgroup_room(root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1), or None where no limit is set."""
    root = Path(root)
    for limit, usage in ((root / "memory.max", root / "memory.current"),
                         (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")):
        cap = _read_int(limit)
        if cap is not None and cap < 2 ** 60:  # v1 writes "no limit" as a huge number
            return max(0, cap - (_read_int(usage) or 0))
    return None


def available_memory(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> Available | None:
    """The smaller of MemAvailable and the room under the cgroup limit; None where neither is known."""
    found = [(b, s) for b, s in ((mem_available(meminfo), "MemAvailable"), (cgroup_room(cgroup), "cgroup memory.max"))
             if b is not None]
    if not found:
        return None
    return Available(*min(found))


# -- what a rank process costs before it builds anything -------------------------------------------------------
def this_process_rss() -> int | None:
    """This process's resident bytes now (VmRSS), or None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_baseline(fresh: bool = False) -> int:
    """Resident bytes of a Python process with torch imported, measured. fresh=False: this process's own
    (cheap; a command has imported torch by the time it checks, as its ranks will, and a bigger process only
    over-counts). fresh=True: the peak of a new `python -c "import torch"` (about two seconds), for callers such
    as a notebook kernel whose own memory says nothing about the processes it starts."""
    if not fresh:
        import torch  # noqa: F401  (what a rank imports first; cheap when already imported)

        rss = this_process_rss()
        if rss is not None:
            return rss
    code = ("import torch, torch.distributed\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=BASELINE_TIMEOUT_S, check=True).stdout
        return int(out.split()[-1]) * 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return this_process_rss() or 0


# -- what a GPT run needs ---------------------------------------------------------------------------------------
_FLAT_STRATEGY = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def _unit_numels(cfg) -> tuple[int, int, int]:
    """(all parameters, one Block's, the root's own) of the course GPT `cfg`, counted on the meta device."""
    import torch

    from fsdp_lab.training.models import Block, build_gpt, count_params

    with torch.device("meta"):
        phi, block = count_params(build_gpt(cfg)), count_params(Block(cfg))
    return phi, block, phi - cfg.n_layer * block


def gpt_model_need(cfg, strategy: str, n: int, batch_per_rank: int, seq_len: int, param_bytes: int = 4,
                   prefetch: bool = True, recompute: bool = False) -> tuple[int, int, int]:
    """(state, unsharded, activations) bytes per rank of the course GPT `cfg` wrapped one unit per Block plus the
    root, sharded over `n` ranks with `strategy`, AdamW, `batch_per_rank` sequences of `seq_len` tokens, the
    gathered parameters and activations in `param_bytes`. See [Note: what a rank holds on the host]."""
    name = _FLAT_STRATEGY.get(strategy, strategy)
    phi, block, root = _unit_numels(cfg)
    pad = (lambda x: x) if name == "NO_SHARD" else (lambda x: _padded(x, n))
    padded_total = pad(root) + cfg.n_layer * pad(block)
    state = max(runtime_state_bytes(name, padded_total, n).total, 4 * phi)
    if name in ("NO_SHARD", "ZERO1"):  # parameters are replicated: nothing is gathered
        unsharded = 0
    elif name == "SHARD_GRAD_OP":     # no free after forward: every unit stays gathered until backward
        unsharded = padded_total * param_bytes + max(pad(root), pad(block)) * param_bytes
    else:
        unsharded = (unsharded_peak_bytes(pad(root), param_bytes, False)
                     + unsharded_peak_bytes(pad(block), param_bytes, prefetch)
                     + max(pad(root), pad(block)) * param_bytes)  # one unit's unsharded gradient
    per_layer = activation_bytes_per_layer(seq_len, batch_per_rank, cfg.n_embd, cfg.n_head, recompute=recompute)
    activations = cfg.n_layer * per_layer * param_bytes // 2 + 3 * 4 * batch_per_rank * seq_len * cfg.vocab_size
    return state, unsharded, activations


def train_need(cfg, world_size: int, local_ranks: int, baseline: int) -> HostMemoryNeed:
    """What `fsdp-lab train` with TrainConfig `cfg` needs on this node's host (a CPU run)."""
    from fsdp_lab.training.models import PRESETS

    name = _FLAT_STRATEGY.get(cfg.strategy, cfg.strategy)
    n = local_ranks if name != cfg.strategy else world_size  # hybrid: sharded inside the node
    gpt = PRESETS[cfg.preset]
    state, unsharded, act = gpt_model_need(
        gpt, cfg.strategy, max(1, n), cfg.global_batch // max(1, world_size), gpt.block_size,
        param_bytes=2 if cfg.mixed_precision == "bf16" else 4,
        prefetch=cfg.backward_prefetch != "none" or cfg.forward_prefetch, recompute=cfg.activation_checkpointing)
    return HostMemoryNeed(local_ranks, baseline, state, unsharded, act)


def processes_need(ranks: int, baseline: int) -> HostMemoryNeed:
    """Rank processes whose work is not known yet (the live ranks run whatever a cell sends): the processes."""
    return HostMemoryNeed(ranks, baseline, 0, 0, 0)


def memory_problem(need: HostMemoryNeed, available: Available | None, override: str,
                   advice: str = "use fewer ranks or a smaller model or batch") -> str | None:
    """One line naming both numbers (GB = 1e9 bytes), what to change and `override` (the way past it, e.g.
    "add --allow-low-memory") when `need` does not fit in `available`; else None."""
    if available is None or need.total <= available.bytes:
        return None
    return (f"this run needs about {need.total / GB:,.2f} GB of host memory ({need.parts()}) but only "
            f"{available.bytes / GB:,.2f} GB is available ({available.source}); {advice}, or {override}")


def bench_need(cfg, baseline: int) -> HostMemoryNeed:
    """What `fsdp-lab bench` with BenchConfig `cfg` needs on the host: every setup of cfg.modes is built on every
    rank before the rounds start (their states add up), and one runs at a time (the largest gathered units and
    activations count once). All compute in bf16; "plain" keeps the whole model on each rank."""
    from fsdp_lab.training.models import PRESETS

    gpt, n, seq = PRESETS[cfg.preset], cfg.nproc, cfg.seq_len or PRESETS[cfg.preset].block_size
    sharded = gpt_model_need(gpt, "FULL_SHARD", n, cfg.batch, seq, param_bytes=2)
    plain = gpt_model_need(gpt, "NO_SHARD", 1, cfg.batch, seq, param_bytes=2)
    parts = [plain if mode == "plain" else sharded for mode in cfg.modes]
    return HostMemoryNeed(n, baseline, sum(p[0] for p in parts), max(p[1] for p in parts),
                          max(p[2] for p in parts))
