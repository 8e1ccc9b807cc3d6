"""What a "Your turn" check answers: a Verdict ("ok: ..." or "not yet: ..."), "not written yet" for a learner's
copy's stub, and the first words of every check that reads a model: which front end it wants and what it got.
Shared by fsdp_lab.lessons.live.checks and .rows, the checks themselves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsdp_lab.runtime.fsdp1.api import FSDP
from fsdp_lab.runtime.fsdp2.fsdp_module import FSDPModule


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str
    todo: bool = False  # the learner's function is not written yet (it raised NotImplementedError)

    def __str__(self) -> str:
        return ("ok: " if self.ok else "not yet: ") + self.message

    __repr__ = __str__


def close_to(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1)


def not_written(name: str, err: Optional[NotImplementedError] = None) -> Verdict:
    return Verdict(False, f"{name} is not written yet" + (f" ({err})" if err is not None and str(err) else ""),
                   todo=True)


def unwritten(name: str, value) -> Optional[Verdict]:
    """The "not written yet" Verdict when `value` is still the learner's stub (None), else None."""
    return not_written(name) if value is None else None


def unwritten_function(name: str, fn, *args) -> Optional[Verdict]:
    """The "not written yet" Verdict when `fn(*args)` raises NotImplementedError (the learner's copy's stub), else
    None: whatever else it does is for the check to judge. A check that reads a model asks this first, so a stubbed
    function is named as such whatever model the cell holds (the plain one an unwritten exercise above left)."""
    try:
        fn(*args)
    except NotImplementedError as err:
        return not_written(name, err)
    except Exception:  # noqa: BLE001 - a wrong answer: the check explains it
        pass
    return None


# [Note: the model a check reads] A learner passes whatever model the cell holds: the plain one they forgot to wrap,
# or the other front end's from an earlier chapter. Each check that reads a model says first which front end it
# reads and what it got, instead of failing on a missing attribute.
FSDP1, FSDP2 = "FSDP(...)", "fully_shard"


def _described(model) -> str:
    if isinstance(model, FSDP):
        return f"an FSDP-wrapped {type(model.module).__name__}"
    if isinstance(model, FSDPModule):
        return f"a fully_shard model ({type(model).__name__})"
    return f"a plain {type(model).__name__} (not wrapped by fsdp_lab)"


def wrong_model(check: str, model, *fronts: str) -> Optional[Verdict]:
    """None if `model` is wrapped by one of `fronts` (FSDP1, FSDP2), else the Verdict that names what it is."""
    if (FSDP1 in fronts and isinstance(model, FSDP)) or (FSDP2 in fronts and isinstance(model, FSDPModule)):
        return None
    if model is None:  # the stub of the learner's copy: `model = None  # ← yours`
        return not_written("the model")
    how = " or ".join(fronts)
    return Verdict(False, f"{check} reads a model wrapped by {how}; this is {_described(model)}: pass the model "
                          f"the exercise wrapped with {how}")
