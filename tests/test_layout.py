"""The code layout is a contract: packages are layers, no module-level import circle, and ``Trainer.step`` reads as
the data flow.

Layers, lowest first: ``vexact_kernels`` (the folder kernels/), ``vexact.records`` (the files a run writes and
reads), ``vexact.engine``, ``vexact.rl``, ``vexact.lab``, ``vexact.real``, then ``vexact`` itself (``__init__``,
``cli``). A module may import its own package and the layers below it, never one above. Within and across layers,
the modules' module-level imports form no circle. ``Trainer.step`` -- with the Trainer methods it calls -- uses at
most six vexact modules besides the policy it trains (``engine.model``'s ``Transformer``): one per stage of the
data flow (rollout + injector, scoring/rollout records, metrics, loss, LR schedule, update).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("records", "engine", "rl", "lab", "real")  # lowest first; vexact/__init__.py and cli.py sit on top
BASE = ("registry", "metric_keys", "progress")
"""Top-level modules below every layer: the registries, metric-key constants and progress display every layer
shares. At import they import nothing of vexact (``test_the_base_modules_import_nothing_of_vexact``)."""


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
    parts = path.relative_to(ROOT).parts  # ('vexact', 'lab', 'studies', 'same_runs.py'): layer 'lab'
    own = _layer(parts[1]) if len(parts) >= 3 else len(LAYERS)
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
    # the update stage (clipping and AdamW, thread-invariant) has a module of its own: rl/optim.py
    assert modules == {"inject", "rollouts", "objective", "schedules", "metrics", "optim"}, modules


def test_pyproject_installs_every_package() -> None:
    """A wheel holds only the packages pyproject.toml lists: each package folder of vexact/ and kernels/ is there."""
    from setuptools.config.pyprojecttoml import read_configuration

    listed = set(read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"])
    folders = {".".join(("vexact_kernels" if path.parts[0] == "kernels" else path.parts[0], *path.parts[1:]))
               for init in (*(ROOT / "vexact").rglob("__init__.py"), *(ROOT / "kernels").rglob("__init__.py"))
               for path in [init.parent.relative_to(ROOT)]}
    assert listed == folders, f"not installed: {sorted(folders - listed)}; no such package: {sorted(listed - folders)}"


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


def _module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its body's, inside if/try blocks too, but not under
    ``if TYPE_CHECKING:`` and not inside functions or classes (those run later, if ever)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            todo[:0] = [*node.body, *(s for h in node.handlers for s in h.body), *node.orelse, *node.finalbody]


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the package modules it imports at module level (``from . import x``: module x where x is one, else
    the package; ``from .m import name``: m, and m.name where that is a module)."""
    files = _module_files(root, packages)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _module_level_imports(ast.parse(path.read_text())):
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
    """No module-level import circle in vexact/ and kernels/: a module that registers built-ins imports the registry,
    never the other way round (``vexact.rl.plugins.BUILTINS`` imports the built-in modules)."""
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """Counter-test: a package whose modules import each other at module level, in a ring of three (relative and
    absolute imports, one through ``from . import``), is found and named; a function-level import and an import
    under TYPE_CHECKING are not circles."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n")
    (pkg / "e.py").write_text("def f():\n    from . import d\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


SHARED_PRIVATELY = {("vexact/lab/ray_executor.py", "_run_point")}  # a Ray worker runs the sweep's own point runner
"""(file, name): the private names a vexact/lab module takes from another module, each with its reason."""


def test_lab_modules_share_helpers_by_public_names() -> None:
    """The report modules' shared helpers (loading, values, cell formats) live in modules every report imports
    (``sweep_data``, ``text_table``) under public names: no lab module borrows another's private helper."""
    borrowed = {(str(path.relative_to(ROOT)), alias.name)
                for path in (ROOT / "vexact" / "lab").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")}
    assert borrowed == SHARED_PRIVATELY, borrowed - SHARED_PRIVATELY


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
    """folder -> its modules (a package's ``__init__`` is its row), for every package folder of vexact/ and kernels/."""
    tree: dict[str, set[str]] = {}
    for folder in ("vexact", "kernels"):
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
    """design.md's layout table names every module of vexact/ and kernels/, and every name in it is a file."""
    assert _layout_differences(_layout_table(DESIGN.read_text())) == []


def test_the_map_check_sees_a_missing_and_a_stale_module() -> None:
    text = DESIGN.read_text().replace("`same_runs`, ", "").replace("`surge_plot`", "`surge_plots`")
    assert _layout_differences(_layout_table(text)) == [
        "vexact/lab/studies/same_runs.py is not in the table", "vexact/lab/studies/surge_plot.py is not in the table",
        "vexact/lab/studies/surge_plots: no such file"]


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
