"""The code layout is a contract: packages are layers, and ``Trainer.step`` reads as the data flow.

Layers, lowest first: ``vexact_kernels`` (the folder kernels/), ``vexact.engine``, ``vexact.rl``, ``vexact.lab``,
``vexact.real``, then ``vexact`` itself (``__init__``, ``cli``). A module may import its own package and the
layers below it, never one above. ``Trainer.step`` -- with the Trainer methods it calls -- uses at most six
vexact modules besides the policy it trains (``engine.model``'s ``Transformer``): one per stage of the data flow
(rollout + injector, scoring/rollout records, metrics, loss, LR schedule, update).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "rl", "lab", "real")  # lowest first; vexact/__init__.py and cli.py sit on top
BASE = ("registry", "metric_keys")
"""Top-level modules below every layer: the registries and metric-key constants every layer shares. At import they
import nothing of vexact (``test_the_base_modules_import_nothing_of_vexact``)."""


def _layer(package: str) -> int:
    if package in BASE:
        return -1
    return LAYERS.index(package) if package in LAYERS else len(LAYERS)


def _imported_vexact_modules(path: Path) -> list[tuple[int, str]]:
    """(line, 'pkg.module' or 'pkg') of every vexact import in the file, relative ones resolved."""
    parts = path.relative_to(ROOT).with_suffix("").parts  # ('vexact', 'rl', 'trainer')
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n.removeprefix("vexact.")) for n in names if n.startswith("vexact.")]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "vexact").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_imports_only_the_layers_below_it(path: Path) -> None:
    parts = path.relative_to(ROOT).parts
    own = _layer(parts[1]) if len(parts) == 3 else len(LAYERS)
    upward = [(line, name) for line, name in _imported_vexact_modules(path) if _layer(name.split(".")[0]) > own]
    assert not upward, f"{path.relative_to(ROOT)} imports a higher layer: {upward}"


@pytest.mark.parametrize("name", BASE)
def test_the_base_modules_import_nothing_of_vexact(name: str) -> None:
    """At module level: ``metric_keys`` reads ``corrections.RS_OPTIONS`` inside a function, when a key is matched."""
    tree = ast.parse((ROOT / "vexact" / f"{name}.py").read_text())
    imported = ["." if node.level else node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
    assert not [m for m in imported if m == "." or m.split(".")[0] in ("vexact", "vexact_kernels")], imported


def _imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file; relative ones as '.'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." if node.level else (node.module or "").split(".")[0]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_kernels_are_the_lowest_layer(path: Path) -> None:
    """kernels/ (importable as ``vexact_kernels``) imports no vexact module, and itself only as ``vexact_kernels``
    or relatively: it is the layer every other one builds on."""
    bad = [(line, name) for line, name in _imports_of(path) if name in ("vexact", "kernels")]
    assert not bad, f"{path.relative_to(ROOT)} imports above its layer (or itself as 'kernels'): {bad}"


def test_the_kernel_layer_check_fails_on_an_upward_import(tmp_path: Path) -> None:
    upward = tmp_path / "bad.py"
    upward.write_text("from vexact.engine.model import Transformer\nimport kernels.native\n")
    assert [name for _, name in _imports_of(upward)] == ["vexact", "kernels"]


def test_the_engine_knows_nothing_of_rl() -> None:
    for path in (ROOT / "vexact" / "engine").glob("*.py"):
        assert all(name.startswith("engine") for _, name in _imported_vexact_modules(path)), path.name


def _trainer_step_modules() -> set[str]:
    """The vexact modules ``Trainer.step`` uses: names it (or a Trainer method it calls, recursively) takes from
    an import, and the modules of the objects ``self.x`` whose methods or attributes it uses (``self.x.y``; the
    module is that of the call that built ``self.x`` in ``__init__``). Passing ``self.x`` along is not a use."""
    tree = ast.parse((ROOT / "vexact" / "rl" / "trainer.py").read_text())
    origin = {}  # imported name -> module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            for alias in node.names:
                origin[alias.asname or alias.name] = (node.module or "").split(".")[-1]
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {f.name: f for f in trainer.body if isinstance(f, ast.FunctionDef)}
    attribute_module = {}  # self.x -> module of the callable that built it in __init__
    for node in ast.walk(methods["__init__"]):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else (
                func.id if isinstance(func, ast.Name) else None)
            for target in node.targets:
                if isinstance(target, ast.Attribute) and name in origin:
                    attribute_module[target.attr] = origin[name]
    modules, seen, todo = set(), set(), ["step"]
    while todo:
        method = todo.pop()
        if method in seen:
            continue
        seen.add(method)
        for node in ast.walk(methods[method]):
            if isinstance(node, ast.Name) and node.id in origin:
                modules.add(origin[node.id])
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in methods:
                    todo.append(node.attr)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and node.value.attr in attribute_module):
                modules.add(attribute_module[node.value.attr])
    # the policy being trained (its weights are the Trainer's own state); the base modules' names (metric-key
    # constants) are data every stage shares, not a stage
    return modules - {"model"} - set(BASE)


def test_trainer_step_touches_at_most_six_modules() -> None:
    modules = _trainer_step_modules()
    # the update stage (clipping and AdamW, thread-invariant) has its own module since issue Q: rl/optim.py
    assert modules == {"inject", "rollouts", "objective", "schedules", "metrics", "optim"}, modules
