"""Numbers in questions come from `fsdp_lab.theory.formulas`, never from the author's head.

A question declares its givens and results in YAML and the text uses them as placeholders:

    params:   {phi: {value: 7e9, unit: billion}, n: 8}
    computed: {zero2: {fn: m_zero2, args: {phi: phi, n: n}, unit: GB}}
    prompt:   "{phi}B on {n} GPUs with ZeRO-2: GB per GPU?"   # option text: "{zero2}"

`fn` names a public function of `fsdp_lab.theory.formulas` or one of the four arithmetic helpers below (for
distractors such as "the ZeRO-2 saving" = m_zero2 − m_zero3); an argument is a number or the name of an
earlier param/computed value. Units only scale the shown number (GB = 1e9 bytes, as in the article)."""
from __future__ import annotations

import importlib
import inspect
import math
from numbers import Real
from types import MappingProxyType
from typing import Any, Callable, Mapping

UNITS: Mapping[str, float] = MappingProxyType({
    "one": 1, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
    "GiB": 2**30, "thousand": 1e3, "million": 1e6, "billion": 1e9,
})


class ComputeError(ValueError):
    """A param or computed entry that cannot be evaluated; `field` is its dotted path in the question."""

    def __init__(self, field: str, detail: str):
        self.field = field
        super().__init__(detail)


def add(a, b):
    """a + b (e.g. MiniFSDP's peak: shard + full layer)."""
    return a + b


def sub(a, b):
    """a − b (e.g. what ZeRO-3 saves over ZeRO-2)."""
    return a - b


def mul(a, b):
    """a × b (e.g. 2 bytes × Φ_layer for a bf16 working copy)."""
    return a * b


def ratio(a, b):
    """a / b, refusing b = 0 by name."""
    if b == 0:
        raise ValueError(f"ratio: divisor is 0 (a={a!r})")
    return a / b


def floordiv(a, b):
    """a // b, as MiniFSDP's `s // world_size` does."""
    if b == 0:
        raise ValueError(f"floordiv: divisor is 0 (a={a!r})")
    return a // b


HELPERS: Mapping[str, Callable] = MappingProxyType(
    {"add": add, "sub": sub, "mul": mul, "ratio": ratio, "floordiv": floordiv})


THEORY_MODULES = ("fsdp_lab.theory.formulas", "fsdp_lab.theory.planner")


def default_registry() -> dict[str, Callable]:
    """Public functions of fsdp_lab.theory.formulas and .planner plus HELPERS; a fresh dict per call (nothing
    global to go stale). If they cannot be imported the registry holds only the helpers and `registry_problem`
    says why."""
    registry = dict(HELPERS)
    for module_name in THEORY_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a half-written module must not take the quizzes without numbers down with it
            return dict(HELPERS, __problem__=f"{module_name} could not be imported: {type(exc).__name__}: {exc}")
        for name, fn in vars(module).items():
            if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__ == module_name:
                registry[name] = fn
    return registry


def format_number(x: float, digits: int | None = None) -> str:
    """At most `digits` decimals (default 2), trailing zeros cut: 38.5, 3.5, 13760, 18.375 with digits=3."""
    if float(x).is_integer():
        return str(int(x))
    text = f"{x:.{2 if digits is None else digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ComputeError(field, f"expected a finite number, got {value!r}")
    return value


def _shown(field: str, value: float, spec: Mapping) -> str:
    unit = spec.get("unit", "one")
    if unit not in UNITS:
        raise ComputeError(field + ".unit", f"unknown unit {unit!r}; expected one of: {', '.join(UNITS)}")
    return format_number(value / UNITS[unit], spec.get("digits"))


def resolve(params: Mapping, computed: Mapping, registry: Mapping[str, Callable]) -> dict[str, str]:
    """Evaluate params then computed entries in file order; return placeholder name -> shown string."""
    raw: dict[str, float] = {}
    shown: dict[str, str] = {}
    for name, spec in params.items():
        spec = spec if isinstance(spec, Mapping) else {"value": spec}
        raw[name] = _number(f"params.{name}.value", spec.get("value"))
        shown[name] = _shown(f"params.{name}", raw[name], spec)
    for name, spec in computed.items():
        field = f"computed.{name}"
        fn = registry.get(spec["fn"])
        if fn is None:
            known = ", ".join(sorted(k for k in registry if not k.startswith("__")))
            problem = registry.get("__problem__", "")
            raise ComputeError(field + ".fn", f"unknown function {spec['fn']!r} (known: {known}) {problem}".strip())
        args = {}
        for arg, value in spec.get("args", {}).items():
            if isinstance(value, str):
                if value not in raw:
                    raise ComputeError(f"{field}.args.{arg}", f"{value!r} is not a param or an earlier computed value"
                                       f" (defined so far: {', '.join(raw) or 'none'})")
                value = raw[value]
            args[arg] = value
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as exc:
            raise ComputeError(field + ".args", f"{spec['fn']}{inspect.signature(fn)}: {exc}") from None
        try:
            result = fn(**args)
        except (ValueError, ArithmeticError) as exc:
            raise ComputeError(field, f"{spec['fn']}({args}) failed: {exc}") from None
        raw[name] = _number(field, result)
        shown[name] = _shown(field, raw[name], spec)
    return shown
