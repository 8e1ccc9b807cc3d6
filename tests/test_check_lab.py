"""`fsdp-lab check` (a real 2-rank gloo probe, the chapter verdict) and `fsdp-lab lab` (the exact command)."""
import json
import multiprocessing
import shlex
import socket
import sys
from pathlib import Path

import pytest

from fsdp_lab import cli
from fsdp_lab.commands import check, lab


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
    assert len(status) == 11 and list(status) == [f"{i:02d}" for i in range(11)]
    assert [status[c] for c in ("03", "06")] == ["mixed"] * 2  # live ranks, no GPU memory here
    assert all(status[c] == "live" for c in ("00", "01", "02", "04", "05", "07", "08", "09", "10"))


def test_chapter_plan_says_whether_gpu_traces_ship():
    none = check.chapter_plan(gpu_count=0, gloo_ok=True)[3].how
    shipped = check.chapter_plan(gpu_count=0, gloo_ok=True, gpu_traces_ship=True)[3].how
    assert "no GPU traces ship yet" in none and "replays" not in none
    assert "replays the shipped GPU traces" in shipped


def test_chapter_plan_without_gloo_replays_the_multi_rank_chapters():
    chapters = check.chapter_plan(gpu_count=0, gloo_ok=False)
    status = _status(chapters)
    assert [status[c] for c in ("00", "03", "04", "05", "06", "08", "09")] == ["replay"] * 7
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
    assert every == [f"{i:02d}" for i in range(11)]
    import torch
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_check_text_ends_with_a_verdict_on_a_cpu_machine(capsys, monkeypatch):
    monkeypatch.setattr(check, "_gpus", lambda: [])
    assert cli.main(["check", "--no-gloo"]) == 0
    out = capsys.readouterr().out
    verdict = out[out.index("Verdict:"):]
    assert "not checked (need the gloo probe; run without --no-gloo): 00, 01, 02, 03, 04, 05, 06, 08, 09" in verdict
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
    assert "show saved outputs only: 00, 01, 02, 03, 04, 05, 06, 08, 09" in captured.out
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


def test_child_env_drops_an_empty_token_only(tmp_path):
    assert "JUPYTER_TOKEN" not in lab.child_env({"JUPYTER_TOKEN": "", "PATH": "/bin"})
    assert lab.child_env({"JUPYTER_TOKEN": "abc"})["JUPYTER_TOKEN"] == "abc"
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.write_text("\n")
    full.write_text("s3cret\n")
    assert "JUPYTER_TOKEN_FILE" not in lab.child_env({"JUPYTER_TOKEN_FILE": str(empty)})
    assert "JUPYTER_TOKEN_FILE" not in lab.child_env({"JUPYTER_TOKEN_FILE": str(tmp_path / "missing")})
    assert lab.child_env({"JUPYTER_TOKEN_FILE": str(full)})["JUPYTER_TOKEN_FILE"] == str(full)


def test_build_command_allow_root_only_when_asked(tmp_path):
    assert "--allow-root" not in lab.build_command(tmp_path)
    assert "--allow-root" in lab.build_command(tmp_path, as_root=True)


def test_the_launcher_turns_the_jupyter_news_pop_up_off(tmp_path):
    """[Note: no news pop-up]: the shipped overrides.json sets fetchNews to "false", and the server fetches no news."""
    argv = lab.build_command(tmp_path)
    settings = next(a.split("=", 1)[1] for a in argv if a.startswith("--LabApp.app_settings_dir="))
    overrides = json.loads((Path(settings) / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    assert "--LabApp.news_url=None" in argv
    assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in argv
