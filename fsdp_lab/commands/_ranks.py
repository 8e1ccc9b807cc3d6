"""How many rank processes a command may start on this machine: the one check train, demo and bench run.

[Note: no more ranks than cores] Every rank is a process that computes; 64 of them on 2 cores do not train 32
times slower, they time out collectives, thrash memory and leave a machine unusable for minutes. So a command
refuses more ranks than the cores this process may run on (its CPU affinity, which is what a container or
`taskset` gives it), before any process starts. `--allow-oversubscribe` is the explicit way past it (a test of
many ranks on a small machine)."""
from __future__ import annotations

from fsdp_lab.training.launch import usable_cores

FLAG = "--allow-oversubscribe"


def add_oversubscribe_flag(p) -> None:
    p.add_argument(FLAG, action="store_true",
                   help="start more ranks than this machine has CPU cores (refused otherwise)")


def oversubscribe_problem(nproc_per_node: int, allow: bool, flag: str = "--nproc-per-node") -> str | None:
    """One line naming both numbers if `nproc_per_node` ranks would oversubscribe this machine's cores, else
    None. Called before anything starts."""
    cores = usable_cores()
    if allow or nproc_per_node <= cores:
        return None
    return (f"{flag} {nproc_per_node} starts {nproc_per_node} rank processes but this machine has {cores} CPU "
            f"core(s); use at most {cores}, or add {FLAG}")
