"""The quiz as an ipywidgets form for the notebooks: pick answers, Submit, read feedback under each
question and a score summary (with the partial-credit rule), then Retry.

Everything a button does is also a method (`select`, `submit`, `retry`) and everything shown can be read
back (`feedback_text`, `score`, `summary_text`), so tests drive it from Python with no browser:

    w = quiz("10", lang="en", progress=False)
    w.select(0, "A"); w.select(4, "AB"); w.submit(); w.score, w.feedback_text(0)
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets

from fsdp_lab.lessons.quiz.bank import load_chapter_by_key
from fsdp_lab.lessons.quiz.scoring import QuizRun
from fsdp_lab.lessons.quiz.progress import ProgressStore
from fsdp_lab.lessons.quiz.questions import Chapter, QuestionType, msg
from fsdp_lab.lessons.quiz.terminal import summary

_FULL_WIDTH = widgets.Layout(width="100%")


def _html(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


class QuizWidget:
    """One chapter's quiz. `progress`: a path, a ProgressStore, None for ~/.fsdp-lab/progress.json, or False
    to keep nothing. It displays itself when it is the last value of a cell."""

    def __init__(self, chapter: Chapter, lang: str = "en", seed: int | None = None,
                 progress: str | Path | ProgressStore | None | bool = None, name: str | None = None):
        self.chapter, self.lang, self.seed, self.name = chapter, lang, seed, name
        if progress is False:
            self.store = None
        else:
            self.store = progress if isinstance(progress, ProgressStore) else ProgressStore(progress)
        self.notice = ""
        self.run = QuizRun(chapter, lang, seed)
        self.controls = [self._control(i) for i in range(len(self.run))]
        self.feedback = [widgets.HTML() for _ in self.run.shown]
        self.summary = widgets.HTML()
        self.submit_button = widgets.Button(description=msg(lang, "submit"), button_style="primary")
        self.retry_button = widgets.Button(description=msg(lang, "retry"), disabled=True)
        self.submit_button.on_click(self.submit)
        self.retry_button.on_click(self.retry)
        heading = msg(lang, "header", key=chapter.key, title=chapter.title.get(lang), n=len(self.run))
        header = widgets.HTML(f"<h3>{_html(heading)}</h3><p><i>{_html(msg(lang, 'rule'))}</i></p>")
        items = [header]
        for shown, control, fb in zip(self.run.shown, self.controls, self.feedback):
            q = shown.question
            title = msg(lang, "question", number=shown.number, total=len(self.run), type=msg(lang, q.type.value),
                        difficulty=q.difficulty.value)
            items.append(widgets.VBox([widgets.HTML(f"<b>{_html(title)}</b> {_html(shown.prompt)}"), control, fb]))
        items += [widgets.HBox([self.submit_button, self.retry_button]), self.summary]
        self.box = widgets.VBox(items)

    def _control(self, index: int) -> widgets.Widget:
        shown = self.run.shown[index]
        labels = [(f"{o.letter}. {o.text}", o.letter) for o in shown.options]
        if shown.question.type is QuestionType.SINGLE:
            return widgets.RadioButtons(options=labels, index=None, layout=_FULL_WIDTH)
        return widgets.VBox([widgets.Checkbox(value=False, description=label, indent=False, layout=_FULL_WIDTH)
                             for label, _ in labels])

    # -- what a learner does ---------------------------------------------------------------------------------
    def select(self, index: int, letters: str) -> None:
        """Set question `index` (0-based) to the shown `letters` ("" clears), as clicking would."""
        shown, control = self.run.shown[index], self.controls[index]
        letters = letters.upper()
        if bad := sorted(set(letters) - set(shown.letters)):
            raise ValueError(f"question {index + 1} has options {shown.letters}; got {''.join(bad)!r}")
        if shown.question.type is QuestionType.SINGLE:
            if len(letters) > 1:
                raise ValueError(f"question {index + 1} is single choice; got {len(letters)} letters {letters!r}")
            control.value = letters or None
        else:
            for box, letter in zip(control.children, shown.letters):
                box.value = letter in letters

    def selection(self, index: int) -> str:
        control, shown = self.controls[index], self.run.shown[index]
        if shown.question.type is QuestionType.SINGLE:
            return control.value or ""
        return "".join(letter for box, letter in zip(control.children, shown.letters) if box.value)

    def submit(self, _button=None) -> float:
        """Grade every question (no selection scores 0), show feedback and the summary, save progress."""
        for i in range(len(self.run)):
            answer = self.run.submit(i, self.selection(i))
            chosen = answer.letters or msg(self.lang, "unanswered")
            fb = answer.feedback
            parts = [f"<b>{_html(fb.verdict)}</b> ({_html(chosen)})", *map(_html, fb.lines), _html(fb.key),
                     _html(fb.explanation)]
            self.feedback[i].value = "<br>".join(p for p in parts if p)
        self._set_enabled(False)
        self._save()
        note = f"<p>{_html(self.notice)}</p>" if self.notice else ""
        self.summary.value = f"<p><b>{_html(self.summary_text)}</b></p>{note}"
        return self.score

    def retry(self, _button=None) -> None:
        """Clear answers and feedback for a fresh attempt (same seed, so the same option order)."""
        self.run = QuizRun(self.chapter, self.lang, self.seed)
        for i, fb in enumerate(self.feedback):
            self.select(i, "")
            fb.value = ""
        self.summary.value = ""
        self._set_enabled(True)

    # -- what tests and notebooks read -----------------------------------------------------------------------
    @property
    def score(self) -> float:
        return self.run.score

    @property
    def summary_text(self) -> str:
        return summary(self.run)

    def feedback_text(self, index: int) -> str:
        answer = self.run.answers.get(index)
        return answer.feedback.as_text() if answer else ""

    def _set_enabled(self, enabled: bool) -> None:
        for control in self.controls:
            for w in (control.children if isinstance(control, widgets.VBox) else (control,)):
                w.disabled = not enabled
        self.submit_button.disabled = not enabled
        self.retry_button.disabled = enabled

    def _save(self) -> None:
        if self.store is None:
            return
        try:
            self.notice = self.store.record(self.run.attempt(), self.name) or ""
            self.notice = (self.notice + " " + msg(self.lang, "saved", path=self.store.path)).strip()
        except OSError as exc:
            self.notice = msg(self.lang, "not_saved", reason=exc)

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)


def quiz(chapter: str = "10", lang: str = "en", seed: int | None = None,
         progress: str | Path | ProgressStore | None | bool = None, name: str | None = None,
         bank: str | Path | None = None) -> QuizWidget:
    """The quiz for `chapter` ("10", "interview", ...) as a widget: `quiz("10", lang="zh")` in a cell."""
    return QuizWidget(load_chapter_by_key(chapter, bank), lang=lang, seed=seed, progress=progress, name=name)
