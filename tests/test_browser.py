"""The chapters in a real browser. Every chapter, opened and not run: no widget area is blank (each shows its
preview and a run-this-cell hint), no answer is visible, no Jupyter news pop-up covers the page. Chapter 03:
JupyterLab in headless Chromium runs every cell, Play and "next beat" advance the potluck, the charts render, the
answers wait for their button, the chapter's quiz warns before grading blanks. Screenshots land in artifacts/
(gitignored): the pages and each widget.

The server serves a temporary copy of the notebook, so JupyterLab's autosave can never rewrite the committed file,
and it gets its own settings and workspace directories, so nothing from a user's JupyterLab leaks in. Skipped,
with the reason, when Chromium or playwright is missing (CI installs both).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fsdp_lab.commands.lab import QUIET as LAB_QUIET
from fsdp_lab.commands.lab import SETTINGS_DIR as LAB_SETTINGS_DIR
from fsdp_lab.training.launch import free_port
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, flat, need_browser, run_cell, type_into

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "03-lifecycle.ipynb"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*-*.ipynb"))  # 06a: lettered after 06
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# What an answer looks like once shown: a graded quiz's key, its explanation, an opened answer box.
ANSWER_SHOWN = r"(^|\n)\s*(Answer: [A-H]|答案：[A-H]|Why: |解析：)|Hide the answers"
ARTIFACTS = ROOT / "artifacts"
# Every cell in the DOM (no virtual scrolling), so the test can find widgets far down the notebook. The news
# pop-up is left to the app settings `fsdp-lab lab` ships (fsdp_lab/commands/lab.py), which the server uses too.
SETTINGS = {"@jupyterlab/notebook-extension": {"tracker.jupyterlab-settings": {"windowingMode": "none",
                                                                              "autoStartDefaultKernel": True}}}


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


@contextlib.contextmanager
def _serve(tmp_path: Path, root: Path):
    """A JupyterLab server on `root`, on a free port with a random token; always shut down, kernels first."""
    need_browser()
    settings = tmp_path / "settings"
    for plugin, files in SETTINGS.items():
        for name, value in files.items():
            (settings / plugin).mkdir(parents=True, exist_ok=True)
            (settings / plugin / name).write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_PLATFORM_DIRS": "1", "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "jupyter.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         "--LabApp.extension_manager=readonly", f"--LabApp.app_settings_dir={LAB_SETTINGS_DIR}", *LAB_QUIET,
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start (exit {server.poll()}): "
                                       f"{(tmp_path / 'jupyter.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        try:
            for kernel in _get(f"{base}/api/kernels?token={token}"):
                req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
                urllib.request.urlopen(req, timeout=20).close()
        except OSError:
            pass  # the server is already gone; terminating it below is all that is left
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on a temporary copy of the solved chapters."""
    need_browser()
    root = tmp_path / "notebooks"
    root.mkdir()
    for chapter in CHAPTERS:
        shutil.copy(chapter, root / chapter.name)
    with _serve(tmp_path, root) as served:
        yield served


@pytest.fixture
def learner_lab(tmp_path):
    """JupyterLab on the learner's copies, written into my-notebooks/ as `fsdp-lab lab` writes them (beside a
    temporary copy of the solved chapters)."""
    need_browser()
    from fsdp_lab.commands.lab import learner_copies

    solved = tmp_path / "course" / "notebooks"
    solved.mkdir(parents=True)
    for chapter in CHAPTERS:
        shutil.copy(chapter, solved / chapter.name)
    folder, written = learner_copies(solved)
    assert sorted(p.name for p in written) == [c.name for c in CHAPTERS], written
    with _serve(tmp_path, folder) as served:
        yield served


def _menu(page, top: str, item: str) -> None:
    page.get_by_role("menuitem", name=top, exact=True).click()
    page.get_by_role("menuitem", name=item, exact=True).click()


