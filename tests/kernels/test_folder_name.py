"""``import kernels`` from a checkout's root (``kernels.folder_name``): the folder hands its name to the PyPI package
``kernels`` (transformers 5.25 and newer import it), or is an empty module whose missing names name
``vexact_kernels``."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_kernels_at_the_root(*python_flags: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """``import kernels`` in a fresh interpreter whose working directory (``sys.path[0]``) is the checkout's root."""
    script = ("import sys, kernels; print(kernels.__file__); print(getattr(kernels, 'MARK', None)); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'vexact_kernels')))")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, *python_flags, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_import_kernels_at_a_checkout_s_root_gets_the_pypi_package(tmp_path):
    """With another package named ``kernels`` on ``sys.path`` after the checkout's root, ``import kernels`` there
    returns that package, and no module of this library is loaded under either name."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("MARK = 'the other kernels'\n")
    done = _import_kernels_at_the_root(pythonpath=str(tmp_path))
    assert done.returncode == 0, done.stderr
    file, mark, modules = done.stdout.splitlines()
    assert Path(file) == tmp_path / "kernels" / "__init__.py"
    assert mark == "the other kernels"
    assert modules == "['kernels']"


def test_import_kernels_at_a_checkout_s_root_without_the_pypi_package_is_an_empty_module():
    """Without another ``kernels`` (``-S``: no site-packages), an empty module: transformers before 5.25 imports it to
    read its version (``getattr(kernels, "__version__", "N/A")``), so the import must not fail; any name it lacks is
    one AttributeError naming ``vexact_kernels``; no module of this library is loaded under the folder's name."""
    script = ("import sys, kernels\n"
              "assert getattr(kernels, '__version__', 'N/A') == 'N/A'\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'vexact_kernels')))\n"
              "kernels.get_ops\n")
    done = subprocess.run([sys.executable, "-S", "-s", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode != 0
    assert done.stdout.splitlines() == ["['kernels', 'kernels.folder_name']"]
    assert done.stderr.strip().splitlines()[-1] == (
        "AttributeError: module 'kernels' (here the folder of vexact's kernel library, found by its folder name) has "
        "no attribute 'get_ops': the library is imported as 'vexact_kernels'")
