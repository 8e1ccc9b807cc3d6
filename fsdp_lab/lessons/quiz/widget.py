"""The quiz as an ipywidgets form for the notebooks: pick answers, Submit, read feedback under each
question (green: right, amber: partly, red: wrong) and a score summary (with the partial-credit rule), then
Retry. It shows the best score and the earlier attempts from the progress file, and Submit warns once before
grading questions left blank.

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
from fsdp_lab.lessons.quiz.progress import ProgressFileError, ProgressStore, read_progress
from fsdp_lab.lessons.quiz.questions import Chapter, QuestionType, difficulty_label, msg, points
from fsdp_lab.lessons.quiz.terminal import summary

from fsdp_lab.lessons.widgets.static import QuietRepr

_FULL_WIDTH = widgets.Layout(width="100%")
# ipywidgets gives each radio label and checkbox a fixed one-line height: a long option would overflow onto the
# next one and push its own button out of view. Inside a quiz, options wrap and grow instead.
_OPTION_CSS = ("<style>.fsdp-quiz .widget-radio-box label{height:auto;min-height:20px;line-height:18px;"
               "display:flex;align-items:flex-start;gap:6px;margin:2px 0;white-space:normal}"
               ".fsdp-quiz .widget-radio-box input{float:none;order:-1;flex:0 0 auto;height:18px;margin:0}"
               ".fsdp-quiz .widget-checkbox{height:auto;min-height:20px;line-height:18px;align-items:flex-start}"
               ".fsdp-quiz .widget-checkbox label{white-space:normal;height:auto;line-height:18px}</style>")
_VERDICT_COLOUR = ("#b91c1c", "#b45309", "#15803d")  # wrong, partly right, right
_TEXT = {
    "en": {"blank": "{n} question(s) left blank ({which}): a blank question scores 0. Press Submit again to "
                    "submit anyway.",
           "history": "Your earlier attempts at this chapter: {n}; best score {best} / {max}; latest {latest} / {max}"
                      " ({when}).",
           "no_history": "No earlier attempt at this chapter in your progress file."},
    "zh": {"blank": "还有 {n} 题未作答（{which}），未作答的题得 0 分。再按一次提交即可照常提交。",
           "history": "本章之前的作答：{n} 次；最高分 {best} / {max}；最近一次 {latest} / {max}（{when}）。",
           "no_history": "进度文件中还没有本章的作答记录。"},
}


class _QuizBox(QuietRepr, widgets.VBox):
    """The quiz's box: no Python repr in a notebook opened before it runs, but its questions and a hint."""

    preview_hint = "Run this cell (Shift+Enter) to take the quiz: pick your answers, then press Submit."
    preview = ""

    def preview_html(self) -> str:
        return self.preview


