"""The course GPT: a small decoder-only transformer used by notebooks, tests, the CLI and the benchmarks.

Presets span a CPU-sized toy to the two GPU configurations in DESIGN.md §7 (369M: 24 layers, d=1024; 1.34B:
d=2048; both with a 65,536-token vocabulary and tied embeddings). The embedding and the output head share one
weight, so the root unit always holds a tied parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    tie_weights: bool = True

    def __post_init__(self):
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd) <= 0:
            raise ValueError(f"GPTConfig sizes must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


PRESETS = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(vocab_size=4096, block_size=256, n_layer=8, n_head=8, n_embd=512),
    "369m": GPTConfig(vocab_size=65536, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1.3b": GPTConfig(vocab_size=65536, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """One transformer block: the natural FSDP unit (the article's Φ_layer)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape  # (B, T) token ids
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_gpt(preset_or_config="tiny", seed: int = 0) -> GPT:
    """Same seed → same weights on every rank, so ranks start identical without a broadcast."""
    cfg = PRESETS[preset_or_config] if isinstance(preset_or_config, str) else preset_or_config
    torch.manual_seed(seed)
    return GPT(cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def batch_for_step(cfg: GPTConfig, step: int, global_batch: int, seq_len: int | None = None, seed: int = 1234):
    """The global batch of a step: deterministic and independent of the world size (ranks take slices)."""
    T = seq_len or cfg.block_size
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # Arithmetic sequences (start + t·stride mod V): learnable, so the loss curve visibly falls.
    start = torch.randint(0, cfg.vocab_size, (global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (global_batch, 1), generator=g)
    data = (start + stride * torch.arange(T + 1)) % cfg.vocab_size
    return data[:, :-1], data[:, 1:]


def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = tensor.shape[0] // world_size
    if per * world_size != tensor.shape[0]:
        raise ValueError(f"global batch {tensor.shape[0]} does not divide by world size {world_size}")
    return tensor[rank * per:(rank + 1) * per]
