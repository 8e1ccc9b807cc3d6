"""`fsdp-lab workshop`: a real JupyterHub on 127.0.0.1 with three learners as real Unix users and one instructor.

Each learner logs in over HTTP, gets a server, starts two CPU live ranks of their own, runs a `%%ranks` cell on
them and answers a quiz question. The first does it in Chromium as a person would: a fresh notebook from
JupyterLab's launcher, each cell typed and run with Shift+Enter, the quiz widget answered with a click on an
option and on Submit, every result read from the page; the other two through the kernel's websocket. The class
view lists the three with those scores, live ranks running and the CSV in `fsdp-lab scores`'s format; the
Chromium learner's `ranks.stop()` then shows there as no ranks running; pushing a chapter adds a fresh
copy beside a learner's work and changes none of it. A learner gets 403 for the class view and for another
learner's server, and cannot read another's files. Stopping the command leaves no process of any of them. The
GPU shares are checked disjoint on a stand-in device list (--gpus 0,1,2,3,4,5; there is no GPU here): each
kernel sees its own CUDA_VISIBLE_DEVICES.

Needs root (to make Unix users and run the hub as root); otherwise it skips and says so. The users it made are
removed at the end, however it ends. The page as the test left it is saved in artifacts/ (gitignored).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from fsdp_lab.lessons.quiz.bank import load_chapter_by_key
from fsdp_lab.lessons.quiz.progress import COLUMNS
from fsdp_lab.lessons.quiz.questions import msg
from fsdp_lab.lessons.quiz.scoring import QuizRun
from fsdp_lab.training.launch import free_port
from fsdp_lab.workshop import accounts, install
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, need_browser, run_cell, type_into
from workshop_helpers import login, new_kernel, own_token, run_code, start_server, wait_for

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
SHARES = ["0,1", "2,3", "4,5"]  # --gpus 0,1,2,3,4,5 --gpus-per-learner 2, in class-list order
CHAPTER = "03"
CELL_DEADLINE_S = 300
SPAWN_DEADLINE_S = 240

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _need(condition: bool, reason: str) -> None:
    if not condition:
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(f"the workshop test must run in CI as root: {reason}")
        pytest.skip(reason)


def learner_python(tmp_path: Path) -> str:
    """An interpreter every learner can run with this environment's packages. sys.executable, unless a 0700
    directory (a pyenv under /root) hides it from other users; then a venv of the system's Python of the same
    version that reads this environment's site-packages through a .pth file, in `tmp_path` (which must be a
    folder other users can enter: pytest's own tmp_path is 0700)."""
    probe = subprocess.run(["su", "-s", "/bin/sh", "nobody", "-c", f"{sys.executable} -c pass"], capture_output=True)
    if probe.returncode == 0:
        return sys.executable
    system = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")
    _need(system is not None, f"{sys.executable} is not runnable by other users and there is no system "
                              f"python{sys.version_info.major}.{sys.version_info.minor} to stand in")
    venv = tmp_path / "learner-venv"
    subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    import site

    (next(venv.glob("lib/python*/site-packages")) / "course-env.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if Path(p).is_dir()) + "\n")
    for shared in ("etc/jupyter", "share/jupyter"):  # the server extensions' config, JupyterLab's static files
        if (Path(sys.prefix) / shared).is_dir():
            (venv / shared).parent.mkdir(parents=True, exist_ok=True)
            (venv / shared).symlink_to(Path(sys.prefix) / shared)
    return str(venv / "bin" / "python")


def processes_of(uids: set, needle: str) -> list:
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if (proc.info["uids"] and proc.info["uids"].real in uids) or needle in cmd:
                if proc.pid != os.getpid():
                    found.append((proc.pid, cmd[:160]))
        except psutil.Error:
            continue
    return found


@pytest.fixture
def workshop(tmp_path):
    _need(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root: the hub makes Unix users and starts each "
                                                         "learner's server as that user")
    _need(shutil.which("useradd") is not None, "useradd is not on PATH")
    _need(not install.python_missing(), f"{' '.join(install.python_missing())} not installed (bash scripts/test.sh "
                                        f"installs them)")
    _need(install.proxy_path().exists(), f"configurable-http-proxy not at {install.proxy_path()} (bash "
                                         f"scripts/test.sh installs it)")
    tag = secrets.token_hex(2)
    learners = [f"w{tag}l{i}" for i in range(3)]
    instructor = f"w{tag}i"
    (tmp_path / "class.txt").write_text("# the test's class\n" + "\n".join(learners) + "\n")
    state = tmp_path / "state"
    port = free_port()
    log = open(tmp_path / "workshop.log", "w")
    made = []
    proc = None
    shared = Path(tempfile.mkdtemp(prefix="fsdp-lab-workshop-"))
    os.chmod(shared, 0o755)
    try:
        passwords = accounts.ensure_users(learners + [instructor], state / "passwords.txt")
        made = list(passwords)
        python = learner_python(shared)
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_lab", "workshop", str(tmp_path / "class.txt"), "--instructor", instructor,
             "--port", str(port), "--state-dir", str(state), "--learner-python", python, "--gpus", "0,1,2,3,4,5",
             "--gpus-per-learner", "2", "--no-install", "--idle-timeout", "3600"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        base = f"http://127.0.0.1:{port}"
        import requests

        wait_for("the hub's API", lambda: proc.poll() is None and requests.get(f"{base}/hub/api/", timeout=5)
                 .status_code == 200 or (proc.poll() is not None and _fail(proc, tmp_path)), 180)
        yield {"base": base, "learners": learners, "instructor": instructor, "passwords": passwords,
               "proc": proc, "state": state, "port": port, "log": tmp_path / "workshop.log"}
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        uids = {pwd.getpwnam(n).pw_uid for n in made if accounts.exists(n)}
        for pid, _ in processes_of(uids, f"--state-dir {state}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in made:
            accounts.remove_user(name)
        shutil.rmtree(shared, ignore_errors=True)


def _fail(proc, tmp_path):
    raise AssertionError(f"fsdp-lab workshop exited {proc.returncode}: "
                         f"{(tmp_path / 'workshop.log').read_text()[-3000:]}")


@pytest.fixture
def chromium():
    """Chromium for the learner who works in the page; closed however the test ends."""
    need_browser()
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.set_default_timeout(60_000)
            page.on("dialog", lambda dialog: dialog.accept())  # "leave the page?" once a cell has been typed into
            yield page
            ARTIFACTS.mkdir(exist_ok=True)  # the page as the test left it, passed or failed
            with contextlib.suppress(PlaywrightError):
                page.screenshot(path=str(ARTIFACTS / "workshop-chromium.png"))
                (ARTIFACTS / "workshop-chromium.html").write_text(page.content())
        finally:
            browser.close()


# What every learner runs: the share this server sees and two live ranks, a `%%ranks` cell on them, another
# learner's file (refused), the chapter's quiz. In the page, each is a cell of its own, typed and run with
# Shift+Enter, and the quiz is answered with its buttons; over the API, one cell calls the quiz's methods.
SHARE_CELL = """\
import os
from fsdp_lab.lessons import live
print("CUDA_VISIBLE_DEVICES=" + repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
ranks = live.start(2)"""
RANKS_BODY = "import torch.distributed as dist\nprint('group', dist.get_world_size(), rank)"
READ_OTHER_CELL = """\
try:
    open({other!r}).read()
    print("READ OTHER: yes")
except PermissionError:
    print("READ OTHER: refused")"""
QUIZ_CELL = "from fsdp_lab.lessons.quiz.widget import quiz\nquiz({chapter!r})"
API_QUIZ = ("from fsdp_lab.lessons.quiz.widget import quiz\nw = quiz({chapter!r})\nw.select(0, {letter!r})\n"
            "print('QUIZ', w.submit(), w.run.max_score)")


def api_cell(chapter: str, letter: str, other: str) -> str:
    return "\n".join([SHARE_CELL, f"get_ipython().run_cell_magic('ranks', '', {RANKS_BODY!r})",
                      READ_OTHER_CELL.format(other=other), API_QUIZ.format(chapter=chapter, letter=letter)])


def assert_learner_ran(out: str, share: str) -> None:
    assert f"CUDA_VISIBLE_DEVICES='{share}'" in out, out
    assert "[rank 0] group 2 0" in out and "[rank 1] group 2 1" in out, out
    assert "READ OTHER: refused" in out, out


def browser_login(page, base: str, name: str, password: str) -> list:
    """Log in at the hub's form and wait for the learner's JupyterLab, which the hub starts on login; the
    hub's cookies, for the API calls after."""
    page.goto(f"{base}/hub/login", timeout=60_000)
    page.fill("#username_input", name)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(re.compile(rf".*/user/{name}/lab.*"), timeout=SPAWN_DEADLINE_S * 1000)
    page.locator(".jp-Launcher").wait_for(timeout=120_000)
    return page.context.cookies()


def work_in_lab(page, other: str, letters: str) -> tuple:
    """A fresh notebook from the launcher, the learner's cells typed in and run one by one with Shift+Enter, the
    quiz's first question answered by clicking its options `letters`, then Submit. Returns the cells' output text
    as the page shows it, (score, maximum) as the quiz's summary shows them, and the notebook's cells."""
    page.locator(".jp-LauncherCard[data-category='Notebook']").first.click()
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    cells = panel.locator(".jp-CodeCell")
    cells.first.wait_for()
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)  # the kernel is up
    out = []
    typed = [(SHARE_CELL, "CUDA_VISIBLE_DEVICES="), ("%%ranks\n" + RANKS_BODY, "[rank 1]"),
             (READ_OTHER_CELL.format(other=other), "READ OTHER:"), (QUIZ_CELL.format(chapter=CHAPTER), "")]
    for i, (code, want) in enumerate(typed):
        cell = cells.nth(i)  # Shift+Enter on the cell before added it, as on a notebook's last cell
        cell.wait_for()
        type_into(page, cell, code)
        out.append(run_cell(page, cell, CELL_DEADLINE_S, want=want))

    quiz = cells.nth(len(typed) - 1).locator(".fsdp-quiz")
    quiz.wait_for(timeout=120_000)
    first = quiz.locator(":scope > .widget-vbox").first  # the first question: its text, options, feedback
    for letter in letters:
        option = first.locator("label").filter(has_text=re.compile(rf"^\s*{letter}\. "))
        option.click()
        assert option.locator("input").is_checked(), f"option {letter} of Q1 is not selected after its click"
    submit = quiz.locator("button", has_text="Submit")
    graded = "el => /Score: /.test(el.innerText)"
    submit.click()
    page.wait_for_function(f"el => /left blank/.test(el.innerText) || ({graded})(el)",
                           arg=quiz.element_handle(), timeout=60_000)
    if "Score: " not in quiz.inner_text():  # the other questions were left blank: it warns once, then grades
        submit.click()
        page.wait_for_function(graded, arg=quiz.element_handle(), timeout=60_000)
    shown = quiz.inner_text()
    found = re.search(r"Score: (\S+) / (\d+)", shown)
    assert found and "Progress saved to" in shown, shown
    assert msg("en", "right") in first.inner_text(), first.inner_text()  # graded as clicked: the kernel got them
    return "\n".join(out), (float(found.group(1)), int(found.group(2))), cells


def class_table(instructor, view: str) -> dict:
    table = instructor.get(f"{view}/api/class", timeout=60)
    assert table.status_code == 200, (table.status_code, table.text[:300])
    return {row["name"]: row for row in table.json()}


def test_a_class_on_one_hub(workshop, chromium):
    import requests

    base, learners, passwords = workshop["base"], workshop["learners"], workshop["passwords"]
    sessions, tokens, outputs, scores = {}, {}, {}, {}
    others = {name: str(Path(pwd.getpwnam(learners[(i + 1) % 3]).pw_dir) / "my-notebooks" / "01-core-idea.ipynb")
              for i, name in enumerate(learners)}
    # the first learner logs in in Chromium (the hub starts their server on login) and works in the page
    first = learners[0]
    s = requests.Session()
    s.trust_env = False
    for c in browser_login(chromium, base, first, passwords[first]):
        s.cookies.set(c["name"], c["value"], domain=c["domain"], path=c["path"])
    sessions[first] = s
    right = QuizRun(load_chapter_by_key(CHAPTER), "en").shown[0].answer_letters  # as quiz(CHAPTER) shows it
    outputs[first], scores[first], cells = work_in_lab(chromium, others[first], right)
    assert scores[first][0] == 1, scores[first]  # Q1 right, the rest left blank
    for name in learners[1:]:
        sessions[name] = login(base, name, passwords[name])
        start_server(sessions[name], base, name, SPAWN_DEADLINE_S)
    for i, name in enumerate(learners):
        tokens[name] = own_token(sessions[name], base, name)
        if name != first:
            code = api_cell(CHAPTER, "ABC"[i], others[name])
            outputs[name] = run_code(base, name, tokens[name], new_kernel(base, name, tokens[name]), code,
                                     CELL_DEADLINE_S)
            found = re.search(r"QUIZ (\S+) (\d+)", outputs[name])
            assert found, outputs[name]
            scores[name] = (float(found.group(1)), int(found.group(2)))
        assert_learner_ran(outputs[name], SHARES[i])

    instructor = login(base, workshop["instructor"], passwords[workshop["instructor"]])
    view = f"{base}/services/class-view"
    by_name = class_table(instructor, view)
    assert sorted(by_name) == sorted(learners)
    for name in learners:
        row = by_name[name]
        assert row["quiz"][CHAPTER]["score"] == scores[name][0] and row["quiz"][CHAPTER]["max"] == scores[name][1]
        assert row["chapter_reached"] == CHAPTER, row
        assert row["ranks_running"] == 2 and row["server_running"], row
    page = instructor.get(f"{view}/", timeout=60)
    assert page.status_code == 200 and all(n in page.text for n in learners)
    exported = instructor.get(f"{view}/class.csv", timeout=60)
    rows = list(csv.reader(io.StringIO(exported.text)))
    assert tuple(rows[0]) == COLUMNS
    assert sorted((r[1], r[2], float(r[3])) for r in rows[1:]) == sorted(
        (n, CHAPTER, scores[n][0]) for n in learners)

    # the Chromium learner stops their live ranks in the page, and the class view sees them gone
    # the empty cell Shift+Enter on the quiz's cell left below it, by its index: `.last` would move on to the
    # cell that Shift+Enter on this one adds
    stop = cells.nth(cells.count() - 1)
    type_into(chromium, stop, "ranks.stop()")
    run_cell(chromium, stop, 120)
    wait_for(f"{first}'s live ranks to end", lambda: class_table(instructor, view)[first]["ranks_running"] == 0, 60)

    # a fresh chapter for everyone, beside their work, which stays as it was
    homes = {n: Path(pwd.getpwnam(n).pw_dir) / "my-notebooks" for n in learners}
    chapter = sorted(p.name for p in (ROOT / "notebooks").glob(f"{CHAPTER}-*.ipynb"))[0]
    before = {n: hashlib.sha256((homes[n] / chapter).read_bytes()).hexdigest() for n in learners}
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    pushed = instructor.post(f"{view}/push", data={"chapter": chapter, "_xsrf": xsrf}, timeout=300)
    assert pushed.status_code == 200, (pushed.status_code, pushed.text[:300])
    assert all(any(line.startswith(f"{n}: wrote") for line in pushed.json()["results"]) for n in learners), pushed.text
    for n in learners:
        assert hashlib.sha256((homes[n] / chapter).read_bytes()).hexdigest() == before[n]
        fresh = list(homes[n].glob(f"{Path(chapter).stem}.fresh-*.ipynb"))
        assert len(fresh) == 1 and fresh[0].stat().st_uid == pwd.getpwnam(n).pw_uid

    # learners see neither the class nor each other
    for i, name in enumerate(learners):
        other = learners[(i + 1) % 3]
        assert sessions[name].get(f"{view}/", timeout=60).status_code == 403
        assert sessions[name].get(f"{view}/api/class", timeout=60).status_code == 403
        assert sessions[name].get(f"{base}/user/{other}/api/contents", timeout=60).status_code == 403
        assert requests.get(f"{base}/user/{other}/api/contents", timeout=60,
                            headers={"Authorization": f"token {tokens[name]}"}).status_code == 403
        assert requests.get(f"{base}/user/{other}/files/01-core-idea.ipynb", timeout=60,
                            headers={"Authorization": f"token {tokens[name]}"}).status_code == 403

    # stopping the command stops everything: hub, proxy, services, servers, kernels, live ranks
    proc = workshop["proc"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=150)
    uids = {pwd.getpwnam(n).pw_uid for n in learners + [workshop["instructor"]]}
    needle = str(workshop["state"])
    wait_for("every process of the workshop to end", lambda: not processes_of(uids, needle), 90)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if f"127.0.0.1:{workshop['port']}" in " ".join(p.info["cmdline"] or [])]
