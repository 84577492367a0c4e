"""The code layout is a contract: packages and top-level modules are layers, no import cycle of any kind, and
``Trainer.step`` reads as the data flow.

Layers, lowest first: ``vexact_kernels`` (the folder kernels/); the base modules every layer shares
(``registry``, ``metric_keys``, ``progress``, ``cli_base``); ``vexact.records`` (the files a run writes and reads),
``vexact.engine``, ``vexact.rl``, ``vexact.sweeps``, ``vexact.map``, ``vexact.reports``, ``vexact.real``; the
top-level modules over the real-model tools (``live``, ``testing``, ``pytest_plugin``); ``vexact.integrations``; then
``vexact`` itself (``__init__``, ``__main__``, ``cli``); on top ``vexact.lab``, the deprecated old paths. A module
may import its own layer and the layers below it, never one above, and every import counts: at module load, inside
a function, under ``if TYPE_CHECKING:``, or by name (a string that names a vexact module, as
``importlib.import_module`` takes it). Within and across layers those imports form no cycle.
``Trainer.step`` -- with the Trainer methods it calls -- uses one vexact module per stage of the data flow besides
the policy it trains (``engine.model``'s ``Transformer``): the plan and rollout, the scoring before the update, the
advantages, the loss, the LR schedule, the update, the step's metrics.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS: tuple[tuple[str, ...], ...] = (
    ("registry", "metric_keys", "progress", "cli_base", "moved", "version"),  # the base: registries, metric keys,
    # progress, exit codes, old import paths, the version
    ("records",),
    ("engine",),
    ("rl",),
    ("sweeps",),  # grids of runs: running a sweep, reading its results, their analyses, the meter
    ("map",),  # the collapse map: fits, verdicts, building it
    ("reports",),  # vexact report: a sweep's and a run's report
    ("real",),
    ("live", "testing", "pytest_plugin"),  # vexact inside other code: the live monitor, the test helpers
    ("integrations",),
    ("__init__", "__main__", "cli"),  # the package's face: its API and its command line
    ("lab",),  # old import paths of the sweeps, reports and map, kept with a DeprecationWarning: nothing imports them
)
"""Each layer's members, lowest first: a package of ``vexact`` (its folder) or a top-level module (its file's stem).
Every package and top-level module is in one (``test_every_package_and_module_has_a_layer``)."""
BASE = LAYERS[0]
"""Top-level modules below every layer: they import nothing of vexact, in any way
(``test_the_base_modules_import_nothing_of_vexact``)."""


def _layer(unit: str) -> int:
    """The layer of a package or top-level module of ``vexact`` ('rl', 'metric_keys'; the package: '__init__')."""
    return next(i for i, members in enumerate(LAYERS) if unit in members)


def _unit(name: str) -> str:
    """The layer member of a module: 'vexact.rl.tasks' -> 'rl', 'vexact.cli' -> 'cli', 'vexact' -> '__init__'."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _names_of_modules(tree: ast.Module, modules: set[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of every string constant in ``tree`` that is exactly the name of one of ``modules``: an import by
    name (``importlib.import_module``, an entry in a list of modules to load). The root packages themselves
    ('vexact', the distribution's name too) are not counted."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules
                and "." in node.value):
            yield node.lineno, node.value


