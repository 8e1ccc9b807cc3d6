"""The instructor's class view: a JupyterHub service (tornado + HubOAuth), for the workshop's instructors only.

    /services/class-view/             the class, live: chapter reached, best quiz scores, checks passed, ranks
    /services/class-view/api/class    the same as JSON
    /services/class-view/class.csv    the class CSV, in `fsdp-lab scores`'s format
    POST /services/class-view/push    chapter=NN-name.ipynb: a fresh copy of it to every learner

[Note: who may see the class] Two locks, each enough on its own. The hub grants access to a service only to
users holding `access:services!service=class-view`, which its admin role has and learners do not, so a learner
is refused (403) by HubOAuth before any handler runs. And every handler checks the user is one of the
workshop's instructors (the hub's admins, from the same settings file), so a role granted by mistake still
does not show a learner the class. The service runs as the hub's user (root) because it reads every learner's
files; it writes none of them itself (pushes run as each learner: fsdp_lab.workshop.learner).
"""
from __future__ import annotations

import asyncio
import html
import io
import json
import os
import pwd
import sys
from pathlib import Path

from tornado import web
from tornado.ioloop import IOLoop

from fsdp_lab.lessons.quiz.progress import write_csv
from fsdp_lab.lessons.student_copy import INSTRUCTOR_NOTEBOOKS
from fsdp_lab.workshop.class_state import class_rows, class_state
from fsdp_lab.workshop.hub_config import Settings

PUSH_TIMEOUT_S = 120.0
REFRESH_S = 10


def chapters() -> list[str]:
    return sorted(p.name for p in INSTRUCTOR_NOTEBOOKS.glob("*.ipynb"))


async def push_one(settings: Settings, learner: str, chapter: str) -> str:
    """Run `learner push CHAPTER` as `learner`; one line saying what was written, or what went wrong."""
    account = pwd.getpwnam(learner)
    env = {"HOME": account.pw_dir, "USER": learner, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": settings.pythonpath}
    proc = await asyncio.create_subprocess_exec(
        settings.learner_python, "-m", "fsdp_lab.workshop.learner", "push", chapter, user=account.pw_uid,
        group=account.pw_gid, extra_groups=[], env=env, cwd=account.pw_dir, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PUSH_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return f"{learner}: no answer within {PUSH_TIMEOUT_S:g} s"
    if proc.returncode:
        last = (err.decode("utf-8", "replace").strip().splitlines() or ["(no output)"])[-1]
        return f"{learner}: failed (exit {proc.returncode}): {last}"
    return f"{learner}: wrote {out.decode('utf-8', 'replace').strip()}"


def _handler_base():
    from jupyterhub.services.auth import HubOAuthenticated

    class Base(HubOAuthenticated, web.RequestHandler):
        @property
        def settings_(self) -> Settings:
            return self.application.settings["workshop"]

        def instructor(self) -> dict:
            user = self.current_user
            if user is None:
                raise web.HTTPError(403)
            if user.get("name") not in self.settings_.instructors:
                raise web.HTTPError(403, f"{user.get('name')} is not an instructor of this workshop")
            return user

    return Base


def make_app(settings: Settings) -> web.Application:
    from jupyterhub.services.auth import HubOAuthCallbackHandler
    from jupyterhub.utils import url_path_join

    Base = _handler_base()
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/class-view/")

    class Page(Base):
        @web.authenticated
        def get(self):
            self.instructor()
            states = class_state(self.settings_.learners)
            quiz_chapters = sorted({r.chapter for s in states for r in s.quiz})
            head = "".join(f"<th>quiz {html.escape(c)}</th>" for c in quiz_chapters)
            rows = []
            for s in states:
                best = {r.chapter: f"{r.score:g}/{r.max}" for r in s.quiz}
                cells = "".join(f"<td>{html.escape(best.get(c, ''))}</td>" for c in quiz_chapters)
                rows.append(f"<tr><td>{html.escape(s.name)}</td><td>{html.escape(s.chapter_reached or '-')}</td>"
                            f"{cells}<td>{s.checks_passed}</td><td>{s.ranks_running}</td>"
                            f"<td>{'yes' if s.server_running else 'no'}</td>"
                            f"<td>{html.escape('; '.join(s.problems))}</td></tr>")
            options = "".join(f"<option>{html.escape(c)}</option>" for c in chapters())
            self.write(f"""<!doctype html><html><head><meta charset="utf-8"><title>Class view</title>
<meta http-equiv="refresh" content="{REFRESH_S}"></head><body><h1>Class view</h1>
<table border="1" cellpadding="4"><tr><th>learner</th><th>chapter reached</th>{head}<th>checks passed</th>
<th>live ranks running</th><th>server</th><th>problems</th></tr>{''.join(rows)}</table>
<p><a href="{prefix}class.csv">Export the class CSV</a> (the `fsdp-lab scores` format)</p>
<form method="post" action="{prefix}push">{self.xsrf_form_html()}
<select name="chapter">{options}</select> <button type="submit">Push a fresh copy to every learner</button>
(an existing copy is never overwritten: the fresh one is saved beside it)</form></body></html>""")

    class ClassJson(Base):
        @web.authenticated
        def get(self):
            self.instructor()
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps([s.to_json() for s in class_state(self.settings_.learners)]))

    class ClassCsv(Base):
        @web.authenticated
        def get(self):
            self.instructor()
            out = io.StringIO()
            write_csv(class_rows(class_state(self.settings_.learners)), out)
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            self.set_header("Content-Disposition", 'attachment; filename="class.csv"')
            self.write(out.getvalue())

    class Push(Base):
        @web.authenticated
        async def post(self):
            self.instructor()
            chapter = self.get_body_argument("chapter", "")
            if chapter not in chapters():
                raise web.HTTPError(400, f"no chapter {chapter!r}; one of {', '.join(chapters())}")
            lines = await asyncio.gather(*(push_one(self.settings_, name, chapter)
                                           for name in self.settings_.learners))
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps({"chapter": chapter, "results": lines}))

    return web.Application([
        (prefix, Page), (url_path_join(prefix, "api/class"), ClassJson), (url_path_join(prefix, "class.csv"), ClassCsv),
        (url_path_join(prefix, "push"), Push), (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
    ], cookie_secret=os.urandom(32), workshop=settings)


def main() -> int:
    from urllib.parse import urlparse

    settings = Settings.load(Path(os.environ["FSDP_LAB_WORKSHOP_SETTINGS"]))
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app = make_app(settings)
    app.listen(url.port, url.hostname)
    print(f"class view listening on {url.geturl()}", file=sys.stderr)
    IOLoop.current().start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
