"""scripts/record_gpu_traces.py in its CPU smoke mode, its refusals, and the CUDA memory snapshot helper."""
from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_lab.observe import trace
from fsdp_lab.observe.cuda_memory import cuda_unavailable_reason, record_memory_snapshot

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "record_gpu_traces.py"
NO_CUDA = cuda_unavailable_reason()


def load_script():
    spec = importlib.util.spec_from_file_location("record_gpu_traces", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_cpu_smoke_run_writes_traces_with_provenance(tmp_path, monkeypatch):
    out = tmp_path / "traces"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote 2 runs" in proc.stdout, proc.stdout
    index = json.loads((out / "index.json").read_text())
    assert [r["world_size"] for r in index["runs"]] == [1, 2]
    for run in index["runs"]:
        folder = out / run["folder"]
        prov = json.loads((folder / "provenance.json").read_text())
        for key in ("gpu", "torch", "cuda", "date_utc", "command", "model", "backend", "summary"):
            assert key in prov, key
        assert prov["torch"] == torch.__version__ and prov["smoke"] is True and prov["gpu"] is None
        assert "--smoke" in prov["command"] and "not GPU data" in prov["what"]
        assert sorted(p.name for p in folder.glob("rank*.jsonl")) == [f"rank{r}.jsonl" for r in
                                                                      range(run["world_size"])]
        events = trace.load_trace(folder)
        names = {e["event"] for e in events}
        assert {"gather_end", "free", "reduce_scatter", "optimizer_step"} <= names, names
        per_rank = prov["summary"]["per_rank"]
        assert len(per_rank) == run["world_size"]
        assert all(len(r["losses"]) == 1 for r in per_rank)
        sent = per_rank[0]["bytes_sent_per_step"]["0"]
        assert (sent == 0) == (run["world_size"] == 1), sent
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert total < load_script().MAX_TOTAL_BYTES, total
    # What the recorder writes is what the course's widgets replay, with its provenance on screen.
    from fsdp_lab.lessons.widgets import LiveMemoryChart, PotluckLifecycle, sources

    monkeypatch.setattr(sources, "GPU_TRACE_DIR", out)
    assert sorted(sources.list_gpu_traces()) == sorted(r["folder"] for r in index["runs"])
    for run in index["runs"]:
        potluck = PotluckLifecycle.from_gpu_trace(run["folder"])
        assert len(potluck.events) == len(trace.load_trace(out / run["folder"])) > 0
        assert run["folder"] in potluck.source.value
        assert LiveMemoryChart.replay(run["folder"]).steps_done >= 1


def test_cpu_or_smoke_runs_may_not_write_to_the_shipped_data_folder():
    module = load_script()
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--device", "cpu"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        module.parse_args(["--smoke"])
    with pytest.raises(SystemExit):
        module.parse_args(["--device", "cpu", "--out", "x", "--world-sizes", "3"])  # 3 does not divide 4


@pytest.mark.skipif(NO_CUDA is None, reason="CUDA is available: the refusal path does not apply")
def test_cuda_run_without_cuda_refuses_with_the_reason(tmp_path, capsys):
    assert load_script().main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert NO_CUDA in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing may be written when there is no GPU"


@pytest.mark.skipif(NO_CUDA is None, reason="CUDA is available")
def test_snapshot_without_cuda_names_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with record_memory_snapshot(tmp_path / "s.pickle"):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=f"needs CUDA: {NO_CUDA}")
def test_snapshot_on_cuda_records_allocations(tmp_path):
    path = tmp_path / "snap.pickle"
    with record_memory_snapshot(path, max_entries=1000) as snap:
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert snap.file_bytes == path.stat().st_size > 0
    assert snap.peak_allocated >= 64 * 2**20
    data = pickle.loads(path.read_bytes())
    assert "segments" in data and "device_traces" in data
    sizes = [t.get("size", 0) for dev in data["device_traces"] for t in dev if t.get("action") == "alloc"]
    assert 64 * 2**20 in sizes, sorted(sizes)[-5:]
