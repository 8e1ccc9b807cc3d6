"""FSDP1: the `FSDP` wrapper and what only it has (flat parameter, wrap policies, state dicts, summon, optim state)."""
