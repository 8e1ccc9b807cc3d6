"""The GPU planner: per-GPU bytes for DDP and ZeRO-1/2/3, and how many GPUs a model needs once activations and
an allocator reserve are counted. Built on the article's formulas in fsdp_lab.theory.formulas ."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from fsdp_lab.theory.formulas import (ATTENTION, GB, STRATEGIES, _ceil_div, _check, _exact,
                                      activation_bytes_per_layer, m_ddp, m_zero1, m_zero2, m_zero3, n_min,
                                      node_traffic)

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
_STAGE = {"DDP": "DDP", "NOSHARD": "DDP", "ZERO1": "ZeRO-1", "ZERO2": "ZeRO-2", "SHARDGRADOP": "ZeRO-2",
          "ZERO3": "ZeRO-3", "FULLSHARD": "ZeRO-3", "FSDP": "ZeRO-3", "HYBRIDSHARD": "ZeRO-3"}
_SPLIT = {"DDP": (0, 16), "ZeRO-1": (8, 8), "ZeRO-2": (12, 4), "ZeRO-3": (16, 0)}  # bytes/param: sharded, kept
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _stage(strategy) -> str:
    key = str(getattr(strategy, "name", strategy)).upper().replace("-", "").replace("_", "")
    if key not in _STAGE:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: {', '.join(STAGES + STRATEGIES)}")
    return _STAGE[key]


def llama_like_shape(phi, layers=None, hidden=None, heads=None):
    """Fills in a LLaMA-like (layers, hidden, heads) from Φ ≈ 12·layers·hidden², head size 128. With neither
    given: hidden = 128·layers, layers a multiple of 8 from 16 up (7e9 → 32, 4096, 32; 13e9 → 40, 5120, 40)."""
    if layers is None and hidden is None:
        raw = (phi / (12 * 128**2)) ** (1 / 3)
        layers = round(raw / 8) * 8 if raw >= 16 else max(1, round(raw))
        hidden = 128 * layers
    elif hidden is None:
        hidden = max(128, round((phi / (12 * layers)) ** 0.5 / 128) * 128)
    elif layers is None:
        layers = max(1, round(phi / (12 * hidden**2)))
    return layers, hidden, heads if heads is not None else max(1, hidden // 128)


@dataclass(frozen=True)
class Plan:
    """Per-GPU bytes of each ZeRO stage for Φ on N GPUs, and how many GPUs the chosen stage needs.

    `*_bytes`: the article's state (16Φ convention). A stage's peak adds one unit's working copies (params +
    grads in the compute dtype, params twice with prefetch), one micro-batch's activations, the layer being
    recomputed in backward (with recompute, its full activations come back for a moment: recompute_layer_bytes)
    and the logits with their fp32 copy for the loss (logits_bytes); all of these are the same on every GPU
    whatever the stage. n_min is the article's; n_min_with_activations leaves room for the peak;
    n_min_with_reserve also keeps `reserve_fraction` of each card free (CUDA context, communication buffers,
    allocator fragmentation). None: no number of GPUs is enough."""

    params: int
    gpus: int
    gpu_mem_bytes: int
    strategy: str
    precision: str
    seq_len: int
    micro_batch: int
    layers: int
    hidden: int
    heads: int
    recompute: bool
    prefetch: bool
    reserve_fraction: float
    attention: str
    assumptions: str
    phi_layer: int
    activation_bytes: int
    recompute_layer_bytes: int
    logits_bytes: int
    vocab: int
    working_bytes: int
    ddp_bytes: int
    zero1_bytes: int
    zero2_bytes: int
    zero3_bytes: int
    n_min: int
    n_min_with_activations: int | None
    n_min_with_reserve: int | None
    nodes: int = 1  # HSDP (HYBRID_SHARD): shard inside each of `nodes` groups of gpus // nodes, replicate across
    cpu_offload: bool = False  # torch's CPU offload: sharded state on the host, the step there

    def __post_init__(self):
        _check(**{k: getattr(self, k) for k in ("params", "gpus", "gpu_mem_bytes", "seq_len", "micro_batch",
                                                  "layers", "hidden", "heads")})
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction!r}")
        if not (isinstance(self.nodes, int) and self.nodes >= 1 and self.gpus % self.nodes == 0):
            raise ValueError(f"nodes must be a positive integer that divides gpus={self.gpus}, got {self.nodes!r}")

    def state_bytes(self, stage) -> int:
        return {"DDP": self.ddp_bytes, "ZeRO-1": self.zero1_bytes, "ZeRO-2": self.zero2_bytes,
                "ZeRO-3": self.zero3_bytes}[_stage(stage)]

    def peak_bytes(self, stage) -> int:
        return self.state_bytes(stage) + self.extra_bytes

    @property
    def extra_bytes(self) -> int:
        """Everything on top of the sharded state: the same on every GPU, whatever the stage."""
        return self.working_bytes + self.activation_bytes + self.recompute_layer_bytes + self.logits_bytes

    @property
    def shard_group(self) -> int:
        """G, the ranks one unit is sharded over: all N, or under HSDP the N / nodes ranks of one node."""
        return self.gpus // self.nodes

    @property
    def hybrid_state_bytes(self) -> int:
        """Per-GPU state under HSDP ([Note: hybrid sharding] in fsdp_lab/runtime/features/hybrid.py): ZeRO-3 inside
        the node, so 16Φ/G; each node keeps a whole copy (the replicas). With one node it is ZeRO-3's 16Φ/N."""
        return math.ceil(16 * self.params / self.shard_group)

    def comm_bytes_per_step(self, reduce_bytes: int = 4) -> dict:
        """Bytes one rank sends per step, inside a node and across nodes: formulas.node_traffic with the gathers
        in the `precision`'s bytes and the reduction in `reduce_bytes` (4: fp32, the course's MixedPrecision).
        Under HSDP (nodes > 1) only the all-reduce of the reduced gradient shard, 2·(M-1)/M·(Φ/G)·reduce_bytes,
        crosses nodes; on one node nothing does. It counts three passes over every unit: FSDP1 keeps the root
        unit gathered from forward to backward, so a run sends one root gather less."""
        traffic = node_traffic(self.params, self.shard_group, self.nodes,
                               "HYBRID_SHARD" if self.nodes > 1 else "FULL_SHARD",
                               param_bytes=PRECISION_BYTES[self.precision], reduce_bytes=reduce_bytes)
        return {"intra_node": math.ceil(traffic.intra_node), "inter_node": math.ceil(traffic.inter_node)}

    @property
    def cpu_offload_gpu_bytes(self) -> int:
        """Per-GPU peak under torch's CPU offload (FSDP1 CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy):
        parameters, gradients and optimizer state live on the host and the optimizer steps there, so the card
        holds only what is computed: working copies, activations, logits, plus the unit's fp32 shard copied in
        for its all-gather (4·Φ_layer/G, G = the shard group)."""
        return self.extra_bytes + math.ceil(4 * self.phi_layer / self.shard_group)

    @property
    def cpu_offload_host_bytes(self) -> int:
        """Host memory per rank under CPU offload: the whole sharded state, 16Φ/G (fp32 params, grads, Adam):
        16Φ/N, or under HSDP 16Φ/G."""
        return self.hybrid_state_bytes

    @property
    def gpu_bytes(self) -> int:
        """The chosen options' per-GPU peak: the stage's (ZeRO-3 inside the node under HSDP), or with
        cpu_offload what stays on the card."""
        if self.cpu_offload:
            return self.cpu_offload_gpu_bytes
        return (self.hybrid_state_bytes + self.extra_bytes if self.nodes > 1
                else self.peak_bytes(self.strategy))

    @property
    def host_bytes(self) -> int:
        """Host memory per rank that the chosen options add: the sharded state under cpu_offload, else 0."""
        return self.cpu_offload_host_bytes if self.cpu_offload else 0

    def fits(self, stage, with_activations=True) -> bool:
        return (self.peak_bytes(stage) if with_activations else self.state_bytes(stage)) <= self.gpu_mem_bytes

    def rows(self):
        """(stage, state bytes, peak bytes, state fits, peak fits) per stage, DDP first."""
        return tuple((s, self.state_bytes(s), self.peak_bytes(s), self.fits(s, False), self.fits(s)) for s in STAGES)


