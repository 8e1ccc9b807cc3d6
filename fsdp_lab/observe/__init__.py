"""Watching a run: the lifecycle trace, following it live, bytes communicated, CUDA memory snapshots."""
