"""A Hugging Face ``config.json`` as vexact's ``ModelConfig``, and back.

Which architectures vexact runs (``SUPPORTED_ARCHITECTURES``: Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) and
the translation of their ``config.json`` into a ``ModelConfig`` (``model_config_from_hf``), refusing with one error
naming the key what ``Transformer.forward`` does not compute exactly: another ``model_type``, a non-SiLU MLP, biases
the model has no slot for, RoPE variants other than plain and Llama-3 scaling, quantised weights. A size key missing or
not a positive integer, a RoPE/epsilon value not a finite positive number, is refused likewise. ``hf_config_of`` is the
inverse, for exporting a vexact model as a checkpoint other engines load.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..engine.model import ModelConfig, ModelConfigError

# model_type -> the causal-LM class transformers builds for it (config.json "architectures").
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # also SmolLM / SmolLM2 (model_type "llama")
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",  # mixture of experts with a shared expert
    "qwen3_moe": "Qwen3MoeForCausalLM",  # mixture of experts (Qwen3-30B-A3B)
}
SUPPORTED_TEXT = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED_ARCHITECTURES.items())
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _unsupported(what: str, found: object, supported: str) -> ValueError:
    return ValueError(f"unsupported checkpoint: {what} is {short(found)}; vexact supports {supported} "
                      f"(architectures: {SUPPORTED_TEXT})")


def short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile file can put megabytes into one name or value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REQUIRED = object()


def _positive_int(hf: dict[str, Any], key: str, source: str, default: Any = _REQUIRED) -> int:
    """``hf[key]`` as a positive int (an integral float such as 128.0 is accepted), else one error naming the key."""
    value = hf.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{source} lacks {key!r}, which vexact needs to build the model")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {short(value)}")
    return value


def _positive_number(value: Any, key: str, source: str) -> float:
    """A finite positive number (RoPE theta and scaling factors, the RMSNorm epsilon), else one error naming the key."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number) and number > 0:
            return number
    raise ValueError(f"{source}: {key} must be a finite positive number, got {short(value)}")


def eos_token_id_of(hf: dict[str, Any], source: str) -> int | None:
    """config.json's end-of-sequence id (the first, if a list; None if absent, null or an empty list), else one
    error naming the key: transformers' type (an int or a list of ints; its loaders refuse a string such as "1"),
    and not negative (generation stops on it)."""
    value = hf.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{source}: eos_token_id must be a non-negative integer (or a list of them), got "
                         f"{short(value)}")
    return ids[0] if ids else None


