"""The article's formulas as pure, tested functions, with the article's symbols.

Φ = `phi` (number of parameters), N = `n` (GPUs/ranks), Φ_layer = `phi_layer` (parameters of one wrapped unit).
Memory is in BYTES; communication in ELEMENTS unless `dtype_bytes` is given. 1 GB = 1e9 bytes, as in the article
(7B: 16Φ = 112 GB). Where a formula leaves something out, its `*_corrected` twin says what it adds.

[Note: the 16Φ convention] The article counts in fp32: params 4Φ, grads 4Φ, Adam momentum + variance 8Φ. The
ZeRO paper's mixed-precision convention (2Φ + 2Φ + 12Φ) also totals 16Φ for DDP but splits the stages
differently; we follow the article. So does the runtime: fp32 master and gradient on the shard, AdamW state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

GB = 10**9
# [Note: a ceiling on inputs] Every count and size is at most 1e18 (an exabyte, a quintillion parameters):
# far beyond any real job, and low enough that the products the planner forms stay finite floats, so every
# number it prints is a number. Above it a value is refused by name instead of overflowing into inf or an
# OverflowError.
LARGEST = 10**18

_COUNTS = ("n", "gpus", "layers", "hidden", "heads", "seq_len", "micro_batch", "numel_padded_total",
           "largest_unit_numel_padded", "micro_batches")


def _check(**values) -> None:
    """Counts (n, gpus, layers...) must be positive integers, everything else a positive number
    (`activation_bytes` may be 0); None means "not given". The error names the argument and the bad value."""
    for name, v in values.items():
        if v is None:
            continue
        if name in _COUNTS and (isinstance(v, bool) or not isinstance(v, Integral) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        zero_ok = name == "activation_bytes"
        if isinstance(v, Real) and not isinstance(v, bool) and v > LARGEST:  # before isfinite: a huge int overflows it
            shown = f"{len(str(v))} digits" if isinstance(v, Integral) else f"{v:.3g}"
            raise ValueError(f"{name} is too large to plan with ({shown}; at most {LARGEST:.0e})")
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise ValueError(f"{name} must be a {'number >= 0' if zero_ok else 'positive number'}, got {v!r}")


def _exact(x):
    """Integral floats become ints so byte counts and ceilings stay exact (7e9 → 7000000000)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _ceil_div(a, b) -> int:
    a, b = _exact(a), _exact(b)
    return -(-a // b) if isinstance(a, int) and isinstance(b, int) else math.ceil(a / b)


# -- 核心思想 / 分片机制 / 前反流程 ---------------------------------------------------------------------------
def m_param(phi, n):
    """M_param = 4Φ/N: fp32 parameter bytes each rank keeps once sharded (7B on 8 GPUs: 3.5 GB)."""
    _check(phi=phi, n=n)
    return 4 * phi / n


def c_gather(phi_layer, n, dtype_bytes=None):
    """C_gather = Φ_layer·(N−1)/N ≈ Φ_layer: what a rank fetches to assemble one unit (it holds 1/N already)."""
    _check(phi_layer=phi_layer, n=n, dtype_bytes=dtype_bytes)
    return phi_layer * (n - 1) / n * (dtype_bytes or 1)


def c_step(phi, dtype_bytes=None):
    """C_step = C_fwd + C_bwd + C_grad ≈ 3Φ (article): gather, re-gather, reduce-scatter, with (N−1)/N ≈ 1."""
    _check(phi=phi, dtype_bytes=dtype_bytes)
    return 3 * phi * (dtype_bytes or 1)


def c_step_exact(phi, n, dtype_bytes=None):
    """3Φ·(N−1)/N: what two ring all-gathers and one ring reduce-scatter really send per rank per step."""
    _check(phi=phi, n=n, dtype_bytes=dtype_bytes)
    return 3 * phi * (n - 1) / n * (dtype_bytes or 1)


def c_ddp(phi, n, dtype_bytes=None):
    """C_DDP = 2Φ·(N−1)/N: a ring all-reduce is a reduce-scatter plus an all-gather of the gradients."""
    _check(phi=phi, n=n, dtype_bytes=dtype_bytes)
    return 2 * phi * (n - 1) / n * (dtype_bytes or 1)


def comm_ratio_fsdp_vs_ddp(n):
    """C_step / C_DDP = 3Φ(N−1)/N ÷ 2Φ(N−1)/N = 1.5 for N ≥ 2 (quiz Q8). At N = 1 nothing is sent: we raise."""
    _check(n=n)
    if n == 1:
        raise ValueError("the comm ratio needs n >= 2: with n=1 neither FSDP nor DDP communicates")
    return c_step_exact(1, n) / c_ddp(1, n)


def comm_bytes_ratio_fsdp_vs_ddp(n, param_bytes=4, reduce_bytes=4, ddp_bytes=4, micro_batches=1, no_sync=True,
                                 root_share=0.0, reduce_scatter_passes=1):
    """FULL_SHARD's bytes per optimizer step over DDP's: when Q8's 1.5 holds, counted in BYTES.

    FSDP per micro-batch gathers twice in `param_bytes` (forward, backward re-gather). With gradient sync off
    between micro-batches (`no_sync`: FSDP1's no_sync(), FSDP2's set_requires_gradient_sync(False), DDP's
    no_sync()) FSDP reduce-scatters once per step in `reduce_bytes` and DDP all-reduces once in `ddp_bytes`
    (fp32 under autocast: its parameters stay fp32). So
        ratio = (2K·param_bytes + reduce_bytes) / (2·ddp_bytes)
    Equal dtypes, K = 1: 1.5 (the article). bf16 params, fp32 reduce vs fp32 DDP: 8/8 = 1.0. bf16 params and
    reduce: 6/8 = 0.75. K micro-batches, one dtype: (2K+1)/2. Without no_sync both reduce every micro-batch:
    (2K·param_bytes + K·reduce_bytes) / (2K·ddp_bytes), 1.5 whatever K is.
    Two departures a real run shows: `root_share` (Φ_root/Φ) of the parameters is never re-gathered, since the
    root stays gathered from forward to backward (torch FSDP1 and FSDP2), so a micro-batch gathers 2 − root_share
    passes; and `reduce_scatter_passes` is 1 for a ring reduce-scatter (NCCL) but 2 on gloo, whose
    reduce-scatter sends an all-reduce's bytes (tests/test_wire.py)."""
    _check(n=n, param_bytes=param_bytes, reduce_bytes=reduce_bytes, ddp_bytes=ddp_bytes, micro_batches=micro_batches,
           reduce_scatter_passes=reduce_scatter_passes)
    if isinstance(root_share, bool) or not isinstance(root_share, Real) or not 0 <= root_share < 1:
        raise ValueError(f"root_share must be a number in [0, 1), got {root_share!r}")
    if not isinstance(no_sync, bool):
        raise ValueError(f"no_sync must be True or False, got {no_sync!r}")
    if n == 1:
        raise ValueError("the comm ratio needs n >= 2: with n=1 neither FSDP nor DDP communicates")
    k = micro_batches
    reduces = 1 if no_sync else k
    gathers = c_gather(1, n, param_bytes) * (2 - root_share) * k
    fsdp = gathers + c_gather(1, n, reduce_bytes) * reduce_scatter_passes * reduces
    return _exact(fsdp / (c_ddp(1, n, ddp_bytes) * reduces))


@dataclass(frozen=True)
class NodeTraffic:
    """Bytes one GPU sends per step over the links inside its node and over the links between nodes."""

    intra_node: float
    inter_node: float


def node_traffic(phi, gpus_per_node, nodes, strategy="FULL_SHARD", param_bytes=2, reduce_bytes=4):
    """Where a step's bytes go on `nodes` × `gpus_per_node` GPUs: the bandwidth gap HYBRID_SHARD is for.

    FULL_SHARD shards over all N = G·M GPUs; its rings span the nodes, so every collective runs at the speed of
    the links between nodes and all of C_step counts as inter-node: (N−1)/N·Φ·(2·param_bytes + reduce_bytes).
    HYBRID_SHARD shards inside a node and replicates across nodes: the two gathers and the reduce-scatter stay on
    the node's links, (G−1)/G·Φ·(2·param_bytes + reduce_bytes), and only an all-reduce of each GPU's gradient
    shard Φ/G crosses nodes: 2·(M−1)/M·(Φ/G)·reduce_bytes. Memory: HYBRID_SHARD holds 16Φ/G, not 16Φ/N."""
    _check(phi=phi, gpus_per_node=gpus_per_node, nodes=nodes, param_bytes=param_bytes, reduce_bytes=reduce_bytes)
    for name, v in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    g, m, per_pass = gpus_per_node, nodes, 2 * param_bytes + reduce_bytes
    if strategy == "FULL_SHARD":
        n = g * m
        sent = (n - 1) / n * phi * per_pass
        return NodeTraffic(0.0, sent) if m > 1 else NodeTraffic(sent, 0.0)
    if strategy == "HYBRID_SHARD":
        return NodeTraffic((g - 1) / g * phi * per_pass, 2 * (m - 1) / m * phi / g * reduce_bytes)
    raise ValueError(f"unknown strategy {strategy!r}; expected FULL_SHARD or HYBRID_SHARD")


# -- 混合精度 / ZeRO对比 / 工程实践 / 适用场景 ------------------------------------------------------------------
def m_fsdp(phi, n, phi_layer):
    """M_FSDP = 4Φ/N + 8Φ/N + 2Φ_layer (article): master shard, Adam shard, the unit's bf16 working copy.
    Leaves out the fp32 gradient shard 4Φ/N: see m_fsdp_corrected."""
    _check(phi=phi, n=n, phi_layer=phi_layer)
    return 4 * phi / n + 8 * phi / n + 2 * phi_layer


def m_ddp(phi):
    """M_DDP = 4Φ + 4Φ + 8Φ = 16Φ: fp32 params, grads and Adam state, all of it on every GPU."""
    _check(phi=phi)
    return 16 * phi


def m_zero1(phi, n):
    """M_ZeRO-1 = 4Φ + 4Φ + 8Φ/N: only the Adam state is sharded."""
    _check(phi=phi, n=n)
    return 4 * phi + 4 * phi + 8 * phi / n


def m_zero2(phi, n):
    """M_ZeRO-2 = 4Φ + 12Φ/N: fp32 params replicated; grads (4Φ/N) and Adam state (8Φ/N) sharded. The article
    gives no ZeRO-2 formula: this is its fp32 16Φ accounting applied to stage 2. The ZeRO paper counts fp16
    params and grads and 12 bytes of fp32 optimizer state, so its P_os+g is 2Ψ + 14Ψ/N (m_zero_paper). (torch's
    SHARD_GRAD_OP also shards params between steps: runtime_state_bytes says what the runtime holds.)"""
    _check(phi=phi, n=n)
    return 4 * phi + 12 * phi / n


def m_zero3(phi, n):
    """M_ZeRO-3 = 16Φ/N: params, grads and Adam state all sharded (7B on 8 GPUs: 14 GB)."""
    _check(phi=phi, n=n)
    return 16 * phi / n


def m_zero_paper(stage, psi, n):
    """Per-GPU model-state bytes in the ZeRO paper's mixed-precision accounting (Rajbhandari et al. 2020, §5,
    Figure 1): fp16 params 2Ψ, fp16 grads 2Ψ, fp32 master + Adam K = 12Ψ. Stage 0 (DDP): 16Ψ; 1 (P_os):
    4Ψ + 12Ψ/N; 2 (P_os+g): 2Ψ + 14Ψ/N; 3 (P_os+g+p): 16Ψ/N. Ψ = 7.5B, N = 64: 120, 31.4, 16.6, 1.9 GB."""
    _check(psi=psi, n=n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    kept, sharded = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}[stage]
    return kept * psi + sharded * psi / n


def m_peak(phi, n, phi_layer):
    """M_peak = 4Φ_layer + 12Φ/N (article): the unit's bf16 params + grads, master + Adam shards.
    Leaves out the fp32 gradient shard 4Φ/N and the activations: see m_peak_corrected."""
    _check(phi=phi, n=n, phi_layer=phi_layer)
    return 4 * phi_layer + 12 * phi / n


def n_min(phi, gpu_mem_bytes):
    """N_min = ⌈16Φ / M_GPU⌉: fewest GPUs that hold the 16Φ state (7B, 80 GB: ⌈1.4⌉ = 2); no activations."""
    _check(phi=phi, gpu_mem_bytes=gpu_mem_bytes)
    return _ceil_div(16 * _exact(phi), gpu_mem_bytes)


def m_fsdp_corrected(phi, n, phi_layer, activation_bytes=0, param_bytes=2):
    """M_FSDP + what it leaves out = 16Φ/N + param_bytes·Φ_layer + activations: adds the sharded fp32 gradient
    4Φ/N (alive from backward to the optimizer step) and activations; param_bytes generalises bf16's "2"."""
    _check(phi=phi, n=n, phi_layer=phi_layer, param_bytes=param_bytes, activation_bytes=activation_bytes)
    return 16 * phi / n + param_bytes * phi_layer + activation_bytes


def m_peak_corrected(phi, n, phi_layer, activation_bytes=0, param_bytes=2, prefetch=False):
    """M_peak + what it leaves out = 16Φ/N + param_bytes·Φ_layer·(2 if prefetch else 1) + param_bytes·Φ_layer
    + activations: adds the sharded fp32 gradient 4Φ/N and activations. With prefetch the next unit is gathered
    while the current one computes: two units' parameters are alive (the prefetched one has no gradient yet)."""
    _check(phi=phi, n=n, phi_layer=phi_layer, param_bytes=param_bytes, activation_bytes=activation_bytes)
    copies = 2 if prefetch else 1
    return 16 * phi / n + param_bytes * phi_layer * copies + param_bytes * phi_layer + activation_bytes


ATTENTION = ("fused", "materialized")


def activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, recompute=False, attention="fused"):
    """Bytes one transformer layer keeps for backward, 16-bit activations.

    attention="materialized": s·b·h·(34 + 5·a·s/h), Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", eq. 1 (no tensor/sequence parallelism): 34sbh = attention 11 + MLP 19 + two
    layer norms 4 (1-byte dropout masks); 5as²b = the stored s×s attention scores, softmax and its dropout.
    attention="fused" (the default): SDPA/FlashAttention never stores the s×s scores; backward recomputes them
    from Q, K, V and one fp32 log-sum-exp per head and row, so the layer keeps 34·s·b·h + 4·a·s·b. The course
    GPT (SDPA, chapter 06) measures 2056 KiB per block against its 2184 KiB; the materialized formula
    overshoots by the 5as²b term.
    Full recompute keeps only the layer input: 2·s·b·h."""
    _check(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads)
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; expected one of: {', '.join(ATTENTION)}")
    s, b, h, a = seq_len, micro_batch, hidden, heads
    if recompute:
        return 2 * s * b * h
    if attention == "fused":
        return 34 * s * b * h + 4 * a * s * b
    return 34 * s * b * h + 5 * a * s * s * b  # = s·b·h·(34 + 5as/h), exact in integers


