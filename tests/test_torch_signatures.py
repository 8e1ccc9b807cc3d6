"""Every public callable of fsdp_lab's FSDP1 front end has torch's signature: names, order, kinds, defaults.

The lists come from torch itself (the public methods of torch's FullyShardedDataParallel, and torch's object of
the same name as each of fsdp_lab's public names), so a method or parameter torch adds later fails here until it
is matched or deliberately refused. Refused means: a method in fsdp_lab.runtime.fsdp1.not_provided.NOT_PROVIDED raises
NotImplementedError naming itself; an option with a non-default value raises ValueError naming it (REFUSED).
"""
from __future__ import annotations

import dataclasses
import enum
import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from ranks_signatures import REFUSED, refused_messages

import fsdp_lab
import fsdp_lab.wrap
from fsdp_lab import FSDP
from fsdp_lab.runtime.core.strategy import coerce_enum
from fsdp_lab.runtime.fsdp1.not_provided import NOT_PROVIDED
from fsdp_lab.runtime.fsdp1.state_dict import StateDictSettings
from fsdp_lab.training.launch import run_on_ranks

TorchFSDP = torch_fsdp.FullyShardedDataParallel


def _default(value):
    if isinstance(value, enum.Enum):
        return ("enum", value.name)  # our enum and torch's twin compare by member name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # our policy object and torch's twin
        return (type(value).__name__, dataclasses.astuple(value))
    return value


def parameters(fn) -> list[tuple]:
    return [(p.name, p.kind.name, _default(p.default)) for p in inspect.signature(fn).parameters.values()]


def _torch_methods() -> list[str]:
    names = [n for n, v in vars(TorchFSDP).items() if not n.startswith("_") and
             (callable(getattr(v, "__func__", v)) or isinstance(v, property))]
    return sorted(names + ["__init__", "__getattr__", "__getitem__"])


def _how(cls, name):
    raw = inspect.getattr_static(cls, name)
    return type(raw).__name__ if isinstance(raw, (staticmethod, classmethod, property)) else "method", raw


@pytest.mark.parametrize("name", _torch_methods())
def test_fsdp_method_has_torchs_signature_or_is_refused_by_name(name):
    if name in NOT_PROVIDED:
        with pytest.raises(NotImplementedError, match=f"FSDP.{name} is not provided by fsdp_lab"):
            getattr(FSDP, name)(None, None)
        return
    assert hasattr(FSDP, name), f"torch FSDP1 has {name}; fsdp_lab must have it or list it in NOT_PROVIDED"
    theirs_kind, theirs = _how(TorchFSDP, name)
    ours_kind, ours = _how(FSDP, name)
    assert ours_kind == theirs_kind, f"{name}: torch's is a {theirs_kind}, ours a {ours_kind}"
    if theirs_kind == "property":
        return
    assert parameters(getattr(FSDP, name)) == parameters(getattr(TorchFSDP, name)), name


def test_not_provided_lists_only_torch_methods():
    assert set(NOT_PROVIDED) <= set(_torch_methods())


def _public_pairs():
    pairs = [(f"fsdp_lab.{n}", getattr(fsdp_lab, n), getattr(torch_fsdp, "FullyShardedDataParallel" if n == "FSDP"
                                                              else n)) for n in fsdp_lab.__all__]
    pairs += [(f"fsdp_lab.wrap.{n}", getattr(fsdp_lab.wrap, n), getattr(torch_wrap, n)) for n in fsdp_lab.wrap.__all__]
    pairs += [("ModuleWrapPolicy.__call__", fsdp_lab.wrap.ModuleWrapPolicy.__call__,
               torch_wrap.ModuleWrapPolicy.__call__),
              ("StateDictSettings", StateDictSettings, torch_fsdp.StateDictSettings)]
    return pairs


@pytest.mark.parametrize("name,ours,theirs", _public_pairs(), ids=[p[0] for p in _public_pairs()])
def test_public_name_has_torchs_signature(name, ours, theirs):
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        for member in theirs:  # each torch member is ours, or refused naming it
            if member.name in ours.__members__:
                assert coerce_enum(member, ours, name) is ours[member.name]
            else:
                with pytest.raises(ValueError, match=member.name):
                    coerce_enum(member, ours, name)
        return
    assert parameters(ours) == parameters(theirs), name


@pytest.fixture(scope="module")
def refused():
    return run_on_ranks(refused_messages, 1, timeout_s=120)[0]


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_refused_option_raises_naming_itself(refused, option):
    message = refused[option]
    assert message is not None and message.startswith("ValueError") and option.split(".")[-1] in message, message


def test_defaults_of_refused_options_are_accepted(refused):
    assert refused["<defaults>"] is None, refused["<defaults>"]
