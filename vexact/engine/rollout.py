"""Deprecated: moved to ``vexact.engine.generation`` (KV-cache generation: a name for its job, apart from the RL
loop's rollout stage); this name is that module, with a DeprecationWarning."""

from ..moved import moved

moved(__name__, "vexact.engine.generation")
