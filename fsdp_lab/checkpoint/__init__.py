"""Sharded checkpoints: `sharded` saves and loads through DCP with reshard; `files` keeps directories atomic;
`trust` decides what may be loaded; `ownership` what a run may write, replace or delete."""
from fsdp_lab.checkpoint.files import CheckpointError, read_latest
from fsdp_lab.checkpoint.sharded import export_checkpoint, export_full_state_dict, full_state_dict, load, save
from fsdp_lab.checkpoint.trust import find, read_meta

__all__ = ["save", "load", "full_state_dict", "export_full_state_dict", "export_checkpoint", "read_meta",
           "read_latest", "find", "CheckpointError"]
