"""Deprecated: moved to ``vexact.sweeps.text_table``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
