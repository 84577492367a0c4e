"""The map, sweeps and reports moved out of ``vexact.lab`` (into ``vexact.map``, ``vexact.sweeps``,
``vexact.reports``); the old import paths and ``python -m vexact.lab.scaling`` keep working, each with a
DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest

from vexact.lab import MOVED
from vexact.map import build, fit, naming, verdict


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """Import an old path as a first import would: the module and its parent's attribute forgotten (restored after),
    so its warning is raised again."""

    def importer(name: str):
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(sys.modules["vexact.lab"], name.rsplit(".", 1)[1], raising=False)
        return importlib.import_module(name)

    import vexact.lab  # noqa: F401  (the parent, whose attribute the fixture forgets)

    return importer


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old: str, fresh) -> None:
    with pytest.warns(DeprecationWarning, match=rf"vexact\.lab\.{old} is deprecated: use {MOVED[old]}$"):
        module = fresh(f"vexact.lab.{old}")
    assert module is importlib.import_module(MOVED[old])  # one module: its private names and patches shared


def test_the_old_scaling_names_resolve_to_their_new_homes(fresh) -> None:
    with pytest.warns(DeprecationWarning, match=r"vexact\.lab\.scaling is deprecated: use vexact\.map$"):
        scaling = fresh("vexact.lab.scaling")
    for name, home, obj in [("load_map", "vexact.map.verdict", verdict.load_map),
                            ("place_on_map", "vexact.map.verdict", verdict.place_on_map),
                            ("build_map", "vexact.map.build", build.build_map),
                            ("fit_law", "vexact.map.fit", fit.fit_law),
                            ("correction_names", "vexact.map.naming", naming.correction_names),
                            ("DEFAULT_MAP", "vexact.map.verdict", verdict.DEFAULT_MAP)]:
        message = rf"vexact\.lab\.scaling\.{name} is deprecated: use {home}\.{name}$"
        with pytest.warns(DeprecationWarning, match=message):
            assert getattr(scaling, name) is obj
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        scaling.no_such_name  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vexact.lab.scaling import scaling as old_scaling  # a from-import of an old name works too
    assert old_scaling is fit.scaling
    # every old public name has a home
    assert all(hasattr(importlib.import_module(scaling.HOME[n]), n) for n in scaling.__all__)


@pytest.mark.slow
def test_python_m_vexact_lab_scaling_runs_the_map_command() -> None:
    """The documented command still runs (``shape`` prints the shipped map's curves) and warns on stderr; its output
    is the new command's."""
    old = subprocess.run([sys.executable, "-m", "vexact.lab.scaling", "shape"], capture_output=True, text=True,
                         timeout=300)
    new = subprocess.run([sys.executable, "-m", "vexact.map", "shape"], capture_output=True, text=True, timeout=300)
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout and "bypass" in new.stdout
    assert "python -m vexact.lab.scaling is deprecated: use python -m vexact.map" in old.stderr
    assert "deprecated" not in new.stderr


@pytest.mark.parametrize("old, new", [("vexact.engine.rollout", "vexact.engine.generation"),
                                      ("vexact.rl.rollouts", "vexact.rl.collect")])
def test_a_renamed_rollout_module_is_the_new_module_with_a_warning(old: str, new: str, monkeypatch) -> None:
    """The three modules once called rollout are named by job: KV-cache generation (``engine.generation``), the RL
    step's rollout stage (``rl.collect``), who samples (``rl.rollout_engines``); the old paths still import."""
    parent, _, leaf = old.rpartition(".")
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(importlib.import_module(parent), leaf, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated: use {re.escape(new)}$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
