"""Exercise 08 · A MiniFSDP in NumPy that handles any layer size (chapter 08).

The article's MiniFSDP splits each layer with `s // world_size`, which silently drops elements when s does not
divide. Here every layer is padded to a multiple of N first, as fsdp_lab does. Run: python ex08_minifsdp.py
"""
import sys

import numpy as np
import torch

import _package  # noqa: F401  (fsdp_lab from this checkout)
from fsdp_lab.lessons import exercises
from fsdp_lab.lessons.live import checks


def shard(layer: np.ndarray, n: int) -> list:
    """Pad the flat layer with zeros to a multiple of n and cut it into n equal chunks (one per rank)."""
    ### HINT: np.pad(layer, (0, pad)) then np.split(..., n)
    ### BEGIN SOLUTION
    pad = -len(layer) % n
    return np.split(np.pad(layer, (0, pad)), n)
    ### END SOLUTION


def all_gather(chunks: list, numel: int) -> np.ndarray:
    """Every rank's chunk, concatenated, without the padding: the full layer."""
    ### BEGIN SOLUTION
    return np.concatenate(chunks)[:numel]
    ### END SOLUTION


def reduce_scatter_mean(grads: list, n: int) -> list:
    """grads[r] is rank r's full gradient; return each rank's chunk of the mean gradient."""
    ### HINT: average over ranks first, then cut the mean the same way as the parameters
    ### BEGIN SOLUTION
    return shard(np.mean(grads, axis=0), n)
    ### END SOLUTION


def check_round_trip():
    """A 4,097-element layer on 4 ranks: 3 zeros of padding, and the gather gives the layer back"""
    layer = np.arange(4097, dtype=np.float64)
    chunks = shard(layer, 4)
    return exercises.all_of(exercises.padded_chunks(chunks, layer, 4),
                            exercises.gathered(all_gather(chunks, 4097), layer))


def check_reduce_scatter():
    """Each rank's chunk of the reduce-scattered gradient is its chunk of the mean (padding included)"""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(4097) for _ in range(4)]
    mine = reduce_scatter_mean(grads, 4)
    return exercises.all_of(*(checks.reduce_scatter_mean(torch.from_numpy(np.asarray(mine[r])),
                                                         [torch.from_numpy(g) for g in grads], r) for r in range(4)))


def check_sharded_step_equals_plain_step():
    """SGD on the shards with reduce-scattered gradients = SGD on the full layer with the mean gradient"""
    rng = np.random.default_rng(0)
    n, lr = 4, 0.01
    layer = rng.standard_normal(4097)
    grads = [rng.standard_normal(4097) for _ in range(n)]
    shards = [s - lr * g for s, g in zip(shard(layer, n), reduce_scatter_mean(grads, n))]
    return exercises.gathered(all_gather(shards, 4097), layer - lr * np.mean(grads, axis=0), rel=1e-9)


if __name__ == "__main__":
    sys.exit(exercises.run(globals()))
