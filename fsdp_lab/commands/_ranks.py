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


# [Note: no more memory than is free] The other half of what a machine can hold: the host memory the ranks of a
# CPU run need (fsdp_lab.training.host_memory says what counts) against what is free. An oversized run refused
# here costs nothing; started, it swaps the machine or is ended by the OOM killer minutes later, often after
# its peers and a notebook server went with it. `--allow-low-memory` is the explicit way past it.
MEMORY_FLAG = "--allow-low-memory"


def add_low_memory_flag(p) -> None:
    p.add_argument(MEMORY_FLAG, action="store_true",
                   help="start even when the estimated host memory of the ranks exceeds what is free (refused "
                        "otherwise)")


def low_memory_problem(need, allow: bool) -> str | None:
    """One line naming the bytes `need` (a HostMemoryNeed) asks for and the bytes free, with the flag, if the
    run does not fit on this machine, else None. Called before anything starts."""
    from fsdp_lab.training import host_memory

    if allow:
        return None
    return host_memory.memory_problem(need, host_memory.available_memory(), f"add {MEMORY_FLAG}")
