"""The FSDP runtime. It imports torch and nothing else of fsdp_lab; the layers above learn about it through its
objects and the events it hands to an attached tracer."""
from fsdp_lab.runtime.api import FSDP
from fsdp_lab.runtime.mixed_precision import MixedPrecision
from fsdp_lab.runtime.state_dict import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from fsdp_lab.runtime.strategy import BackwardPrefetch, ShardingStrategy

__all__ = ["FSDP", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch", "StateDictType", "FullStateDictConfig",
           "ShardedStateDictConfig"]
