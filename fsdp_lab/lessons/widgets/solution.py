"""The "show the solution" button under each exercise of a learner's copy (fsdp_lab.lessons.student_copy).

    show_solution("yourturn-01-07")      # a button; pressed, it shows that cell's solution, pressed again, hides it

The solution is read from the instructor's notebook (the repository's notebooks/, which hold the solved
exercises) only when the button is pressed, so neither the learner's copy nor its saved widget state holds it.
One button shows one exercise's solution: the others stay hidden.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import ipywidgets as widgets

from fsdp_lab.lessons import student_copy
from fsdp_lab.lessons.widgets.fmt import esc
from fsdp_lab.lessons.widgets.static import QuietRepr

SHOW, HIDE = "Show the solution 显示答案", "Hide the solution 隐藏答案"


class SolutionButton(QuietRepr, widgets.VBox):
    """A button that shows (and hides again) the solution of one exercise cell, read when pressed."""

    preview_hint = "Run this cell, then press the button if you are stuck: the solution stays hidden until then."

    def __init__(self, cell_id: str, source_dir: Optional[Path] = None):
        self.cell_id = cell_id
        self.source_dir = Path(source_dir) if source_dir is not None else student_copy.INSTRUCTOR_NOTEBOOKS
        self.button = widgets.Button(description=SHOW, icon="eye", layout=widgets.Layout(width="auto"))
        self.body = widgets.HTML("")
        self.button.on_click(self.toggle)
        super().__init__([self.button, self.body])

    def preview_html(self) -> str:
        return (f"<span style='display:inline-block;border:1px solid #9ca3af;border-radius:3px;padding:2px 10px;"
                f"background:#f3f4f6;color:#374151'>{esc(SHOW)}</span>")

    @property
    def shown(self) -> bool:
        return bool(self.body.value)

    def solution_text(self) -> str:
        """The solution lines of the exercise, from the instructor's notebook (several blocks: one after another)."""
        _name, blocks = student_copy.find_solution(self.cell_id, self.source_dir)
        return "\n\n".join(blocks)

    def toggle(self, _button=None) -> None:
        """Show the solution if hidden, hide it if shown (what the button does)."""
        if self.shown:
            self.body.value, self.button.description = "", SHOW
            return
        try:
            text = self.solution_text()
        except (FileNotFoundError, KeyError) as err:
            text = f"the solution cannot be read: {err}"
        self.body.value = (f"<pre style='border-left:4px solid #16a34a;padding:4px 10px;margin:2px 0;"
                           f"white-space:pre-wrap'>{esc(text)}</pre>")
        self.button.description = HIDE


def show_solution(cell_id: str, source_dir: Optional[Path] = None) -> SolutionButton:
    """The solution of exercise cell `cell_id` behind a button; make it the last value of a cell."""
    return SolutionButton(cell_id, source_dir)
