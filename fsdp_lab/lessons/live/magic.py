"""`%%ranks`: run a notebook cell on every live rank and print each rank's output, labelled by rank.

    %%ranks                      all ranks, the handle's default timeout
    %%ranks --timeout 10         give up on the ranks after 10 s (a hung rank is reported by number)
    %%ranks --rank 0             only rank 0 (a collective there would wait for the others: avoid one)

The magic is registered on the running IPython shell by fsdp_lab.lessons.live.start(); the shell, not this
module, holds the handle, so re-running the start cell replaces the old ranks instead of leaking them.
"""
from __future__ import annotations

import argparse
import math
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from fsdp_lab.lessons.live.ranks import Ranks, RanksState


def parse_args(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="%%ranks", add_help=False, exit_on_error=False)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--rank", type=int, action="append", default=None)
    try:
        args, unknown = parser.parse_known_args(shlex.split(line))
    except argparse.ArgumentError as err:
        raise ValueError(f"%%ranks {line!r}: {err}") from None
    if unknown:
        raise ValueError(f"%%ranks does not know {' '.join(unknown)!r}; it takes --timeout S and --rank R")
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"%%ranks --timeout must be finite and positive, got {args.timeout:g}")
    return args


@magics_class
class RanksMagics(Magics):
    def __init__(self, shell, ranks: Ranks):
        super().__init__(shell)
        self.ranks = ranks

    @cell_magic("ranks")
    def ranks_cell(self, line: str, cell: str):
        try:  # refused in one line, before any rank runs anything: the group stays as it was
            args = parse_args(line)
        except ValueError as err:
            raise UsageError(str(err)) from None
        self.ranks.run_or_raise(cell, timeout_s=args.timeout, ranks=args.rank)


def register(ranks: Ranks, shell=None) -> None:
    """Make `%%ranks` run on `ranks` in `shell` (default: the running IPython shell; no-op outside IPython)."""
    from IPython import get_ipython

    shell = shell or get_ipython()
    if shell is None:
        return
    old = shell.magics_manager.registry.get("RanksMagics")
    if old is not None and old.ranks is not ranks and old.ranks.state is not RanksState.STOPPED:
        old.ranks.stop()
    shell.register_magics(RanksMagics(shell, ranks))