def _imported_vexact_modules(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, 'vexact.pkg.module', 'vexact.pkg' or 'vexact') of every vexact import in the file (``text``, else the
    file's): anywhere in it (module level, functions, ``if TYPE_CHECKING:``), relative ones resolved, and imports by
    name."""
    parts = path.relative_to(ROOT).with_suffix("").parts  # ('vexact', 'rl', 'trainer')
    tree = ast.parse(path.read_text() if text is None else text)
    modules = set(_module_files(ROOT, {"vexact": "vexact"}))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # from a package, a name that is no module of it (``from . import __version__``) is the package's
            names = [target] if node.module else [
                f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n.removesuffix(".__init__")) for n in names if n == "vexact" or n.startswith("vexact.")]
    return found + list(_names_of_modules(tree, modules))


def _own_unit(path: Path) -> str:
    """The layer member of a file of vexact/: its package's folder, or a top-level module's stem."""
    parts = path.relative_to(ROOT / "vexact").with_suffix("").parts  # ('map', 'build'): 'map'
    return parts[0]


@pytest.mark.parametrize("path", sorted((ROOT / "vexact").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_imports_only_the_layers_below_it(path: Path) -> None:
    own = _layer(_own_unit(path))
    upward = [(line, name) for line, name in _imported_vexact_modules(path) if _layer(_unit(name)) > own]
    assert not upward, f"{path.relative_to(ROOT)} imports a higher layer: {upward}"


def test_every_package_and_module_has_a_layer() -> None:
    """No package or top-level module of vexact/ falls outside ``LAYERS`` (and so silently on top)."""
    units = {path.stem if path.parent == ROOT / "vexact" else path.relative_to(ROOT / "vexact").parts[0]
             for path in (ROOT / "vexact").rglob("*.py")}
    placed = {unit for members in LAYERS for unit in members}
    assert units == placed, f"no layer: {sorted(units - placed)}; no such module: {sorted(placed - units)}"


def test_the_layer_check_sees_every_kind_of_import() -> None:
    """Counter-test: a base module's upward imports under TYPE_CHECKING, inside a function and by name are all found
    (what ``metric_keys`` and ``rl/plugins.py`` once did, unseen by a check of module-level imports)."""
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .rl.config import RunConfig\n"
            "def f():\n    from .rl.corrections import RS_OPTIONS\n"
            "BUILTINS = ('vexact.integrations.vllm_rollout',)\n")
    found = _imported_vexact_modules(ROOT / "vexact" / "metric_keys.py", text)
    assert [name for _, name in found] == ["vexact.rl.config", "vexact.rl.corrections",
                                          "vexact.integrations.vllm_rollout"]
    assert all(_layer(_unit(name)) > _layer("metric_keys") for _, name in found)


@pytest.mark.parametrize("name", BASE)
def test_the_base_modules_import_nothing_of_vexact(name: str) -> None:
    """Anywhere in the file, in any way: ``metric_keys`` holds the rejection options its key patterns name
    (``RS_OPTIONS``) rather than reading them from ``vexact.rl.corrections`` when a key is matched."""
    path = ROOT / "vexact" / f"{name}.py"
    imported = [name for _, name in _imported_vexact_modules(path)]
    imported += [m for _, m in _imports_of(path) if m in (".", "vexact_kernels")]
    assert not imported, imported


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
    """The engine imports itself and the base modules only (an old name's shim takes ``vexact.moved``)."""
    for path in (ROOT / "vexact" / "engine").glob("*.py"):
        assert all(_unit(name) in ("engine", *BASE) for _, name in _imported_vexact_modules(path)), path.name


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


def test_trainer_step_touches_only_its_stage_modules() -> None:
    """One module per stage of the step: the plan (inject), the rollout (collect), the scoring before the update
    (scoring: anchors, lagged policy, the monitor's sample, routing), the advantages (advantages), the loss
    (objective), the learning rate (schedules), the update (optim: clipping and AdamW, thread-invariant), the
    metrics (step_metrics)."""
    modules = _trainer_step_modules()
    assert modules == {"inject", "collect", "scoring", "advantages", "objective", "schedules", "optim",
                       "step_metrics"}, modules


@pytest.mark.parametrize("path", sorted((*(ROOT / "vexact").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"))),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_imports_no_tool(path: Path) -> None:
    """tools/ is not installed: a module of the package that imported it (in any way) would fail outside a checkout."""
    text = path.read_text()
    imported = [name for _, name in _imports_of(path) if name == "tools"]
    imported += [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and re.fullmatch(r"tools(\.\w+)+", n.value)]
    assert not imported, f"{path.relative_to(ROOT)} imports tools/: {imported}"


INSTALLED_AS = {"vexact": "vexact", "kernels": "vexact_kernels", "benchmarks": "vexact_benchmarks"}
"""Folder of the checkout -> the package it is installed as (pyproject.toml's package-dir)."""


def test_pyproject_installs_every_package() -> None:
    """A wheel holds only the packages pyproject.toml lists: each package folder of vexact/, kernels/ and
    benchmarks/ (vexact bench runs them from an installed package) is there, under its installed name."""
    from setuptools.config.pyprojecttoml import read_configuration

    setuptools = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {".".join((INSTALLED_AS[path.parts[0]], *path.parts[1:]))
               for folder in INSTALLED_AS for init in (ROOT / folder).rglob("__init__.py")
               for path in [init.parent.relative_to(ROOT)]}
    assert listed == folders, f"not installed: {sorted(folders - listed)}; no such package: {sorted(listed - folders)}"
    assert {v: k for k, v in INSTALLED_AS.items()} == setuptools["package-dir"]


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_benchmark_imports_its_siblings_relatively_and_no_tool(path: Path) -> None:
    """Installed, benchmarks/ is vexact_benchmarks: an absolute ``benchmarks.`` import (or a ``-m benchmarks.X``
    string) would find no such package there, and tools/ is not installed at all."""
    imported = [(line, name) for line, name in _imports_of(path) if name in ("benchmarks", "tools")]
    named = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and re.fullmatch(r"(benchmarks|tools)(\.\w+)+", n.value)]
    assert not imported and not named, f"{path.relative_to(ROOT)}: {imported or named}"


def test_the_benchmarks_ship_the_experiments_they_run_as_one_file_each() -> None:
    """The experiments the benchmarks run (the RL step's default config, gpu_real's rl_run) ship in the package
    (package-data) as links to experiments/: the wheel copies their content, the checkout keeps one file each."""
    from setuptools.config.pyprojecttoml import read_configuration

    data = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    assert sorted(data["vexact_benchmarks"]) == ["gpu_qwen3_0_6b.yaml", "zero_mismatch.yaml"]
    for name in data["vexact_benchmarks"]:
        shipped = ROOT / "benchmarks" / name
        assert shipped.is_symlink() and shipped.resolve() == (ROOT / "experiments" / name).resolve(), name


# --------------------------------------------------------------------------- import circles
PACKAGES = {"vexact": "vexact", "vexact_kernels": "kernels"}  # import name -> folder


def _module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """'pkg.sub.module' (a package as 'pkg.sub') -> its file, for every module under the packages' folders."""
    found = {}
    for package, folder in packages.items():
        for path in (root / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(root / folder).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it is: at module level, inside if/try blocks, functions and
    classes, and under ``if TYPE_CHECKING:`` -- a cycle counts whichever kind of import closes it."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the package modules it imports, in any way (``_imports``; ``from . import x``: module x where x is
    one, else the package; ``from .m import name``: m, and m.name where that is a module) or by name (a string that
    is a module's dotted name, ``_names_of_modules``)."""
    files = _module_files(root, packages)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        targets = {module for _, module in _names_of_modules(tree, set(files))}
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in files}
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module not in files:
                continue
            submodules = {f"{module}.{a.name}" for a in node.names} & files.keys()
            targets |= submodules | ({module} if len(submodules) < len(node.names) else set())
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of modules (more than one), as one cycle through all of its
    modules' first member back to itself (a readable witness), first module alphabetically first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(_cycle(graph, set(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A shortest path within ``members`` from their first module back to it: [a, b, ..., a]."""
    start = min(members)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for succ in sorted(graph[node] & members):
            if succ == start:
                return [*paths[node], start]
            if succ not in paths:
                paths[succ] = [*paths[node], succ]
                todo.append(succ)
    raise AssertionError(f"no cycle through {sorted(members)}")


def test_no_import_circle() -> None:
    """No import cycle of any kind in vexact/ and kernels/ (at load, in a function, for types, by name): a module
    that registers built-ins imports the registry, never the other way round (``vexact.rl.BUILTINS`` names
    the built-in modules of ``vexact.rl``; a higher layer's built-ins are entry points)."""
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """Counter-test: a package whose modules import each other at module level, in a ring of three (relative and
    absolute imports, one through ``from . import``), is found and named; so are a ring closed by an import under
    TYPE_CHECKING and one inside a function, and one closed by a module's name in a string."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n")
    (pkg / "e.py").write_text("def f():\n    from . import d\n")
    (pkg / "f.py").write_text("import importlib\nMODULES = ('pkg.g',)\n")
    (pkg / "g.py").write_text("from .f import MODULES\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"],
                              ["pkg.f", "pkg.g", "pkg.f"]]


@pytest.mark.parametrize("package", ["sweeps", "map", "reports"])
def test_modules_share_helpers_by_public_names(package: str) -> None:
    """The sweep, map and report modules' shared helpers (loading, values, cell formats, the map's number checks)
    live in modules the others import (``sweep_data``, ``text_table``, ``map.points``) under public names: no module
    borrows another's private helper (the Ray executor is handed the sweep's point runner; it takes nothing from the
    sweep)."""
    borrowed = {(str(path.relative_to(ROOT)), alias.name)
                for path in (ROOT / "vexact" / package).rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")}
    assert not borrowed, borrowed


BORROWED_ACROSS_PACKAGES: set[tuple[str, str, str]] = set()
"""Private helpers one package still takes from another (each to be made public where it is defined): none now
(vllm.py took measure's ``_Loader``, ``_checkpoint_config`` and ``_require_finite``; they are public)."""


def _borrowed_across_packages() -> set[tuple[str, str, str]]:
    """(importing file, module, private name) for each ``from M import _name`` of a vexact module M of another
    package (a top-level module of ``vexact`` is in the package ``vexact``)."""
    borrowed = set()
    for path in (ROOT / "vexact").rglob("*.py"):
        where = path.relative_to(ROOT).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = (node.module or "").split(".") if node.module else []
            target = (*where[:len(where) - node.level + 1], *module) if node.level else tuple(module)
            package = target if (ROOT.joinpath(*target)).is_dir() else target[:-1]
            if target[:1] == ("vexact",) and package != where:
                borrowed |= {(str(path.relative_to(ROOT)), ".".join(target), alias.name) for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")}
    return borrowed


def test_no_package_borrows_another_packages_private_helper() -> None:
    """A helper two packages share has a public name where it is defined (verl took live's ``_from_numpy``; it
    uses ``vexact.engine.inputs.tensor_from_numpy`` now)."""
    assert _borrowed_across_packages() == BORROWED_ACROSS_PACKAGES


# --------------------------------------------------------------------------- the design page's map of the tree
DESIGN = ROOT / "docs" / "explanation" / "design.md"


def _layout_table(text: str) -> dict[str, set[str]]:
    """folder -> every name in backticks in the modules column of its rows, from the "Code layout" table."""
    table: dict[str, set[str]] = {}
    for line in text.split("## Code layout", 1)[1].splitlines():
        if not line.startswith("| `"):
            continue
        folder_cell, modules_cell, *_ = (cell.strip() for cell in line.strip().strip("|").split("|"))
        folder = re.match(r"`([^`]+/)`", folder_cell)
        assert folder, f"a layout row that names no folder: {line[:80]}"
        table.setdefault(folder.group(1), set()).update(re.findall(r"`([^`]+)`", modules_cell))
    return table


def _tree() -> dict[str, set[str]]:
    """folder -> its modules (a package's ``__init__`` is its row), for every package folder of vexact/, kernels/
    and tools/."""
    tree: dict[str, set[str]] = {}
    for folder in ("vexact", "kernels", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            modules = tree.setdefault(f"{path.parent.relative_to(ROOT)}/", set())
            if path.stem != "__init__":
                modules.add(path.stem)
    return tree


def _layout_differences(table: dict[str, set[str]]) -> list[str]:
    tree = _tree()
    found = [f"package {folder} is not in the table" for folder in sorted(tree.keys() - table.keys())]
    found += [f"{folder} is in the table but is no package" for folder in sorted(table.keys() - tree.keys())]
    for folder in sorted(tree.keys() & table.keys()):
        named = {name for name in table[folder] if "." not in name}  # a module; with a suffix, another file
        found += [f"{folder}{name}.py is not in the table" for name in sorted(tree[folder] - named)]
        found += [f"{folder}{name}: no such file" for name in sorted(table[folder])
                  if not (ROOT / folder / (name if "." in name else f"{name}.py")).is_file()]
    return found


def test_the_design_page_maps_every_module() -> None:
    """design.md's layout table names every module of vexact/, kernels/ and tools/, and every name in it is a file."""
    assert _layout_differences(_layout_table(DESIGN.read_text())) == []


def test_the_map_check_sees_a_missing_and_a_stale_module() -> None:
    text = DESIGN.read_text().replace("`same_runs`, ", "").replace("`surge_plot`", "`surge_plots`")
    assert _layout_differences(_layout_table(text)) == [
        "tools/studies/same_runs.py is not in the table", "tools/studies/surge_plot.py is not in the table",
        "tools/studies/surge_plots: no such file"]


# --------------------------------------------------------------------------- no issue letters
ISSUE_LETTER = re.compile(r"\bissues? [A-Z]\b")  # "issue O", "(issue Q)", "issues O and R"
WRITTEN = ("vexact", "kernels", "benchmarks", "docs", "tests", "README.md")


def test_no_issue_letters_in_code_or_docs() -> None:
    """Code, tests and docs cite no tracker letter ("issue O"): a reader of the repository cannot look one up, so a
    text says what the thing is (the thread-invariant backward, the length surge) instead."""
    paths = [ROOT / "README.md", *(path for folder in WRITTEN[:-1] for path in (ROOT / folder).rglob("*")
                                   if path.suffix in (".py", ".md", ".cpp", ".yaml", ".yml"))]
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}" for path in paths
             if path != Path(__file__).resolve()  # this file spells the pattern's examples
             for number, line in enumerate(path.read_text().splitlines(), 1) if ISSUE_LETTER.search(line)]
    assert not cited, "\n".join(cited)


def test_the_issue_letter_pattern() -> None:
    assert [bool(ISSUE_LETTER.search(text)) for text in
            ("(issue Q)", "issue O: threshold", "issues O and R", "issue #12", "an issue. Fix", "issue tracker")] == [
        True, True, True, False, False, False]


# --------------------------------------------------------------------------- the tests' own layout
def test_every_test_file_is_in_one_subject_folder() -> None:
    """tests/ holds conftest.py and one folder per subject; every test file lies in one of them, under a name no
    other test file has (a test module's name is its file's name: no ``__init__.py``), and no folder has a
    conftest.py or ``__init__.py`` of its own (a second ``conftest`` module would shadow ``from conftest import``)."""
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("*.py")) == ["conftest.py"]
    files = sorted(tests.glob("*/test_*.py"))
    names = [p.name for p in files]
    assert len(files) > 90 and len(set(names)) == len(names), sorted({n for n in names if names.count(n) > 1})
    stray = [p.relative_to(ROOT).as_posix() for p in tests.rglob("*.py")
             if p.name in ("conftest.py", "__init__.py") and p.parent != tests]
    assert stray == [] and not any(p.parent.parent != tests for p in tests.rglob("test_*.py")), stray


# --------------------------------------------------------------------------- type hints on public functions
def _unhinted(tree: ast.Module) -> list[str]:
    """'line name' of each public function or method in ``tree`` (no leading underscore, in a public class; dunder
    methods count) with a parameter or return that has no annotation (``__init__``'s return may go without).
    Functions nested in functions are private to them and not counted."""
    found: list[str] = []

    def visit(node: ast.AST, public_scope: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, public_scope and not child.name.startswith("_"))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
                dunder = name.startswith("__") and name.endswith("__")
                if public_scope and (dunder or not name.startswith("_")):
                    a = child.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                    if (any(p.annotation is None and p.arg not in ("self", "cls") for p in params)
                            or (child.returns is None and name != "__init__")):
                        found.append(f"{child.lineno} {name}")
            else:  # a module-level ``if``/``try`` block; a function's own functions are its private helpers
                visit(child, public_scope)

    visit(tree, True)
    return found


def test_public_functions_have_type_hints() -> None:
    """Every public function and method of vexact/ and kernels/ has type hints on its parameters and its return."""
    missing = [f"{path.relative_to(ROOT)}:{where}" for folder in ("vexact", "kernels")
               for path in sorted((ROOT / folder).rglob("*.py")) for where in _unhinted(ast.parse(path.read_text()))]
    assert missing == [], missing


def test_the_type_hint_check_sees_a_missing_hint() -> None:
    source = ("def f(x: int) -> int: ...\ndef g(x) -> int: ...\ndef h(x: int): ...\ndef _p(x): ...\n"
              "class C:\n    def __init__(self, x: int): ...\n    def m(self, *a): ...\n"
              "    def __exit__(self) -> None: ...\n"
              "class _D:\n    def m(self, x): ...\n"
              "def outer() -> None:\n    def inner(x): ...\n")
    assert _unhinted(ast.parse(source)) == ["2 g", "3 h", "7 m"]


# --------------------------------------------------------------------------- a run directory's file names
def test_a_run_directorys_files_are_named_once() -> None:
    """config.yaml, metrics.jsonl and summary.json are named by ``vexact.records``' constants: no module of vexact/,
    benchmarks/ or tools/ spells one as a string of its own (a message may still name one in its text)."""
    from vexact import records

    names = {records.CONFIG_FILE, records.METRICS_FILE, records.SUMMARY_FILE}
    own = ROOT / "vexact" / "records" / "__init__.py"
    spelled = [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}"
               for folder in ("vexact", "benchmarks", "tools") for path in sorted((ROOT / folder).rglob("*.py"))
               if path != own for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value in names]
    assert spelled == [], spelled


# --------------------------------------------------------------------------- no dead code
WORDS_IN = (".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cpp")
NAMED_IN = ("vexact", "kernels", "benchmarks", "tools", "tests", "docs", "experiments")
NAMED_AT_ROOT = ("README.md", "pyproject.toml", "mkdocs.yml")


def _named_once(defined: dict[str, list[str]]) -> list[str]:
    """Of ``defined`` (name -> where it is defined), those whose name appears exactly once in the repository's code,
    tests, docs and configuration: defined and never called, imported, documented or registered by name."""
    counts: dict[str, int] = {}
    # the repository's own files only: runs/, site/ and caches are outputs (written by tests running beside this one)
    paths = [ROOT / name for name in NAMED_AT_ROOT]
    paths += [path for folder in NAMED_IN for path in (ROOT / folder).rglob("*")]
    for path in paths:
        if path.suffix in WORDS_IN and path.is_file():
            for word in re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")):
                if word in defined:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(where for name, places in defined.items() if counts.get(name, 0) <= 1 for where in places)


def _definitions(tree: ast.Module, where: str) -> dict[str, list[str]]:
    """name -> ['where:line'] of the module's functions, classes, methods and module-level names. A function with a
    decorator (other than staticmethod / classmethod / property) is left out: the decorator registers it (a run
    check, a config section), so it is used without its name being written again; so are dunder names."""
    found: dict[str, list[str]] = {}

    def add(name: str, line: int) -> None:
        if not (name.startswith("__") and name.endswith("__")):
            found.setdefault(name, []).append(f"{where}:{line} {name}")

    def registered(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
        return any(not (isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod", "property"))
                   for d in node.decorator_list)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not registered(node):
            add(node.name, node.lineno)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not registered(member):
                    add(member.name, member.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        for target in targets:
            if isinstance(target, ast.Name):
                add(target.id, node.lineno)
    return found


def test_no_definition_is_named_only_where_it_is_defined() -> None:
    """Every function, class, method and module-level name of vexact/, kernels/, benchmarks/ and tools/ is named
    somewhere besides its definition (a caller, an import, a test, a doc page, pyproject's entry points): one that is
    not is dead code, left behind when its callers moved."""
    defined: dict[str, list[str]] = {}
    for folder in ("vexact", "kernels", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, places in _definitions(ast.parse(path.read_text()), str(path.relative_to(ROOT))).items():
                defined.setdefault(name, []).extend(places)
    assert _named_once(defined) == []


def test_the_dead_code_check_sees_a_definition_nothing_names() -> None:
    source = ("X_NEVER_NAMED_ELSEWHERE_1 = 1\ndef f_never_named_elsewhere_2(): ...\n"
              "@register\ndef registered_never_named_elsewhere_3(): ...\n"
              "class C_never_named_elsewhere_4:\n    @staticmethod\n    def m_never_named_elsewhere_5(): ...\n")
    defined = _definitions(ast.parse(source), "m.py")
    assert sorted(defined) == ["C_never_named_elsewhere_4", "X_NEVER_NAMED_ELSEWHERE_1",
                               "f_never_named_elsewhere_2", "m_never_named_elsewhere_5"]
    assert _named_once({"_definitions": ["here"], "zz_nowhere_at_all": ["there"]}) == ["there"]
