"""Which Python scripts/install.sh, course.sh and test.sh run (scripts/env.sh, [Note: which python] and
[Note: which torch] there), checked offline in a copy of scripts/.

Most cases put fake interpreters first on PATH: small programs named python3 that answer env.sh's probe from
canned facts (in a venv or not, can make a venv or not, has torch or not), make fake venvs and log every other
call instead of running it, so pip never runs. Two cases use real interpreters with FSDP_LAB_PIP_DRY_RUN=1: a real
virtual environment, and a real .venv made from the system's externally managed Python.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash") or "/bin/bash"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH = f"-m pip install -q --index-url {CPU_INDEX} torch==2.13.0"  # what a machine without a GPU installs
UNREACHABLE = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens
SYSTEM_PATH = "/usr/bin:/bin"

# Answers `-c PROBE facts|torch` like env.sh's probe, makes `-m venv [--system-site-packages] DIR` as a copy of
# itself, "installs" a pinned torch under `-m pip`, and logs every call but the probes.
FAKE_PYTHON = r'''#!{python}
import json, os, shutil, sys
me = os.path.abspath(sys.argv[0])
facts = json.load(open(me + ".json"))
args = sys.argv[1:]
if args[:1] == ["-c"]:
    if args[2].startswith("http"):  # env.sh asking whether an index can be reached
        sys.exit(0 if facts["reach"] else 1)
    if args[2] == "facts":
        print(int(facts["in_env"]), facts["version"], int(facts["venv_ok"]), int(facts["has_pip"]), me)
    elif facts["torch"]:
        print(facts["torch"])
    sys.exit(0)
with open(facts["log"], "a") as log:
    log.write(" ".join([me] + args) + "\n")
if args[:2] == ["-m", "venv"]:
    target = args[-1]
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(os.path.join(target, "bin"))
    child = os.path.join(target, "bin", "python")
    shutil.copy(me, child)
    shared = "--system-site-packages" in args
    child_facts = dict(facts, in_env=True, has_pip=True, torch=facts["torch"] if shared else "")
    json.dump(child_facts, open(child + ".json", "w"))
elif args[:2] == ["-m", "pip"]:
    if not facts["in_env"]:
        sys.exit("error: externally-managed-environment")
    pins = [a for a in args if a.startswith("torch==")]
    if pins:
        facts["torch"] = pins[0][len("torch=="):] + " CPU build"
        json.dump(facts, open(me + ".json", "w"))
else:
    sys.exit(facts["exits"].get(args[1], 0) if args[:1] == ["-m"] else 0)
'''


class Sandbox:
    """A repository copy holding only scripts/, fake interpreters, and a log of what they were asked to run."""

    def __init__(self, tmp_path: Path):
        self.repo = tmp_path / "repo"
        shutil.copytree(REPO / "scripts", self.repo / "scripts")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.touch()
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.nvidia_smi(None)  # no GPU unless a test gives one, whatever this machine has
        self.nvidia_proc = tmp_path / "proc-driver-nvidia"

    def nvidia_smi(self, gpu: str | None):
        """A fake nvidia-smi first on PATH: lists GPU as `nvidia-smi -L` does, or fails as without a driver."""
        script = f"#!/bin/sh\necho 'GPU 0: {gpu} (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n"
        (self.bin / "nvidia-smi").write_text(script)
        (self.bin / "nvidia-smi").chmod(0o755)

    def fake_python(self, path: Path, *, in_env=False, version="3.11", venv_ok=True, has_pip=True, torch="",
                    exits=None, reach=True) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FAKE_PYTHON.replace("{python}", sys.executable))
        path.chmod(0o755)
        facts = dict(in_env=in_env, version=version, venv_ok=venv_ok, has_pip=has_pip, torch=torch,
                     log=str(self.log), exits=exits or {}, reach=reach)
        Path(str(path) + ".json").write_text(json.dumps(facts))
        return path

    def run(self, script="install.sh", *args, path=None, **env):
        """Runs scripts/SCRIPT in a clean environment: no VIRTUAL_ENV, CONDA_PREFIX or PYTHON unless given."""
        full_env = {"PATH": path or f"{self.bin}:{SYSTEM_PATH}", "HOME": str(self.home), "LC_ALL": "C.UTF-8",
                    "FSDP_LAB_NVIDIA_PROC": str(self.nvidia_proc), **env}
        return subprocess.run([BASH, f"scripts/{script}", *args], cwd=self.repo, env=full_env, capture_output=True,
                              text=True, timeout=120)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    @property
    def venv_python(self) -> str:
        return str(self.repo / ".venv" / "bin" / "python")


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


def test_inside_a_virtual_environment_it_is_used_as_it_is(box, tmp_path):
    env_dir = tmp_path / "active-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    # no GPU, and a CPU index that cannot be reached (the real probe asks a closed port): pip's default index
    done = box.run("install.sh", "--test", path=f"{box.bin}:{env_dir}/bin:{SYSTEM_PATH}", VIRTUAL_ENV=str(env_dir),
                   FSDP_LAB_PIP_DRY_RUN="1", FSDP_LAB_TORCH_CPU_INDEX_URL=UNREACHABLE)
    assert done.returncode == 0, done.stderr
    py = f"{env_dir}/bin/python"
    assert done.stdout.splitlines() == [f"dry run: {py} -m pip install -q torch==2.13.0",
                                        f"dry run: {py} -m pip install -q -e .[test]"]
    assert f"the CPU index {UNREACHABLE} cannot be reached; using pip's configured index" in done.stderr
    assert not (box.repo / ".venv").exists()


def test_an_active_conda_env_is_used_as_it_is(box, tmp_path):
    box.fake_python(box.bin / "python3")  # a system python3 that must not be used
    conda_py = box.fake_python(tmp_path / "conda" / "bin" / "python", in_env=True)
    done = box.run(CONDA_PREFIX=str(tmp_path / "conda"))
    assert done.returncode == 0, done.stderr
    assert box.calls() == [f"{conda_py} {CPU_TORCH}", f"{conda_py} -m pip install -q -e ."]
    assert not (box.repo / ".venv").exists()


def test_outside_an_environment_a_dot_venv_is_made_and_used(box):
    base = box.fake_python(box.bin / "python3")  # its pip refuses: externally-managed-environment
    done = box.run("install.sh", "--test")
    assert done.returncode == 0, done.stderr
    venv = box.venv_python
    assert box.calls() == [f"{base} -m venv --clear {box.repo}/.venv",
                           f"{venv} {CPU_TORCH}",
                           f"{venv} -m pip install -q -e .[test]"]
    assert "making" in done.stderr and ".venv" in done.stderr
    # the next run reuses it: no second venv, and torch (now "installed") is not installed again
    box.log.write_text("")
    again = box.run("install.sh", "--test")
    assert again.returncode == 0, again.stderr
    assert box.calls() == [f"{venv} -m pip install -q -e .[test]"]
    assert "keeping torch 2.13.0 (CPU build)" in again.stderr


def test_a_dot_venv_without_pip_is_made_again(box):
    base = box.fake_python(box.bin / "python3")
    box.fake_python(box.repo / ".venv" / "bin" / "python", in_env=True, has_pip=False)
    done = box.run()
    assert done.returncode == 0, done.stderr
    assert box.calls()[0] == f"{base} -m venv --clear {box.repo}/.venv"
    assert box.calls()[1:] == [f"{box.venv_python} {CPU_TORCH}",
                               f"{box.venv_python} -m pip install -q -e ."]


def test_torch_already_in_the_environment_is_kept(box, tmp_path):
    env_py = box.fake_python(tmp_path / "venv" / "bin" / "python", in_env=True, torch="2.13.0+cu126 CUDA 12.6 build")
    done = box.run(VIRTUAL_ENV=str(tmp_path / "venv"),
                   FSDP_LAB_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert done.returncode == 0, done.stderr
    assert box.calls() == [f"{env_py} -m pip install -q -e ."]
    assert "keeping torch 2.13.0+cu126 (CUDA 12.6 build); FSDP_LAB_TORCH_INDEX_URL is not used" in done.stderr


def test_a_new_dot_venv_shares_the_base_pythons_torch(box):
    base = box.fake_python(box.bin / "python3", torch="2.13.0+cu126 CUDA 12.6 build")
    done = box.run()
    assert done.returncode == 0, done.stderr
    assert box.calls() == [f"{base} -m venv --clear --system-site-packages {box.repo}/.venv",
                           f"{box.venv_python} -m pip install -q -e ."]


def test_torch_older_than_the_minimum_is_replaced_by_the_pinned_build(box, tmp_path):
    env_py = box.fake_python(tmp_path / "venv" / "bin" / "python", in_env=True, torch="2.5.1+cu121 CUDA 12.1 build")
    done = box.run(VIRTUAL_ENV=str(tmp_path / "venv"))
    assert done.returncode == 0, done.stderr
    assert box.calls() == [f"{env_py} {CPU_TORCH}", f"{env_py} -m pip install -q -e ."]
    assert "older than 2.11" in done.stderr


def test_the_index_url_picks_the_torch_build_and_torch_comes_first(box):
    box.fake_python(box.bin / "python3")
    url = "https://download.pytorch.org/whl/cu126"
    done = box.run(FSDP_LAB_TORCH_INDEX_URL=url)
    assert done.returncode == 0, done.stderr
    assert box.calls()[1:] == [f"{box.venv_python} -m pip install -q --index-url {url} torch==2.13.0",
                               f"{box.venv_python} -m pip install -q -e ."]


def test_without_an_nvidia_gpu_the_cpu_build_is_installed_and_named(box):
    box.fake_python(box.bin / "python3")
    done = box.run("course.sh")
    assert done.returncode == 0, done.stderr
    assert box.calls()[1] == f"{box.venv_python} {CPU_TORCH}"
    assert f"installing torch==2.13.0, the CPU build (no NVIDIA GPU found), from {CPU_INDEX}" in done.stderr
    assert "installed torch 2.13.0 (CPU build)" in done.stderr


@pytest.mark.parametrize("how", ["nvidia-smi", "proc"])
def test_with_an_nvidia_gpu_pips_default_cuda_build_is_installed(box, how):
    box.fake_python(box.bin / "python3")
    if how == "nvidia-smi":
        box.nvidia_smi("NVIDIA H200")
    else:
        (box.nvidia_proc / "gpus" / "0000:01:00.0").mkdir(parents=True)
    done = box.run("course.sh")
    assert done.returncode == 0, done.stderr
    assert box.calls()[1] == f"{box.venv_python} -m pip install -q torch==2.13.0"
    assert "pip's default build (CUDA on Linux: an NVIDIA GPU is present)" in done.stderr


def test_an_unreachable_cpu_index_falls_back_to_pips_default_and_says_so(box):
    box.fake_python(box.bin / "python3", reach=False)
    done = box.run("course.sh")
    assert done.returncode == 0, done.stderr
    assert box.calls()[1] == f"{box.venv_python} -m pip install -q torch==2.13.0"
    assert f"no NVIDIA GPU found, but the CPU index {CPU_INDEX} cannot be reached" in done.stderr


def test_a_configured_index_is_named_without_promising_a_cuda_build(box):
    """PIP_INDEX_URL may serve the CPU build (a mirror): the note names it and predicts no CUDA download; the
    build pip installed is named after the install."""
    box.fake_python(box.bin / "python3", reach=False)
    done = box.run("course.sh", PIP_INDEX_URL="https://mirror.example/whl/cpu")
    assert done.returncode == 0, done.stderr
    assert "using PIP_INDEX_URL (https://mirror.example/whl/cpu)" in done.stderr
    assert "CUDA" not in done.stderr and "installed torch 2.13.0 (CPU build)" in done.stderr


@pytest.mark.parametrize("fonts", ["", "/usr/share/fonts/noto/NotoSansCJK-Regular.ttc: Noto Sans CJK SC:style=Regular"])
def test_course_sh_names_the_font_package_when_no_chinese_font_is_installed(box, fonts):
    box.fake_python(box.bin / "python3", torch="2.13.0 CPU build")
    (box.bin / "fc-list").write_text(f"#!/bin/sh\n[ \"$1\" = :lang=zh ] && printf '%s' '{fonts}'\nexit 0\n")
    (box.bin / "fc-list").chmod(0o755)
    done = box.run("course.sh")
    assert done.returncode == 0, done.stderr
    hint = "no Chinese font found" in done.stderr and "apt-get install fonts-noto-cjk" in done.stderr
    assert hint == (not fonts), done.stderr


def test_the_real_reachability_probe_uses_a_cpu_index_that_answers(box, tmp_path):
    """The probe env.sh runs in real Python: a local HTTP server standing in for the CPU index is reachable."""
    import http.server
    import threading
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env_dir = tmp_path / "active-venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
        done = box.run("install.sh", path=f"{box.bin}:{env_dir}/bin:{SYSTEM_PATH}", VIRTUAL_ENV=str(env_dir),
                       FSDP_LAB_PIP_DRY_RUN="1", FSDP_LAB_TORCH_CPU_INDEX_URL=url)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first == f"dry run: {env_dir}/bin/python -m pip install -q --index-url {url} torch==2.13.0"


def test_no_venv_module_gives_the_one_install_command_and_fails(box):
    box.fake_python(box.bin / "python3", version="3.12", venv_ok=False)
    done = box.run()
    assert done.returncode != 0
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and line.endswith("apt-get install python3.12-venv"), line
    assert box.calls() == [] and not (box.repo / ".venv").exists()


def test_python_names_the_base_interpreter_and_too_old_ones_are_refused(box, tmp_path):
    box.fake_python(box.bin / "python3", version="3.8")
    chosen = box.fake_python(tmp_path / "opt" / "python3.12", version="3.12")
    done = box.run(PYTHON=str(chosen))
    assert done.returncode == 0, done.stderr
    assert box.calls()[0] == f"{chosen} -m venv --clear {box.repo}/.venv"
    shutil.rmtree(box.repo / ".venv")
    old = box.run()
    assert old.returncode != 0
    assert old.stderr.splitlines() == [f"error: {box.bin}/python3 is Python 3.8; fsdp-lab needs 3.10 or newer "
                                       "(set PYTHON to one)"]
    missing = box.run(PYTHON="no-such-python")
    assert missing.returncode != 0 and missing.stderr.startswith("error: cannot run 'no-such-python'")


def test_course_and_test_commands_run_with_the_chosen_python(box):
    box.fake_python(box.bin / "python3", exits={"pytest": 5})
    (box.bin / "chromium").write_text("#!/bin/sh\n")  # present, so test.sh does not reach for apt-get
    (box.bin / "chromium").chmod(0o755)
    course = box.run("course.sh", "--ip", "0.0.0.0")
    assert course.returncode == 0, course.stderr
    assert box.calls()[-1] == f"{box.venv_python} -m fsdp_lab lab --ip 0.0.0.0"
    tests = box.run("test.sh", "-k", "nothing")
    assert box.calls()[-2:] == [f"{box.venv_python} -m pip install -q -e .[test]",
                                f"{box.venv_python} -m pytest -k nothing"]
    assert tests.returncode == 1 and "pytest collected no tests" in tests.stderr  # exit 5 is a failure


def _externally_managed_system_python() -> str | None:
    """/usr/bin/python3 when it is marked externally managed (PEP 668) and can make a venv, else None."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        return None
    probe = ("import os, sysconfig; from importlib.util import find_spec; "
             "print(os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))"
             " and bool(find_spec('ensurepip')))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    return python if done.stdout.strip() == "True" else None


def test_the_real_externally_managed_system_python_gets_a_dot_venv(box):
    python = _externally_managed_system_python()
    if python is None:
        pytest.skip("no externally managed /usr/bin/python3 that can make a venv on this machine "
                    "(Debian 12 and Ubuntu 24.04 with python3-venv have one)")
    done = box.run("install.sh", "--test", path=SYSTEM_PATH, PYTHON=python, FSDP_LAB_PIP_DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    venv = box.venv_python
    lines = done.stdout.splitlines()
    assert lines and all(line.startswith(f"dry run: {venv} -m pip install -q ") for line in lines), lines
    assert lines[-1].endswith(" -e .[test]")
    prefix = subprocess.run([venv, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            timeout=60).stdout.strip()
    assert prefix == str(box.repo / ".venv")
    assert "home = /usr/bin" in (box.repo / ".venv" / "pyvenv.cfg").read_text()


def test_pins_match_pyproject_and_the_scripts_parse():
    env_sh = (REPO / "scripts" / "env.sh").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert (re.search(r'^FSDP_LAB_TORCH_MIN="([\d.]+)"', env_sh, re.M)[1]
            == re.search(r'"torch>=([\d.]+)"', pyproject)[1])
    assert (re.search(r'^FSDP_LAB_PYTHON_MIN="([\d.]+)"', env_sh, re.M)[1]
            == re.search(r'requires-python = ">=([\d.]+)"', pyproject)[1])
    for path in [*sorted((REPO / "scripts").glob("*.sh")), REPO / ".ci" / "run"]:
        done = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{path}: {done.stderr}"
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text().splitlines()
