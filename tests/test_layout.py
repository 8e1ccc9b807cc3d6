"""The package's shape, read from its import graph with `ast`: layers you can see from the folder list.

    runtime → (fsdp_lab/__init__, fsdp_lab/wrap: public names; fsdp_lab/user_files) → observe → checkpoint
            → theory → training → bench → lessons → workshop → commands → (fsdp_lab/cli, fsdp_lab/__main__)

A module may import its own layer and the layers before it, never a later one; `runtime` imports nothing of
fsdp_lab outside itself; no import cycle, counting imports inside functions; at most five plain modules at the
top of fsdp_lab/. Each failure names the modules involved.

The runtime has floors of its own (fsdp_lab/runtime/__init__.py says what each holds):

    core → features → fsdp1, fsdp2      (fsdp_lab/runtime/__init__: the public names, may import every floor)

core imports no other floor; features import core only; fsdp1 and fsdp2 import core and features, never each
other; no floor imports the runtime package itself, and every runtime module but the package sits in a floor.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_lab"
LAYERS = ("runtime", "<public>", "observe", "checkpoint", "theory", "training", "bench", "lessons", "workshop",
          "commands", "<entry>")
TOP_LEVEL_LAYER = {"fsdp_lab": "<public>", "fsdp_lab.wrap": "<public>", "fsdp_lab.user_files": "<public>",
                   "fsdp_lab.cli": "<entry>", "fsdp_lab.__main__": "<entry>"}
MAX_TOP_LEVEL_MODULES = 5
RUNTIME = "fsdp_lab.runtime"
FLOORS = {"core": set(), "features": {"core"}, "fsdp1": {"core", "features"}, "fsdp2": {"core", "features"}}


def module_names(root: Path) -> dict[str, Path]:
    """{dotted name: file} for every module of the package at `root` (a package's __init__ is the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports anywhere in its file (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name from pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names the deepest module that exists
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    names = module_names(root)
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def layer_of(name: str) -> str | None:
    """The layer a module belongs to, or None for a module outside every layer."""
    if name in TOP_LEVEL_LAYER:
        return TOP_LEVEL_LAYER[name]
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"{name} belongs to no layer: move it into one of {', '.join(LAYERS[::2][:1] + LAYERS[2:-1])}"
                for name in sorted(graph) if layer_of(name) is None]
    for importer, targets in sorted(graph.items()):
        here = layer_of(importer)
        for target in sorted(targets):
            there = layer_of(target)
            if here is None or there is None:
                continue
            if here == "runtime" and there != "runtime":
                problems.append(f"{importer} (runtime) imports {target}: the runtime imports nothing of fsdp_lab "
                                f"outside fsdp_lab.runtime")
            elif LAYERS.index(there) > LAYERS.index(here):
                problems.append(f"{importer} ({here}) imports {target} ({there}), a later layer")
    return problems


