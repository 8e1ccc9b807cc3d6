"""An FSDP2 line a notebook shows as the same as an FSDP1 line is run beside it, on 2 gloo ranks, and checked on
what the cell claims is the same (tests/fsdp2_equivalences.py lists the cells; tests/ranks_fsdp2_equivalence.py
runs the lines): torch's FSDP1 (device_id=cpu) against torch's fully_shard, and fsdp_lab's FSDP against
fsdp_lab's fully_shard, each log of fsdp_lab's read from its lifecycle trace and compared with torch's.

A log is a list of [kind, unit]: "AG" (an all-gather issued for the unit), "RS" (its gradients reduced),
"grad_out" (the gradient of the block's output is ready: its backward starts), and the script's marks."""
from __future__ import annotations

import functools
import inspect

import pytest
from ranks_fsdp2_equivalence import CASES, run_cases

from fsdp_lab.training.launch import run_on_ranks

LIBS = ("torch", "fsdp_lab")
BLOCKS = ["blocks.0", "blocks.1"]


@functools.cache
def results(lib: str) -> list:
    """All cases in one launch per lib (the ranks' start-up is most of the cost)."""
    return run_on_ranks(run_cases, 2, lib, tuple(CASES), timeout_s=240)


def case(lib: str, name: str, rank: int = 0):
    out = results(lib)[rank][name]
    assert not (isinstance(out, dict) and "error" in out and isinstance(out["error"], str)
                and "Traceback" in out["error"]), f"{lib} {name}: {out['error']}"
    return out


def split(log: list, mark: str = "forward_end"):
    i = log.index([mark, ""])
    return log[:i], log[i + 1:]


def gathers(part: list) -> list:
    return [u for k, u in part if k == "AG"]


def reductions(part: list) -> list:
    return [u for k, u in part if k == "RS"]


def prefetched(log: list) -> list:
    """Blocks whose backward all-gather was issued before their own backward started."""
    _, backward = split(log)
    return [u for k, u in backward if k == "AG" and backward.index(["AG", u]) < backward.index(["grad_out", u])]


def lifecycle(lib: str, run: str) -> list:
    return case(lib, "lifecycles")[run]["log"]


@pytest.mark.parametrize("lib", LIBS)
def test_wrap_policy_and_fully_shard_loop_run_the_same_lifecycle(lib):
    """legacy-01/02/06/07/09, fsdp2-12/19: the policy and the loop make the same units, gather them in the same
    order, keep the root gathered after forward, free the blocks, and prefetch in backward alike."""
    fsdp2 = lifecycle(lib, "fsdp2_default")
    for run in ("fsdp1_default", "fsdp1_transformer_policy", "fsdp1_full_shard"):
        assert lifecycle(lib, run) == fsdp2, (lib, run)
    forward, backward = split(fsdp2)
    assert gathers(forward) == ["<root>", *BLOCKS]
    assert gathers(backward) == BLOCKS[::-1], "blocks re-gathered in backward, the root kept"
    assert prefetched(fsdp2) == BLOCKS[::-1], "each block gathered before its backward starts"
    assert reductions(backward) == [*BLOCKS[::-1], "<root>"]
    assert len(gathers(fsdp2)) == 5  # fsdp2-10: the root once, each block twice


@pytest.mark.parametrize("lib", LIBS)
def test_backward_prefetch_none_has_no_fully_shard_equivalent(lib):
    """legacy-03: same units, not the same backward order; an empty set_modules_to_backward_prefetch list brings
    FSDP2's default back instead of turning prefetch off."""
    none, fsdp2 = lifecycle(lib, "fsdp1_no_backward_prefetch"), lifecycle(lib, "fsdp2_default")
    assert gathers(split(none)[0]) == gathers(split(fsdp2)[0])
    assert sorted(gathers(split(none)[1])) == sorted(gathers(split(fsdp2)[1]))
    assert prefetched(none) == [] and prefetched(fsdp2) == BLOCKS[::-1]
    assert lifecycle(lib, "fsdp2_empty_backward_prefetch") == fsdp2, \
        "set_modules_to_backward_prefetch([]) changed the backward order; torch's restores the default"


def test_the_quoted_torch_line_on_backward_prefetch_is_in_torch():
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    assert "default_prefetch = len(self._states_to_backward_prefetch) == 0" in inspect.getsource(_fsdp_state)


