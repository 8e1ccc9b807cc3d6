"""What tests/test_browser.py and tests/test_workshop.py both do in Chromium: find the browser (or skip, or fail in
CI), and work a JupyterLab notebook as a learner does: type a cell's code, run it with Shift+Enter, read its
output from the page. Every wait has a deadline and waits for a state of the DOM."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("FSDP_LAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]


def need_browser() -> None:
    """Skip where no browser can be had; in CI (CI=true), where scripts/test.sh installs one, fail instead, so a
    broken install cannot turn a browser test into a silent skip."""
    missing = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "playwright is not installed (pip install playwright; Chromium comes from the system)"
    if missing is None and not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing = f"Chromium not found at {CHROMIUM} (apt-get install -y chromium, or set FSDP_LAB_CHROMIUM)"
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"the browser test must run in CI: {missing}")
    if missing:
        pytest.skip(missing)


def flat(text: str) -> str:
    return " ".join(text.replace("\u200b", "").split())


def run_cell(page, cell, timeout_s: float, want: str = "") -> str:
    """Run one code cell as a learner does (Shift+Enter in its editor); done when its prompt shows a new count
    (counts only grow in a kernel) and, if `want` is given, its output shows it. Returns the output's text."""
    prompt = cell.locator(".jp-InputPrompt").first
    before = prompt.inner_text()
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-editor").first.click()
    page.keyboard.press("Shift+Enter")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        count = prompt.inner_text().strip().strip("[]:").strip()
        output = cell.locator(".jp-Cell-outputArea").first.inner_text()
        if count.isdigit() and prompt.inner_text() != before and (not want or want in output):
            return output
        page.wait_for_timeout(250)
    output = cell.locator(".jp-Cell-outputArea").first.inner_text()
    raise AssertionError(f"the cell did not finish within {timeout_s:.0f} s (prompt {prompt.inner_text()!r}, "
                         f"want {want!r}); its output:\n{output[-1500:]}")


def type_into(page, cell, text: str) -> None:
    """Replace the cell's text with `text`, as typed (one insertion: no auto-indent or closing brackets added)."""
    editor = cell.locator(".jp-InputArea-editor .cm-content").first
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(text)
    shown = flat(editor.inner_text())
    assert shown == flat(text), f"the editor holds {shown[:300]!r}, not what was typed"
