"""The folder ``kernels/`` imported by its own name, ``kernels``: where a checkout's root is on ``sys.path`` (``python
-m pytest`` or ``python -m vexact`` run there), ``import kernels`` finds this folder before the PyPI package of that
name, Hugging Face's hub kernels, which transformers 5.25 and newer require and import (``from kernels import
CUDAProperties``). The name is not this library's (that is ``vexact_kernels``; a second copy of it under another name
would also hold a second host guard), so it goes to the PyPI package, found on ``sys.path`` past this checkout; without
one, the name is an empty module.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAME = "kernels"


def hand_the_name_to_the_pypi_package(own_path: list[str]) -> bool:
    """Make ``sys.modules["kernels"]`` the PyPI package ``kernels``, loaded from the first ``sys.path`` entry whose
    ``kernels`` is not this folder (``own_path``: the package's ``__path__``); the import that is running returns it.
    False where no such package is installed: the folder then stays an empty module (``not_this_library``), as
    transformers before 5.25 expects, which imports ``kernels`` to read a version it then finds missing."""
    own = {Path(folder).resolve() for folder in own_path}
    elsewhere = [entry for entry in sys.path if (Path(entry or ".").resolve() / NAME) not in own]
    spec = importlib.machinery.PathFinder.find_spec(NAME, elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # the import machinery returns what sys.modules holds once this folder's code ends
    sys.modules.pop(__name__, None)  # this module, loaded as kernels.folder_name: not a submodule of the PyPI package
    spec.loader.exec_module(module)
    return True


def not_this_library(name: str) -> object:
    """The empty ``kernels`` module's ``__getattr__`` (PEP 562): every name it lacks is one AttributeError saying where
    vexact's kernel library is (``getattr(kernels, "__version__", None)`` still gives the default)."""
    raise AttributeError(f"module {NAME!r} (here the folder of vexact's kernel library, found by its folder name) has "
                         f"no attribute {name!r}: the library is imported as 'vexact_kernels'")