@pytest.mark.parametrize("lib", LIBS)
def test_mixed_precision_and_its_policy_cast_the_same(lib):
    """legacy-04, fsdp2-19: MixedPrecision and MixedPrecisionPolicy with the same dtypes."""
    fsdp1, fsdp2 = case(lib, "lifecycles")["fsdp1_mixed_precision"], case(lib, "lifecycles")["fsdp2_mixed_precision"]
    assert fsdp1["dtypes"] == fsdp2["dtypes"], (fsdp1["dtypes"], fsdp2["dtypes"])
    assert fsdp2["dtypes"] == {"param_in_forward": "torch.bfloat16", "output": "torch.bfloat16",
                               "reductions": ["torch.float32"], "master": ["torch.float32"],
                               "grads": ["torch.float32"]}
    assert fsdp1["log"] == fsdp2["log"] == lifecycle(lib, "fsdp2_default")


@pytest.mark.parametrize("lib", LIBS)
def test_shard_grad_op_is_reshard_after_forward_false(lib):
    """legacy-05/09/10: SHARD_GRAD_OP is reshard_after_forward=False on the blocks (no re-gather in backward);
    legacy-10's `strategy is ShardingStrategy.FULL_SHARD` line gives each strategy its FSDP1 lifecycle."""
    grad_op = lifecycle(lib, "fsdp1_shard_grad_op")
    assert grad_op == lifecycle(lib, "fsdp2_no_reshard_blocks") == lifecycle(lib, "fsdp2_legacy10_SHARD_GRAD_OP")
    assert gathers(split(grad_op)[1]) == []
    assert lifecycle(lib, "fsdp1_full_shard") == lifecycle(lib, "fsdp2_legacy10_FULL_SHARD")
    fsdp = pytest.importorskip("torch.distributed.fsdp") if lib == "torch" else __import__("fsdp_lab")
    assert inspect.signature(fsdp.fully_shard).parameters["reshard_after_forward"].default is None


@pytest.mark.parametrize("lib", LIBS)
def test_no_shard_has_no_fully_shard_form(lib):
    """legacy-05/10: fully_shard takes no sharding strategy; torch's FSDP1 warns NO_SHARD is deprecated."""
    fsdp = pytest.importorskip("torch.distributed.fsdp") if lib == "torch" else __import__("fsdp_lab")
    assert not {"sharding_strategy", "strategy"} & set(inspect.signature(fsdp.fully_shard).parameters)
    if lib == "torch":
        warned = case(lib, "no_shard")
        assert warned and warned[0].startswith("FutureWarning") and "DistributedDataParallel" in warned[0]


@pytest.mark.parametrize("lib", LIBS)
def test_linear_policy_and_modules_loop_shard_every_linear_at_any_depth(lib):
    """legacy-08: ModuleWrapPolicy({nn.Linear}) is the loop over layers.modules(); the loop over the Sequential
    itself misses a Linear nested a level down (it joins the root's group)."""
    logs = case(lib, "linear_policy")
    assert logs["flat/fsdp1"] == logs["flat/fsdp2_modules"] == logs["flat/fsdp2_children"]
    assert logs["nested/fsdp1"] == logs["nested/fsdp2_modules"]
    assert "1.1" in gathers(logs["nested/fsdp1"]) and "1.1" not in gathers(logs["nested/fsdp2_children"])


@pytest.mark.parametrize("lib", LIBS)
def test_clip_grad_norm_method_and_torch_function_agree(lib):
    """fsdp2-19: model.clip_grad_norm_ and torch.nn.utils.clip_grad_norm_ on DTensor gradients: the same global
    norm, and the same clipped norm after."""
    got = case(lib, "clip")
    assert got["fsdp1"]["norm"] == pytest.approx(got["fsdp2"]["norm"], rel=1e-6)
    assert got["fsdp1"]["after"] == pytest.approx(0.01, rel=1e-5) and got["fsdp2"]["after"] == pytest.approx(
        0.01, rel=1e-5)
    assert got["fsdp2"]["dtensor_grads"] and not got["fsdp1"]["dtensor_grads"]


@pytest.mark.parametrize("lib", LIBS)
def test_fully_shard_keeps_the_model_object_and_makes_it_an_fsdp_module(lib):
    """fsdp2-19's first row: FSDP(model) is a new wrapper object; fully_shard(model) leaves the same object, whose
    class becomes an FSDPModule."""
    got = case(lib, "clip")
    assert got["fsdp2"]["same_object"] and got["fsdp2"]["fsdp_module"]
    assert not got["fsdp1"]["same_object"] and not got["fsdp1"]["fsdp_module"]


