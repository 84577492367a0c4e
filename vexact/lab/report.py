"""Deprecated: moved to ``vexact.reports.sweep_report``; this name is that module, with a DeprecationWarning."""

from . import alias

alias(__name__)