def _display_path(path: Path) -> str:
    """The progress file as a learner would type it: ~/… under the home directory, else just its name."""
    try:
        return "~/" + str(Path(path).expanduser().resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return Path(path).name


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
        self._saved = False  # the last Submit was saved to the progress file
        self._blank_warned = False
        self.run = QuizRun(chapter, lang, seed)
        self.controls = [self._control(i) for i in range(len(self.run))]
        self.feedback = [widgets.HTML() for _ in self.run.shown]
        self.summary = widgets.HTML()
        self.history = widgets.HTML(self._history_html())
        self.submit_button = widgets.Button(description=msg(lang, "submit"), button_style="primary")
        self.retry_button = widgets.Button(description=msg(lang, "retry"), disabled=True)
        self.submit_button.on_click(self._on_submit_click)
        self.retry_button.on_click(self.retry)
        heading = msg(lang, "header", key=chapter.key, title=chapter.title.get(lang), n=len(self.run))
        header = widgets.HTML(f"{_OPTION_CSS}<h3>{_html(heading)}</h3><p><i>{_html(msg(lang, 'rule'))}</i></p>")
        items = [header]
        for shown, control, fb in zip(self.run.shown, self.controls, self.feedback):
            q = shown.question
            title = msg(lang, "question", number=shown.number, total=len(self.run), type=msg(lang, q.type.value),
                        difficulty=difficulty_label(q.difficulty, lang))
            items.append(widgets.VBox([widgets.HTML(f"<b>{_html(title)}</b> {_html(shown.prompt)}"), control, fb]))
        items += [self.history, widgets.HBox([self.submit_button, self.retry_button]), self.summary]
        self.box = _QuizBox(items)
        self.box.add_class("fsdp-quiz")
        self.box.preview = self._preview_html(heading)

    def _preview_html(self, heading: str) -> str:
        """The questions and their options as the form will show them; no key, no feedback."""
        parts = [f"<h3>{_html(heading)}</h3>"]
        for shown in self.run.shown:
            q = shown.question
            title = msg(self.lang, "question", number=shown.number, total=len(self.run),
                        type=msg(self.lang, q.type.value), difficulty=difficulty_label(q.difficulty, self.lang))
            mark = "○" if q.type is QuestionType.SINGLE else "☐"
            options = "".join(f"<div style='margin-left:12px'>{mark} {_html(f'{o.letter}. {o.text}')}</div>"
                              for o in shown.options)
            parts.append(f"<div style='margin:6px 0'><b>{_html(title)}</b> {_html(shown.prompt)}{options}</div>")
        return "".join(parts)

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

    def blank_questions(self) -> list:
        """Question numbers (1-based) with nothing selected."""
        return [i + 1 for i in range(len(self.run)) if not self.selection(i)]

    def _on_submit_click(self, _button=None) -> None:
        """The Submit button: with questions left blank, warn once; the next click submits."""
        blank = self.blank_questions()
        if blank and not self._blank_warned:
            self._blank_warned = True
            which = ", ".join(f"Q{n}" for n in blank)
            text = _TEXT[self.lang]["blank"].format(n=len(blank), which=which)
            self.summary.value = f"<p style='color:{_VERDICT_COLOUR[1]}'><b>{_html(text)}</b></p>"
            return
        self.submit()

    def submit(self, _button=None) -> float:
        """Grade every question (no selection scores 0), show feedback and the summary, save progress."""
        for i in range(len(self.run)):
            answer = self.run.submit(i, self.selection(i))
            chosen = f"({answer.letters})" if answer.letters else msg(self.lang, "unanswered")
            fb = answer.feedback
            colour = _VERDICT_COLOUR[2 if answer.grade.full else 1 if answer.grade.score > 0 else 0]
            parts = [f"<b style='color:{colour}'>{_html(fb.verdict)}</b> {_html(chosen)}", *map(_html, fb.lines),
                     _html(fb.key), _html(fb.explanation)]
            self.feedback[i].value = (f"<div style='border-left:4px solid {colour};padding-left:8px'>"
                                      + "<br>".join(p for p in parts if p) + "</div>")
        self._set_enabled(False)
        self._save()
        note = f"<p>{_html(self.notice)}</p>" if self.notice else ""
        self.summary.value = f"<p><b>{_html(self.summary_text)}</b></p>{note}"
        self.history.value = self._history_html(own_saved=self._saved)
        return self.score

    def retry(self, _button=None) -> None:
        """Clear answers and feedback for a fresh attempt (same seed, so the same option order)."""
        self.run = QuizRun(self.chapter, self.lang, self.seed)
        for i, fb in enumerate(self.feedback):
            self.select(i, "")
            fb.value = ""
        self.summary.value = ""
        self._blank_warned = False
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

    def earlier_attempts(self) -> list:
        """This chapter's attempts in the progress file, oldest first; read only (a bad file is left alone here:
        saving an attempt is what moves it aside and says so)."""
        if self.store is None:
            return []
        try:
            progress = read_progress(self.store.path)
        except (FileNotFoundError, ProgressFileError, OSError):
            return []
        return [a for a in progress.attempts if a.chapter == self.chapter.key]

    def _history_html(self, own_saved: bool = False) -> str:
        """`own_saved`: the file's last attempt is the one just submitted here, which is not an earlier one."""
        if self.store is None:
            return ""
        attempts, text = self.earlier_attempts(), _TEXT[self.lang]
        if own_saved:
            attempts = attempts[:-1]
        if not attempts:
            line = text["no_history"]
        else:
            best, latest = max(attempts, key=lambda a: a.score), attempts[-1]
            line = text["history"].format(n=len(attempts), best=points(best.score), latest=points(latest.score),
                                          max=latest.max, when=latest.finished[:16].replace("T", " "))
        return f"<p style='color:#374151'>{_html(line)}</p>"

    def _save(self) -> None:
        self._saved = False
        if self.store is None:
            return
        try:
            self.notice = self.store.record(self.run.attempt(), self.name) or ""
            self._saved = True
            self.notice = (self.notice + " " + msg(self.lang, "saved", path=_display_path(self.store.path))).strip()
        except OSError as exc:
            self.notice = msg(self.lang, "not_saved", reason=exc)

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)


def quiz(chapter: str = "10", lang: str = "en", seed: int | None = None,
         progress: str | Path | ProgressStore | None | bool = None, name: str | None = None,
         bank: str | Path | None = None) -> QuizWidget:
    """The quiz for `chapter` ("10", "interview", ...) as a widget: `quiz("10", lang="zh")` in a cell."""
    return QuizWidget(load_chapter_by_key(chapter, bank), lang=lang, seed=seed, progress=progress, name=name)
