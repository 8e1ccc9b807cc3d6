"""torch 2.13's FSDPModule methods on fsdp_lab's fully_shard, each against torch's own on gloo ranks
(tests/ranks_fsdp_module_methods.py), and the method list itself against torch's: every public method torch's
FSDPModule has, ours has, with torch's signature."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
from ranks_fsdp_module_methods import CASES_2, run_cases

from fsdp_lab.training.launch import run_on_ranks

TOL = 1e-6


@functools.cache
def results(lib: str, world_size: int) -> list:
    names = CASES_2 if world_size == 2 else ("hsdp",)
    return run_on_ranks(run_cases, world_size, lib, names, timeout_s=400)


def case(name: str, world_size: int = 2):
    return [r[name] for r in results("torch", world_size)], [r[name] for r in results("fsdp_lab", world_size)]


def grad_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    assert [k for k in a if a[k] is None] == [k for k in b if b[k] is None], "different parameters have no grad"
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k] is not None)


def test_every_torch_fsdp_module_method_is_there_with_torchs_signature():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fsdp_lab import FSDPModule

    public = [n for n, v in vars(TorchFSDPModule).items() if callable(v) and not n.startswith("_")]
    assert len(public) >= 20, public
    missing = [n for n in public if not hasattr(FSDPModule, n)]
    assert not missing, f"FSDPModule lacks {missing}"
    differ = {n: (_params(getattr(TorchFSDPModule, n)), _params(getattr(FSDPModule, n))) for n in public}
    differ = {n: pair for n, pair in differ.items() if pair[0] != pair[1]}
    assert not differ, differ


def _params(fn) -> list:
    """Names, kinds and defaults: what a caller can tell apart (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_force_sum_and_divide_factor_match_torch():
    refs, gots = case("divide")
    for ref, got in zip(refs, gots):
        assert grad_diff(ref["force_sum"], got["force_sum"]) <= TOL
    for got in gots:  # a factor of 4 on 2 ranks: half the mean
        default, factor = got["default"], got["factor"]
        assert max((factor[k] * 2 - default[k]).abs().max().item() for k in default) <= TOL


def test_all_reduce_hook_sees_each_reduced_gradient_like_torch():
    refs, gots = case("hook")
    for ref, got in zip(refs, gots):
        assert got["hook_calls"] == ref["hook_calls"] > 0
        assert got["hook_numel"] == ref["hook_numel"]
        assert grad_diff(ref["grads"], got["grads"]) <= TOL


def test_unused_parameters_reduce_zeros_like_torch():
    refs, gots = case("unused")
    for ref, got in zip(refs, gots):
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert grad_diff(ref["grads"], got["grads"]) <= TOL
        assert got["grads"]["tower.proj.weight"] is not None
        assert got["grads"]["tower.proj.weight"].abs().max().item() == 0.0


def test_unshard_in_backward_false_skips_the_embeddings_regather():
    refs, gots = case("unshard_in_backward")
    for ref, got in zip(refs, gots):
        assert got["gathers_on"] - got["gathers_off"] == ref["gathers_on"] - ref["gathers_off"] == 1
        assert grad_diff(got["grads_on"], got["grads_off"]) <= TOL
        assert grad_diff(ref["grads_off"], got["grads_off"]) <= TOL


def test_custom_collectives_run_where_torchs_do():
    refs, gots = case("custom")
    for ref, got in zip(refs, gots):
        assert got["gather_calls"] == ref["gather_calls"] > 0
        assert got["scatter_calls"] == ref["scatter_calls"] > 0
        assert got["scatter_allocations"] == ref["scatter_allocations"]
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert grad_diff(ref["grads"], got["grads"]) <= TOL


def test_separate_reduce_scatter_group():
    refs, gots = case("separate")
    for ref, got in zip(refs, gots):
        assert grad_diff(ref["grads"], got["grads"]) <= TOL
        assert got["own_groups"] == 1 and not got["shares_shard_group"]


def test_reset_iter_state_after_a_failed_forward_trains_like_torch():
    refs, gots = case("reset")
    for ref, got in zip(refs, gots):
        assert ref["raised"] and got["raised"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert max((ref["params"][k] - got["params"][k]).abs().max().item() for k in ref["params"]) <= 1e-5
        assert got["non_root"] == ref["non_root"] == "reset_iter_state must be called on the root FSDP module"


def test_bad_arguments_raise_what_torch_raises():
    refs, gots = case("errors")
    assert gots[0] == refs[0]
    assert gots[0]["True"][0] == "TypeError" and gots[0]["0"][0] == "ValueError"
    assert gots[0]["deprecation"] and all(c == "DeprecationWarning" for c, _m in gots[0]["deprecation"])


def test_hsdp_requires_all_reduce_false_keeps_the_sum_until_the_next_backward():
    refs, gots = case("hsdp", 4)
    for ref, got in zip(refs, gots):
        assert got["stream_error"] == ref["stream_error"] == "stream cannot be set when using native HSDP"
        assert got["none_after_first"] == ref["none_after_first"]
        assert all(got["none_after_first"].values())
        assert grad_diff(ref["grads"], got["grads"]) <= TOL


def test_nccl_only_methods_are_refused_by_name():
    from fsdp_lab.runtime.fsdp2.fsdp_module import FSDPModule

    for method, args in (("set_allocate_memory_from_process_group_for_comm", (True,)),
                         ("set_symm_mem_for_comm", ())):
        with pytest.raises(NotImplementedError, match=method):
            getattr(FSDPModule, method)(object(), *args)


def test_post_optim_event_replaces_the_gather_streams_wait_once():
    """On a stand-in CUDA (tests/ranks_overlap.FakeCuda): the root's next forward makes the gather stream wait
    for the user's event instead of for the whole compute stream, and the one after waits for compute again."""
    results = run_on_ranks(_post_optim_event_rank, 1, timeout_s=120)
    first, second = results[0]
    assert first == [("wait_event", "gather", "mine")]
    assert second == [("wait_stream", "gather", "compute")]


def _post_optim_event_rank(rank, world_size):
    from ranks_fsdp_module_methods import build, step
    from ranks_overlap import FakeCuda

    from fsdp_lab.runtime.core.streams import CommStreams

    model = build("fsdp_lab", world_size)
    step(model, rank, world_size, 0)
    log = []
    fake = FakeCuda(log)
    model.__dict__["_fsdp_lab_state"].ctx.use_streams(CommStreams(torch.device("cpu"), cuda=fake))

    class Event:
        def wait(self, stream):
            log.append({"kind": "wait_event", "stream": stream.label, "of": "mine"})

    waits = []
    for event in (Event(), None):
        if event is not None:
            model.set_post_optim_event(event)
        del log[:]
        step(model, rank, world_size, 1)
        first_wait = next(e for e in log if e["kind"] in ("wait_event", "wait_stream") and e.get("stream") == "gather")
        waits.append([(first_wait["kind"], "gather", first_wait.get("of") or first_wait.get("on"))])
    return waits
