"""The hub's configuration: one settings file (JSON) that `fsdp-lab workshop` writes, applied to JupyterHub's
config object by the two-line jupyterhub_config.py beside it.

[Note: what the hub is told] Everything the hub does is JupyterHub's own machinery, configured here:
- bound to `ip` (127.0.0.1 unless the instructor says otherwise), the hub's internal API on 127.0.0.1 only;
- PAMAuthenticator, allowed users = the class list, admin users = the instructors ([Note: which
  authenticator] in fsdp_lab.workshop.accounts);
- LocalProcessSpawner: every server runs as its learner's Unix user, started through fsdp_lab.workshop.learner
  with the course's JupyterLab settings; a pre-spawn hook sets CUDA_VISIBLE_DEVICES to the learner's share
  ([Note: GPU shares] in fsdp_lab.workshop.shares); instructors' own servers see no GPU;
- [Note: limits] LocalProcessSpawner enforces no memory or CPU limit: JupyterHub documents that `mem_limit`
  and `cpu_limit` are only passed to the server as MEM_LIMIT / CPU_LIMIT for spawners that enforce them, and
  LocalProcessSpawner is not one. So `fsdp-lab workshop` refuses --mem-limit / --cpu-limit by name rather
  than promise a limit nothing applies; what it does set is one thread per live rank (the course's default),
  and OMP_NUM_THREADS for the kernel, so a learner's ranks do not take every core;
- services: jupyterhub-idle-culler (stops servers idle for `idle_timeout_s`) and the class view, each with
  only the scopes it needs; the class view is reachable by the hub's admins only ([Note: who may see the class]
  in fsdp_lab.workshop.class_view);
- state (database, cookie secret) in `state_dir`, which only root can read.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLASS_VIEW = "class-view"
IDLE_CULLER = "idle-culler"
CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]


@dataclass
class Settings:
    ip: str
    port: int
    hub_port: int
    proxy_api_port: int
    class_view_port: int
    state_dir: str
    proxy_path: str
    learners: list[str]
    instructors: list[str]
    shares: dict[str, str]  # learner -> CUDA_VISIBLE_DEVICES
    learner_python: str
    pythonpath: str
    lab_args: list[str] = field(default_factory=list)
    idle_timeout_s: int = 3600
    start_timeout_s: int = 180
    kernel_threads: int = 1

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> "Settings":
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def config_text(settings_path: Path) -> str:
    """The jupyterhub_config.py that applies the settings file at `settings_path`."""
    return ("from pathlib import Path\nfrom fsdp_lab.workshop.hub_config import Settings, apply\n"
            f"apply(c, Settings.load(Path({str(settings_path)!r})))\n")


def environment_for(settings: Settings, name: str) -> dict[str, str]:
    """The variables a user's server gets on top of JupyterHub's own."""
    return {"CUDA_VISIBLE_DEVICES": settings.shares.get(name, ""), "PYTHONPATH": settings.pythonpath,
            "OMP_NUM_THREADS": str(settings.kernel_threads)}


def apply(c, settings: Settings) -> None:
    state = Path(settings.state_dir)
    c.JupyterHub.ip = settings.ip
    c.JupyterHub.port = settings.port
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = settings.hub_port
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.JupyterHub.cleanup_servers = True  # stopping the hub stops every learner's server
    c.JupyterHub.cleanup_proxy = True
    c.ConfigurableHTTPProxy.command = [settings.proxy_path]
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings.proxy_api_port}"

    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.open_sessions = False  # no login session (utmp, pam_systemd) for a web login
    c.Authenticator.allowed_users = set(settings.learners)
    c.Authenticator.admin_users = set(settings.instructors)

    c.JupyterHub.spawner_class = "localprocess"
    c.Spawner.cmd = [settings.learner_python, "-m", "fsdp_lab.workshop.learner", "serve"]
    c.Spawner.args = list(settings.lab_args)
    c.Spawner.default_url = "/lab"
    c.Spawner.start_timeout = settings.start_timeout_s
    c.Spawner.http_timeout = settings.start_timeout_s

    def pre_spawn_hook(spawner):
        spawner.environment = {**spawner.environment, **environment_for(settings, spawner.user.name)}

    c.Spawner.pre_spawn_hook = pre_spawn_hook

    c.JupyterHub.services = [
        {"name": IDLE_CULLER,
         "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={settings.idle_timeout_s}"]},
        {"name": CLASS_VIEW, "url": f"http://127.0.0.1:{settings.class_view_port}", "display": True,
         "oauth_no_confirm": True,
         "command": [sys.executable, "-m", "fsdp_lab.workshop.class_view"],
         "environment": {"FSDP_LAB_WORKSHOP_SETTINGS": str(state / "workshop.json"),
                         "PYTHONPATH": settings.pythonpath}},
    ]
    c.JupyterHub.load_roles = [{"name": IDLE_CULLER, "scopes": CULLER_SCOPES, "services": [IDLE_CULLER]}]
