"""fsdp_lab: a compact, complete FSDP (ZeRO-3) runtime for learning, with the names of torch.distributed.fsdp."""
from fsdp_lab.runtime import FSDP, BackwardPrefetch, MixedPrecision, ShardingStrategy

FullyShardedDataParallel = FSDP

__all__ = ["FSDP", "FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch"]
__version__ = "0.1.0"
