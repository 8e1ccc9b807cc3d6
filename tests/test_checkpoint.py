"""Sharded checkpoints: atomic saves, exact reload into other world sizes and strategies, full state dict, export.

One 4-rank job tells the whole story (spawning ranks is the expensive part on a 2-core machine): save at step 2
on 4 ranks, break the next save half-way, then reload step 2 on sub-groups of 2, 3 and 1 ranks under other
strategies and check the weights, AdamW's moments and the next step's loss against the 4-rank run.
"""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import FSDP, checkpoint
from fsdp_lab.checkpoint import files as files
from fsdp_lab.checkpoint import ownership, trust
from fsdp_lab.checkpoint import sharded as checkpoint_layout
from fsdp_lab.checkpoint.files import CheckpointError
from fsdp_lab.runtime.core.strategy import ShardingStrategy
from fsdp_lab.training.launch import run_on_ranks
from fsdp_lab.training.models import PRESETS, Block, batch_for_step, build_gpt, rank_slice
from fsdp_lab.wrap import ModuleWrapPolicy

REPO = Path(__file__).resolve().parents[1]
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def _model(strategy, group=None, preset="tiny"):
    model = FSDP(build_gpt(preset, seed=0), process_group=group, sharding_strategy=strategy,
                 auto_wrap_policy=ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, index, group=None):
    x, y = batch_for_step(PRESETS["tiny"], index, 12)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    loss = model(rank_slice(x, r, n), rank_slice(y, r, n))
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total.item() / n


def _full_optim_state(model, opt, name):
    """Every group's optimizer state `name`, gathered and unpadded: comparable across world sizes."""
    out = {}
    for key, _unit, group in checkpoint_layout.flats(model):
        state = opt.state[group.shard][name]
        if model.sharding_strategy is ShardingStrategy.NO_SHARD:
            full = state
        else:
            full = torch.empty(group.padded_numel)
            _all_gather(full, state.contiguous(), group=model._ctx.pg)
        out[key] = full[:group.numel].clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


class _BreakAfterWrite:
    """A DCP writer whose rank 1 fails after its own files are on disk: a save interrupted half-way."""

    def __new__(cls, path):
        from torch.distributed.checkpoint import FileSystemWriter

        class Broken(FileSystemWriter):
            def write_data(self, plan, planner):
                future = super().write_data(plan, planner)
                future.wait()
                if dist.get_rank() == 1:
                    raise OSError("simulated failure after this rank wrote its files")
                return future

        return Broken(path)


def _story(rank, world_size, tmp):
    ckdir = Path(tmp) / "ck"
    out = {}
    model, opt = _model("FULL_SHARD")
    initial = checkpoint.full_state_dict(model)
    if rank == 0:
        plain = build_gpt("tiny", seed=0).state_dict()
        out["initial_keys"] = (list(initial), list(plain))
        out["initial_equal"] = _same(initial, plain)
    else:
        out["nonzero_rank_state"] = len(initial)
    losses = [_train_step(model, opt, i) for i in range(2)]
    published = checkpoint.save(model, opt, ckdir, 2)
    saved_model = checkpoint.full_state_dict(model)
    saved_adam = _full_optim_state(model, opt, "exp_avg_sq")
    out["published"] = str(published)
    if rank == 0:
        torch.save(saved_model, Path(tmp) / "at_step2.pt")
    dist.barrier()
    saved_model = torch.load(Path(tmp) / "at_step2.pt")  # full_state_dict gave it to rank 0 only
    out["loss3_world4"] = _train_step(model, opt, 2)
    try:
        checkpoint.save(model, opt, ckdir, 3, writer_factory=_BreakAfterWrite)
        out["interrupted"] = None
    except CheckpointError as err:
        out["interrupted"] = str(err)
    if rank == 0:
        out["latest_after_failure"] = files.read_latest(ckdir).name
        out["tmp_left"] = sorted(p.name for p in files.tmp_dir(ckdir, 3).iterdir())
    # Reload step 2 (through `latest`) on other world sizes and strategies, then take the same step 3.
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (1, 2, 3), (0,))}
    phases = [{(0, 1): "FULL_SHARD", (2, 3): "ZERO1"}, {(1, 2, 3): "FULL_SHARD", (0,): "NO_SHARD"}]
    for phase in phases:
        for ranks, strategy in phase.items():
            if rank not in ranks:
                continue
            group = groups[ranks]
            fresh, fresh_opt = _model(strategy, group)
            meta = checkpoint.load(fresh, fresh_opt, ckdir)
            label = f"{len(ranks)} ranks {strategy}"
            state = checkpoint.full_state_dict(fresh)
            out[f"{label}: step"] = meta["step"]
            out[f"{label}: adam equal"] = _same(_full_optim_state(fresh, fresh_opt, "exp_avg_sq"), saved_adam)
            if dist.get_rank(group) == 0:
                out[f"{label}: weights equal"] = _same(state, saved_model)
            out[f"{label}: loss3"] = _train_step(fresh, fresh_opt, 2, group)
    if rank in (0, 1):
        small, small_opt = _model("FULL_SHARD", groups[(0, 1)], preset="small")
        try:
            checkpoint.load(small, small_opt, ckdir)
        except CheckpointError as err:
            out["wrong_model"] = str(err)
    dist.barrier()
    checkpoint.save(model, opt, ckdir, 3)  # a later save removes the half-written leftovers
    if rank == 0:
        out["latest_final"] = files.read_latest(ckdir).name
        out["leftovers"] = sorted(p.name for p in ckdir.iterdir() if p.name.startswith(".tmp"))
    out["losses"] = losses
    return out


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    return tmp, run_on_ranks(_story, 4, str(tmp), timeout_s=240, collective_timeout_s=120, threads_per_rank=1)