# -- what the fsdp_lab runtime holds and sends -----------------------------------------------------------------
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD")


def _strategy(strategy, numel, n) -> str:
    """Checks a runtime strategy (name or ShardingStrategy member) and the padded element count P."""
    name = str(getattr(strategy, "name", strategy)).upper()
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: {', '.join(STRATEGIES)}")
    _check(n=n, numel_padded_total=numel)
    if name != "NO_SHARD" and numel % n:
        raise ValueError(f"{name}: numel_padded_total={numel} is not a multiple of n={n}; pad each unit to it")
    return name


@dataclass(frozen=True)
class StateBytes:
    """Persistent bytes per rank between optimizer steps: fp32 master params, fp32 grads, AdamW state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def runtime_state_bytes(strategy, numel_padded_total, n) -> StateBytes:
    """EXACT bytes per rank the runtime holds between steps (AdamW; fp32 masters and grads whatever the mixed
    precision). P = sum over units of the flat numel padded to a multiple of n.
    FULL_SHARD, SHARD_GRAD_OP: 4P/N, 4P/N, 8P/N. ZERO1: 4P, 4P, 8P/N. NO_SHARD: 4P, 4P, 8P (P unpadded)."""
    s, p = _strategy(strategy, numel_padded_total, n), numel_padded_total
    if s in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return StateBytes(4 * p // n, 4 * p // n, 8 * p // n)
    return StateBytes(4 * p, 4 * p, 8 * p // n if s == "ZERO1" else 8 * p)


def unsharded_peak_bytes(largest_unit_numel_padded, param_bytes, prefetch) -> int:
    """Gathered-parameter bytes alive at once: the largest unit in `param_bytes`, twice with prefetch."""
    _check(largest_unit_numel_padded=largest_unit_numel_padded, param_bytes=param_bytes)
    return largest_unit_numel_padded * param_bytes * (2 if prefetch else 1)


def comm_bytes_per_step(strategy, numel_padded_total, n, param_bytes, reduce_bytes, *, master_bytes=4):
    """Bytes SENT per rank per step.

    [Note: ring convention] In a ring all-gather or reduce-scatter of P elements each rank sends N−1 chunks of
    P/N: (N−1)/N·P. A ring all-reduce is both: 2·(N−1)/N·P. FULL_SHARD: gather (fwd) + re-gather (bwd) in
    param_bytes + reduce-scatter in reduce_bytes. SHARD_GRAD_OP: one gather + one reduce-scatter. NO_SHARD:
    all-reduce in reduce_bytes. ZERO1 (the ZeRO paper's two passes): reduce-scatter of grads in reduce_bytes +
    all-gather of the updated fp32 masters in `master_bytes` (replicas must stay identical, so they travel at
    full precision)."""
    s, p = _strategy(strategy, numel_padded_total, n), numel_padded_total
    _check(param_bytes=param_bytes, reduce_bytes=reduce_bytes, master_bytes=master_bytes)
    if s == "NO_SHARD":  # P may be unpadded: ring chunks are then uneven and (N−1)/N·P is their mean
        total = 2 * (n - 1) * p * reduce_bytes
        return _exact(total // n if total % n == 0 else total / n)
    gathers, gather_bytes, reduces = {"FULL_SHARD": (2, param_bytes, 1), "SHARD_GRAD_OP": (1, param_bytes, 1),
                                      "ZERO1": (1, master_bytes, 1)}[s]
    return _exact((n - 1) * (p // n) * (gathers * gather_bytes + reduces * reduce_bytes))
