"""Subcommands of `fsdp-lab`; one module per command (see fsdp_lab.cli)."""
