"""MiniFSDP: the article's NumPy sketch of full sharding (fridges, gather, reduce-scatter), with its gaps fixed.

The potluck in arrays: `fridges[r][i]` is household r's slice of dish (layer) i; `gather_layer(i)` brings every
slice to the long table; `reduce_scatter_grad(i, grads)` sums the leftovers of every household and hands each one
its slice back. No processes, no torch: just the bookkeeping, so it can be read in one sitting and compared
number for number with the real runtime (fsdp_lab.runtime.core.collectives on real ranks, notebook 08).

What differs from the article's version, and why:
  * Padding. Cutting a layer of s elements into N slices of s // N drops s mod N elements: the gathered layer
    comes back shorter than the layer. We pad each layer to ceil(s/N)·N (as fsdp_lab.runtime.fsdp1.flat_param and torch
    do) and strip the padding after a gather.
  * Reduce, then scatter. The article's scatter_grad splits one gradient across ranks. In data parallelism every
    rank has its own gradient (from its own micro-batch); reduce-scatter first averages them over ranks, then
    each rank keeps its slice. `reduce_scatter_grad` takes one gradient per rank.
  * Peak. A rank's fridge holds its slice of *every* layer, not only of the biggest one; the peak is that whole
    fridge plus the biggest gathered layer. `peak_params` counts both, and `simulate_step` measures it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def padded(size: int, world_size: int) -> int:
    """Smallest multiple of world_size that holds `size` elements (at least one slot per rank)."""
    return max(1, math.ceil(size / world_size)) * world_size


@dataclass(frozen=True)
class StepStats:
    """Element counts one rank held during a simulated step (forward then backward over every layer)."""

    peak_live: int  # largest (fridge + gathered layers) seen at any moment
    gathers: int  # all-gathers issued (forward + backward)
    reduce_scatters: int
    elements_sent: int  # per rank, ring convention: (N-1)/N of each padded buffer per collective


class MiniFSDP:
    """Every layer flat, padded to a multiple of N, cut into N equal slices; rank r keeps slice r of each layer."""

    def __init__(self, world_size: int, layer_sizes: Sequence[int], seed: int = 0, scale: float = 0.01):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not layer_sizes or any(int(s) < 1 for s in layer_sizes):
            raise ValueError(f"layer_sizes must be positive element counts, got {list(layer_sizes)}")
        self.world_size = world_size
        self.layer_sizes = [int(s) for s in layer_sizes]
        rng = np.random.default_rng(seed)
        layers = [rng.standard_normal(s) * scale for s in self.layer_sizes]
        self.fridges = self._cut(layers)

    @classmethod
    def from_layers(cls, world_size: int, layers: Sequence[np.ndarray]) -> "MiniFSDP":
        """Shard given full layers (1-D arrays) instead of random ones."""
        obj = cls(world_size, [np.asarray(layer).size for layer in layers])
        obj.fridges = obj._cut([np.asarray(layer, dtype=np.float64).reshape(-1) for layer in layers])
        return obj

    @classmethod
    def from_shards(cls, shards: Sequence[Sequence[np.ndarray]], layer_sizes: Sequence[int]) -> "MiniFSDP":
        """Adopt shards that already exist (shards[r][i]: rank r's slice of layer i, padding included), e.g. the
        real runtime's fp32 shards, so its gathers can be compared with a real all-gather."""
        obj = cls(len(shards), layer_sizes)
        for r, row in enumerate(shards):
            for i, piece in enumerate(row):
                want = obj.chunk(i)
                if np.asarray(piece).size != want:
                    raise ValueError(f"rank {r}, layer {i}: shard has {np.asarray(piece).size} elements, expected "
                                     f"{want} = padded({obj.layer_sizes[i]}, {obj.world_size}) / {obj.world_size}")
        obj.fridges = [[np.asarray(p, dtype=np.float64).reshape(-1).copy() for p in row] for row in shards]
        return obj

    def chunk(self, idx: int) -> int:
        """Elements of layer idx in each fridge (the layer padded, divided by N)."""
        return padded(self.layer_sizes[idx], self.world_size) // self.world_size

    def _cut(self, layers: list) -> list:
        out = [[None] * len(layers) for _ in range(self.world_size)]
        for i, layer in enumerate(layers):
            flat = np.zeros(padded(layer.size, self.world_size))
            flat[:layer.size] = layer
            for r, piece in enumerate(np.split(flat, self.world_size)):
                out[r][i] = piece.copy()
        return out

    # -- the three moves -----------------------------------------------------------------------------------
    def gather_layer(self, idx: int, keep_padding: bool = False) -> np.ndarray:
        """All-gather: every household's slice of layer idx, end to end; the padding is cut off unless asked."""
        full = np.concatenate([self.fridges[r][idx] for r in range(self.world_size)])
        return full if keep_padding else full[:self.layer_sizes[idx]]

    def reduce_scatter_grad(self, idx: int, grads: Sequence[np.ndarray]) -> list:
        """Average one full gradient per rank, then give rank r its slice (padding has gradient 0)."""
        if len(grads) != self.world_size:
            raise ValueError(f"reduce-scatter needs one gradient per rank: got {len(grads)}, world_size is "
                             f"{self.world_size}")
        size, total = self.layer_sizes[idx], np.zeros(padded(self.layer_sizes[idx], self.world_size))
        for r, g in enumerate(grads):
            g = np.asarray(g, dtype=np.float64).reshape(-1)
            if g.size != size:
                raise ValueError(f"rank {r}'s gradient for layer {idx} has {g.size} elements, the layer {size}")
            total[:size] += g
        return [piece.copy() for piece in np.split(total / self.world_size, self.world_size)]

    def sgd_step(self, idx: int, grad_shards: Sequence[np.ndarray], lr: float = 0.01) -> None:
        """Each household updates only its own slice: a sharded optimizer step."""
        for r in range(self.world_size):
            self.fridges[r][idx] -= lr * grad_shards[r]

    # -- how much one rank holds -----------------------------------------------------------------------------
    def fridge_elements(self, rank: int = 0) -> int:
        return sum(piece.size for piece in self.fridges[rank])

    def peak_params(self) -> int:
        """Whole fridge (this rank's slice of every layer) + the biggest layer on the table, padding included."""
        return self.fridge_elements(0) + max(padded(s, self.world_size) for s in self.layer_sizes)

    def simulate_step(self, grad_fn=None, lr: float = 0.0, rank: int = 0) -> StepStats:
        """Forward (gather, compute, free) then backward (re-gather, reduce-scatter, free) over every layer,
        counting what `rank` holds. grad_fn(idx, full_layer, r) gives rank r's gradient (default: zeros)."""
        n, live, peak, sent, gathers, scatters = self.world_size, self.fridge_elements(rank), 0, 0, 0, 0
        order = list(range(len(self.layer_sizes)))
        for backward, phase_order in ((False, order), (True, order[::-1])):
            for idx in phase_order:
                full = self.gather_layer(idx, keep_padding=True)
                gathers += 1
                sent += full.size * (n - 1) // n
                live += full.size
                peak = max(peak, live)
                if backward:
                    grads = [np.zeros(self.layer_sizes[idx]) if grad_fn is None
                             else grad_fn(idx, full[:self.layer_sizes[idx]], r) for r in range(n)]
                    shards = self.reduce_scatter_grad(idx, grads)
                    scatters += 1
                    sent += full.size * (n - 1) // n
                    if lr:
                        self.sgd_step(idx, shards, lr)
                live -= full.size  # clear the table
        return StepStats(peak, gathers, scatters, sent)


def article_peak_estimate(layer_sizes: Sequence[int], world_size: int) -> int:
    """What the article's peak_params returns: the biggest layer's slice + the biggest layer. It leaves out the
    slices of every other layer that stay in the fridge (kept here only to compare against)."""
    biggest = max(layer_sizes)
    return biggest // world_size + biggest


def dropped_by_floor_division(layer_sizes: Sequence[int], world_size: int) -> list:
    """Elements the article's s // world_size slicing loses per layer: s mod N."""
    return [s - (s // world_size) * world_size for s in layer_sizes]
