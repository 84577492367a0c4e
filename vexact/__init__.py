"""vexact: zero training-inference mismatch, then put it back under control.

Public API: ``ModelConfig``, ``Transformer``, ``generate`` (rollout path, KV cache),
``token_logprobs`` (training path, full-sequence forward) and ``from_pretrained`` (a Hugging Face
Llama/Mistral/Qwen2/Qwen3 checkpoint as a ``Transformer``).
"""

from .engine.model import KVCache, ModelConfig, Transformer
from .engine.rollout import GenerateOutput, generate
from .engine.scoring import token_logprobs
from .real.pretrained import from_pretrained

__all__ = ["GenerateOutput", "KVCache", "ModelConfig", "Transformer", "from_pretrained", "generate", "token_logprobs"]
__version__ = "0.1.0"
