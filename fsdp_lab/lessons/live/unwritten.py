"""Which exercises of a learner's copy are still stubs, so that a later cell's NameError can say so.

[Note: a name an unwritten exercise would define] In a learner's copy (fsdp_lab.lessons.student_copy) a stub that
raises NotImplementedError is shown as "not written yet: <its message>". The line it stands in for would have
defined names the later cells use (`model`, `opt`, `fsdp_losses`), so those cells, the checks among them, would
fail with a NameError that says nothing of the exercise. The live ranks keep one `UnwrittenStubs` per handle: it
remembers each cell whose stub raised, until that cell runs again without raising it (the cell's other lines and
the stub's message; the learner fills in the stub and keeps the rest of the cell). While one is remembered, a
rank's NameError, in a cell or in `pull`, says "not written yet: <name> comes from the exercise above that is not
written yet (...)" without a traceback; with none remembered a NameError is an ordinary error. Fresh engines
(start, restart) forget them.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

_NAME_ERROR = re.compile(r"name '(\w+)' is not defined")


def other_lines(code: str) -> frozenset:
    """A cell's lines but a stub's `raise NotImplementedError(...)`, stripped: what stays when the learner writes
    the exercise in place of the stub."""
    lines = (line.strip() for line in code.splitlines())
    return frozenset(line for line in lines if line and not line.startswith("raise NotImplementedError"))


class UnwrittenStubs:
    """The cells whose stub raised and that have not run without it since, each as (its other lines, the stub's
    message)."""

    def __init__(self):
        self._cells: list[tuple[frozenset, str]] = []

    def forget_all(self) -> None:
        self._cells = []

    def after_run(self, code: str, stub_messages: Iterable[Optional[str]]) -> None:
        """A cell ran: forget the stubs of its earlier runs; remember its stub if one raised now (`stub_messages`:
        what each rank's stub said, None for a rank whose stub did not raise)."""
        lines = other_lines(code)
        self._cells = [(cell, stub) for cell, stub in self._cells if not cell <= lines]
        stub = next((m for m in stub_messages if m is not None), None)
        if stub is not None:
            self._cells.append((lines, stub))

    def explain(self, ename: str, evalue) -> Optional[str]:
        """What a rank's NameError means while an exercise above is not written yet; None when none is."""
        found = _NAME_ERROR.search(str(evalue)) if ename == "NameError" else None
        if not (found and self._cells):
            return None
        stubs = list(dict.fromkeys(stub or "its stub raises NotImplementedError" for _, stub in self._cells))
        said = "; ".join(f'"{stub}"' for stub in stubs)
        if len(stubs) == 1:
            return (f"not written yet: {found.group(1)} comes from the exercise above that is not written yet "
                    f"({said}); write it and run that cell first")
        return (f"not written yet: {found.group(1)} comes from one of the exercises above that are not written yet "
                f"({said}); write them and run their cells first")