@pytest.mark.parametrize("lib", LIBS)
def test_no_sync_and_requires_gradient_sync_accumulate_the_same(lib):
    """fsdp2-19, accum-05-00/02: no reduction in the first micro-batch, the same gathers (root once, each block
    twice per micro-batch), one reduction per unit in the last, the same accumulated gradient."""
    got = case(lib, "accumulation")
    fsdp1, fsdp2 = got["fsdp1"]["log"], got["fsdp2"]["log"]
    assert fsdp1 == fsdp2
    first, last = split(fsdp2, "micro_batch_end")
    assert reductions(first) == [] and len(gathers(first)) == len(gathers(last)) == 5
    assert reductions(last) == [*BLOCKS[::-1], "<root>"]
    assert got["fsdp1"]["norm"] == pytest.approx(got["fsdp2"]["norm"], rel=1e-6)


@pytest.mark.parametrize("lib", LIBS)
def test_reshard_after_backward_false_keeps_blocks_gathered_between_micro_batches(lib):
    """accum-05-00: set_reshard_after_backward(False): the next micro-batch's forward gathers nothing."""
    got = case(lib, "accumulation")["fsdp2_keep_gathered"]
    _, last = split(got["log"], "micro_batch_end")
    assert gathers(split(last)[0]) == []
    assert got["norm"] == pytest.approx(case(lib, "accumulation")["fsdp2"]["norm"], rel=1e-6)


def _same_rows(a: dict, b: dict) -> None:
    assert list(a) == list(b), (list(a), list(b))
    for key in a:
        assert a[key]["shape"] == b[key]["shape"], key
        assert a[key]["local"].equal(b[key]["local"]), key


@pytest.mark.parametrize("lib", LIBS)
def test_sharded_state_dict_and_fully_shard_state_dict_hold_the_same_rows(lib):
    """fsdp2-15/19: FSDP1's SHARDED_STATE_DICT and FSDP2's state_dict(): the model's keys, global shapes and this
    rank's rows on both ranks; FSDP1 all-gathers each unit for it, FSDP2 communicates nothing."""
    for rank in (0, 1):
        got = case(lib, "state_dict", rank)
        fsdp1, fsdp2 = got["fsdp1_sharded"], got["fsdp2_state_dict"]
        _same_rows(fsdp1["values"], fsdp2["values"])
        assert {v["kind"] for v in fsdp2["values"].values()} == {"DTensor"} and fsdp2["collectives"] == 0
        assert fsdp1["collectives"] == 3, "one all-gather per unit"
        if lib == "torch":
            assert {v["kind"] for v in fsdp1["values"].values()} == {"ShardedTensor"}
            assert "FutureWarning" in fsdp1["warnings"], "state_dict_type is deprecated"


@pytest.mark.parametrize("lib", LIBS)
def test_get_model_state_dict_on_both_front_ends(lib):
    """fsdp2-15/17: get_model_state_dict on an FSDP1 model is sharded (after a gather per unit) with the rows
    FSDP2's DTensors hold: ShardedTensor on torch's FSDP, DTensor on fsdp_lab's, as the cell says."""
    for rank in (0, 1):
        got = case(lib, "state_dict", rank)
        fsdp1, fsdp2 = got["fsdp1_get_model_state_dict"], got["fsdp2_get_model_state_dict"]
        _same_rows(fsdp2["values"], got["fsdp2_state_dict"]["values"])
        assert fsdp2["collectives"] == 0
        _same_rows(fsdp1["values"], fsdp2["values"])
        assert {v["kind"] for v in fsdp1["values"].values()} == {"ShardedTensor" if lib == "torch" else "DTensor"}
        assert fsdp1["collectives"] == 3


@pytest.mark.parametrize("lib", LIBS)
def test_summon_full_params_has_no_single_fully_shard_equivalent(lib):
    """fsdp2-19's last row: summon_full_params is recursive, in full precision, and writes back; full_tensor()
    is a copy; unshard() gathers only that module's group, in param_dtype, until reshard()."""
    got = case(lib, "full_params")
    every = sorted(n for n, _ in __import__("ranks_fsdp2_equivalence").fresh().named_parameters())
    assert got["summon"] == {"full": every, "dtypes": ["torch.float32"], "write_kept": True}
    assert got["full_tensor"] == {"shape": [8, 8], "dtype": "torch.float32", "write_kept": False}
    root_only = ["head.bias", "head.weight", "inp.bias", "inp.weight"]
    assert got["unshard"] == {"full": root_only, "dtypes": ["torch.bfloat16"], "still_full": root_only,
                              "after_reshard": []}


