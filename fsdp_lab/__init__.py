"""fsdp_lab: a compact, complete FSDP (ZeRO-3) runtime for learning, with the names of torch.distributed.fsdp:
FSDP1's wrapper (`FSDP`) and FSDP2's `fully_shard`, over one core.

The public names load torch on first use, so `fsdp-lab --help` (and a Ctrl-C while it starts) stays quick."""
__version__ = "0.1.0"
__all__ = ["FSDP", "FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy", "BackwardPrefetch",
           "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig",
           "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy",
           "register_fsdp_forward_method", "CPUOffload", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'fsdp_lab' has no attribute {name!r}")
    from fsdp_lab import runtime

    return runtime.FSDP if name == "FullyShardedDataParallel" else getattr(runtime, name)


def __dir__():
    return sorted(__all__ + ["__version__"])
