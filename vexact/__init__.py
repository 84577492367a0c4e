"""vexact: zero training-inference mismatch, then put it back under control.

Public API: ``ModelConfig``, ``Transformer``, ``generate`` (rollout path, KV cache),
``token_logprobs`` (training path, full-sequence forward) and ``from_pretrained`` (a Hugging Face
Llama/Mistral/Qwen2/Qwen3 checkpoint as a ``Transformer``); ``vexact.testing`` for users' own tests;
``LiveMonitor`` (``vexact.live``) for mismatch metrics and gates inside the user's own trainer, once per step.

The names are imported on first use (PEP 562), so ``import vexact`` -- and the pytest plugin, which every
pytest run in an environment with vexact loads -- does not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "GenerateOutput": "vexact.engine.rollout",
    "KVCache": "vexact.engine.model",
    "LiveMonitor": "vexact.live",
    "ModelConfig": "vexact.engine.model",
    "Transformer": "vexact.engine.model",
    "from_pretrained": "vexact.real.pretrained",
    "generate": "vexact.engine.rollout",
    "token_logprobs": "vexact.engine.scoring",
}

__all__ = ["GenerateOutput", "KVCache", "LiveMonitor", "ModelConfig", "Transformer", "from_pretrained", "generate",
           "token_logprobs"]
__version__ = "0.1.0"  # the one place: pyproject.toml reads it (dynamic version)

if TYPE_CHECKING:
    from .engine.model import KVCache, ModelConfig, Transformer
    from .engine.rollout import GenerateOutput, generate
    from .engine.scoring import token_logprobs
    from .live import LiveMonitor
    from .real.pretrained import from_pretrained


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'vexact' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
