"""``import kernels`` from a checkout's root (``kernels.folder_name``): the folder hands its name to the PyPI package
``kernels`` (transformers 5.25 and newer import it), or fails with one ImportError naming ``vexact_kernels``."""

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


def test_import_kernels_at_a_checkout_s_root_without_the_pypi_package_names_vexact_kernels():
    """Without another ``kernels`` (``-S``: no site-packages), one ImportError naming the import this library takes."""
    done = _import_kernels_at_the_root("-S", "-s")
    assert done.returncode != 0
    assert "ImportError: 'kernels' here is the folder of vexact's kernel library, which is imported as " \
           "'vexact_kernels'" in done.stderr
