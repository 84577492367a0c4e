"""vexact: zero training-inference mismatch, then put it back under control.

Public API: ``ModelConfig``, ``Transformer``, ``generate`` (rollout path, KV cache),
``token_logprobs`` (training path, full-sequence forward) and ``from_pretrained`` (a Hugging Face
Llama/Mistral/Qwen2/Qwen3 checkpoint as a ``Transformer``); ``vexact.testing`` for users' own tests;
``LiveMonitor`` (``vexact.live``) for mismatch metrics and gates inside the user's own trainer, once per step.
Extension points, registrable from outside the package: ``register_task`` (a ``Task`` subclass: ``task.name``),
``register_inject_mode`` (an ``InjectMode`` instance: ``inject.mode``), ``register_lr_schedule`` (a ``ScheduleKind``
instance: ``lr_schedule.kind``), ``register_correction_method`` (a ``CorrectionMethod``: ``correction.method``),
``register_advantage_estimator`` (an ``AdvantageEstimator`` instance: ``algorithm.advantage``),
``register_log_backend`` (a ``LogBackendKind`` instance: ``logging.backends``) and ``register_rollout_engine`` (a
``RolloutEngine`` instance: ``rollout.engine``); each may bring its own settings (a dataclass whose fields become
config keys).
A module that registers them is named in a config's ``plugins:`` key (or the ``vexact.plugins`` entry-point group)
for ``vexact run`` / ``sweep`` / ``report`` to import it (``vexact.rl.plugins``).

The names are imported on first use (PEP 562), so ``import vexact`` -- and the pytest plugin, which every
pytest run in an environment with vexact loads -- does not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .version import __version__ as __version__  # written in vexact/version.py, the one place

_PUBLIC = {
    "AdvantageEstimator": "vexact.rl.advantages",
    "CorrectionMethod": "vexact.rl.corrections",
    "GenerateOutput": "vexact.engine.generation",
    "InjectMode": "vexact.rl.inject_modes",
    "KVCache": "vexact.engine.model",
    "LiveMonitor": "vexact.live",
    "LogBackendKind": "vexact.rl.log_backends",
    "ModelConfig": "vexact.engine.model",
    "Transformer": "vexact.engine.model",
    "from_pretrained": "vexact.real.pretrained",
    "generate": "vexact.engine.generation",
    "register_advantage_estimator": "vexact.rl.advantages",
    "register_correction_method": "vexact.rl.corrections",
    "register_inject_mode": "vexact.rl.inject_modes",
    "register_log_backend": "vexact.rl.log_backends",
    "register_lr_schedule": "vexact.rl.schedules",
    "register_rollout_engine": "vexact.rl.rollout_engines",
    "RolloutEngine": "vexact.rl.rollout_engines",
    "register_task": "vexact.rl.tasks",
    "ScheduleKind": "vexact.rl.schedules",
    "Task": "vexact.rl.tasks",
    "token_logprobs": "vexact.engine.scoring",
}

__all__ = ["AdvantageEstimator", "CorrectionMethod", "GenerateOutput", "InjectMode", "KVCache", "LiveMonitor",
           "LogBackendKind", "ModelConfig", "RolloutEngine", "ScheduleKind", "Task", "Transformer", "from_pretrained",
           "generate",
           "register_advantage_estimator", "register_correction_method", "register_inject_mode",
           "register_log_backend", "register_lr_schedule", "register_rollout_engine", "register_task",
           "token_logprobs"]

if TYPE_CHECKING:
    from .engine.generation import GenerateOutput, generate
    from .engine.model import KVCache, ModelConfig, Transformer
    from .engine.scoring import token_logprobs
    from .live import LiveMonitor
    from .real.pretrained import from_pretrained
    from .rl.advantages import AdvantageEstimator, register_advantage_estimator
    from .rl.corrections import CorrectionMethod, register_correction_method
    from .rl.inject_modes import InjectMode, register_inject_mode
    from .rl.log_backends import LogBackendKind, register_log_backend
    from .rl.rollout_engines import RolloutEngine, register_rollout_engine
    from .rl.schedules import ScheduleKind, register_lr_schedule
    from .rl.tasks import Task, register_task


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'vexact' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
