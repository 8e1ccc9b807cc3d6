"""What nbval cannot see: every chapter exists, was committed with real outputs and no errors or warnings, gives
key terms in Chinese, labels its plots, and ends with a "Check yourself" section."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = ["00", "01", "02", "03", "04", "05", "06", "06a", "06b", "06c", "07", "08", "09", "09a", "10"]
CJK = re.compile(r"[\u4e00-\u9fff]")


def _chapter(number: str) -> Path:
    found = sorted(NOTEBOOKS.glob(f"{number}-*.ipynb"))
    assert len(found) == 1, f"expected exactly one notebooks/{number}-*.ipynb, found {found}"
    return found[0]


@pytest.fixture(params=CHAPTERS)
def notebook(request):
    path = _chapter(request.param)
    return path, json.loads(path.read_text(encoding="utf-8"))


def _outputs(nb):
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            yield cell, out


def test_committed_with_real_outputs_and_no_errors_or_warnings(notebook):
    path, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: run every cell before committing"
    for cell, out in _outputs(nb):
        assert out["output_type"] != "error", f"{path.name}: error output {out.get('ename')}"
        text = "".join(out.get("text", "")) if out["output_type"] == "stream" else ""
        assert not re.search(r"\w+Warning:", text), f"{path.name}: stray warning in output: {text[:200]}"


def test_key_terms_in_chinese_and_check_yourself_at_the_end(notebook):
    path, nb = notebook
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert CJK.search(markdown), f"{path.name}: no Chinese key terms"
    headings = [line for c in nb["cells"] if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")]
    assert headings and "check yourself" in headings[-1].lower(), f"{path.name}: last heading {headings[-1:]}"


PLOT_CALL = r"\.(plot|bar|barh|scatter|step|fill_between)\((?!\))"  # opt.step() is an optimizer, not a plot


def test_the_plot_detector_skips_optimizer_steps():
    assert re.search(PLOT_CALL, "ax.step(t, y, where='post')") and not re.search(PLOT_CALL, "opt.step()")


def test_every_plot_has_axis_labels_with_units(notebook):
    path, nb = notebook
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or not re.search(PLOT_CALL, src):
            continue
        labels = re.findall(r"(?:set_[xy]label|[xy]label)\(\s*[rf]?[\"']([^\"']*)", src)
        assert labels, f"{path.name}: a plotting cell without axis labels:\n{src[:300]}"
        assert all("(" in label for label in labels if label.strip()), f"{path.name}: labels without units {labels}"


# -- what a learner sees on first open, and what the text may claim ---------------------------------------------
ABSOLUTE_PATH = re.compile(r"(?<![\w.])(/tmp/|/work/|/home/|/Users/|/root/|/private/var/|[A-Z]:\\\\)")
GPU_CLAIM = re.compile(r"\b(ships?|shipped|replays?|replayed)\b[^.]*\btraces?\b|\btraces?\b[^.]*\brecorded on a "
                       r"(real )?(GPU|card)\b", re.I)
NOT_A_CLAIM = re.compile(r"\bno GPU trace|\bnone ship|\bnot yet\b|\bwould\b|\bwhether\b|\bonce\b[^.]*\bship|"
                         r"\bwhen\b[^.]*\bship", re.I)
REPO = NOTEBOOKS.parent


def _texts(nb):
    """Every piece of text a learner can read: markdown, code, outputs and saved widget state."""
    for cell in nb["cells"]:
        yield "".join(cell["source"])
        for out in cell.get("outputs", []):
            yield "".join(out.get("text", ""))
            for mime, data in out.get("data", {}).items():
                if mime.startswith("text/"):
                    yield "".join(data)
    yield json.dumps(nb["metadata"].get("widgets", {}), ensure_ascii=False)


def _sentences(text: str):
    flat = re.sub(r"\s+", " ", text)
    return [s for s in re.split(r"(?<=[.!?:;])\s", flat) if s]


def gpu_claims(text: str) -> list:
    """Sentences that say GPU traces ship or are replayed, unless they say none do (yet)."""
    return [s for s in _sentences(text) if re.search(r"\bGPU", s) and GPU_CLAIM.search(s)
            and not NOT_A_CLAIM.search(s)]


def test_the_claim_detector_catches_what_the_chapters_used_to_say():
    for old in ("Chapters that show GPU memory replay traces recorded on a real GPU, and each trace says where.",
                "If it has none, the course ships traces recorded on a real GPU, each with a note.",
                "no GPU here: the counts above are the runtime's exact FSDP bytes; chapter 06 replays GPU traces"):
        assert gpu_claims(old), old
    for fine in ("No GPU trace ships with the course yet: record them with scripts/record_gpu_traces.py.",
                 "Traces recorded on a GPU would let a CPU-only machine see that too.",
                 "Replay that trace as the potluck and watch each rank's memory."):
        assert not gpu_claims(fine), fine


def test_no_text_claims_gpu_traces_while_none_ship(notebook):
    from fsdp_lab.lessons.widgets import list_gpu_traces

    if list_gpu_traces():
        pytest.skip("GPU traces ship: the chapters may replay them (each says which GPU recorded it)")
    path, nb = notebook
    claims = [c for text in _texts(nb) for c in gpu_claims(text)]
    assert not claims, f"{path.name} claims GPU traces, but fsdp_lab/data/gpu_traces/ holds none: {claims}"


def test_no_kit_text_claims_gpu_traces_while_none_ship():
    from fsdp_lab.lessons.widgets import list_gpu_traces

    if list_gpu_traces():
        pytest.skip("GPU traces ship")
    for path in [REPO / "README.md", *sorted((REPO / "course").rglob("*.md"))]:
        claims = gpu_claims(path.read_text(encoding="utf-8"))
        assert not claims, f"{path.relative_to(REPO)} claims GPU traces, but none ship: {claims}"


def test_first_open_shows_no_python_repr(notebook):
    """An untrusted notebook renders text/plain for a widget: it must be empty (or a picture is there)."""
    path, nb = notebook
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                plain = "".join(data.get("text/plain", ""))
                assert plain == "", f"{path.name}: a widget output saved its repr {plain[:80]!r}"


def test_answers_wait_to_be_asked_for(notebook):
    """Nothing after the last "Check yourself" heading prints: the answers sit behind a button."""
    path, nb = notebook
    heading = max(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
                  and "check yourself" in "".join(c["source"]).lower())
    for cell in nb["cells"][heading + 1:]:
        printed = [o for o in cell.get("outputs", []) if o["output_type"] == "stream"]
        shown = "".join(printed[0]["text"])[:120] if printed else ""
        assert not printed, f"{path.name}: a Check-yourself cell prints its answers: {shown}"
    printed = "".join("".join(o["text"]) for c in nb["cells"] for o in c.get("outputs", [])
                      if o["output_type"] == "stream")
    graded = re.search(r"^\s*(Answer: [A-D]|答案：[A-D])", printed, re.M)
    assert not graded, f"{path.name}: a quiz answer printed in the open: {printed[graded.start():][:100]}"


def test_every_chapter_with_a_quiz_file_shows_its_quiz(notebook):
    path, nb = notebook
    number = path.name.split("-", 1)[0]
    if not list((REPO / "quizzes").glob(f"{number}-*.yaml")):
        return
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert re.search(rf"quiz\(\"{number}\"", code), f"{path.name}: quizzes/{number}-*.yaml exists but no quiz cell"


def test_no_clutter_in_learner_cells(notebook):
    """nbval tags instead of comment lines, no asserts, no machine paths, no printed line a notebook must wrap."""
    path, nb = notebook
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        assert "# NBVAL" not in src, f"{path.name}: use the nbval-check-output cell tag, not a comment line"
        assert not re.search(r"^\s*assert\b", src, re.M), f"{path.name}: an assert in a learner's cell:\n{src[:200]}"
        for out in cell.get("outputs", []):
            for line in "".join(out.get("text", "")).splitlines():
                assert len(line) <= 115, f"{path.name}: a printed line of {len(line)} characters wraps: {line[:80]}"
    for text in _texts(nb):
        found = ABSOLUTE_PATH.search(text)
        around = text[max(0, found.start() - 40):found.end() + 40] if found else ""
        assert not found, f"{path.name}: a machine path in the notebook: …{around}…"


def test_every_cell_has_slide_metadata(notebook):
    path, nb = notebook
    missing = [i for i, c in enumerate(nb["cells"]) if "slide_type" not in c["metadata"].get("slideshow", {})]
    assert not missing, f"{path.name}: cells {missing} have no slideshow metadata (course/make_slides.sh)"


def test_figure_code_lives_in_the_package(notebook):
    """A learner's cell is about FSDP: it calls a figure from fsdp_lab.lessons.figures instead of drawing one."""
    path, nb = notebook
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code":
            assert not re.search(r"\bplt\.|\bax\d?\.|\.subplots\(", src), \
                f"{path.name}: a cell draws with matplotlib itself; put it in fsdp_lab/lessons/figures:\n{src[:200]}"


