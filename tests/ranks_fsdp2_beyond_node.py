"""Ranks for the chapter 06b entries of tests/test_fsdp2_equivalence.py: meta-device init with FSDP1's
param_init_fn against fully_shard then to_empty (tests/ranks_deferred_init.py's wrap_peaks), and HYBRID_SHARD on a
2-D mesh against fully_shard on the same mesh (tests/ranks_hybrid.py's models), on both libraries."""
from __future__ import annotations

import torch
from ranks_deferred_init import fsdp, fully_shard_gpt, init_fn, meta_gpt, real_gpt, unit_unsharded_bytes
from ranks_hybrid import _fully_shard, _ours, _torch, fsdp2_clip, gpt, mesh, train

from fsdp_lab import ShardingStrategy, fully_shard
from fsdp_lab.observe.storage_peak import StoragePeak


def meta_peaks(rank, world_size):
    """Peak and final bytes of float storage while building and wrapping (fsdp_lab.observe.storage_peak): FSDP1
    on meta with a param_init_fn and built first, fully_shard on meta then to_empty and built first (fsdp_lab's
    front ends; tests/test_deferred_init.py compares torch's)."""
    out = {}
    builds = {"fsdp1_meta": lambda: fsdp("fsdp_lab", meta_gpt(), param_init_fn=init_fn),
              "fsdp1_real": lambda: fsdp("fsdp_lab", real_gpt(0)),
              "fsdp2_meta": lambda: fully_shard_gpt("fsdp_lab", meta_gpt(), world_size, seed=0),
              "fsdp2_real": lambda: fully_shard_gpt("fsdp_lab", real_gpt(0), world_size)}
    for name, build in builds.items():
        with StoragePeak() as counter:
            model = build()
            out[name] = {"peak": counter.peak, "final": counter.settled(), "unit": unit_unsharded_bytes(model)}
        del model
    return out


def hybrid_both(rank, world_size):
    """Losses of the four lines on a (2, 2) mesh, and the groups fsdp_lab's two front ends shard and replicate in."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    fsdp1 = _ours(ShardingStrategy.HYBRID_SHARD, "mesh")
    out["groups_fsdp1"] = (list(fsdp1._settings["process_group"]), list(fsdp1._settings["replicate_group"]))
    out["fsdp_lab FSDP"] = train(fsdp1, rank, world_size)[0]
    out["torch FSDP"] = train(_torch(ShardingStrategy.HYBRID_SHARD), rank, world_size)[0]
    m = mesh()
    out["groups_fsdp2"] = (list(torch.distributed.get_process_group_ranks(m.get_group(1))),
                           list(torch.distributed.get_process_group_ranks(m.get_group(0))))
    out["fsdp_lab fully_shard"] = train(_fully_shard(fully_shard, gpt(), m), rank,
                                        world_size, clip=fsdp2_clip)[0]
    out["torch fully_shard"] = train(_fully_shard(torch_fully_shard, gpt(), mesh()), rank,
                                     world_size, clip=fsdp2_clip)[0]
    return out
