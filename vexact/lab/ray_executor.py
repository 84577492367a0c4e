"""Deprecated: moved to ``vexact.sweeps.ray_executor``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
