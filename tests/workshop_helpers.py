"""What tests/test_workshop.py does over HTTP: a hub login, a learner's own API token, a kernel run through the
Jupyter REST and kernel-websocket API. Every wait has a deadline."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid

import requests


def wait_for(what: str, check, deadline_s: float, poll_s: float = 1.0):
    """check() until it returns something truthy; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (requests.RequestException, OSError) as exc:
            last = exc
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {deadline_s:g} s (last: {last!r})")


def login(base: str, name: str, password: str) -> requests.Session:
    """Log in at /hub/login with the form, as a browser does; the hub then starts the learner's server."""
    s = requests.Session()
    s.trust_env = False
    s.get(f"{base}/hub/login", timeout=60)
    r = s.post(f"{base}/hub/login", data={"username": name, "password": password,
                                          "_xsrf": s.cookies.get("_xsrf", path="/hub/")},
               allow_redirects=False, timeout=120)
    assert r.status_code == 302, (name, r.status_code, r.text[:300])
    return s


def hub_xsrf(s: requests.Session) -> str:
    return s.cookies.get("_xsrf", path="/hub/")


def start_server(s: requests.Session, base: str, name: str, deadline_s: float) -> None:
    r = s.post(f"{base}/hub/api/users/{name}/server", headers={"X-XSRFToken": hub_xsrf(s)}, timeout=120)
    assert r.status_code in (201, 202, 400), (r.status_code, r.text[:300])  # 400: already running
    wait_for(f"{name}'s server", lambda: s.get(f"{base}/hub/api/users/{name}", timeout=30,
                                                headers={"X-XSRFToken": hub_xsrf(s)}).json()
             .get("servers", {}).get("", {}).get("ready"), deadline_s, poll_s=2.0)


def own_token(s: requests.Session, base: str, name: str) -> str:
    """An API token the learner makes for themselves: it carries their own permissions only."""
    r = s.post(f"{base}/hub/api/users/{name}/tokens", json={"note": "workshop test", "expires_in": 3600},
               headers={"X-XSRFToken": hub_xsrf(s)}, timeout=60)
    assert r.status_code == 201, (r.status_code, r.text[:300])
    return r.json()["token"]


async def _execute(ws_url: str, token: str, code: str, deadline_s: float) -> str:
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    conn = await asyncio.wait_for(websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"})),
                                  60)
    msg_id = uuid.uuid4().hex
    conn.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    out = []
    loop_deadline = time.monotonic() + deadline_s
    try:
        while True:
            left = loop_deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the cell did not finish within {deadline_s:g} s; output so far: {''.join(out)}")
            raw = await asyncio.wait_for(conn.read_message(), left)
            if raw is None:
                raise AssertionError(f"the kernel's websocket closed; output so far: {''.join(out)}")
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                out.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)
    finally:
        conn.close()


def run_code(base: str, name: str, token: str, kernel_id: str, code: str, deadline_s: float) -> str:
    """The cell's output. Its event loop runs in a thread of its own: a caller may hold one already (playwright's
    sync API keeps its loop running while a browser is open), and asyncio.run refuses to start beside it."""
    ws = f"{base.replace('http://', 'ws://')}/user/{name}/api/kernels/{kernel_id}/channels"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _execute(ws, token, code, deadline_s)).result()


def new_kernel(base: str, name: str, token: str) -> str:
    r = requests.post(f"{base}/user/{name}/api/kernels", json={"name": "python3"},
                      headers={"Authorization": f"token {token}"}, timeout=120)
    assert r.status_code == 201, (r.status_code, r.text[:300])
    return r.json()["id"]
