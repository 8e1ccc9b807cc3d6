"""`fsdp-lab workshop CLASS_LIST --instructor NAME`: serve the course to a class through JupyterHub.

[Note: one command for a class] It installs what is missing (fsdp_lab.workshop.install: JupyterHub, its idle
culler, configurable-http-proxy, pinned), makes the learners and instructors on the class list Unix users
(fsdp_lab.workshop.accounts, as root), cuts the GPUs into one share per learner (fsdp_lab.workshop.shares),
writes the hub's settings and config into the state folder (0700) and runs JupyterHub as its child. Ctrl-C or
SIGTERM stops the hub, which stops every learner's server, the proxy and its services; if this command is
killed outright, the hub gets SIGTERM from the kernel, so no hub outlives it.

It must run as root: LocalProcessSpawner starts each learner's server as that learner only when the hub is
root, and only that keeps one learner's kernels out of another's files.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from fsdp_lab.commands._argtypes import path, positive_int
from fsdp_lab.commands.lab import QUIET, SETTINGS_DIR, stop
from fsdp_lab.user_files import printable

NAME = "workshop"
HELP = "Serve the course to a class through JupyterHub: one Unix user, server and GPU share per learner."
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE = ROOT / ".workshop" / "hub"
STOP_GRACE_S = 60.0  # the hub stops every server and service before it exits

EPILOG = """\
The class list has one user name a line (# comments). Missing users are made with useradd (home 0700) and a
random password, written to STATE_DIR/passwords.txt (root only) for you to hand out; existing accounts keep
theirs. Learners log in with their Unix password (PAM). Instructors are the hub's admins and the only users
who see the class view at /services/class-view/.

TLS: the hub binds 127.0.0.1 by default. To open it to a network, keep it there and put a TLS-terminating
reverse proxy in front, e.g. Caddy (`caddy reverse-proxy --from hub.example.org --to 127.0.0.1:8000`) or
nginx with `proxy_pass http://127.0.0.1:8000;` plus the WebSocket headers (`proxy_http_version 1.1;
proxy_set_header Upgrade $http_upgrade; proxy_set_header Connection "upgrade";`), as JupyterHub's
documentation ("Using a reverse proxy") shows. --ip 0.0.0.0 serves plain HTTP to the network: passwords
would cross it in clear text.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    # the epilog keeps its lines; the options keep the command's defaults-in-help formatter
    parser.formatter_class = type("WorkshopHelpFormatter", (argparse.RawDescriptionHelpFormatter,
                                                          parser.formatter_class), {})
    parser.add_argument("class_list", type=path, help="file with one learner's user name a line")
    parser.add_argument("--instructor", action="append", default=[], metavar="NAME", required=True,
                        help="an instructor's user name (repeat for several): a hub admin, sees the class view")
    parser.add_argument("--ip", default="127.0.0.1", help="address the hub binds (default 127.0.0.1; see TLS below)")
    parser.add_argument("--port", type=positive_int, default=8000, help="the hub's public port")
    parser.add_argument("--gpus", default=None, metavar="LIST",
                        help="GPU indices to share out, e.g. 0,1,2,3 (default: every GPU nvidia-smi lists)")
    parser.add_argument("--gpus-per-learner", type=positive_int, default=1, metavar="N",
                        help="GPUs in each learner's share")
    parser.add_argument("--cpu-for-rest", action="store_true",
                        help="when learners outnumber the GPU shares, give the rest CPU ranks instead of refusing")
    parser.add_argument("--mem-limit", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-limit", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--idle-timeout", type=positive_int, default=3600, metavar="S",
                        help="seconds of inactivity before jupyterhub-idle-culler stops a server")
    parser.add_argument("--state-dir", type=path, default=DEFAULT_STATE,
                        help="the hub's database, cookie secret, settings and new passwords (made 0700)")
    parser.add_argument("--learner-python", default=sys.executable, metavar="PATH",
                        help="the Python every learner's server runs; each learner must be able to run it and "
                             "import fsdp_lab and jupyterhub (default: this one)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not install JupyterHub or the proxy; fail if they are missing")
    parser.add_argument("--dry-run", action="store_true", help="write the settings and print them; start nothing")


def _err(text: str) -> int:
    print(f"fsdp-lab workshop: error: {text}", file=sys.stderr)
    return 2


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def learner_can_run(python: str, user: str, pythonpath: str) -> str | None:
    """None when `user` can run `python` and import what a server needs, else what went wrong."""
    import pwd

    account = pwd.getpwnam(user)
    try:
        done = subprocess.run([python, "-c", "import jupyterhub.singleuser, fsdp_lab.workshop.learner"],
                              user=account.pw_uid, group=account.pw_gid, extra_groups=[], cwd="/",
                              env={"HOME": account.pw_dir, "PATH": os.environ.get("PATH", ""),
                                   "PYTHONPATH": pythonpath}, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def run(args: argparse.Namespace) -> int:
    from fsdp_lab.workshop import accounts, install, shares
    from fsdp_lab.workshop.hub_config import Settings, config_text
    from fsdp_lab.training.launch import die_with_parent, free_port

    for flag, value in (("--mem-limit", args.mem_limit), ("--cpu-limit", args.cpu_limit)):
        if value is not None:
            return _err(f"{flag} is not supported: JupyterHub's LocalProcessSpawner, which runs each learner as "
                        f"their Unix user, does not enforce memory or CPU limits (it only passes them on as "
                        f"MEM_LIMIT/CPU_LIMIT); limit the machine with systemd or cgroups instead")
    if not args.ip.strip():
        return _err("--ip must not be empty")
    try:
        klass = accounts.load_class(args.class_list, args.instructor)
        devices = shares.parse_devices(args.gpus) if args.gpus is not None else shares.detect_gpus()
        share = shares.assign(klass.learners, devices, args.gpus_per_learner, args.cpu_for_rest)
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    if os.geteuid() != 0 and not args.dry_run:
        return _err("run it as root: the hub starts each learner's server as that learner's Unix user, which "
                    "only root can do")
    state = Path(args.state_dir).resolve()
    pythonpath = _pythonpath()
    settings = Settings(ip=args.ip, port=args.port, hub_port=free_port(), proxy_api_port=free_port(),
                        class_view_port=free_port(), state_dir=str(state),
                        proxy_path=str(install.proxy_path()), learners=list(klass.learners),
                        instructors=list(klass.instructors),
                        shares={n: s.cuda_visible_devices for n, s in share.items()},
                        learner_python=args.learner_python, pythonpath=pythonpath,
                        lab_args=[f"--LabApp.app_settings_dir={SETTINGS_DIR}", *QUIET],
                        idle_timeout_s=args.idle_timeout)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state, 0o700)
    settings.save(state / "workshop.json")
    (state / "jupyterhub_config.py").write_text(config_text(state / "workshop.json"), encoding="utf-8")
    for name, s in share.items():
        print(f"{name}: CUDA_VISIBLE_DEVICES={s.cuda_visible_devices!r}"
              f"{'' if s.devices else ' (CPU ranks)'}", file=sys.stderr)
    if args.dry_run:
        print((state / "workshop.json").read_text(encoding="utf-8"))
        return 0
    try:
        if not args.no_install:
            install.install(say=lambda line: print(f"fsdp-lab workshop: {line}", file=sys.stderr))
        absent = install.python_missing()
        if absent or not install.proxy_path().exists():
            return _err(f"missing: {' '.join(absent + ([install.PROXY_PIN] if not install.proxy_path().exists() else []))}"
                        f" (run without --no-install to install them)")
        made = accounts.ensure_users(klass.everyone, state / "passwords.txt")
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        return _err(str(exc))
    if made:
        print(f"fsdp-lab workshop: made {len(made)} user(s) ({', '.join(made)}); their passwords are in "
              f"{state / 'passwords.txt'} (root only)", file=sys.stderr)
    problem = learner_can_run(args.learner_python, klass.learners[0], pythonpath)
    if problem:
        return _err(f"learner {klass.learners[0]} cannot run {printable(args.learner_python)} with fsdp_lab and "
                    f"jupyterhub: {printable(problem)}; pass --learner-python with an interpreter every learner "
                    f"can run (one outside a 0700 home)")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "jupyterhub", "-f", str(state / "jupyterhub_config.py")]
    proc = subprocess.Popen(cmd, cwd=state, env=env, preexec_fn=lambda: die_with_parent(sig=15))
    print(f"fsdp-lab workshop: the hub is starting on http://{args.ip}:{args.port}/ (class view: "
          f"/services/class-view/; Ctrl-C stops it and every learner's server)", file=sys.stderr)
    try:
        return proc.wait()
    finally:
        stop(proc, STOP_GRACE_S)
