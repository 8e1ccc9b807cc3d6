"""`fsdp-lab demo` prints, per step, fsdp_lab's loss beside the single-process reference and each rank's bytes."""
from __future__ import annotations

import re

import pytest

from fsdp_lab.cli import main


def test_demo_losses_match_reference_and_bytes_are_sharded(capsys):
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [int(row.split()[0]) for row in rows] == [1, 2, 3], out  # numbered like `fsdp-lab train`
    for row in rows:
        fields = row.replace("|", " ").split()
        loss, ref = float(fields[1]), float(fields[2])
        assert abs(loss - ref) < 1e-5, row
        p0, g0, o0, p1, g1, o1 = map(float, fields[4:10])
        assert p0 == p1 and g0 == g1 and o0 == o1 > 0, row
        assert abs(o0 - 2 * p0) < 0.25, "AdamW keeps two fp32 moments per sharded parameter (0.1 KiB display rounding)"
    assert "match" in out.splitlines()[-1]


def test_demo_rejects_bad_flags(capsys):
    assert main(["demo", "--world-size", "3", "--global-batch", "8"]) == 2  # the old spelling still works
    assert capsys.readouterr().err.strip() == ("fsdp-lab demo: error: --global-batch 8 does not divide by "
                                               "--nproc-per-node 3; each rank needs equal rows")
    for argv in (["--nproc-per-node", "0"], ["--steps", "0"], ["--preset", "huge"]):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", *argv])
        assert exit_.value.code == 2, argv
