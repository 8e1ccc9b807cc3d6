"""fsdp_lab: a compact, complete FSDP (ZeRO-3) runtime for learning, with the names of torch.distributed.fsdp."""
from fsdp_lab.api import FSDP
from fsdp_lab.mixed_precision import MixedPrecision
from fsdp_lab.strategy import BackwardPrefetch, ShardingStrategy

FullyShardedDataParallel = FSDP

__all__ = ["FSDP", "FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch"]
__version__ = "0.1.0"
