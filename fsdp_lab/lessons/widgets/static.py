"""What a widget cell shows before anyone runs it.

A committed notebook opened for the first time is not trusted, so JupyterLab will not render a widget view
from it; it falls back to the richest safe mime type in the output. ipywidgets fills text/plain with the Python
repr (`VBox(children=(HTML(value=...`), and nothing else, so the cell would look blank or broken.

[Note: first-open previews] Widgets that mix in QuietRepr replace that repr with nothing and add a text/html
preview, which an untrusted notebook renders (sanitised): a one-line hint to run the cell, then what the widget
will show, as HTML (`preview_html`: a quiz's questions, the potluck's first frame, a button that hides answers)
and as a PNG of itself where it has one (a chart). The PNG also goes in as image/png. A preview never contains
an answer. A trusted, running notebook still picks the live widget: its mime type ranks above all of these.
A widget displayed before its data exists (the live chart, shown before its run starts) calls
`refresh_preview()` when the data is in, so the saved output shows the finished chart.
"""
from __future__ import annotations

import base64
import html
from typing import Optional

HINT_STYLE = ("border-left:4px solid #2563eb;background:#eff6ff;padding:4px 10px;margin:2px 0 6px 0;"
              "color:#1e3a8a;font-size:13px")


def first_open_html(hint: str, png: Optional[bytes] = None, body: str = "") -> str:
    """The text/html preview: the hint line, the widget's own HTML, then its picture."""
    img = (f"<img alt='{html.escape(hint)}' style='max-width:100%' "
           f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>" if png else "")
    return f"<div class='fsdp-lab-preview'><div style='{HINT_STYLE}'>▶ {html.escape(hint)}</div>{body}{img}</div>"


class QuietRepr:
    """Mix in before an ipywidgets class: no repr in the saved output, a preview and a hint instead."""

    preview_hint = "Run this cell (Shift+Enter) to use this widget; until then this is a picture of it."

    def static_png(self) -> Optional[bytes]:
        """PNG bytes of what the widget shows now, or None."""
        return None

    def preview_html(self) -> str:
        """HTML of what the widget shows now, answers left out; "" when the picture says it all."""
        return ""

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if not bundle:
            return bundle
        bundle["text/plain"] = ""
        png = self.static_png()
        if png:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        bundle["text/html"] = first_open_html(self.preview_hint, png, self.preview_html())
        return bundle

    def _ipython_display_(self):
        """display(widget): the same bundle, under a display id so refresh_preview can replace it later."""
        from IPython.display import display

        self._preview_handle = display(self._repr_mimebundle_(), raw=True, display_id=True)

    def refresh_preview(self) -> None:
        """Re-publish the saved output with the widget as it is now (same live view, new preview)."""
        handle = getattr(self, "_preview_handle", None)
        if handle is not None:
            handle.update(self._repr_mimebundle_(), raw=True)
