"""fsdp_lab against torch FSDP2 and plain training on the same work; GPU checks; profiler traces."""
