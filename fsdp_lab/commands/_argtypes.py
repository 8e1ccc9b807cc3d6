"""argparse types shared by the commands: numbers checked at parse time, so a bad flag exits 2 with its value."""
from __future__ import annotations

import argparse
from pathlib import Path


def number(kind, low: float, what: str):
    """An argparse type: `kind` (int or float) at least `low` (exclusive for floats), finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (low <= value if kind is int else low < value < float("inf")):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text if kind is float else value!r}")
        return value
    return parse


positive_int = number(int, 1, "a positive integer")
count = number(int, 0, "an integer >= 0")
positive_float = number(float, 0.0, "a positive number")


def _nonempty(kind):
    """An argparse type for a path flag: an empty value is refused, because it is almost always an unset shell
    variable (`--checkpoint-dir "$CKPT"`), and Path("") would silently mean the current folder or nothing."""
    def parse(text: str):
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (an unset shell variable?)")
        return kind(text)
    return parse


path_text = _nonempty(str)
path = _nonempty(Path)