@pytest.mark.parametrize("module", sorted((REPO / "fsdp_lab" / "lessons" / "figures").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_package_figures_label_their_axes_with_units(module):
    src = module.read_text(encoding="utf-8")
    labels = [label for _quote, label in re.findall(r"set_[xy]label\(\s*f?([\"'])(.*?)\1", src)]
    if re.search(r"\.(plot|bar|barh|step|fill_between)\(", src):
        assert labels, f"{module.name} draws without axis labels"
    assert all("(" in label for label in labels if label.strip()), f"{module.name}: labels without units {labels}"


# -- hands on: the learner's own FSDP code on live ranks (fsdp_lab.lessons.live) ----------------------------------
LIVE_CHAPTERS = CHAPTERS[1:]


def _printed(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o["output_type"] == "stream")


@pytest.mark.parametrize("number", LIVE_CHAPTERS)
def test_every_chapter_has_the_learner_write_fsdp_on_live_ranks(number):
    """A `%%ranks` cell that calls FSDP(...) or fully_shard(...) itself, run with both ranks' output stored; the
    ranks are started in the notebook and stopped before the chapter ends."""
    path = _chapter(number)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [(i, c, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    starts = [i for i, _c, src in code if re.search(r"\blive\.start\(", src)]
    stops = [i for i, _c, src in code if re.search(r"\blive_ranks\.stop\(\)", src)]
    learner = [(i, c) for i, c, src in code
               if src.startswith("%%ranks") and re.search(r"\b(FSDP|fully_shard)\(", src)]
    assert starts and learner and stops, f"{path.name}: start {starts}, %%ranks cells with FSDP( {len(learner)}, " \
                                         f"stop {stops}"
    assert starts[0] < learner[0][0] and stops[-1] > learner[-1][0], f"{path.name}: start, learner cells, stop"
    for i, cell in learner:
        printed = _printed(cell)
        for rank in (0, 1):
            assert f"[rank {rank}] " in printed, f"{path.name} cell {i}: no output from rank {rank}:\n{printed[:300]}"


@pytest.mark.parametrize("number", LIVE_CHAPTERS)
def test_every_chapter_has_an_exercise_checked_on_the_live_ranks(number):
    path = _chapter(number)
    nb = json.loads(path.read_text(encoding="utf-8"))
    checked = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).startswith("%%ranks")
               and re.search(r"\bchecks\.\w+\(", "".join(c["source"]))]
    assert checked, f"{path.name}: no %%ranks cell runs a fsdp_lab.lessons.live.checks check"
    printed = _printed(checked[-1])
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] ok: ", printed, re.M), f"{path.name}: rank {rank}'s check: {printed}"


def test_the_chapters_link_the_exercise_files_and_every_file_is_linked():
    linked = set()
    for number in LIVE_CHAPTERS:
        nb = json.loads(_chapter(number).read_text(encoding="utf-8"))
        markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        linked |= set(re.findall(r"\]\(\.\./course/exercises/(ex\d\d_\w+\.py)\)", markdown))
    files = {p.name for p in (REPO / "course" / "exercises").glob("ex*.py")}
    assert linked and linked <= files, f"links to missing exercise files: {sorted(linked - files)}"
    assert files <= linked, f"exercise files no chapter links: {sorted(files - linked)}"


# -- FSDP1 is torch's legacy API: every chapter that calls it shows FSDP2's line beside it --------------------
FSDP1_CALL = re.compile(r"\bFSDP\(|FullyShardedDataParallel\(")


@pytest.mark.parametrize("number", [n for n in CHAPTERS if n != "06a"])
def test_every_chapter_calling_fsdp1_says_it_is_legacy_and_shows_fully_shard(number):
    """A chapter with an FSDP1 call in a code cell also has a fully_shard(...) line, the word "legacy" and a link
    to chapter 06a, which runs both front ends side by side."""
    path = _chapter(number)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    if not any(c["cell_type"] == "code" and FSDP1_CALL.search("".join(c["source"])) for c in cells):
        return
    text = "\n".join("".join(c["source"]) for c in cells)
    assert re.search(r"^\s*fully_shard\(", text, re.M), f"{path.name}: calls FSDP(...) but shows no fully_shard line"
    assert re.search(r"\blegacy\b", text, re.I), f"{path.name}: calls FSDP(...) but never says FSDP1 is legacy"
    assert "](06a-fsdp2.ipynb)" in text, f"{path.name}: calls FSDP(...) but does not link chapter 06a"


def test_the_legacy_check_sees_fsdp1_calls():
    calls = [n for n in CHAPTERS if any(c["cell_type"] == "code" and FSDP1_CALL.search("".join(c["source"]))
                                        for c in json.loads(_chapter(n).read_text(encoding="utf-8"))["cells"])]
    assert len(calls) >= 10, f"only {calls} call FSDP(...): the pattern no longer matches the chapters' code"


def test_every_chapter_names_the_same_kernelspec_as_ipykernel_installs():
    """JupyterLab rewrites a kernelspec that differs from the kernel it starts, so a chapter whose metadata
    differs (06a said "Python 3") opens with unsaved changes."""
    from ipykernel.kernelspec import get_kernel_dict

    specs = {number: json.loads(_chapter(number).read_text(encoding="utf-8"))["metadata"].get("kernelspec")
             for number in CHAPTERS}
    installed = get_kernel_dict()
    expected = {"display_name": installed["display_name"], "language": installed["language"], "name": "python3"}
    differing = {number: spec for number, spec in specs.items() if spec != expected}
    assert not differing, f"kernelspec differs from {expected}: {differing}"
