"""Statements the chapters, quizzes and instructor notes make about torch and about the course's own numbers,
checked against torch 2.13's source and fsdp_lab's planner: the ones a reading against torch once found wrong.
The equivalence of FSDP1 and FSDP2 lines is checked apart, by running them (tests/test_fsdp2_equivalence.py)."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _cells(path: Path) -> list:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell) -> str:
    return "".join(cell["source"])


def _strings(node):
    """Every string in a loaded YAML document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _passages() -> list:
    """(where, text) for every piece of prose: a notebook's markdown cell, a quiz's string, a paragraph of the
    instructor notes, the slides and the README."""
    yaml = pytest.importorskip("yaml")
    out = [(f"{p.name} cell {c['id']}", _source(c)) for p in NOTEBOOKS for c in _cells(p)
           if c["cell_type"] == "markdown"]
    for path in sorted((REPO / "quizzes").glob("*.yaml")):
        out += [(path.name, s) for s in _strings(yaml.safe_load(path.read_text(encoding="utf-8")))]
    for path in [*sorted((REPO / "course" / "instructor-notes").glob("*.md")), REPO / "course" / "slides.md",
                 REPO / "README.md"]:
        out += [(path.name, para) for para in path.read_text(encoding="utf-8").split("\n\n")]
    return out


# -- torch's FutureWarnings, mentioned in every chapter that uses what they are on --------------------------------
@pytest.mark.parametrize("name", ["NO_SHARD", "state_dict_type"])
def test_a_chapter_that_uses_a_deprecated_fsdp1_feature_says_torch_warns(name):
    """torch 2.13's FSDP1 raises a FutureWarning for NO_SHARD (use DDP) and for state_dict_type (use
    get_state_dict); a chapter that uses either says so in its text."""
    from torch.distributed.fsdp import _init_utils, fully_sharded_data_parallel

    source = inspect.getsource(_init_utils if name == "NO_SHARD" else fully_sharded_data_parallel)
    assert re.search(r"NO_SHARD` sharding strategy is deprecated" if name == "NO_SHARD"
                     else r"state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being", source)
    silent = []
    for path in NOTEBOOKS:
        cells = _cells(path)
        if not any(name in _source(c) for c in cells):
            continue
        if not any(c["cell_type"] == "markdown" and name in _source(c) and "FutureWarning" in _source(c)
                   for c in cells):
            silent.append(path.name)
    assert not silent, f"these chapters use {name} and never say torch's FSDP1 deprecates it: {silent}"


# -- fully_shard's reshard_after_forward defaults to None ---------------------------------------------------------
TRUE_DEFAULT = re.compile(r"True,? (?:is )?the default|default(?:,| is|:)? True\b")


def test_no_text_calls_true_the_default_of_reshard_after_forward():
    """torch's default is None: True for a non-root module, False for the root (_fully_shard.py)."""
    from torch.distributed.fsdp import fully_shard

    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    texts = [(f"{p.name} cell {c['id']}", _source(c)) for p in NOTEBOOKS for c in _cells(p)] + _passages()
    wrong = [(where, line.strip()) for where, text in texts for line in text.splitlines()
             if "reshard_after_forward" in line and TRUE_DEFAULT.search(line)]
    assert not wrong, f"reshard_after_forward's default is None, not True: {wrong}"


# -- the 7B model under DDP on an H200 ----------------------------------------------------------------------------
def test_the_ddp_quiz_says_what_the_planner_says_of_an_h200():
    """16Φ = 112 GB plus one 2048-token micro-batch's activations is chapter 07's DDP peak, which fits an H200's
    141 GB; only the planner's 20 % reserve turns it down. The quiz quotes that peak."""
    yaml = pytest.importorskip("yaml")
    from fsdp_lab.theory import planner
    from fsdp_lab.theory.formulas import GB

    plan = planner.plan(7e9, gpus=8, gpu_mem_gb=80, seq_len=2048, micro_batch=1)
    peak = next(row[2] for row in plan.rows() if row[0] == "DDP")
    assert peak < 141 * GB and peak > (1 - plan.reserve_fraction) * 141 * GB
    quiz = yaml.safe_load((REPO / "quizzes" / "01-core-idea.yaml").read_text(encoding="utf-8"))
    question = next(q for q in quiz["questions"] if q["id"] == "core-ddp-total")
    for lang in ("en", "zh"):
        text = question["explanation"][lang]
        assert "H200" in text and f"{peak / GB:.1f} GB" in text, text
    assert "not the activations" not in question["explanation"]["en"]


# -- loss scaling under FSDP2 --------------------------------------------------------------------------------------
def test_sharded_grad_scaler_is_named_with_fsdp2s_plain_grad_scaler():
    """ShardedGradScaler is FSDP1's; under FSDP2 the plain torch.amp.GradScaler works (DTensor gradients; the
    equivalence test test_sharded_grad_scaler_and_plain_grad_scaler_skip_together runs both)."""
    alone = [where for where, text in _passages()
             if "ShardedGradScaler" in text and not ("FSDP2" in text and "torch.amp.GradScaler" in text)]
    assert not alone, f"ShardedGradScaler named as the FSDP answer, without FSDP2's plain GradScaler: {alone}"


# -- what chapter 06 saved ------------------------------------------------------------------------------------------
def test_chapter_06a_does_not_say_chapter_06_saved_fsdp2_state_dicts():
    """Chapter 06's checkpoint holds each FSDP1 unit's flat buffer as a 1-D DTensor (fsdp_lab/checkpoint/sharded.py,
    [Note: a world-size-independent layout]), not the per-parameter DTensors of an FSDP2 state dict."""
    from fsdp_lab.checkpoint import sharded

    assert "the *unpadded* flat buffer: one 1-D tensor" in sharded.__doc__
    cell = next(_source(c) for c in _cells(REPO / "notebooks" / "06a-fsdp2.ipynb") if c["id"] == "fsdp2-17")
    flat = " ".join(cell.split())
    assert "such checkpoints" not in flat and "flat buffer" in flat, flat