def test_full_state_dict_is_the_plain_models_state_dict(story):
    _tmp, results = story
    keys, plain_keys = results[0]["initial_keys"]
    assert keys == plain_keys
    assert results[0]["initial_equal"], "full_state_dict of an untrained model differs from build_gpt's weights"
    assert all(r["nonzero_rank_state"] == 0 for r in results[1:])


def test_interrupted_save_keeps_the_previous_checkpoint(story):
    tmp, results = story
    # One line per failing rank, the exception itself: not DCP's (exception, stack frames) pair.
    assert all(r["interrupted"].endswith("Cause: rank 1: OSError: simulated failure after this rank wrote its "
                                         "files") for r in results), results
    assert "still names the previous checkpoint" in results[0]["interrupted"]
    assert results[0]["latest_after_failure"] == "step_00000002"
    assert any(name.endswith(".distcp") for name in results[0]["tmp_left"]), "no file was written before the break"
    assert ".metadata" not in results[0]["tmp_left"]
    assert results[0]["latest_final"] == "step_00000003" and results[0]["leftovers"] == []
    assert not (Path(tmp) / "ck" / "latest.tmp").exists()


@pytest.mark.parametrize("label, ranks", [("2 ranks FULL_SHARD", (0, 1)), ("2 ranks ZERO1", (2, 3)),
                                          ("3 ranks FULL_SHARD", (1, 2, 3)), ("1 ranks NO_SHARD", (0,))])
def test_reload_into_another_world_size_and_strategy(story, label, ranks):
    _tmp, results = story
    first = results[ranks[0]]
    assert first[f"{label}: weights equal"], f"{label}: weights differ from the 4-rank run at step 2"
    for r in ranks:
        assert results[r][f"{label}: step"] == 2
        assert results[r][f"{label}: adam equal"], f"{label}: AdamW exp_avg_sq differs on rank {r}"
        assert results[r][f"{label}: loss3"] == pytest.approx(results[0]["loss3_world4"], rel=1e-5, abs=1e-6)


def test_wrong_model_is_refused_by_name(story):
    _tmp, results = story
    message = results[0]["wrong_model"]
    assert "does not fit this model" in message and "blocks.0/params" in message and "saved 49408" in message


