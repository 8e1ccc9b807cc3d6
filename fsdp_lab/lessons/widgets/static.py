"""What a widget cell shows before anyone runs it.

A committed notebook opened for the first time is not trusted, so JupyterLab will not render a widget view
from it; it falls back to the output's text/plain, which ipywidgets fills with the Python repr
(`VBox(children=(HTML(value=...`). Widgets that mix in QuietRepr replace that repr with nothing, and add a
static PNG of themselves when they have one (a chart), which an untrusted notebook does render. A trusted,
running notebook still picks the live widget: its mime type ranks above both.
"""
from __future__ import annotations

import base64
from typing import Optional


class QuietRepr:
    """Mix in before an ipywidgets class: no repr in the saved output, a static picture where there is one."""

    def static_png(self) -> Optional[bytes]:
        """PNG bytes of what the widget shows now, or None (the cell then shows nothing before it runs)."""
        return None

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if not bundle:
            return bundle
        bundle["text/plain"] = ""
        png = self.static_png()
        if png:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        return bundle
