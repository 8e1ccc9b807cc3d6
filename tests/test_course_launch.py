"""README's first command as a newcomer runs it: a fresh clone, an empty HOME, `bash scripts/course.sh
--no-browser`. The URL it prints on a line of its own opens the lab and chapter 03; without the token the API
says 403 and the lab page is not served; the token is on no process's command line; stopping the launcher leaves
no process behind; and the terminal shows the launcher's lines only, not Jupyter's log ([Note: server log] in
fsdp_lab/commands/lab.py).

The clone reuses the virtual environment this test runs in (scripts/env.sh uses an active one as it is), and
FSDP_LAB_PIP_DRY_RUN=1 keeps pip from pointing that environment's editable install at the temporary clone.
"""
from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from fsdp_lab.commands.check import free_port
from fsdp_lab.commands.lab import _NoRedirect

REPO = Path(__file__).resolve().parent.parent
START_DEADLINE_S = 300  # pip's dry run, the install checks and Jupyter's start on a loaded 2-core machine
URL_LINE = re.compile(r"^http://127\.0\.0\.1:(\d+)/lab\?token=([0-9A-Za-z%._~-]+)$")
# Every line the launcher path may print: env.sh's choice of Python and install steps, the launcher's own lines,
# the URL, and the font hint. Anything else (Jupyter's "[I ...]" log, ipyparallel, CurveZMQ) is noise.
LAUNCHER_LINE = re.compile(r"^(using |keeping torch|installing |dry run: |note: |fsdp-lab lab: |http://127\.0\.0\.1:)")


def _opener(cookies=None):
    handlers = [urllib.request.ProxyHandler({}), _NoRedirect()]
    if cookies is not None:
        handlers.append(urllib.request.HTTPCookieProcessor(cookies))
    return urllib.request.build_opener(*handlers)


def _get(url, cookies=None):
    """(status, headers, body) of a GET; redirects are reported, not followed."""
    try:
        with _opener(cookies).open(url, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def _newcomer_env(home: Path) -> dict:
    env = {"HOME": str(home), "LC_ALL": "C.UTF-8", "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "FSDP_LAB_PIP_DRY_RUN": "1"}
    return env


@pytest.mark.slow
def test_the_url_course_sh_prints_opens_the_lab_and_nothing_opens_without_it(tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs a virtual environment to hand to the clone (env.sh would make a new .venv otherwise)")
    if shutil.which("git") is None:
        pytest.skip("needs git to clone the checkout")
    clone, home = tmp_path / "fsdp-lab", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120,
                   env={**os.environ, "HOME": str(home)})
    port = free_port()
    launcher = subprocess.Popen(["bash", "scripts/course.sh", "--no-browser", "--port", str(port)], cwd=clone,
                                env=_newcomer_env(home), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in launcher.stdout),
                              daemon=True)
    reader.start()
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        match = None
        while match is None and time.monotonic() < deadline:
            assert launcher.poll() is None, "\n".join(lines)[-3000:]
            match = next((m for m in map(URL_LINE.match, list(lines)) if m), None)
            time.sleep(0.2)
        assert match, f"no URL line within {START_DEADLINE_S} s:\n" + "\n".join(lines)[-3000:]
        url, served_port, token = match.group(0), int(match.group(1)), urllib.parse.unquote(match.group(2))
        base = f"http://127.0.0.1:{served_port}"
        family = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]

        cookies = http.cookiejar.CookieJar()
        status, _, page = _get(url, cookies)
        assert status == 200 and b"JupyterLab" in page
        assert _get(f"{base}/lab/tree/03-lifecycle.ipynb", cookies)[0] == 200  # the login cookie from the URL
        status, _, body = _get(f"{base}/api/contents/03-lifecycle.ipynb?token={match.group(2)}")
        assert status == 200 and json.loads(body)["type"] == "notebook"

        assert _get(f"{base}/api/contents")[0] == 403
        status, headers, _ = _get(f"{base}/lab")
        assert status in (302, 303) and "/login" in headers.get("Location", ""), status
        assert _get(f"{base}/lab?token=wrong{token}")[0] != 200

        for proc in psutil.process_iter(["pid", "cmdline"]):
            assert token not in " ".join(proc.info["cmdline"] or []), f"the token is on pid {proc.info['pid']}'s command line"
        log = next(Path(line.rsplit(" goes to ", 1)[1]) for line in lines if "server's log" in line)
        assert log.stat().st_mode & 0o777 == 0o600 and "ServerApp" in log.read_text(errors="replace")
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)  # Ctrl-C, the README's way out
        try:
            launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    reader.join(timeout=10)
    noise = [line for line in lines if line.strip() and not LAUNCHER_LINE.match(line)]
    assert not noise, "lines that are not the launcher's:\n" + "\n".join(noise[:20])
    assert sum(bool(URL_LINE.match(line)) for line in lines) == 1
