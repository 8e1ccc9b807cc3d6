"""The FSDP runtime. It imports torch and nothing else of fsdp_lab; the layers above learn about it through its
objects and the events it hands to an attached tracer. Two front ends over one core: `FSDP` (torch's FSDP1
wrapper, one flat buffer per unit) and `fully_shard` (torch's FSDP2, per-parameter DTensor shards).

Its floors, as torch keeps `_fully_shard/` apart from FSDP1 (tests/test_layout.py holds the rules):

    core/      what both front ends share: the unit state machine and its hooks (unit), the side streams and
               queues (streams), the collectives (collectives), the layout seam (layout), where a layout lives
               (placement), the per-model run state (state), the root's end of backward (root), mixed precision,
               strategies and prefetch modes (strategy), misuse checks (misuse), the byte count (memory) and how an
               observer reaches either front end's units (observed). Imports no other floor.
    fsdp1/     the FSDP wrapper (api) and what only it has: the flat parameter, wrap policies, device and process
               group checks, frozen/trainable partition, nesting, state dicts, summon_full_params, optimizer state
               dicts, clip_grad_norm_, the torch methods refused by name (not_provided). Imports core and features.
    fsdp2/     fully_shard, FSDPModule, the parameter group (per-parameter DTensor shards), post-forward
               resharding to a smaller group. Imports core and features.
    features/  the lab features, one file each, for both front ends: CPU offload, hybrid sharding, deferred
               (meta-device) init, ignored modules, activation checkpointing. Import core only.

fsdp1 and fsdp2 never import each other. Public names live here and in fsdp_lab/__init__; `memory` and
`activation_checkpointing` are bound here too, so `fsdp_lab.runtime.memory.memory_report` keeps working.
"""
from fsdp_lab.runtime.core import memory
from fsdp_lab.runtime.core.mixed_precision import MixedPrecision, MixedPrecisionPolicy
from fsdp_lab.runtime.core.strategy import BackwardPrefetch, ShardingStrategy
from fsdp_lab.runtime.features import activation_checkpointing
from fsdp_lab.runtime.features.offload import CPUOffload, CPUOffloadPolicy, OffloadPolicy
from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp1.state_dict import (FullOptimStateDictConfig, FullStateDictConfig,
                                               ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType)
from fsdp_lab.runtime.fsdp2.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp_lab.runtime.fsdp2.fully_shard import fully_shard

__all__ = ["FSDP", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch", "StateDictType", "FullStateDictConfig",
           "ShardedStateDictConfig", "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy",
           "CPUOffloadPolicy", "OffloadPolicy", "register_fsdp_forward_method", "CPUOffload",
           "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"]
