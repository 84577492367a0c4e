"""Deprecated: moved to ``vexact.sweeps.dynamics``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