def floor_of(name: str) -> str | None:
    """The runtime floor of a module: core, features, fsdp1 or fsdp2; None for the runtime package itself or a
    module outside every floor."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["fsdp_lab", "runtime"] and parts[2] in FLOORS else None


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    runtime = sorted(name for name in graph if layer_of(name) == "runtime")
    problems = [f"{name} sits in no runtime floor: move it into fsdp_lab/runtime/{{{','.join(FLOORS)}}}/"
                for name in runtime if name != RUNTIME and floor_of(name) is None]
    for importer in runtime:
        here = floor_of(importer)
        if here is None:
            continue
        for target in sorted(graph[importer]):
            if target == RUNTIME:
                problems.append(f"{importer} ({here}) imports the runtime package {RUNTIME}: import the floor's "
                                f"module instead")
                continue
            there = floor_of(target)
            if there is None or there == here:
                continue
            if there not in FLOORS[here]:
                allowed = ", ".join(sorted(FLOORS[here])) or "no other floor"
                problems.append(f"{importer} ({here}) imports {target} ({there}): {here} may import {allowed}")
    return problems


def top_level_modules(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.py"))


def check(root: Path) -> list[str]:
    """Every rule broken by the package at `root`, one line each."""
    graph = import_graph(root)
    problems = [f"import cycle: {' ↔ '.join(cycle)}" for cycle in find_cycles(graph)]
    problems += layer_violations(graph)
    problems += floor_violations(graph)
    top = top_level_modules(root)
    if len(top) > MAX_TOP_LEVEL_MODULES:
        problems.append(f"{len(top)} plain modules at the top of {root.name}/ (at most {MAX_TOP_LEVEL_MODULES}): "
                        f"{', '.join(top)}")
    return problems


def test_the_package_keeps_its_layers():
    problems = check(PACKAGE)
    assert not problems, "\n".join(problems)


def test_every_layer_exists_and_the_runtime_stands_alone():
    graph = import_graph(PACKAGE)
    present = {layer_of(name) for name in graph}
    assert present == set(LAYERS), f"layers without a module: {sorted(set(LAYERS) - present)}"
    runtime = {name: targets for name, targets in graph.items() if layer_of(name) == "runtime"}
    assert len(runtime) >= 10 and all(t.startswith("fsdp_lab.runtime") for ts in runtime.values() for t in ts)


def test_every_runtime_floor_holds_its_pieces():
    graph = import_graph(PACKAGE)
    floors = {floor: {n.rpartition(".")[2] for n in graph if floor_of(n) == floor} for floor in FLOORS}
    assert {"unit", "streams", "collectives", "layout", "state", "root", "mixed_precision"} <= floors["core"], floors
    assert {"api", "flat_param", "wrap", "state_dict", "summon", "optim_state_dict"} <= floors["fsdp1"], floors
    assert {"fully_shard", "fsdp_module", "param_group", "post_forward"} <= floors["fsdp2"], floors
    assert {"offload", "hybrid", "deferred_init", "ignored", "activation_checkpointing"} <= floors["features"], floors


def test_paths_the_readme_names_keep_working():
    import fsdp_lab
    import fsdp_lab.wrap

    assert fsdp_lab.runtime.memory.memory_report is fsdp_lab.runtime.core.memory.memory_report
    assert callable(fsdp_lab.runtime.activation_checkpointing.apply_activation_checkpointing)
    assert fsdp_lab.FSDP is fsdp_lab.runtime.fsdp1.api.FSDP and callable(fsdp_lab.wrap.ModuleWrapPolicy)


@pytest.fixture
def package_copy(tmp_path) -> Path:
    copy = tmp_path / "fsdp_lab"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.json", "data"))
    assert check(copy) == []
    return copy


def test_checker_reports_a_cycle_hidden_inside_a_function(package_copy):
    summon = package_copy / "runtime" / "fsdp1" / "summon.py"
    summon.write_text(summon.read_text() + "\n\ndef _late():\n    from fsdp_lab.runtime.fsdp1.api import FSDP\n")
    problems = check(package_copy)
    assert any(p.startswith("import cycle:") and "fsdp_lab.runtime.fsdp1.api" in p
               and "fsdp_lab.runtime.fsdp1.summon" in p for p in problems), problems


def test_checker_reports_upward_imports_and_a_runtime_that_leans_on_the_course(package_copy):
    (package_copy / "theory" / "formulas.py").open("a").write("\nfrom fsdp_lab.lessons import quiz  # noqa\n")
    (package_copy / "runtime" / "core" / "unit.py").open("a").write("\nimport fsdp_lab.observe.trace  # noqa\n")
    problems = check(package_copy)
    assert any("fsdp_lab.theory.formulas (theory) imports fsdp_lab.lessons.quiz (lessons)" in p for p in problems)
    assert any("fsdp_lab.runtime.core.unit (runtime) imports fsdp_lab.observe.trace" in p for p in problems), problems


def test_checker_reports_a_floor_that_leans_on_a_floor_it_may_not(package_copy):
    runtime = package_copy / "runtime"
    (runtime / "core" / "strategy.py").open("a").write("\nimport fsdp_lab.runtime.fsdp2.post_forward  # noqa\n")
    (runtime / "fsdp1" / "partition.py").open("a").write(
        "\n\ndef _late():\n    from fsdp_lab.runtime.fsdp2 import post_forward  # noqa\n")
    (runtime / "features" / "ignored.py").open("a").write("\nfrom fsdp_lab.runtime.fsdp1 import wrap  # noqa\n")
    (runtime / "fsdp2" / "post_forward.py").open("a").write("\nimport fsdp_lab.runtime  # noqa\n")
    (runtime / "helpers.py").write_text("")
    problems = check(package_copy)
    expected = ["fsdp_lab.runtime.core.strategy (core) imports fsdp_lab.runtime.fsdp2.post_forward (fsdp2): core may "
                "import no other floor",
                "fsdp_lab.runtime.fsdp1.partition (fsdp1) imports fsdp_lab.runtime.fsdp2.post_forward (fsdp2): fsdp1 "
                "may import core, features",
                "fsdp_lab.runtime.features.ignored (features) imports fsdp_lab.runtime.fsdp1.wrap (fsdp1): features "
                "may import core",
                "fsdp_lab.runtime.fsdp2.post_forward (fsdp2) imports the runtime package fsdp_lab.runtime",
                "fsdp_lab.runtime.helpers sits in no runtime floor"]
    for line in expected:
        assert any(line in p for p in problems), (line, problems)


def test_checker_counts_top_level_modules(package_copy):
    for extra in ("helpers.py", "more_helpers.py"):
        (package_copy / extra).write_text("")
    problems = check(package_copy)
    assert any("plain modules at the top of fsdp_lab/" in p and "helpers.py" in p for p in problems), problems
