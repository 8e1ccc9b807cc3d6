"""Every misuse gets an error that names the unit (or option) and the problem."""
from __future__ import annotations

import pytest
import torch
from ranks_features import error_cases, unit_on_one_rank_only

from fsdp_lab import FSDP
from fsdp_lab.training.launch import run_on_ranks


@pytest.fixture(scope="module")
def messages():
    return run_on_ranks(error_cases, 1, timeout_s=120)[0]


def test_weight_tied_across_two_units(messages):
    msg = messages["tied_across"]
    assert msg.startswith("ValueError") and "blocks.0" in msg and "blocks.1" in msg and "tied" in msg


def test_no_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        FSDP(torch.nn.Linear(2, 2))


def test_module_on_meta_device(messages):
    assert messages["meta_device"].startswith("ValueError") and "meta device" in messages["meta_device"]


def test_module_partly_on_meta_is_materialised_as_torch_does(messages):
    """One Linear on the CPU, one on meta: torch FSDP1 materialises the unit (to_empty + reset_parameters for each
    module with tensors of its own), and so do we; a CPU-only machine has no second real device to refuse."""
    assert messages["mixed_device"] is None, messages["mixed_device"]


def test_unknown_strategy_and_policy(messages):
    assert "unknown sharding_strategy 'HYBRID_ZERO9'" in messages["unknown_strategy"]
    assert "FULL_SHARD" in messages["unknown_strategy"]
    assert "unknown auto_wrap_policy 42" in messages["unknown_policy"]


def test_second_backward_through_freed_parameters(messages):
    msg = messages["second_backward"]
    assert msg.startswith("RuntimeError") and "second backward" in msg and "FSDP unit '" in msg


def test_a_unit_run_on_one_rank_only_names_the_unit_and_the_rule():
    """A data-dependent branch taken on rank 0 only: no hang past the process group's timeout (3 s here), and an
    error that says which unit's collective did not complete and that every rank must run the same units."""
    results = run_on_ranks(unit_on_one_rank_only, 2, timeout_s=60, collective_timeout_s=3)
    kind, is_dist_error, msg = results[0]
    assert kind == "CollectiveFailed" and is_dist_error, (kind, msg)
    assert msg.startswith("FSDP all_gather of unit 'branch' (") and "did not complete" in msg, msg
    assert "Every rank must run the same FSDP units in the same order" in msg
    assert results[1] is not None and results[1][0] == "CollectiveFailed", results[1]


def test_a_bare_class_where_a_set_of_classes_goes_is_named_with_the_fix():
    """`ModuleWrapPolicy(Block)` (isinstance takes one class, so it is an easy slip) raised "'type' object is not
    iterable" one line before the check that explains it; torch raises the same bare TypeError."""
    import functools

    from fsdp_lab.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    class Block(torch.nn.Linear):
        pass

    with pytest.raises(TypeError, match=r"ModuleWrapPolicy\(module_classes\) takes a set of classes, got the class "
                                        r"Block itself; write \{Block\}"):
        ModuleWrapPolicy(Block)
    with pytest.raises(TypeError, match=r"takes a set of nn.Module classes, got int 3"):
        ModuleWrapPolicy(3)
    with pytest.raises(ValueError, match=r"takes nn.Module subclasses, got \[<class 'int'>\]"):
        ModuleWrapPolicy({int})
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=Block)
    with pytest.raises(TypeError, match=r"transformer_auto_wrap_policy\(transformer_layer_cls\) takes a set of "
                                        r"classes, got the class Block itself; write \{Block\}"):
        policy(module=Block(2, 2), recurse=False, nonwrapped_numel=6)
    assert ModuleWrapPolicy({Block})(Block(2, 2), recurse=False)
    assert policy.func(Block(2, 2), False, 6, transformer_layer_cls={Block})
