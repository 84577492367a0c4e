"""Deprecated: moved to ``vexact.sweeps.dose_response``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