def _flag(hf: dict[str, Any], key: str, default: bool, source: str) -> bool:
    """``hf[key]`` as a JSON boolean (absent or null: ``default``); a string such as "false" is refused -- read as
    Python truth it was True (tie_word_embeddings "false" tied the head and dropped the stored lm_head.weight)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {short(value)}")
    return value


# vexact's ModelConfig field -> the config.json key it comes from (for ModelConfig's own refusals).
_HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "intermediate_size": "intermediate_size", "head_dim": "head_dim", "num_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
            "decoder_sparse_step": "decoder_sparse_step", "mlp_only_layers": "mlp_only_layers",
            "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
_MOE_TYPES = ("qwen2_moe", "qwen3_moe")


def model_config_from_hf(hf: dict[str, Any], max_seq_len: int | None = None, *,
                         source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict into a ``ModelConfig``, refusing what vexact cannot run.

    Accepts both the transformers 4.x layout (``rope_theta`` / ``rope_scaling``) and 5.x
    (``rope_parameters``). ``max_seq_len`` defaults to ``max_position_embeddings``, capped at the
    sliding window when one is active: up to that length sliding-window attention equals the
    full causal attention vexact computes, so Mistral and sliding Qwen layers need no special path.
    A config that is not a JSON object, lacks a size key, or has a size that is not a positive
    integer (or a RoPE/epsilon value that is not a finite positive number) is one ValueError naming
    ``source`` (the config file) and the key.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected a JSON object (a Hugging Face config), got {type(hf).__name__}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
                                    or max_seq_len < 1):  # the caller's argument, not the config file's
        raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
    try:
        return _model_config_from_hf(hf, max_seq_len, source)
    except ModelConfigError as err:
        key = _HF_KEYS.get(err.field)
        raise ValueError(f"{source}: {err.problem}" + (f" (config key {key!r})" if key else "")) from None
    except (TypeError, AttributeError, KeyError, OverflowError) as err:  # a value of a type no real config has
        raise ValueError(f"{source}: malformed config ({type(err).__name__}: {str(err)[:100]})") from None


def _model_config_from_hf(hf: dict[str, Any], max_seq_len: int | None, source: str) -> ModelConfig:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture: the checkpoint asks for model_type={short(model_type)} "
                         f"(architectures {short(architectures, 200)}); vexact supports {SUPPORTED_TEXT}")
    expected = SUPPORTED_ARCHITECTURES[model_type]
    if architectures and architectures != [expected]:
        raise ValueError(f"unsupported architecture: the checkpoint asks for {str(architectures)[:200]} with "
                         f"model_type {model_type!r}; vexact loads causal language models only: {SUPPORTED_TEXT}")
    quantization = hf.get("quantization_config")
    if quantization:
        raise _unsupported("quantization_config",
                           quantization.get("quant_method", "set") if isinstance(quantization, dict) else quantization,
                           "unquantised fp32/bf16/fp16 weights")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise _unsupported("hidden_act", act, "'silu' (SwiGLU MLP)")
    if _flag(hf, "mlp_bias", False, source):
        raise _unsupported("mlp_bias", True, "MLPs without bias")
    if model_type not in ("qwen2", "qwen2_moe") and _flag(hf, "attention_bias", False, source):
        raise _unsupported("attention_bias", True, "q/k/v biases only as in Qwen2 (no o_proj bias)")

    sizes = {key: _positive_int(hf, key, source) for key in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                             "num_attention_heads", "intermediate_size")}
    num_heads = sizes["num_attention_heads"]
    # absent or null: transformers' defaults (every head its own KV head; hidden_size / heads); 0 is refused, as in
    # transformers, whose model cannot be built with it
    num_kv_heads = (_positive_int(hf, "num_key_value_heads", source) if hf.get("num_key_value_heads") is not None
                    else num_heads)
    head_dim = _positive_int(hf, "head_dim", source) if hf.get("head_dim") is not None else None
    theta, rope_scaling = _rope_from_hf(hf, source)
    limit = _positive_int(hf, "max_position_embeddings", source, default=4096)
    window = _sliding_window(hf, model_type, source)
    if window is not None:
        limit = min(limit, window)
    if max_seq_len is not None:
        if max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds what this checkpoint supports ({limit}: "
                             f"max_position_embeddings{', capped at its sliding window' if window else ''})")
        limit = max_seq_len
    return ModelConfig(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=sizes["intermediate_size"],
        max_seq_len=limit,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=_positive_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        tie_embeddings=_flag(hf, "tie_word_embeddings", False, source),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and _flag(hf, "qkv_bias", True, source)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=rope_scaling,
        **(_moe_from_hf(hf, model_type, source) if model_type in _MOE_TYPES else {}),
    )


def _moe_from_hf(hf: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """ModelConfig's MoE fields from a Qwen2-MoE / Qwen3-MoE config (HF's names; ``num_local_experts`` is how
    transformers 5 writes ``num_experts``), with HF's defaults where a key is absent."""
    experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {short(layers)}")
    shared = hf.get("shared_expert_intermediate_size", 5632 if model_type == "qwen2_moe" else 0)
    if model_type == "qwen3_moe" and shared:
        raise _unsupported("shared_expert_intermediate_size", shared, "Qwen3-MoE without a shared expert")
    return dict(num_experts=_positive_int(hf, experts_key, source),
                num_experts_per_tok=_positive_int(hf, "num_experts_per_tok", source),
                moe_intermediate_size=_positive_int(hf, "moe_intermediate_size", source),
                norm_topk_prob=_flag(hf, "norm_topk_prob", False, source),
                decoder_sparse_step=_positive_int(hf, "decoder_sparse_step", source, default=1),
                mlp_only_layers=tuple(layers),
                shared_expert_intermediate_size=_positive_int(hf, "shared_expert_intermediate_size", source,
                                                              default=shared) if shared else 0)


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """(rope_theta, ModelConfig.rope_scaling) from either config layout; other RoPE types are refused."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters / rope_scaling must be a JSON object, got {short(params)}")
    _check_rope_layouts(hf, source)
    if any(isinstance(v, dict) for v in params.values()):
        raise _unsupported("rope_parameters", "per-layer RoPE settings", "one RoPE setting for all layers")
    rope_type = _rope_type(params)
    if rope_type not in ("default", "llama3"):
        raise _unsupported("RoPE type", rope_type, "'default' and Llama-3 'llama3' scaling")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    theta = _positive_number(params.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", source)
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": "llama3"}
    for key in _ROPE_SCALING_KEYS:
        value = params.get(key, hf.get("max_position_embeddings") if key == "original_max_position_embeddings"
                           else None)
        if value is None:
            raise ValueError(f"{source}: checkpoint's llama3 RoPE scaling lacks {key!r}")
        _positive_number(value, key, source)
        scaling[key] = value
    if scaling["low_freq_factor"] == scaling["high_freq_factor"]:  # Llama-3 scaling divides by their difference
        raise ValueError(f"{source}: llama3 RoPE scaling needs high_freq_factor != low_freq_factor, got both "
                         f"{scaling['low_freq_factor']}")
    return theta, scaling


def _rope_type(values: dict[str, Any]) -> Any:
    """The RoPE type a rope_parameters / rope_scaling object says: ``rope_type``, else the older ``type``, else
    ``default`` (the one reading of the two keys, for the model and for the layouts' comparison)."""
    return values.get("rope_type", values.get("type", "default"))


def _check_rope_layouts(hf: dict[str, Any], source: str) -> None:
    """A config with both ``rope_parameters`` (transformers 5) and ``rope_scaling`` (4.x; what model cards say to add
    for long context) must say the same in both: transformers 4 reads only rope_scaling and 5 lets rope_scaling
    replace rope_parameters, so reading rope_parameters alone would run a model transformers scales (yarn) as plain
    RoPE. A key of rope_scaling that rope_parameters lacks or sets otherwise is refused, naming both."""
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    if not (isinstance(scaling, dict) and isinstance(parameters, dict) and scaling and parameters):
        return

    def settings(values: dict[str, Any]) -> dict[str, Any]:
        return {"rope_type": _rope_type(values), **{k: v for k, v in values.items() if k not in ("type", "rope_type")}}

    said, held = settings(scaling), settings(parameters)
    differ = [key for key, value in said.items() if key in scaling or key == "rope_type"
              if held.get(key, value if key == "rope_theta" else None) != value]
    if differ:
        raise ValueError(f"{source}: rope_scaling {short(scaling, 200)} and rope_parameters {short(parameters, 200)} "
                         f"disagree on {', '.join(differ)}: transformers uses rope_scaling where both are set; remove "
                         "the one that is not meant")


def _sliding_window(hf: dict[str, Any], model_type: str, source: str) -> int | None:
    """The sliding-window size if any layer of this checkpoint uses one, else None.

    Qwen configs without ``layer_types`` (older transformers) are treated as sliding whenever
    ``use_sliding_window`` is set: capping the length is never wrong, only shorter.
    """
    if not hf.get("sliding_window"):
        return None
    if model_type == "mistral":
        return _positive_int(hf, "sliding_window", source)
    if model_type in ("qwen2", "qwen3", *_MOE_TYPES) and hf.get("use_sliding_window"):
        layer_types = hf.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise ValueError(f"{source}: layer_types must be a list, got {short(layer_types)}")
        if "sliding_attention" in layer_types or not layer_types:
            return _positive_int(hf, "sliding_window", source)
    return None


def hf_config_of(config: ModelConfig, dtype: torch.dtype, eos_token_id: int | None) -> Any:
    """The transformers config of the architecture whose math ``Transformer(config)`` runs: the inverse of
    ``model_config_from_hf`` (Qwen3 for q/k norms, Qwen2 for q/k/v biases, else Llama)."""
    import transformers

    if config.moe_layers:  # written as a dense config, its expert tensors would load as missing MLP weights
        raise ValueError(f"cannot export a mixture-of-experts model (experts in layers "
                         f"{', '.join(map(str, config.moe_layers))}): the export writes dense Llama/Qwen2/Qwen3 "
                         "checkpoints only")
    if config.qk_norm and config.qkv_bias:
        raise ValueError("cannot export a model with both q/k/v biases and q/k norms: no supported architecture "
                         f"has both ({SUPPORTED_TEXT})")
    model_type = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {**config.rope_scaling, "rope_theta": config.rope_theta}
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                  head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
                  rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_embeddings, hidden_act="silu",
                  rope_parameters=rope, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    if model_type == "llama":
        hf = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    else:
        hf = getattr(transformers, f"{'Qwen3' if model_type == 'qwen3' else 'Qwen2'}Config")(
            **common, use_sliding_window=False)
    hf.architectures = [SUPPORTED_ARCHITECTURES[model_type]]
    hf.dtype = dtype
    return hf
