"""Live ranks for the notebooks: FSDP code typed in a cell runs on N gloo ranks that live across cells.

    from fsdp_lab.lessons import live
    ranks = live.start(2)        # ipyparallel engines, each one a gloo rank; registers the %%ranks magic

    %%ranks
    model = FSDP(build_gpt("tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}))
    print(sum(p.numel() for p in model.parameters()))      # printed once per rank, labelled "[rank r]"

    ranks.pull("losses")         # a name's value on every rank, in rank order
    ranks.restart()              # after a rank died or hung
    ranks.stop()                 # at the end of the notebook (also done at kernel exit)
"""
from fsdp_lab.lessons.live.outcome import CellRun, RankOutput, RanksFailed, RankStatus
from fsdp_lab.lessons.live.ranks import Ranks, RanksState

__all__ = ["CellRun", "RankOutput", "RankStatus", "Ranks", "RanksFailed", "RanksState", "start"]


def start(n: int = 2, **kwargs) -> Ranks:
    """Start `n` live ranks and, inside IPython, register `%%ranks` for them (a previous handle is stopped)."""
    from fsdp_lab.lessons.live.magic import register

    ranks = Ranks(n, **kwargs)
    register(ranks)
    return ranks.start()
