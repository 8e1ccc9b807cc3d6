"""`fsdp-lab lab`: open JupyterLab on the course's notebooks.

[Note: the learner's copies] The repository's notebooks/ hold the solved exercises (CI runs them). A learner
works in my-notebooks/ beside it: the launcher writes there the copy of each chapter that is not there yet, its
solutions replaced by stubs (fsdp_lab.lessons.student_copy), and opens JupyterLab on that folder. A copy that
exists is the learner's work and is never written over; delete it to start a chapter afresh. `--solved` opens
notebooks/ itself. Beside notebooks/, the chapters' links to ../course/ still resolve.

[Note: token auth] Jupyter runs arbitrary code for whoever reaches it, so this command enforces the token it
promises; it does not trust configuration to keep it on. A Jupyter config file (JUPYTER_CONFIG_DIR,
JUPYTER_CONFIG_PATH, jupyter_server_config.py/json) with `c.IdentityProvider.token = ''` would otherwise switch
authentication off, and `--ip 0.0.0.0` would serve the course to the network while this command said a token
was required. So:

1. The launcher picks the token: JUPYTER_TOKEN or the file JUPYTER_TOKEN_FILE names if either holds one, else
   a fresh random one. It reaches Jupyter in JUPYTER_TOKEN, which `ps` does not show to other local users (a
   `--IdentityProvider.token=...` argument would).
2. Jupyter's command line, which outranks every config file, names LauncherTokenIdentityProvider
   (fsdp_lab.commands._jupyter_auth): Jupyter's own provider, except that its token is always that one. A
   configured password still works as well.
3. Config is code, and a config file can still get around that. So once the server is up, the launcher asks
   it for /api/status without the token. Anything but 401/403 (or no answer before START_DEADLINE_S) and the
   server is stopped and the command fails with one line: it never keeps serving without the token.

4. Jupyter prints its URL with the token masked (it hides a token it did not generate), so once the check has
   passed the launcher prints the URL with the token itself, alone on one line: the one to open, also over ssh
   or with --no-browser. It goes to the launcher's own output, which other users cannot read.

[Note: server log] Jupyter's log, and with it everything the kernels' children write (the ipyparallel
controller and engines of live_ranks, their CurveZMQ notices), goes to a file that only the user can read,
jupyter's runtime dir/fsdp-lab-server-<launcher pid>.log, whose path the launcher prints; the terminal keeps the
launcher's few lines. If Jupyter exits before it serves, the log's last lines are printed.

The launcher stays Jupyter's parent: Ctrl-C or SIGTERM stops the server, and on Linux the server gets SIGTERM
if the launcher is killed outright, so no server outlives the command.
"""
from __future__ import annotations

import argparse
import enum
import functools
import importlib.util
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.user_files import printable, read_text

NAME = "lab"
LEARNER_DIR = "my-notebooks"
HELP = "Launch JupyterLab on the course notebooks (127.0.0.1 and token auth by default)."

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# [Note: no news pop-up] JupyterLab 4 asks "Would you like to receive official Jupyter news?" in a toast that
# covers every page until answered. The course ships an app-settings folder whose overrides.json sets the
# notification plugin's fetchNews to "false" (and turns update checks off), and the server is told not to fetch
# news or announcements at all. A user's own settings still win over these defaults.
SETTINGS_DIR = Path(__file__).resolve().parent.parent / "data" / "jupyterlab"
QUIET = ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]


def find_notebooks(package_dir: Path | None = None, cwd: Path | None = None) -> Path:
    """fsdp_lab/../notebooks (a source checkout), else ./notebooks; a clear error when neither exists."""
    package_dir = package_dir or Path(__file__).resolve().parent.parent
    cwd = cwd or Path.cwd()
    candidates = list(dict.fromkeys([package_dir.parent / "notebooks", cwd / "notebooks"]))
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no notebooks/ folder found (looked in: {tried}); run from a checkout of fsdp-lab")


IDENTITY_PROVIDER = "fsdp_lab.commands._jupyter_auth.LauncherTokenIdentityProvider"
START_DEADLINE_S = 120.0  # JupyterLab takes a few seconds to start; a loaded 2-core machine, much longer


