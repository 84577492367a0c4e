"""The folder ``kernels/`` imported by its own name, ``kernels``: where a checkout's root is on ``sys.path``
(``python -m pytest`` or ``python -m vexact`` run there), ``import kernels`` finds this folder before the PyPI package
of that name, Hugging Face's hub kernels, which transformers 5.25 and newer require and import (``from kernels import
CUDAProperties``). The name is not this library's (that is ``vexact_kernels``; a second copy of it under another
name would also hold a second host guard), so it goes to the PyPI package, found on ``sys.path`` past this checkout.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAME = "kernels"


def hand_the_name_to_the_pypi_package(own_path: list[str]) -> None:
    """Make ``sys.modules["kernels"]`` the PyPI package ``kernels``, loaded from the first ``sys.path`` entry whose
    ``kernels`` is not this folder (``own_path``: the package's ``__path__``); the import that is running returns it.
    Without it installed, one ImportError naming the import this library takes."""
    own = {Path(folder).resolve() for folder in own_path}
    elsewhere = [entry for entry in sys.path if (Path(entry or ".").resolve() / NAME) not in own]
    spec = importlib.machinery.PathFinder.find_spec(NAME, elsewhere)
    if spec is None or spec.loader is None:
        raise ImportError(f"{NAME!r} here is the folder of vexact's kernel library, which is imported as "
                          f"'vexact_kernels'; no other package named {NAME!r} is installed", name=NAME)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # the import machinery returns what sys.modules holds once this folder's code ends
    sys.modules.pop(__name__, None)  # this module, loaded as kernels.folder_name: not a submodule of the PyPI package
    spec.loader.exec_module(module)
