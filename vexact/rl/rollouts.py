"""Deprecated: moved to ``vexact.rl.collect`` (the rollout stage of a step: problems -> generate -> rewards); this
name is that module, with a DeprecationWarning."""

from ..moved import moved

moved(__name__, "vexact.rl.collect")