@pytest.mark.parametrize("lib", LIBS)
def test_sharded_grad_scaler_and_plain_grad_scaler_skip_together(lib):
    """939481c3: an inf in rank 1's gradient shard only; with ShardedGradScaler (FSDP1) and the plain GradScaler
    (FSDP2, DTensor gradients) both ranks skip the step and halve the scale."""
    for rank in (0, 1):
        got = case(lib, "grad_scaler", rank)
        for front in ("fsdp1", "fsdp2"):
            assert got[front]["stepped"] is False and got[front]["scale"] == 32768.0, (rank, front, got[front])
        assert got["fsdp2"]["dtensor_grads"]


@pytest.mark.parametrize("lib", LIBS)
def test_cpu_offload_and_its_policy_keep_the_state_on_the_host(lib):
    """91c9dfb4: CPUOffload(offload_params=True) and CPUOffloadPolicy(): parameters, gradients and optimizer
    state on the host, the same loss. torch's need an accelerator, so on a CPU-only machine they are skipped."""
    got = case(lib, "cpu_offload")
    if lib == "torch" and any("accelerator" in got[f].get("error", "") for f in got):
        pytest.skip(f"torch's CPU offload needs an accelerator: {got['fsdp1'].get('error')}")
    for front in ("fsdp1", "fsdp2"):
        assert "error" not in got[front], got[front]
        assert got[front]["params"] == got[front]["grads"] == got[front]["optimizer_state"] == ["cpu"]
    assert got["fsdp1"]["loss"] == pytest.approx(got["fsdp2"]["loss"], rel=1e-6)


def test_fsdp_lab_logs_match_torch():
    """fsdp_lab's trace of each line gives the log torch's front end gives: the same units, the same gathers and
    reductions in the same order, the same dtypes."""
    torch_runs, lab_runs = case("torch", "lifecycles"), case("fsdp_lab", "lifecycles")
    assert list(torch_runs) == list(lab_runs)
    for run in torch_runs:
        assert lab_runs[run]["log"] == torch_runs[run]["log"], run
        assert lab_runs[run]["dtypes"] == torch_runs[run]["dtypes"], run
        assert lab_runs[run]["loss"] == pytest.approx(torch_runs[run]["loss"], rel=1e-5, abs=1e-6), run


# -- chapter 06b: meta-device init and HSDP, each line beside its FSDP2 twin ------------------------------------------
def test_meta_init_param_init_fn_and_fully_shard_to_empty_peak_at_shards_plus_one_unit():
    """beyond-meta: FSDP(meta model, param_init_fn=...) and fully_shard on the meta model then to_empty: each rank
    peaks at its shards plus one unit (group), and a model built first exceeds that."""
    from ranks_fsdp2_beyond_node import meta_peaks

    for got in run_on_ranks(meta_peaks, 2, timeout_s=240):
        for meta, real in (("fsdp1_meta", "fsdp1_real"), ("fsdp2_meta", "fsdp2_real")):
            assert got[meta]["peak"] <= got[meta]["final"] + got[meta]["unit"] < got[real]["peak"], (meta, got)


def test_hybrid_shard_and_fully_shard_on_a_2d_mesh_shard_in_the_node_and_train_the_same():
    """beyond-hsdp: HYBRID_SHARD with device_mesh=(2, 2) and fully_shard(..., mesh=(2, 2)) on 4 ranks: the shard
    group is the node's ranks, the replicate group crosses nodes, and all four lines give the same losses."""
    from ranks_fsdp2_beyond_node import hybrid_both

    for rank, got in enumerate(run_on_ranks(hybrid_both, 4, timeout_s=300)):
        node, local = divmod(rank, 2)
        want = ([2 * node, 2 * node + 1], [local, local + 2])
        assert got["groups_fsdp1"] == want and got["groups_fsdp2"] == want, got
        ref = got["torch FSDP"]
        for name in ("fsdp_lab FSDP", "fsdp_lab fully_shard", "torch fully_shard"):
            assert got[name] == pytest.approx(ref, abs=1e-5), (name, got)
