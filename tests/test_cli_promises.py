"""What every `fsdp-lab` subcommand promises: --version, defaults in --help, one spelling for the rank count."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lab import __version__, cli

REPO = Path(__file__).resolve().parents[1]


def test_version():
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "--version"], capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == f"fsdp-lab {__version__}"


def _subparsers():
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_help_shows_the_defaults(name):
    sub = _subparsers()[name]
    text = sub.format_help()
    for action in sub._actions:
        if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            continue
        help_text = sub._get_formatter()._expand_help(action)
        assert action.help and "default" in help_text.lower(), f"{name} {action.option_strings[0]}: {help_text!r}"
    assert "usage: fsdp-lab " + name in text


def test_help_of_a_default_that_was_not_written_in_the_text():
    text = _subparsers()["bench"].format_help()
    assert "timed rounds, each setup once per round (default: 15)" in " ".join(text.split())


def test_the_rank_count_has_one_spelling_everywhere():
    for name in ("train", "bench", "demo"):
        flags = {s for a in _subparsers()[name]._actions for s in a.option_strings}
        assert "--nproc-per-node" in flags, name
    demo = _subparsers()["demo"]
    assert demo.parse_args(["--world-size", "4"]).nproc_per_node == 4  # the old spelling, kept as an alias


@pytest.mark.parametrize("argv", [["train", "--checkpoint-dir", ""], ["train", "--export", " "],
                                  ["train", "--trace", ""], ["train", "--json-log", ""], ["train", "--resume", ""],
                                  ["bench", "--json-out", ""], ["quiz", "--progress", ""], ["scores", ""],
                                  ["scores", ".", "--csv", ""]])
def test_an_empty_path_is_refused_before_anything_runs(capsys, argv):
    """`--checkpoint-dir "$CKPT"` with CKPT unset trained to the end and saved nothing: an empty path flag is
    an unset shell variable far more often than a wish, so every path flag refuses it at parse time."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "expected a path, got" in capsys.readouterr().err
