"""`fsdp-lab lab`: open JupyterLab on the course's notebooks.

[Note: token auth] Jupyter runs arbitrary code for whoever reaches it, so this command never turns the token off:
it passes no token option at all and lets Jupyter generate one (printed in the URL it logs). Binding to
0.0.0.0 for a workshop server keeps the token and says so loudly. The child's environment loses an empty
JUPYTER_TOKEN and a JUPYTER_TOKEN_FILE naming an empty or unreadable file: with jupyter_server the latter means
"no token at all". (A token set to '' in the user's own Jupyter config files is their explicit choice; passing a
token on the command line to override it would show the token to every local user in `ps`.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

NAME = "lab"
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


def build_command(notebook_dir: Path, ip: str = "127.0.0.1", port: int = 8888, no_browser: bool = False,
                  as_root: bool = False) -> list[str]:
    """The exact `jupyter lab` command line. No token option on purpose: see [Note: token auth]. Jupyter
    refuses to start as root unless told; containers often run as root, so `as_root` passes --allow-root."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={notebook_dir}", f"--ip={ip}", f"--port={port}",
           f"--LabApp.app_settings_dir={SETTINGS_DIR}", *QUIET]
    if no_browser:
        cmd.append("--no-browser")
    if as_root:
        cmd.append("--allow-root")
    return cmd


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def child_env(environ: dict | None = None) -> dict:
    """The environment for Jupyter, without settings that would leave it with an empty token."""
    env = dict(os.environ if environ is None else environ)
    if env.get("JUPYTER_TOKEN") == "":
        del env["JUPYTER_TOKEN"]
    token_file = env.get("JUPYTER_TOKEN_FILE")
    if token_file is not None:
        try:
            empty = not Path(token_file).read_text().strip()
        except OSError:
            empty = True
        if empty:
            del env["JUPYTER_TOKEN_FILE"]
    return env


def network_warning(ip: str) -> str | None:
    if ip in _LOOPBACK:
        return None
    return (f"warning: --ip {ip} makes the server reachable from the network; token auth stays on and the "
            f"token (in the URL Jupyter prints) is required to connect.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ip", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 for a lab server, token still required)")
    parser.add_argument("--port", type=int, default=8888, help="port (default 8888; Jupyter tries the next if busy)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")


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
    sys.stdout.flush(), sys.stderr.flush()
    if os.name == "posix":  # become Jupyter: signals (Ctrl-C, kill) reach it directly and leave no orphan
        os.execve(cmd[0], cmd, child_env())
    try:
        return subprocess.call(cmd, env=child_env())
    except KeyboardInterrupt:  # Ctrl-C stops Jupyter too; that is the normal way out
        return 0