def _gpus_needed(stage, phi, fixed_bytes, usable_bytes):
    """Smallest N with sharded·Φ/N + kept·Φ + fixed ≤ usable; None when even N → ∞ is not enough."""
    sharded, kept = _SPLIT[stage]
    room = usable_bytes - kept * phi - fixed_bytes
    if room < 0 or (room == 0 and sharded):
        return None
    return max(1, _ceil_div(sharded * phi, room)) if sharded else 1


LLAMA_VOCAB = 32_000


def _billions(x) -> str:
    """7e9 reads as 7e9 (the article's way); past a trillion billions, plain scientific notation."""
    return f"{x / 1e9:.3g}e9" if x < 1e12 else f"{x:.3g}"


def plan(params, gpus, gpu_mem_gb, strategy="FULL_SHARD", precision="bf16", seq_len=2048, micro_batch=1,
         layers=None, hidden=None, heads=None, *, recompute=False, prefetch=False, reserve_fraction=0.2,
         vocab=LLAMA_VOCAB, attention="fused", nodes=1, cpu_offload=False) -> Plan:
    """Plans Φ = `params` on `gpus` cards of `gpu_mem_gb` GB (1e9 bytes). `strategy` (a ZeRO stage or torch
    name) is the stage the n_min_with_* answers are for; `precision` sets working-copy and activation bytes
    (bf16/fp16: 2, fp32: 4). Missing shape numbers come from llama_like_shape; `vocab` sizes the logits.
    `attention`: "fused" (SDPA/FlashAttention, no stored s×s scores: what current models run) or "materialized"
    (the scores kept, Korthikanti's sbh(34 + 5as/h)); see formulas.activation_bytes_per_layer. `nodes` > 1: HSDP,
    each unit sharded over the gpus // nodes ranks of a node and replicated across nodes (strategy must be
    ZeRO-3, which HYBRID_SHARD is inside a node); `cpu_offload`: torch's CPU offload (Plan.gpu_bytes,
    Plan.host_bytes)."""
    given = {k for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads)) if v is not None}
    _check(params=params, gpus=gpus, gpu_mem_gb=gpu_mem_gb, seq_len=seq_len, micro_batch=micro_batch, layers=layers,
           hidden=hidden, heads=heads, vocab=vocab)
    stage = _stage(strategy)
    if not (isinstance(reserve_fraction, Real) and 0 <= reserve_fraction < 1):
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; expected one of: {', '.join(ATTENTION)}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of: {', '.join(PRECISION_BYTES)}")
    if not isinstance(cpu_offload, bool):
        raise ValueError(f"cpu_offload must be True or False, got {cpu_offload!r}")
    if nodes != 1 and stage != "ZeRO-3":
        raise ValueError(f"nodes={nodes!r} plans HSDP, which shards like ZeRO-3 inside each node; strategy "
                         f"{strategy!r} is {stage}: pass strategy='HYBRID_SHARD' or 'ZeRO-3'")
    phi, mem = _exact(params), _exact(gpu_mem_gb * GB)
    layers, hidden, heads = llama_like_shape(phi, layers, hidden, heads)
    derived = [f"{k}={v}" for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads)) if k not in given]
    assumptions = (f"LLaMA-like shape derived from Φ≈12·layers·hidden² (head size 128): {', '.join(derived)}; "
                   f"12·{layers}·{hidden}² = {_billions(12 * layers * hidden**2)} of Φ = {_billions(phi)} "
                   f"sits in the blocks"
                   if derived else f"shape given: layers={layers}, hidden={hidden}, heads={heads}")
    pb = PRECISION_BYTES[precision]
    phi_layer = 12 * hidden**2
    act = layers * activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, recompute, attention) * pb // 2
    # With recompute, backward rebuilds one layer's full activations before using them.
    recompute_layer = (activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, attention=attention) * pb // 2
                       if recompute else 0)
    logits = (pb + 4) * seq_len * micro_batch * vocab  # the head's output, plus its fp32 copy for the softmax/loss
    working = pb * phi_layer * (2 if prefetch else 1) + pb * phi_layer
    extra = working + act + recompute_layer + logits
    state = [math.ceil(_exact(f)) for f in (m_ddp(phi), m_zero1(phi, gpus), m_zero2(phi, gpus), m_zero3(phi, gpus))]
    return Plan(phi, gpus, mem, stage, precision, seq_len, micro_batch, layers, hidden, heads, bool(recompute),
                bool(prefetch), reserve_fraction, attention, assumptions, phi_layer, act, recompute_layer, logits,
                vocab, working,
                *state, n_min(phi, mem),
                *(_gpus_needed(stage, phi, extra, u) for u in (mem, mem * (1 - reserve_fraction))), nodes,
                cpu_offload)
