"""The workshop's pieces that need no hub and no root: GPU shares, the class list, the refusals, the pins, the
fresh chapter copy and what the class view counts in a saved notebook."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lab.lessons.student_copy import INSTRUCTOR_NOTEBOOKS, student_notebook, write_fresh_copy
from fsdp_lab.workshop import accounts, install, shares
from fsdp_lab.workshop.class_state import notebook_facts
from fsdp_lab.workshop.hub_config import Settings, environment_for

ROOT = Path(__file__).resolve().parent.parent


def test_shares_are_disjoint_slots_in_class_order():
    got = shares.assign(["a", "b", "c"], shares.parse_devices("0,1,2,3,4,5,6,7"), per_learner=2)
    assert [got[n].cuda_visible_devices for n in "abc"] == ["0,1", "2,3", "4,5"]
    seen = [d for s in got.values() for d in s.devices]
    assert len(seen) == len(set(seen))


def test_more_learners_than_shares_is_refused_unless_the_rest_get_cpu_ranks():
    with pytest.raises(shares.TooFewShares, match=r"3 learners but only 1 GPU share\(s\) \(3 GPU\(s\), 2 per "
                                                  r"learner\); pass --cpu-for-rest"):
        shares.assign(["a", "b", "c"], ["0", "1", "2"], per_learner=2)
    got = shares.assign(["a", "b", "c"], ["0", "1", "2"], per_learner=2, cpu_for_rest=True)
    assert [got[n].cuda_visible_devices for n in "abc"] == ["0,1", "", ""]
    assert all(s.cuda_visible_devices == "" for s in shares.assign(["a", "b"], []).values())  # no GPU here
    with pytest.raises(ValueError, match="device\\(s\\) 1 more than once"):
        shares.parse_devices("0,1,1")


def test_the_spawner_environment_carries_the_share():
    s = Settings(ip="127.0.0.1", port=1, hub_port=2, proxy_api_port=3, class_view_port=4, state_dir="/x",
                 proxy_path="/p", learners=["a", "b"], instructors=["t"], shares={"a": "0", "b": "1"},
                 learner_python="/py", pythonpath="/repo")
    assert environment_for(s, "b")["CUDA_VISIBLE_DEVICES"] == "1" and environment_for(s, "t")["CUDA_VISIBLE_DEVICES"] == ""


def test_the_class_list_refuses_what_useradd_or_the_hub_cannot_take():
    assert accounts.parse_class_list("# class\nalice\n\nbob  # late\n") == ["alice", "bob"]
    for text, message in (("Alice\n", "line 1: 'Alice' is not a usable Unix user name"),
                          ("bob\nbob\n", "line 2: bob is listed twice"),
                          ("root\n", "root cannot be a learner")):
        with pytest.raises(ValueError, match=re.escape(message)):
            accounts.parse_class_list(text)


def _workshop(*args, tmp_path):
    (tmp_path / "class.txt").write_text("alice\nbob\n")
    return subprocess.run([sys.executable, "-m", "fsdp_lab", "workshop", str(tmp_path / "class.txt"),
                           "--instructor", "teach", "--state-dir", str(tmp_path / "state"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_limits_the_spawner_cannot_enforce_are_refused_by_name(tmp_path):
    done = _workshop("--mem-limit", "4G", tmp_path=tmp_path)
    assert done.returncode == 2 and "--mem-limit is not supported: JupyterHub's LocalProcessSpawner" in done.stderr


def test_a_dry_run_writes_the_settings_and_says_each_share(tmp_path):
    done = _workshop("--dry-run", "--gpus", "0,1", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "alice: CUDA_VISIBLE_DEVICES='0'" in done.stderr and "bob: CUDA_VISIBLE_DEVICES='1'" in done.stderr
    settings = json.loads((tmp_path / "state" / "workshop.json").read_text())
    assert settings["ip"] == "127.0.0.1" and settings["instructors"] == ["teach"]
    refused = _workshop("--dry-run", "--gpus", "0", tmp_path=tmp_path)
    assert refused.returncode == 2 and "2 learners but only 1 GPU share(s)" in refused.stderr


def test_the_pins_agree_with_pyproject_and_the_scripts():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in install.PIP_PINS:
        assert pyproject.count(f'"{pin}"') == 2, pin  # the workshop extra and the test extra
    assert f'FSDP_LAB_PROXY_PIN="{install.PROXY_PIN}"' in (ROOT / "scripts" / "env.sh").read_text()


def test_a_pushed_chapter_lands_beside_the_learners_work_never_over_it(tmp_path):
    source = sorted(INSTRUCTOR_NOTEBOOKS.glob("03-*.ipynb"))[0]
    first = write_fresh_copy(source, tmp_path, "T1")
    assert first == tmp_path / source.name
    first.write_text("my work")
    second = write_fresh_copy(source, tmp_path, "T2")
    assert second.name == f"{source.stem}.fresh-T2.ipynb" and first.read_text() == "my work"
    with pytest.raises(FileExistsError):
        write_fresh_copy(source, tmp_path, "T2")


def test_the_class_view_counts_only_cells_the_learner_ran(tmp_path):
    source = sorted(INSTRUCTOR_NOTEBOOKS.glob("03-*.ipynb"))[0]
    nb = student_notebook(json.loads(source.read_text()), source.name)
    fresh = {c.get("id"): c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code"}
    path = tmp_path / source.name
    path.write_text(json.dumps(nb))
    assert notebook_facts(path, fresh) == (False, 0)  # as given: solved outputs do not count
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["execution_count"] = 999
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ok: the shards add up\n", "x\n"]}]
    path.write_text(json.dumps(nb))
    assert notebook_facts(path, fresh) == (True, 1)
