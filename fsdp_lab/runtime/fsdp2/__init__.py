"""FSDP2: `fully_shard`, `FSDPModule`, the per-parameter group, post-forward resharding."""