def test_export_loads_into_the_plain_gpt_without_fsdp_lab(story, tmp_path):
    tmp, _results = story
    out = tmp_path / "gpt_step2.pt"
    meta = checkpoint.export_checkpoint(Path(tmp) / "ck" / "step_00000002", out)
    assert meta["step"] == 2 and meta["world_size"] == 4
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("course_gpt",
                                                      {str(REPO / "fsdp_lab" / "training" / "models.py")!r})
        models = sys.modules["course_gpt"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(models)
        gpt = models.GPT(models.GPTConfig(**{meta["model_config"]!r}))
        state = torch.load({str(out)!r}, weights_only=True)
        assert list(state) == list(gpt.state_dict()), (list(state), list(gpt.state_dict()))
        gpt.load_state_dict(state, strict=True)
        ref = torch.load({str(Path(tmp) / "at_step2.pt")!r}, weights_only=True)
        assert all(torch.equal(state[k], ref[k]) for k in ref)
        assert not [m for m in sys.modules if m.startswith("fsdp_lab")]
        print("loaded", len(state), "tensors")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "loaded 21 tensors" in done.stdout


def test_checkpoint_module_cli_reports_and_exports(story, tmp_path):
    tmp, _results = story
    from fsdp_lab.checkpoint.__main__ import _main

    assert _main(["info", str(Path(tmp) / "ck")]) == 0
    assert _main(["export", str(Path(tmp) / "nowhere"), str(tmp_path / "x.pt")]) == 4


def test_latest_pointer_and_step_dirs(tmp_path):
    assert files.read_latest(tmp_path) is None and trust.find(tmp_path) is None
    tmp = files.prepare_tmp(tmp_path, 5)
    with pytest.raises(CheckpointError, match="save did not complete"):
        files.publish(tmp_path, 5)
    (tmp / files.DCP_METADATA).write_bytes(b"x")
    final = files.publish(tmp_path, 5)
    assert final.name == "step_00000005" and files.read_latest(tmp_path) == final
    with pytest.raises(CheckpointError, match=r"already exists \(a complete checkpoint\)"):
        files.prepare_tmp(tmp_path, 5)
    (tmp_path / files.LATEST).write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        files.read_latest(tmp_path)
    (tmp_path / files.LATEST).write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="should name a step directory"):
        files.read_latest(tmp_path)
    (tmp_path / files.LATEST).write_bytes(bytes(range(128, 256)))
    with pytest.raises(CheckpointError, match="cannot be read as a step name"):
        files.read_latest(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        trust.find(tmp_path / "missing")


def test_a_failed_latest_write_leaves_no_staging_file_and_the_step_is_still_found(story, tmp_path, monkeypatch):
    """The disk fills just while `latest` is written: the step directory is already published and whole."""
    tmp, _results = story
    ck = Path(shutil.copytree(Path(tmp) / "ck", tmp_path / "ck"))
    (ck / files.LATEST).write_text("step_00000002\n")
    shutil.copytree(ck / "step_00000003", files.tmp_dir(ck, 4))
    shutil.rmtree(ck / "step_00000003")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(CheckpointError, match="step 4 is saved, complete, as .*step_00000004, but 'latest' could "
                                              "not be updated \\(No space left on device\\)"):
        files.publish(ck, 4)
    monkeypatch.undo()
    assert not (ck / "latest.tmp").exists() and (ck / files.LATEST).read_text() == "step_00000002\n"
    found = trust.find(ck)
    assert found.step_dir == ck / "step_00000004" and found.note == (
        "'latest' names step_00000002; resuming from the newest complete checkpoint, step_00000004")


def _published_copy(story, tmp_path) -> Path:
    tmp, _results = story
    return Path(shutil.copytree(Path(tmp) / "ck" / "step_00000002", tmp_path / "ck" / "step_00000002"))


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m.update(units=None), "'units' should be list, found NoneType None"),
    (lambda m: m.update(units={"a": 1}), "'units' should be list, found dict"),
    (lambda m: m["units"][0].update(numel="49408"), "units[0]: 'numel' should be int, found str '49408'"),
    (lambda m: m.update(step=True), "'step' should be int, found bool True"),
    (lambda m: m["units"][0]["slots"][0].update(shape=[1, None]), "'shape'[1] should be int, found NoneType"),
    (lambda m: m.update(checksums=[]), "'checksums' should be dict, found list"),
    (lambda m: m.pop("state_dict_order"), "'state_dict_order' is missing"),
])
def test_a_malformed_manifest_is_one_line_naming_the_field(story, tmp_path, edit, expected):
    step = _published_copy(story, tmp_path)
    meta = json.loads((step / files.META_FILE).read_text())
    edit(meta)
    (step / files.META_FILE).write_text(json.dumps(meta))
    verdict = trust.inspect(step)
    assert verdict.kind is trust.Kind.MALFORMED and expected in verdict.reason, verdict
    with pytest.raises(CheckpointError) as err:
        checkpoint.export_checkpoint(step, tmp_path / "out.pt")
    assert len(str(err.value).splitlines()) == 1 and expected in str(err.value)
    (step / files.META_FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert trust.inspect(step).kind is trust.Kind.MALFORMED


@pytest.mark.parametrize("edit", [lambda m: m.pop("checksums"), lambda m: m.update(checksums={}),
                                  lambda m: m["checksums"].pop("__1_0.distcp")], ids=["absent", "empty", "partial"])
def test_a_manifest_that_does_not_vouch_for_every_file_is_unverifiable(story, tmp_path, edit):
    step = _published_copy(story, tmp_path)
    meta = json.loads((step / files.META_FILE).read_text())
    edit(meta)
    (step / files.META_FILE).write_text(json.dumps(meta))
    assert trust.inspect(step).kind is trust.Kind.UNVERIFIED
    with pytest.raises(CheckpointError, match="is unverifiable: .*pass --allow-unverified"):
        checkpoint.export_checkpoint(step, tmp_path / "out.pt")
    assert checkpoint.export_checkpoint(step, tmp_path / "out.pt", allow_unverified=True)["step"] == 2


@pytest.mark.parametrize("out", ["latest", "step_00000002", "step_00000002/fsdp_lab.json", ".tmp-step_00000009/x",
                                 ".lock"])
def test_an_export_over_the_checkpoints_own_files_is_refused(story, tmp_path, out):
    tmp, _results = story
    ck = Path(shutil.copytree(Path(tmp) / "ck", tmp_path / "ck"))
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    for source in (ck, ck / "step_00000002"):
        with pytest.raises(CheckpointError, match="inside --resume .*write it elsewhere"):
            checkpoint.export_checkpoint(source, ck / out)
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before
    assert trust.find(ck).step_dir.name == "step_00000003"
    (tmp_path / "mine").symlink_to(ck / "step_00000002")  # a link the user names is followed; a scan skips links
    assert trust.find(tmp_path / "mine").step_dir == ck / "step_00000002"


def test_pruning_removes_only_this_runs_real_checkpoint_directories(story, tmp_path):
    tmp, _results = story
    ck = tmp_path / "ck"
    for step, run in ((1, "mine"), (2, "other"), (3, "mine"), (4, "mine"), (6, "mine")):
        target = Path(shutil.copytree(Path(tmp) / "ck" / "step_00000002", ck / files.step_dirname(step)))
        meta = json.loads((target / files.META_FILE).read_text())
        (target / files.META_FILE).write_text(json.dumps(dict(meta, step=step, run=run)))
    (ck / "step_00000000").mkdir()  # the user's own folder
    (ck / "step_00000000" / "notes.txt").write_text("mine")
    elsewhere = Path(shutil.copytree(ck / "step_00000001", tmp_path / "elsewhere"))
    (ck / "step_00000005").symlink_to(elsewhere)
    files.write_latest(ck, "step_00000003")
    chosen = ownership.prunable(ck, "mine", keep=1)
    assert [p.name for p in chosen] == ["step_00000001", "step_00000004"]  # never `latest`, nor others' or links
    for path in chosen:
        ownership.remove_checkpoint(path)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000000", "step_00000002", "step_00000003",
                                                    "step_00000005", "step_00000006"]
    assert (elsewhere / files.META_FILE).is_file() and (ck / "step_00000000" / "notes.txt").is_file()


