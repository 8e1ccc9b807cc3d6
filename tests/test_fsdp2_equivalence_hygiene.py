"""No FSDP2 line beside an FSDP1 line in a notebook without a test that runs both: every such cell has an entry in
tests/fsdp2_equivalences.py, every entry's cell still exists and still shows the lines it names, and every check
it names is a test in tests/test_fsdp2_equivalence.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_fsdp2_equivalence as equivalence_tests
from fsdp2_equivalences import EQUIVALENCES

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# An FSDP2 line: a call or argument only fully_shard's API has.
FSDP2_LINE = re.compile(
    r"fully_shard\(|MixedPrecisionPolicy\(|reshard_after_forward\s*=|set_modules_to_(?:forward|backward)_prefetch"
    r"|\.unshard\(|\.reshard\(|full_tensor\(|get_model_state_dict|CPUOffloadPolicy\(|OffloadPolicy\("
    r"|set_requires_gradient_sync\(|set_reshard_after_backward\(|torch\.nn\.utils\.clip_grad_norm_\("
    r"|torch\.amp\.GradScaler")
# An FSDP1 line: the wrapper, its arguments, its methods and enums.
FSDP1_LINE = re.compile(
    r"\bFSDP\(|\bMixedPrecision\(|no_sync\(|ShardingStrategy\.|\b(?:FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD)\b"
    r"|SHARDED_STATE_DICT|state_dict_type|summon_full_params|\bCPUOffload\(|backward_prefetch\s*=|BackwardPrefetch\."
    r"|ShardedGradScaler|auto_wrap_policy|model\.clip_grad_norm_\(|use_orig_params")


def _cells() -> dict:
    """(notebook file name, cell id) -> the cell's text."""
    out = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            assert "id" in cell, f"{path.name}: a cell without an id (nbformat 4.5 ids key the registry)"
            out[(path.name, cell["id"])] = "".join(cell["source"])
    return out


CELLS = _cells()
REGISTERED = {(e.notebook, e.cell): e for e in EQUIVALENCES}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_cell_with_fsdp2_beside_fsdp1_has_a_registered_test():
    missing = [f"{nb} cell {cell}: {sorted(set(FSDP2_LINE.findall(src)))} beside {sorted(set(FSDP1_LINE.findall(src)))}"
               for (nb, cell), src in CELLS.items()
               if FSDP2_LINE.search(src) and FSDP1_LINE.search(src) and (nb, cell) not in REGISTERED]
    assert not missing, ("an FSDP2 line beside an FSDP1 line with no entry in tests/fsdp2_equivalences.py "
                         "(and no test that runs both):\n" + "\n".join(missing))


def test_registry_has_one_entry_per_cell():
    assert len(REGISTERED) == len(EQUIVALENCES), "a cell is registered twice"


@pytest.mark.parametrize("entry", EQUIVALENCES, ids=lambda e: f"{e.notebook}:{e.cell}")
def test_registered_cell_exists_and_shows_both_lines(entry):
    key = (entry.notebook, entry.cell)
    assert key in CELLS, f"{entry.notebook} has no cell {entry.cell!r} any more: update tests/fsdp2_equivalences.py"
    text = _flat(CELLS[key])
    for side, snippet in (("FSDP1", entry.fsdp1), ("FSDP2", entry.fsdp2)):
        assert _flat(snippet) in text, (f"{entry.notebook} cell {entry.cell} no longer shows its {side} line "
                                        f"{snippet!r}: re-check the claim and update the registry")


@pytest.mark.parametrize("entry", EQUIVALENCES, ids=lambda e: f"{e.notebook}:{e.cell}")
def test_registered_checks_are_tests(entry):
    assert entry.checks and entry.same, f"{entry.cell}: an entry needs the claims and the tests that check them"
    missing = [name for name in entry.checks
               if not (name.startswith("test_") and callable(getattr(equivalence_tests, name, None)))]
    assert not missing, f"{entry.notebook} cell {entry.cell}: no such test in test_fsdp2_equivalence.py: {missing}"


def test_the_detector_sees_the_cells_it_is_meant_to():
    """The patterns themselves: a legacy cell's two lines are both found, a cell with one side only is not."""
    legacy = CELLS[("01-core-idea.ipynb", "legacy-01")]
    assert FSDP2_LINE.search(legacy) and FSDP1_LINE.search(legacy)
    assert not FSDP1_LINE.search("for block in model.blocks:\n    fully_shard(block)\nfully_shard(model)")
    assert not FSDP2_LINE.search("model = FSDP(model, auto_wrap_policy=policy)")
