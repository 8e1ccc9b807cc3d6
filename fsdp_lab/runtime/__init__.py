"""The FSDP runtime. It imports torch and nothing else of fsdp_lab; the layers above learn about it through its
objects and the events it hands to an attached tracer. Two front ends over one core: `FSDP` (torch's FSDP1
wrapper, one flat buffer per unit) and `fully_shard` (torch's FSDP2, per-parameter DTensor shards)."""
from fsdp_lab.runtime.api import FSDP
from fsdp_lab.runtime.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp_lab.runtime.fully_shard import fully_shard
from fsdp_lab.runtime.mixed_precision import MixedPrecision, MixedPrecisionPolicy
from fsdp_lab.runtime.offload import CPUOffload, CPUOffloadPolicy, OffloadPolicy
from fsdp_lab.runtime.state_dict import (FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig,
                                         ShardedStateDictConfig, StateDictType)
from fsdp_lab.runtime.strategy import BackwardPrefetch, ShardingStrategy

__all__ = ["FSDP", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch", "StateDictType", "FullStateDictConfig",
           "ShardedStateDictConfig", "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy",
           "CPUOffloadPolicy", "OffloadPolicy", "register_fsdp_forward_method", "CPUOffload",
           "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"]
