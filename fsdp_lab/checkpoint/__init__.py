"""Sharded checkpoints: `sharded` saves and loads through DCP with reshard; `files` keeps directories atomic."""
from fsdp_lab.checkpoint.files import CheckpointError, read_latest, read_meta, resolve
from fsdp_lab.checkpoint.sharded import export_checkpoint, full_state_dict, load, save

__all__ = ["save", "load", "full_state_dict", "export_checkpoint", "read_meta", "read_latest", "resolve",
           "CheckpointError"]
