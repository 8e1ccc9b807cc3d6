"""`fsdp-lab check` (a real 2-rank gloo probe, the chapter verdict) and `fsdp-lab lab` (the exact command)."""
import importlib
import json
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.commands import check, lab

# `fsdp-lab check` plans every chapter the course ships, in the notebooks' order (00 … 06, 06a …, 07 …).
NOTEBOOK_CHAPTERS = sorted(p.name.split("-")[0] for p in (Path(__file__).resolve().parent.parent / "notebooks")
                           .glob("[0-9][0-9]*-*.ipynb"))


# -- check ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_probe_gloo_really_runs_two_ranks():
    ok, seconds, error = check.probe_gloo(world_size=2, timeout_s=120)
    assert (ok, error) == (True, None)
    assert 0 < seconds < 120
    assert not multiprocessing.active_children()


def test_probe_gloo_times_out_and_kills_its_children():
    ok, seconds, error = check.probe_gloo(world_size=2, timeout_s=0.2)
    assert not ok
    assert "timed out after 0.2 s" in error
    assert seconds < 30
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_probe_gloo_reports_a_failing_rank_and_stops_the_others(monkeypatch):
    with socket.socket() as busy:  # rank 0 must host the rendezvous on this port and cannot
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        monkeypatch.setattr(check, "free_port", lambda host="127.0.0.1": busy.getsockname()[1])
        ok, seconds, error = check.probe_gloo(world_size=2, timeout_s=120)
    assert not ok
    assert error.startswith("rank 0:") and "in use" in error.lower()
    assert seconds < 60  # did not wait out the 30 s rendezvous timeout of the other rank plus the probe limit
    assert not multiprocessing.active_children()


def test_probe_gloo_rejects_nonsense():
    with pytest.raises(ValueError, match="timeout_s=0"):
        check.probe_gloo(2, timeout_s=0)


def test_free_port_can_be_bound():
    port = check.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def _status(chapters):
    return {c.chapter: c.status for c in chapters}


def test_chapter_plan_cpu_with_gloo():
    status = _status(check.chapter_plan(gpu_count=0, gloo_ok=True))
    assert list(status) == NOTEBOOK_CHAPTERS and len(status) >= 13
    assert [status[c] for c in ("03", "06")] == ["mixed"] * 2  # live ranks, no GPU memory here
    assert all(status[c] == "live" for c in ("00", "01", "02", "04", "05", "06a", "07", "08", "09", "10"))


def test_chapter_plan_says_whether_gpu_traces_ship():
    none = check.chapter_plan(gpu_count=0, gloo_ok=True)[3].how
    shipped = check.chapter_plan(gpu_count=0, gloo_ok=True, gpu_traces_ship=True)[3].how
    assert "no GPU traces ship yet" in none and "replays" not in none
    assert "replays the shipped GPU traces" in shipped


def test_chapter_plan_without_gloo_replays_the_multi_rank_chapters():
    chapters = check.chapter_plan(gpu_count=0, gloo_ok=False)
    status = _status(chapters)
    assert [status[c] for c in ("00", "03", "04", "05", "06", "06a", "08", "09", "09a")] == ["replay"] * 9
    assert [status[c] for c in ("07", "10")] == ["live"] * 2
    assert "gloo failed" in chapters[3].how


def test_chapter_plan_with_gpus_runs_everything_live():
    one = check.chapter_plan(gpu_count=1, gloo_ok=True)
    assert set(_status(one).values()) == {"live"}
    assert "gloo with CUDA tensors" in one[6].how
    assert "NCCL" in check.chapter_plan(gpu_count=4, gloo_ok=True)[6].how


def test_chapter_plan_one_gpu_without_gloo_cannot_share_it():
    status = _status(check.chapter_plan(gpu_count=1, gloo_ok=False))
    assert [status[c] for c in ("03", "04", "05", "06")] == ["replay"] * 4
    many = _status(check.chapter_plan(gpu_count=2, gloo_ok=False))  # NCCL across GPUs needs no gloo
    assert [many[c] for c in ("03", "04")] == ["mixed", "replay"]


