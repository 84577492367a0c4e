"""vexact: zero training-inference mismatch, then put it back under control.

Public API: ``ModelConfig``, ``Transformer``, ``generate`` (rollout path, KV cache) and
``token_logprobs`` (training path, full-sequence forward).
"""

from .model import KVCache, ModelConfig, Transformer
from .rollout import GenerateOutput, generate
from .scoring import token_logprobs

__all__ = ["GenerateOutput", "KVCache", "ModelConfig", "Transformer", "generate", "token_logprobs"]
__version__ = "0.1.0"
