"""Deprecated: moved to ``vexact.sweeps.sweep_data``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
