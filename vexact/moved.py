"""Old import paths kept working: a module that moved stays importable under its old name, as the module it now is,
with a DeprecationWarning naming the new path. Imports nothing of vexact (the new module is imported by name)."""

from __future__ import annotations

import importlib
import sys
import warnings


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a module path or command) is deprecated in favour of ``new``."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


def moved(old: str, new: str) -> None:
    """Make module ``old`` the module ``new`` under its old name (one module under two names, so attributes, private
    helpers and patches are shared), with a DeprecationWarning. Called by the old module's file, as its only code."""
    deprecated(old, new, stacklevel=4)
    sys.modules[old] = importlib.import_module(new)