@pytest.mark.slow
def test_check_json_is_one_object_with_everything(capsys):
    assert cli.main(["check", "--json", "--timeout", "120"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"python", "torch", "cuda", "nccl", "cpu_cores", "gpus", "free_port", "gloo", "chapters",
            "verdict"} <= set(info)
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["gloo"]["ok"] is True, info["gloo"]
    every = sorted(sum(info["verdict"].values(), []))
    assert every == NOTEBOOK_CHAPTERS
    import torch
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_check_text_ends_with_a_verdict_on_a_cpu_machine(capsys, monkeypatch):
    monkeypatch.setattr(check, "_gpus", lambda: [])
    assert cli.main(["check", "--no-gloo"]) == 0
    out = capsys.readouterr().out
    verdict = out[out.index("Verdict:"):]
    live = ", ".join(c for c in NOTEBOOK_CHAPTERS if c not in ("07", "10"))  # every chapter that launches ranks
    assert f"not checked (need the gloo probe; run without --no-gloo): {live}\n" in verdict
    assert "show saved outputs only: none" in verdict and "FAILED" not in out  # nothing was tried, nothing failed
    assert "run live here: 07, 10" in verdict
    assert "2-rank gloo on 127.0.0.1: not checked (--no-gloo)" in out
    assert "GPUs torch can use (torch.cuda): none" in out


def test_check_exits_1_when_the_gloo_probe_fails(capsys, monkeypatch):
    monkeypatch.setattr(check, "_gpus", lambda: [])
    monkeypatch.setattr(check, "probe_gloo", lambda world_size, timeout_s: (False, 2.0, "rank 1: boom"))
    assert cli.main(["check"]) == 1
    captured = capsys.readouterr()
    assert "2-rank gloo on 127.0.0.1: FAILED: rank 1: boom" in captured.out
    live = ", ".join(c for c in NOTEBOOK_CHAPTERS if c not in ("07", "10"))  # every chapter that launches ranks
    assert f"show saved outputs only: {live}\n" in captured.out
    assert captured.err.strip() == "fsdp-lab check: the 2-rank gloo probe failed: rank 1: boom"


def test_check_text_lists_gpus(capsys, monkeypatch):
    fake = [{"index": 0, "name": "Fake H200", "memory_bytes": 150 * 2**30}]
    monkeypatch.setattr(check, "_gpus", lambda: fake)
    monkeypatch.setattr(check, "probe_gloo", lambda world_size, timeout_s: (True, 1.0, None))
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: Fake H200, 150.0 GiB" in out
    assert "run live here (GPU memory measured on this machine's GPU): 00, 01, 02, 03, 04" in out


def test_check_rejects_a_zero_timeout(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--timeout", "0"])
    assert exit_.value.code == 2
    assert "--timeout: expected a positive number, got '0'" in capsys.readouterr().err


# -- lab --------------------------------------------------------------------------------------------------------
def _dry_run(capsys, *argv):
    """A dry run from a folder that has notebooks/, so the test does not depend on the checkout having one."""
    code = cli.main(["lab", "--dry-run", *argv])
    captured = capsys.readouterr()
    return code, shlex.split(captured.out.strip()), captured.err


def _assert_token_not_disabled(argv):
    for arg in argv:
        if "token" in arg.lower():
            value = arg.split("=", 1)[1] if "=" in arg else ""
            assert value.strip("'\"") != "", f"token auth disabled by {arg!r}"
    joined = " ".join(argv)
    for bad in ("--IdentityProvider.token=''", "--NotebookApp.token=''", "--ServerApp.token=''"):
        assert bad not in joined


@pytest.fixture
def cwd_with_notebooks(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path)


def test_lab_dry_run_binds_loopback_with_token(capsys, cwd_with_notebooks):
    code, argv, err = _dry_run(capsys)
    assert code == 0
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert "--ip=127.0.0.1" in argv
    assert any(a.startswith("--notebook-dir=") and a.endswith("notebooks") for a in argv)
    _assert_token_not_disabled(argv)
    assert err == ""


def test_lab_on_all_interfaces_keeps_the_token_and_warns(capsys, cwd_with_notebooks):
    code, argv, err = _dry_run(capsys, "--ip", "0.0.0.0", "--port", "9999", "--no-browser")
    assert code == 0
    assert {"--ip=0.0.0.0", "--port=9999", "--no-browser"} <= set(argv)
    _assert_token_not_disabled(argv)
    assert "reachable from the network" in err and "token" in err and "required" in err
    assert "the URL this command prints" in err and "Jupyter prints" not in err  # Jupyter masks the token


def test_lab_rejects_a_bad_port(capsys, cwd_with_notebooks):
    assert cli.main(["lab", "--dry-run", "--port", "70000"]) == 2
    assert "70000" in capsys.readouterr().err


def test_find_notebooks_prefers_the_checkout_then_cwd(tmp_path):
    package_dir = tmp_path / "src" / "fsdp_lab"
    package_dir.mkdir(parents=True)
    cwd = tmp_path / "work"
    (cwd / "notebooks").mkdir(parents=True)
    assert lab.find_notebooks(package_dir, cwd) == (cwd / "notebooks").resolve()
    (tmp_path / "src" / "notebooks").mkdir()
    assert lab.find_notebooks(package_dir, cwd) == (tmp_path / "src" / "notebooks").resolve()


def test_find_notebooks_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no notebooks/ folder found.*looked in.*elsewhere"):
        lab.find_notebooks(tmp_path / "pkg", tmp_path / "elsewhere")


def test_lab_without_notebooks_fails_clearly(capsys, monkeypatch, tmp_path):
    def nowhere():
        raise FileNotFoundError("no notebooks/ folder found (looked in: /x)")
    monkeypatch.setattr(lab, "find_notebooks", nowhere)
    assert cli.main(["lab", "--dry-run"]) == 1
    assert "no notebooks/ folder found" in capsys.readouterr().err


def test_the_token_is_the_users_if_they_gave_one_else_new(tmp_path):
    assert lab.launcher_token({"JUPYTER_TOKEN": "abc"}) == "abc"
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.write_text("\n")
    full.write_text("s3cret\n")
    assert lab.launcher_token({"JUPYTER_TOKEN_FILE": str(full)}) == "s3cret"
    for environ in ({"JUPYTER_TOKEN": ""}, {"JUPYTER_TOKEN": " "}, {"JUPYTER_TOKEN_FILE": str(empty)},
                    {"JUPYTER_TOKEN_FILE": str(tmp_path / "missing")}, {"JUPYTER_TOKEN_FILE": "/dev/zero"}, {}):
        token = lab.launcher_token(environ)
        assert len(token) == 48 and token != lab.launcher_token(environ)  # random, never empty
    env = lab.child_env({"JUPYTER_TOKEN": "", "JUPYTER_TOKEN_FILE": str(empty), "PATH": "/bin"})
    assert len(env["JUPYTER_TOKEN"]) == 48 and "JUPYTER_TOKEN_FILE" not in env and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(lab.__file__).resolve().parents[2])


def test_the_token_outranks_config_files_without_showing_in_ps(capsys, cwd_with_notebooks):
    code, argv, _ = _dry_run(capsys)
    assert f"--ServerApp.identity_provider_class={lab.IDENTITY_PROVIDER}" in argv
    assert not [a for a in argv if "token" in a.lower() and "identity_provider_class" not in a]  # in JUPYTER_TOKEN
    module, _, name = lab.IDENTITY_PROVIDER.rpartition(".")
    provider = getattr(importlib.import_module(module), name)
    from jupyter_server.auth.identity import IdentityProvider
    from traitlets.config import Config

    assert issubclass(provider, IdentityProvider)
    config = Config({"IdentityProvider": {"token": ""}})
    with pytest.MonkeyPatch.context() as m:
        m.setenv("JUPYTER_TOKEN", "from-the-launcher")
        assert provider(config=config).token == "from-the-launcher"
        assert provider(config=config, token="").token == "from-the-launcher"


def test_build_command_allow_root_only_when_asked(tmp_path):
    assert "--allow-root" not in lab.build_command(tmp_path)
    assert "--allow-root" in lab.build_command(tmp_path, as_root=True)


# -- lab, for real: a server on 127.0.0.1 whose Jupyter config turns the token off ---------------------------------
EMPTY_TOKEN = {"IdentityProvider": {"token": ""}, "ServerApp": {"token": "", "password": ""}}
AUTH_OFF_BY_CODE = """
from jupyter_server.auth.identity import IdentityProvider
IdentityProvider.get_user = lambda self, handler: self.generate_anonymous_user(handler)  # everyone is a user
"""


def _http_status(url):
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def _start_lab(tmp_path, config_py=None):
    """`fsdp-lab lab` on a free loopback port with the user's Jupyter config dirs in tmp_path, all saying
    token = ''; returns (launcher, port, runtime dir, stderr lines so far)."""
    user, extra = tmp_path / "jupyter-config", tmp_path / "jupyter-config-path"
    for folder in (user, extra):
        folder.mkdir()
        (folder / "jupyter_server_config.json").write_text(json.dumps(EMPTY_TOKEN))
    (user / "jupyter_server_config.py").write_text("c.IdentityProvider.token = ''\n" + (config_py or ""))
    runtime = tmp_path / "runtime"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(user), "JUPYTER_CONFIG_PATH": str(extra), "JUPYTER_TOKEN": "",
           "JUPYTER_RUNTIME_DIR": str(runtime), "JUPYTER_DATA_DIR": str(tmp_path / "data"), "HOME": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    port = check.free_port()
    launcher = subprocess.Popen([sys.executable, "-m", "fsdp_lab", "lab", "--no-browser", "--ip", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(launcher.stderr), daemon=True).start()
    return launcher, port, runtime, lines


def _server_pid(runtime, deadline):
    while time.monotonic() < deadline:
        for info in runtime.glob("jpserver-*.json"):
            try:
                return json.loads(info.read_text())["pid"]
            except (ValueError, KeyError, OSError):
                pass
        time.sleep(0.2)
    return None


def _gone(pid, deadline):
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_lab_serves_with_its_token_whatever_the_jupyter_config_says(tmp_path, ending):
    """Ended by SIGTERM the launcher stops the server itself; killed outright, the server gets SIGTERM from
    the kernel (parent-death signal), so it never outlives the command."""
    if ending == signal.SIGKILL and sys.platform != "linux":
        pytest.skip("the parent-death signal is Linux's")
    launcher, port, runtime, lines = _start_lab(tmp_path)
    try:
        deadline = time.monotonic() + 180
        pid = _server_pid(runtime, deadline)
        assert pid, f"no server started: {''.join(lines)[-2000:]}"
        base = f"http://127.0.0.1:{port}/api/status"
        while time.monotonic() < deadline and not any("fsdp-lab lab: checked:" in line for line in lines):
            assert launcher.poll() is None, "".join(lines)[-2000:]
            time.sleep(0.2)
        assert _http_status(base) == 403  # the old launcher served this with no token (HTTP 200)
        token = json.loads(next(runtime.glob("jpserver-*.json")).read_text())["token"]
        assert len(token) == 48 and _http_status(f"{base}?token={token}") == 200
        assert f"fsdp-lab lab: checked: {base} refuses a request without the token (HTTP 403).\n" in "".join(lines)
    finally:
        launcher.send_signal(ending)
        launcher.wait(timeout=60)
    assert _gone(pid, time.monotonic() + 60), "the server outlived the launcher"


@pytest.mark.slow
def test_lab_stops_a_server_that_answers_without_the_token(tmp_path):
    """Config is code: one that switches authentication off behind the identity provider's back still gets
    caught by the check after start, and the server is stopped."""
    launcher, port, runtime, lines = _start_lab(tmp_path, AUTH_OFF_BY_CODE)
    try:
        code = launcher.wait(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    time.sleep(0.5)  # the reader thread has the last lines
    errors = [line for line in lines if "fsdp-lab lab: error:" in line]
    assert code == 1 and len(errors) == 1, "".join(lines)[-3000:]
    assert (f"the Jupyter server answered it: authentication is off (HTTP 200 without the token, "
            f"http://127.0.0.1:{port}/api/status), so it was stopped") in errors[0]
    with pytest.raises(urllib.error.URLError):  # stopped, not left serving
        _http_status(f"http://127.0.0.1:{port}/api/status")


def test_the_launcher_turns_the_jupyter_news_pop_up_off(tmp_path):
    """[Note: no news pop-up]: the shipped overrides.json sets fetchNews to "false", and the server fetches no news."""
    argv = lab.build_command(tmp_path)
    settings = next(a.split("=", 1)[1] for a in argv if a.startswith("--LabApp.app_settings_dir="))
    overrides = json.loads((Path(settings) / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    assert "--LabApp.news_url=None" in argv
    assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in argv