def _counts(page) -> list:
    return [p.strip().strip("[]:").strip() for p in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def _wait_for_all_cells(page, n_code: int, timeout_s: float) -> None:
    """Done when the code cells show the counts 1..n of a fresh kernel: the committed outputs were cleared
    first, so old counts cannot pass for new ones."""
    deadline, want = time.monotonic() + timeout_s, [str(i) for i in range(1, n_code + 1)]
    while time.monotonic() < deadline:
        if _counts(page) == want:
            return
        page.wait_for_timeout(500)
    raise AssertionError(f"cells did not all finish within {timeout_s:.0f} s; prompts: {_counts(page)}")


def _widget_outputs(path: Path) -> int:
    """How many outputs of the committed notebook hold a widget view."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return sum(WIDGET_VIEW in out.get("data", {}) for c in cells for out in c.get("outputs", []))


def _shut_down_kernels(base: str, token: str) -> None:
    for kernel in _get(f"{base}/api/kernels?token={token}"):
        req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=20).close()


def test_every_chapter_on_first_open_shows_every_widget_area_and_no_answer(lab):
    """Nothing run: each widget output shows its preview (hint, and a picture or its HTML), none is blank, and no
    answer, quiz key or explanation is on the page. No Jupyter news pop-up either."""
    import re

    from playwright.sync_api import sync_playwright

    base, token, _root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.set_default_timeout(60_000)
            for chapter in CHAPTERS:
                # ?reset: a fresh workspace, so the chapter opened before is not restored beside this one
                page.goto(f"{base}/lab/tree/{chapter.name}?reset&token={token}", wait_until="domcontentloaded")
                panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
                panel.locator(".jp-Cell").first.wait_for()
                panel.locator(".jp-OutputArea-output").first.wait_for()
                page.wait_for_timeout(1500)  # let the output renderers finish
                want = _widget_outputs(chapter)
                hints = panel.locator(".jp-OutputArea-output .fsdp-lab-preview")
                assert hints.count() == want, f"{chapter.name}: {hints.count()} previews for {want} widget outputs"
                blank = panel.evaluate("""p => [...p.querySelectorAll('.jp-OutputArea-output')]
                    .filter(o => !o.innerText.trim() && !o.querySelector('img, svg, canvas')).length""")
                assert blank == 0, f"{chapter.name}: {blank} blank output area(s) on first open"
                for i in range(hints.count()):
                    assert "Run" in hints.nth(i).inner_text(), f"{chapter.name}: preview {i} has no hint"
                text = panel.inner_text()
                shown = re.search(ANSWER_SHOWN, text)
                assert not shown, f"{chapter.name}: an answer is visible on first open: {text[shown.start():][:80]}"
                assert "official Jupyter news" not in page.inner_text("body"), "the news pop-up is showing"
                page.screenshot(path=str(ARTIFACTS / f"browser-first-open-{chapter.stem}.png"), full_page=False)
                _shut_down_kernels(base, token)
        finally:
            browser.close()


def test_chapter_03_runs_plays_and_draws(lab):
    from playwright.sync_api import sync_playwright

    base, token, _root = lab
    n_code = sum(c["cell_type"] == "code" for c in json.loads(NOTEBOOK.read_text())["cells"])
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", wait_until="domcontentloaded")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=90_000)  # the kernel is up

            # First open, nothing run: the saved outputs show pictures or nothing, never a widget's Python repr.
            outputs = page.locator(".jp-OutputArea-output")
            outputs.first.wait_for()
            shown = " ".join(outputs.all_inner_texts())
            for repr_start in ("children=(", "VBox(", "PotluckLifecycle(", "LiveMemoryChart(", "Planner("):
                assert repr_start not in shown, f"a widget repr on first open: {repr_start}"
            first_chart = page.locator(".jp-OutputArea-output img").first
            first_chart.scroll_into_view_if_needed()
            assert first_chart.evaluate("img => img.complete && img.naturalWidth > 300")  # the chart's saved picture
            page.screenshot(path=str(ARTIFACTS / "browser-ch03-first-open.png"))

            _menu(page, "Edit", "Clear Outputs of All Cells")
            assert all(c == "" for c in _counts(page)), _counts(page)
            _menu(page, "Run", "Run All Cells")
            _wait_for_all_cells(page, n_code, timeout_s=240)

            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert errors.count() == 0, f"stderr or errors in the outputs: {errors.all_inner_texts()}"

            potluck = page.locator(".widget-vbox:has(.widget-play)").first
            potluck.scroll_into_view_if_needed()
            readout = potluck.locator(".widget-readout").first
            before, label_before = readout.inner_text(), potluck.locator(".widget-html").last.inner_text()
            potluck.screenshot(path=str(ARTIFACTS / "browser-ch03-potluck-start.png"))
            potluck.locator(".widget-play button").first.click()  # ▶
            # Let it play into the backward pass (about 10 s), so the screenshot shows gradient shards too.
            page.wait_for_function("([el, v]) => Number(el.innerText) >= Number(v) + 30",
                                   arg=[readout.element_handle(), before], timeout=60_000)
            after = readout.inner_text()
            assert int(after) > int(before)
            assert potluck.locator(".widget-html").last.inner_text() != label_before
            page.screenshot(path=str(ARTIFACTS / "browser-ch03.png"))
            potluck.screenshot(path=str(ARTIFACTS / "browser-ch03-potluck.png"))

            potluck.locator("button", has_text="next beat").click()  # jumps to the next beat of one household
            page.wait_for_timeout(300)
            assert "forward" in potluck.inner_text() or "backward" in potluck.inner_text()  # the phase strip

            chart = page.locator(".widget-vbox:has(.widget-hprogress)").first
            chart.scroll_into_view_if_needed()
            image = chart.locator(".widget-output img").first
            image.wait_for()
            assert image.evaluate("img => img.complete && img.naturalWidth > 300")
            assert "2 of 2 training step(s) done on every rank" in chart.inner_text()
            chart.screenshot(path=str(ARTIFACTS / "browser-ch03-memory-chart.png"))

            # the handle, not the locator: the button's label changes once pressed
            answers = page.locator(".widget-vbox:has(button:has-text('Show the answers'))").last.element_handle()
            answers.scroll_into_view_if_needed()
            assert "stays gathered" not in answers.inner_text()  # hidden until asked for
            answers.screenshot(path=str(ARTIFACTS / "browser-ch03-answers-hidden.png"))
            answers.query_selector("button").click()
            page.wait_for_function("el => el.innerText.includes('stays gathered')", arg=answers)
            assert "Hide the answers" in answers.inner_text()
            answers.screenshot(path=str(ARTIFACTS / "browser-ch03-answers-shown.png"))

            quiz = page.locator(".widget-vbox:has(h3:has-text('Chapter 03'))").last
            quiz.scroll_into_view_if_needed()
            assert "Submit" in quiz.inner_text() and "Q1/" in quiz.inner_text()
            quiz.locator(".widget-radio-box label").first.click()
            quiz.locator("button", has_text="Submit").click()  # questions left blank: a warning, not a grade
            page.wait_for_function("el => el.innerText.includes('left blank')", arg=quiz.element_handle())
            quiz.screenshot(path=str(ARTIFACTS / "browser-ch03-quiz.png"))

            planner = page.locator(".widget-vbox:has(.widget-toggle-buttons)").first
            planner.scroll_into_view_if_needed()
            assert planner.locator(".widget-output img").first.evaluate("img => img.naturalWidth > 300")
            assert "measured" in planner.inner_text() and "16Φ/N" in planner.inner_text()
            planner.screenshot(path=str(ARTIFACTS / "browser-ch03-planner.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-ch03-failure.png"))
            (ARTIFACTS / "browser-ch03-failure.html").write_text(page.content())
            raise
        finally:
            browser.close()


def test_chapter_09_quiz_long_options_wrap_without_overlap(lab):
    """Chapter 09's quiz alone, run live: every option label is as tall as its wrapped text, keeps its radio
    button inside it, and does not overlap the next option."""
    from playwright.sync_api import sync_playwright

    base, token, _root = lab
    chapter = next(c for c in CHAPTERS if c.name.startswith("09-"))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1400})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{chapter.name}?reset&token={token}", wait_until="domcontentloaded")
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=90_000)
            cell = page.locator(".jp-CodeCell:has-text('quiz(\"09\"')").last
            cell.scroll_into_view_if_needed()
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            quiz = page.locator(".fsdp-quiz").last
            quiz.wait_for(timeout=90_000)
            quiz.scroll_into_view_if_needed()
            problems = quiz.evaluate("""q => {
                const out = [];
                for (const box of q.querySelectorAll('.widget-radio-box')) {
                    const labels = [...box.querySelectorAll('label')];
                    labels.forEach((l, i) => {
                        const r = l.getBoundingClientRect(), input = l.querySelector('input').getBoundingClientRect();
                        if (l.scrollHeight > l.clientHeight + 1) out.push('overflows: ' + l.innerText.slice(0, 40));
                        if (input.left < r.left - 1 || input.right > r.right + 1 || input.width === 0)
                            out.push('radio hidden: ' + l.innerText.slice(0, 40));
                        if (input.left > r.left + 8) out.push('radio not in front: ' + l.innerText.slice(0, 40));
                        const next = labels[i + 1];
                        if (next && next.getBoundingClientRect().top < r.bottom - 1)
                            out.push('overlaps the next: ' + l.innerText.slice(0, 40));
                    });
                }
                return out;
            }""")
            quiz.screenshot(path=str(ARTIFACTS / "browser-ch09-quiz.png"))
            assert problems == [], problems
        finally:
            browser.close()


# -- the learner's copies: every exercise shows its stub, and its check says "not written yet" -------------------
def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read().decode())


def _written(solved: str) -> str:
    """An exercise cell as the learner leaves it once done: the solved cell without its markers and stubs."""
    from fsdp_lab.lessons import student_copy as sc

    return "\n".join(line for line in solved.split("\n")
                     if not line.strip().startswith(sc.STUB) and line.strip() not in (sc.BEGIN, sc.END))


@pytest.mark.timeout(1800)  # a guard against a hang: every wait inside has its own deadline; idle it takes ~4 min
def test_learner_copies_show_every_stub_and_each_check_says_not_written_yet(learner_lab):
    """The copies `fsdp-lab lab` writes, opened in Chromium: no solution line is on any page, every exercise cell
    shows its stub, and the Your turn section runs as a learner runs it: each exercise's stub first (its check
    answers "not written yet"), then the solution typed in, which the check accepts, so the next cell starts
    from the state it expects. The first exercise of each chapter also has its "show the solution" button pressed.

    [Note: one kernel for every chapter] Each chapter's notebook is attached to the same kernel (a session per
    path, one kernel id), so one pair of live ranks serves the whole walk: only the first chapter's
    `live.start(2)` cell starts them, the later ones are not re-run, and the last chapter's `live_ranks.stop()`
    ends them. That keeps the test to one rank start instead of eleven."""
    import re

    from playwright.sync_api import sync_playwright

    from fsdp_lab.lessons import student_copy as sc
    from test_student_copies import distinctive_lines, your_turn_cells

    base, token, root = learner_lab
    chapters = [c for c in CHAPTERS if sc.exercise_cells(json.loads(c.read_text(encoding="utf-8")))]
    kernel_id, ranks_started, checked = None, False, {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        page.set_default_timeout(60_000)
        page.on("dialog", lambda dialog: dialog.accept())  # "leave the page?" once a cell has been typed into
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            for chapter in chapters:
                solved = json.loads(chapter.read_text(encoding="utf-8"))
                copy = json.loads((root / chapter.name).read_text(encoding="utf-8"))
                assert copy == sc.student_notebook(solved, chapter.name), f"{chapter.name}: not the learner's copy"
                solutions = sc.solutions_of(solved, chapter.name)
                marked = {c["id"] for c in sc.exercise_cells(solved)}
                solved_source = {c["id"]: sc._text(c["source"]) for c in solved["cells"]}
                session = _post(f"{base}/api/sessions?token={token}",
                                {"path": chapter.name, "type": "notebook", "name": chapter.name,
                                 "kernel": {"id": kernel_id} if kernel_id else {"name": "python3"}})
                kernel_id = session["kernel"]["id"]
                page.goto(f"{base}/lab/tree/{chapter.name}?reset&token={token}", wait_until="domcontentloaded")
                panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
                panel.locator(".jp-Cell").first.wait_for()
                page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=90_000)
                cells = panel.locator(".jp-Cell")
                assert cells.count() == len(copy["cells"]), f"{chapter.name}: {cells.count()} cells rendered"

                text = flat(panel.inner_text())  # nothing run yet: the notes and every cell as the copy has them
                for cell_id, blocks in solutions.items():
                    for line in (ln for b in blocks for ln in distinctive_lines(b)):
                        assert line not in text, f"{chapter.name}: the solution of {cell_id} shows: {line!r}"
                index = {c["id"]: i for i, c in enumerate(copy["cells"])}
                for cell_id in marked:
                    shown = flat(cells.nth(index[cell_id]).locator(".jp-InputArea-editor").first.inner_text())
                    for line in sc._text(copy["cells"][index[cell_id]]["source"]).splitlines():
                        assert flat(line) in shown, f"{chapter.name} cell {cell_id}: {line!r} not shown"

                turn = [c["id"] for c in your_turn_cells(solved) if c["cell_type"] == "code"]
                last = max(i for i, cell_id in enumerate(turn) if cell_id in marked)
                first_exercise = True
                for cell_id in turn[:last + 1]:
                    cell, source = cells.nth(index[cell_id]), solved_source[cell_id]
                    if "live.start(" in source:
                        if ranks_started:
                            continue  # [Note: one kernel for every chapter]
                        run_cell(page, cell, 240)
                        ranks_started = True
                        continue
                    if cell_id not in marked:
                        out = run_cell(page, cell, 180)
                        assert "Traceback" not in out and "not written yet" not in out, f"{cell_id}:\n{out[-1500:]}"
                        continue
                    out = run_cell(page, cell, 180, want="not written yet")
                    assert "Traceback" not in out, f"{chapter.name} cell {cell_id}, the stub gave:\n{out[-1500:]}"
                    checked.setdefault(chapter.name, []).append(cell_id)
                    if first_exercise:
                        cell.screenshot(path=str(ARTIFACTS / f"browser-learner-{chapter.stem}-stub.png"))
                        button = cells.nth(index[cell_id] + 1)
                        run_cell(page, button, 60, want="Show the solution")
                        button.locator("button", has_text="Show the solution").click()
                        line = distinctive_lines(solutions[cell_id][0])[0]
                        page.wait_for_function("([el, s]) => el.innerText.replace(/\\s+/g, ' ').includes(s)",
                                               arg=[button.element_handle(), line], timeout=30_000)
                        first_exercise = False
                    type_into(page, cell, _written(source))
                    out = run_cell(page, cell, 180)
                    assert not re.search(r"not written yet|not yet|Traceback", out), \
                        f"{chapter.name} cell {cell_id}, the solution typed in gave:\n{out[-1500:]}"
                if chapter == chapters[-1]:
                    stop = next(c["id"] for c in your_turn_cells(solved) if "live_ranks.stop()" in sc._text(c["source"]))
                    run_cell(page, cells.nth(index[stop]), 60)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-learner-failure.png"))
            (ARTIFACTS / "browser-learner-failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
    assert sorted(checked) == [c.name for c in chapters]