def build_command(notebook_dir: Path, ip: str = "127.0.0.1", port: int = 8888, no_browser: bool = False,
                  as_root: bool = False) -> list[str]:
    """The exact `jupyter lab` command line. The token itself is not on it: see [Note: token auth]. Jupyter
    refuses to start as root unless told; containers often run as root, so `as_root` passes --allow-root."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={notebook_dir}", f"--ip={ip}", f"--port={port}",
           f"--ServerApp.identity_provider_class={IDENTITY_PROVIDER}",
           f"--LabApp.app_settings_dir={SETTINGS_DIR}", *QUIET]
    if no_browser:
        cmd.append("--no-browser")
    if as_root:
        cmd.append("--allow-root")
    return cmd


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def launcher_token(environ: dict) -> str:
    """The token the server will require: the user's (JUPYTER_TOKEN, else JUPYTER_TOKEN_FILE's contents) when
    it is not empty, else a new random one."""
    if environ.get("JUPYTER_TOKEN", "").strip():
        return environ["JUPYTER_TOKEN"]
    if environ.get("JUPYTER_TOKEN_FILE"):
        try:
            token = read_text(environ["JUPYTER_TOKEN_FILE"], limit=4096).strip()
        except (OSError, UnicodeDecodeError):
            token = ""
        if token:
            return token
    return secrets.token_hex(24)


def child_env(environ: dict | None = None, token: str | None = None) -> dict:
    """The environment for Jupyter: JUPYTER_TOKEN set to `token` (default: `launcher_token`), no token file,
    and this fsdp_lab importable (the server loads its identity provider from it)."""
    env = dict(os.environ if environ is None else environ)
    env["JUPYTER_TOKEN"] = token or launcher_token(env)
    env.pop("JUPYTER_TOKEN_FILE", None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


class Auth(enum.Enum):
    """What the running server said to a request without the token."""

    REQUIRED = "refused the request (401/403): the token is required"
    DISABLED = "answered it: authentication is off"
    UNCHECKABLE = "could not be asked"
    EXITED = "stopped before it could be asked"


@dataclass(frozen=True)
class AuthCheck:
    auth: Auth
    detail: str
    url: str = ""


def probe_host(ip: str) -> str:
    """Where to reach a server bound to `ip` from this machine (all interfaces: the loopback address)."""
    if ip in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if ip == "::":
        return "[::1]"
    return f"[{ip}]" if ":" in ip else ip


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect is reported as its own status, not followed to a login page's 200


def unauthenticated_status(url: str, timeout_s: float = 5.0) -> int | None:
    """HTTP status of a GET of `url` without credentials, or None if nothing answered; proxies are ignored and
    redirects are not followed."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
    try:
        with opener.open(urllib.request.Request(url, headers={"Accept": "application/json"}), timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


def check_auth(proc: subprocess.Popen, ip: str, runtime_dir: Path, deadline_s: float = START_DEADLINE_S,
               poll_s: float = 0.2) -> AuthCheck:
    """Wait for the server `proc` to write its jpserver-<pid>.json, then ask /api/status without the token."""
    info_file = runtime_dir / f"jpserver-{proc.pid}.json"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return AuthCheck(Auth.EXITED, f"Jupyter exited with code {proc.returncode}")
        try:
            info = json.loads(read_text(info_file, limit=1 << 20))
            port, base_url, sock = int(info["port"]), str(info.get("base_url") or "/"), info.get("sock")
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or half written
            time.sleep(poll_s)
            continue
        if sock:
            return AuthCheck(Auth.UNCHECKABLE, f"it serves the Unix socket {printable(str(sock))} "
                                               f"(ServerApp.sock in a Jupyter config), not --ip/--port")
        url = f"http://{probe_host(ip)}:{port}{base_url.rstrip('/')}/api/status"
        status = unauthenticated_status(url)
        if status in (401, 403):
            return AuthCheck(Auth.REQUIRED, f"HTTP {status}", url)
        if status is not None and 200 <= status < 300:
            return AuthCheck(Auth.DISABLED, f"HTTP {status} without the token", url)
        if status is not None:
            return AuthCheck(Auth.UNCHECKABLE, f"HTTP {status}, neither an answer nor a refusal", url)
        time.sleep(poll_s)
    return AuthCheck(Auth.UNCHECKABLE, f"no answer within {deadline_s:g} s")


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM (Jupyter shuts its kernels down), then SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def _say(line: str) -> None:
    """One write of one line to stderr, which Jupyter's log shares: its lines cannot land inside ours."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def lab_url(status_url: str, token: str) -> str:
    """The URL that opens the lab, token included, on the server whose /api/status is `status_url`."""
    base = status_url[: -len("/api/status")] if status_url.endswith("/api/status") else status_url.rstrip("/")
    return f"{base}/lab?token={urllib.parse.quote(token, safe='')}"


SERVER_LOG_LINES = 20  # the log's last lines printed when Jupyter exits before serving


def server_log_path(runtime_dir: Path, launcher_pid: int | None = None) -> Path:
    """Where Jupyter's log goes ([Note: server log])."""
    return runtime_dir / f"fsdp-lab-server-{launcher_pid or os.getpid()}.log"


def open_private_log(path: Path) -> int:
    """A new, empty file only the user can read or write (0600), as a file descriptor."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of the same name keeps its mode under O_CREAT
    return fd


def log_tail(path: Path, lines: int = SERVER_LOG_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 16)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(printable(line) for line in text.splitlines()[-lines:])


def network_warning(ip: str) -> str | None:
    if ip in _LOOPBACK:
        return None
    return (f"warning: --ip {ip} makes the server reachable from the network; token auth stays on and the "
            f"token (in the URL this command prints once the server is up) is required to connect.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ip", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 for a lab server, token still required)")
    parser.add_argument("--port", type=int, default=8888, help="port (default 8888; Jupyter tries the next if busy)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("--solved", action="store_true",
                        help=f"open the solved notebooks (notebooks/) instead of your copies in {LEARNER_DIR}/")


def learner_copies(notebooks: Path, write: bool = True) -> tuple[Path, list]:
    """(the learner's folder beside `notebooks`, the chapters' copies written into it now: the missing ones)."""
    from fsdp_lab.lessons.student_copy import write_student_copies

    folder = notebooks.parent / LEARNER_DIR
    if not write:
        return folder, []
    return folder, write_student_copies(notebooks, folder)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        print(f"fsdp-lab lab: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if not args.ip.strip():
        print("fsdp-lab lab: error: --ip must not be empty", file=sys.stderr)
        return 2
    try:
        notebooks = find_notebooks()
    except FileNotFoundError as err:
        print(f"fsdp-lab lab: error: {err}", file=sys.stderr)
        return 1
    if not args.solved:
        try:
            notebooks, written = learner_copies(notebooks, write=not args.dry_run)
        except (OSError, ValueError) as err:
            print(f"fsdp-lab lab: error: cannot write the learner's copies: {err}", file=sys.stderr)
            return 1
        if written:
            _say(f"fsdp-lab lab: wrote your copy of {len(written)} chapter(s) to {notebooks}: the exercises wait "
                 f"for your code there (--solved opens the solved ones)")
    cmd = build_command(notebooks, args.ip, args.port, args.no_browser, as_root=_is_root())
    warning = network_warning(args.ip)
    if warning:
        print(warning, file=sys.stderr)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if importlib.util.find_spec("jupyterlab") is None:
        print("fsdp-lab lab: error: jupyterlab is not installed here; run `pip install jupyterlab` "
              "(or bash scripts/course.sh)", file=sys.stderr)
        return 1
    from jupyter_core.paths import jupyter_runtime_dir

    sys.stdout.flush(), sys.stderr.flush()
    env = child_env()
    from fsdp_lab.training.launch import die_with_parent  # SIGTERM lets Jupyter shut its kernels down

    runtime_dir = Path(jupyter_runtime_dir())
    log = server_log_path(runtime_dir)
    log_fd = open_private_log(log)
    _say(f"fsdp-lab lab: the Jupyter server's log (kernels and live_ranks engines included) goes to {log}")
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
                                if sys.platform == "linux" else None)
    finally:
        os.close(log_fd)
    try:
        check = check_auth(proc, args.ip, runtime_dir)
        if check.auth is Auth.EXITED:
            _say(f"fsdp-lab lab: error: {check.detail} before serving; the last lines of {log}:\n{log_tail(log)}")
            return proc.returncode or 1
        if check.auth is not Auth.REQUIRED:
            stop(proc)
            _say(f"fsdp-lab lab: error: the Jupyter server {check.auth.value} ({check.detail}"
                 f"{', ' + check.url if check.url else ''}), so it was stopped: this command never serves the "
                 f"course without its token. Look for token, password or identity settings in the Jupyter "
                 f"config files that `jupyter --paths` lists.")
            return 1
        _say(f"fsdp-lab lab: checked: {check.url} refuses a request without the token ({check.detail}).")
        _say("fsdp-lab lab: open this URL (it holds the token; Ctrl-C stops the server):")
        _say(lab_url(check.url, env["JUPYTER_TOKEN"]))
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C stops Jupyter too; that is the normal way out
        stop(proc)
        return 0
    finally:
        stop(proc)  # SIGTERM or any error on our side: no server outlives the command
