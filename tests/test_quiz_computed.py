"""Templated numbers: evaluated by calling registered functions, never by evaluating YAML text."""
import pytest

from fsdp_lab.lessons.quiz.computed import ComputeError, default_registry, format_number, resolve
from fsdp_lab.theory import formulas


def test_registry_is_formulas_plus_helpers_and_fresh_each_time():
    reg = default_registry()
    assert reg["m_zero2"] is formulas.m_zero2 and reg["n_min"] is formulas.n_min
    assert {"add", "sub", "mul", "ratio", "floordiv"} <= set(reg)
    assert not any(name.startswith("_") for name in reg)
    reg["m_zero2"] = None
    assert default_registry()["m_zero2"] is formulas.m_zero2  # nothing global to go stale


def test_resolve_params_then_computed_in_order():
    shown = resolve({"phi": {"value": 7e9, "unit": "billion"}, "n": 8, "gpu": {"value": 80e9, "unit": "GB"}},
                    {"z2": {"fn": "m_zero2", "args": {"phi": "phi", "n": "n"}, "unit": "GB"},
                     "z3": {"fn": "m_zero3", "args": {"phi": "phi", "n": "n"}, "unit": "GB"},
                     "saving": {"fn": "sub", "args": {"a": "z2", "b": "z3"}, "unit": "GB"},
                     "need": {"fn": "n_min", "args": {"phi": "phi", "gpu_mem_bytes": "gpu"}},
                     "bytes": {"fn": "m_param", "args": {"phi": "phi", "n": "n"}}},
                    default_registry())
    assert shown == {"phi": "7", "n": "8", "gpu": "80", "z2": "38.5", "z3": "14", "saving": "24.5", "need": "2",
                     "bytes": "3500000000"}


def test_a_fake_registry_can_stand_in():
    assert resolve({}, {"x": {"fn": "twice", "args": {"v": 4}}}, {"twice": lambda v: 2 * v}) == {"x": "8"}


@pytest.mark.parametrize("computed, field, words", [
    ({"x": {"fn": "nope", "args": {}}}, "computed.x.fn", "unknown function 'nope'"),
    ({"x": {"fn": "m_zero2", "args": {"phi": 7e9}}}, "computed.x.args", "missing a required argument: 'n'"),
    ({"x": {"fn": "m_zero2", "args": {"phi": "psi", "n": 8}}}, "computed.x.args.phi", "'psi' is not a param"),
    ({"x": {"fn": "m_zero2", "args": {"phi": -1, "n": 8}}}, "computed.x", "phi must be a positive number"),
    ({"x": {"fn": "ratio", "args": {"a": 1, "b": 0}}}, "computed.x", "divisor is 0"),
    ({"x": {"fn": "llama_like_shape", "args": {"phi": 7e9}}}, "computed.x", "expected a finite number"),
    ({"x": {"fn": "m_ddp", "args": {"phi": 7e9}, "unit": "parsecs"}}, "computed.x.unit", "unknown unit 'parsecs'"),
])
def test_errors_name_the_field(computed, field, words):
    with pytest.raises(ComputeError) as info:
        resolve({}, computed, default_registry())
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_yaml_text_is_never_evaluated():
    # an expression in an argument is just an unknown name, not code
    with pytest.raises(ComputeError, match="is not a param"):
        resolve({}, {"x": {"fn": "m_ddp", "args": {"phi": "__import__('os').getcwd()"}}}, default_registry())


@pytest.mark.parametrize("value, digits, text", [
    (38.5, None, "38.5"), (14.0, None, "14"), (196.875, None, "196.88"), (196.875, 3, "196.875"),
    (13760, None, "13760"), (1.0 / 3, None, "0.33"), (0.875, 3, "0.875"), (2.0, 0, "2"),
])
def test_format_number(value, digits, text):
    assert format_number(value, digits) == text
