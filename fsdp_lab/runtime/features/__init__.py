"""The lab features, one file each, for both front ends: offload, hybrid, deferred init, ignored, checkpointing."""
