"""Named model shapes (``model.preset``), the one table of model sizes the project uses.

Like gpt-fast's ``transformer_configs``: the run config (``model.preset``), ``vexact check``, ``vexact locate``'s
random model and the benchmarks all read their sizes here, so a shape is written once. A preset gives
``ModelConfig`` keyword arguments; whoever uses it may pass more (the task's vocabulary, a longer
``max_seq_len``), and what is passed explicitly wins over the preset.
"""

from __future__ import annotations

from typing import Any, Literal

from .model import ModelConfig

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Smoke tests: the smallest shape that still has grouped-query attention.
    "tiny": dict(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=48),
    # The RL testbed: learns the synthetic tasks in minutes on a CPU (the run config's default shape; the
    # vocabulary is the task's).
    "testbed": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
                    max_seq_len=64),
    # The random model of ``vexact check`` and ``vexact locate`` (twice the testbed's width, 256 token ids).
    "small": dict(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352),
    # The MoE check model (``vexact check --preset small_moe``): ``small`` with each MLP a mixture of 4 experts, top-2,
    # each expert half the dense MLP's width (the same active MLP width per token).
    "small_moe": dict(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=176),
    # The MoE RL testbed (experiments/moe_testbed.yaml): the realistic testbed's width and depth, 8 experts top-2.
    "moe_testbed": dict(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=352,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=176),
    # SmolLM-135M-like: hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied embeddings.
    "llama100m": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, max_seq_len=2048, tie_embeddings=True),
    # Real sizes: the shapes of the public Hugging Face configs of Qwen3-0.6B, Qwen3-1.7B and
    # Qwen3-30B-A3B (vocabulary 151,936, head_dim 128 apart from hidden / heads, q/k RMSNorm, RoPE theta 1e6),
    # random weights (init on the device); ``num_layers`` overrides the depth for smaller runs.
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, intermediate_size=3072, max_seq_len=40960, rope_theta=1e6, qk_norm=True,
                       tie_embeddings=True),
    "qwen3_1_7b": dict(vocab_size=151936, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, intermediate_size=6144, max_seq_len=40960, rope_theta=1e6, qk_norm=True,
                       tie_embeddings=True),
    # every layer a mixture of 128 experts (decoder_sparse_step 1, no mlp_only_layers), top-8, normalised top-k
    # weights; intermediate_size is the dense MLP width of the public config, unused by its all-MoE layers
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, intermediate_size=6144, max_seq_len=40960, rope_theta=1e6, qk_norm=True,
                          tie_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
}
"""Preset name -> ``ModelConfig`` keyword arguments. A preset without ``vocab_size`` (``testbed``) takes the
vocabulary from its user (the task); one without ``max_seq_len`` (``small``) takes the length its user needs."""

PRESET_NAMES = tuple(MODEL_PRESETS)
PresetName = Literal[PRESET_NAMES]  # type: ignore[valid-type]  # derived from the table above


class UnknownPresetError(ValueError):
    """A preset name that is not in ``MODEL_PRESETS``."""

    def __init__(self, name: object):
        self.name = name
        super().__init__(f"unknown model preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")


def preset_values(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s ``ModelConfig`` keyword arguments (unknown name: ``UnknownPresetError``)."""
    if name not in MODEL_PRESETS:
        raise UnknownPresetError(name)
    return dict(MODEL_PRESETS[name])


def preset_config(name: str, **explicit: Any) -> ModelConfig:
    """``ModelConfig`` of preset ``name``; keys in ``explicit`` win over the preset's (e.g. ``vocab_size`` from a
    task, a longer ``max_seq_len``)."""
    return ModelConfig(**{**preset_values(name), **explicit})