def test_a_checkpoint_directory_is_held_by_one_run(tmp_path):
    ck = tmp_path / "ck"
    with ownership.RunLock(ck):
        with pytest.raises(CheckpointError, match=f"{ck} is in use by another run \\(pid {os.getpid()} on "):
            ownership.check_unlocked(ck)
        child = subprocess.run([sys.executable, "-c", "import sys; from fsdp_lab.checkpoint import ownership; "
                                "ownership.check_unlocked(sys.argv[1])", str(ck)], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert child.returncode == 1 and f"in use by another run (pid {os.getpid()} on" in child.stderr
    ownership.check_unlocked(ck)  # released
    with ownership.RunLock(ck):  # a run saving there keeps a run that resumes from there out, and says why
        with pytest.raises(CheckpointError, match="its pruning could remove the checkpoint this run loads"):
            ownership.RunLock(ck, reading=True).acquire()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    (ck / ownership.LOCK).write_text(f"{dead} {socket.gethostname()}\n")  # an earlier saving run, now gone
    with ownership.RunLock(ck, reading=True), ownership.RunLock(ck, reading=True):  # readers share it
        with pytest.raises(CheckpointError, match=r"in use by another run \(a run resuming from a checkpoint there"):
            ownership.check_unlocked(ck)
    assert ownership.RunLock(tmp_path / "never-saved", reading=True).acquire()  # no lock file: nothing to keep out


def test_meta_records_layout_for_the_export(story):
    tmp, _results = story
    meta = json.loads((Path(tmp) / "ck" / "step_00000002" / files.META_FILE).read_text())
    root = next(u for u in meta["units"] if u["key"] == "<root>/params")
    tied = next(s for s in root["slots"] if "lm_head.weight" in s["names"])
    assert tied["names"] == ["wte.weight", "lm_head.weight"] and tied["shape"] == [256, 64]
    assert meta["strategy"] == "FULL_SHARD" and meta["world_size"] == 4
