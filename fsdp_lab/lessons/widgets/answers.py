"""Answers that wait to be asked for: the "Check yourself" sections compute their answers from the learner's own
run, but show them only when the learner presses the button.

    reveal_answers([f"1. {x}", "2. ..."])        # the last line of a cell: a button; the answers stay hidden

Nothing of the answers is in the widget's state until the button is pressed, so a saved notebook does not give
them away either.
"""
from __future__ import annotations

from typing import Iterable

import ipywidgets as widgets

from fsdp_lab.lessons.widgets.fmt import esc
from fsdp_lab.lessons.widgets.static import QuietRepr

SHOW, HIDE = "Show the answers 显示答案", "Hide the answers 隐藏答案"


class HiddenAnswers(QuietRepr, widgets.VBox):
    """A button that shows (and hides again) a numbered list of answers."""

    preview_hint = "Run this cell (Shift+Enter), then press the button: the answers stay hidden until you ask."

    def __init__(self, lines: Iterable[str], label: str = SHOW):
        self.lines = tuple(str(line) for line in lines)
        if not self.lines:
            raise ValueError("HiddenAnswers needs at least one answer line")
        self.label = label
        self.button = widgets.Button(description=label, icon="eye", layout=widgets.Layout(width="auto"))
        self.body = widgets.HTML("")
        self.button.on_click(self.toggle)
        super().__init__([self.button, self.body])

    def preview_html(self) -> str:
        """The button as it will look, and nothing of the answers."""
        return (f"<span style='display:inline-block;border:1px solid #9ca3af;border-radius:3px;padding:2px 10px;"
                f"background:#f3f4f6;color:#374151'>{esc(self.label)}</span>")

    @property
    def shown(self) -> bool:
        return bool(self.body.value)

    def toggle(self, _button=None) -> None:
        """Show the answers if hidden, hide them if shown (what the button does)."""
        if self.shown:
            self.body.value, self.button.description = "", self.label
            return
        rows = "".join(f"<div style='margin:2px 0'>{esc(line)}</div>" for line in self.lines)
        self.body.value = (f"<div style='border-left:4px solid #16a34a;padding:4px 10px;line-height:20px;"
                           f"white-space:pre-wrap'>{rows}</div>")
        self.button.description = HIDE


def reveal_answers(lines: Iterable[str], label: str = SHOW) -> HiddenAnswers:
    """The answers behind a button; make it the last value of a cell."""
    return HiddenAnswers(lines, label)
