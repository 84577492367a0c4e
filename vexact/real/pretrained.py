"""Load Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) into vexact's ``Transformer``.

Why: vexact must diagnose users' real models, not only toy ones. ``Transformer`` already uses
Hugging Face's parameter names, so loading is a name check plus a copy -- but only for
architectures whose math ``Transformer.forward`` reproduces exactly. Anything else (another
``model_type``, a non-SiLU MLP, biases the model has no slot for, RoPE variants other than plain
and Llama-3 scaling, quantised weights) is refused with one error naming what the checkpoint asked
for and what is supported: a partial load or a silently different model would make every
mismatch number meaningless.

Local files only (no hub access): a directory with ``config.json`` and safetensors weights
(``model.safetensors`` or sharded with ``model.safetensors.index.json``; ``pytorch_model.bin``
files are read with ``torch.load(weights_only=True)``), or an already constructed
``transformers`` model object.

``make_tiny_checkpoint`` writes a small random-init checkpoint of any supported architecture
(optionally with a local character-level tokenizer) for tests and the README's measurements
(``python -m vexact.real.measure --make-tiny-checkpoint DIR --arch llama``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.inputs import padded_with_mask
from ..engine.model import ModelConfig, Transformer, resolve_dtype

# model_type -> the causal-LM class transformers builds for it (config.json "architectures").
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # also SmolLM / SmolLM2 (model_type "llama")
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_SUPPORTED_TEXT = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED_ARCHITECTURES.items())
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _unsupported(what: str, found: object, supported: str) -> ValueError:
    return ValueError(f"unsupported checkpoint: {what} is {found!r}; vexact supports {supported} "
                      f"(architectures: {_SUPPORTED_TEXT})")


def model_config_from_hf(hf: dict[str, Any], max_seq_len: int | None = None) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict into a ``ModelConfig``, refusing what vexact cannot run.

    Accepts both the transformers 4.x layout (``rope_theta`` / ``rope_scaling``) and 5.x
    (``rope_parameters``). ``max_seq_len`` defaults to ``max_position_embeddings``, capped at the
    sliding window when one is active: up to that length sliding-window attention equals the
    full causal attention vexact computes, so Mistral and sliding Qwen layers need no special path.
    """
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture: the checkpoint asks for model_type={model_type!r} "
                         f"(architectures {architectures}); vexact supports {_SUPPORTED_TEXT}")
    expected = SUPPORTED_ARCHITECTURES[model_type]
    if architectures and architectures != [expected]:
        raise ValueError(f"unsupported architecture: the checkpoint asks for {architectures} with model_type "
                         f"{model_type!r}; vexact loads causal language models only: {_SUPPORTED_TEXT}")
    if hf.get("quantization_config"):
        raise _unsupported("quantization_config", hf["quantization_config"].get("quant_method", "set"),
                           "unquantised fp32/bf16/fp16 weights")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise _unsupported("hidden_act", act, "'silu' (SwiGLU MLP)")
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", True, "MLPs without bias")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise _unsupported("attention_bias", True, "q/k/v biases only as in Qwen2 (no o_proj bias)")

    num_heads = int(hf["num_attention_heads"])
    theta, rope_scaling = _rope_from_hf(hf)
    limit = int(hf.get("max_position_embeddings", 4096))
    window = _sliding_window(hf, model_type)
    if window is not None:
        limit = min(limit, window)
    if max_seq_len is not None:
        if max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds what this checkpoint supports ({limit}: "
                             f"max_position_embeddings{', capped at its sliding window' if window else ''})")
        limit = max_seq_len
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        intermediate_size=int(hf["intermediate_size"]),
        max_seq_len=limit,
        head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        rope_scaling=rope_scaling,
    )


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, ModelConfig.rope_scaling) from either config layout; other RoPE types are refused."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise _unsupported("rope_parameters", "per-layer RoPE settings", "one RoPE setting for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise _unsupported("RoPE type", rope_type, "'default' and Llama-3 'llama3' scaling")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": "llama3"}
    for key in _ROPE_SCALING_KEYS:
        value = params.get(key, hf.get("max_position_embeddings") if key == "original_max_position_embeddings"
                           else None)
        if value is None:
            raise ValueError(f"checkpoint's llama3 RoPE scaling lacks {key!r}")
        scaling[key] = value
    return theta, scaling


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    """The sliding-window size if any layer of this checkpoint uses one, else None.

    Qwen configs without ``layer_types`` (older transformers) are treated as sliding whenever
    ``use_sliding_window`` is set: capping the length is never wrong, only shorter.
    """
    window = hf.get("sliding_window")
    if not window:
        return None
    if model_type == "mistral":
        return int(window)
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        layer_types = hf.get("layer_types") or []
        if "sliding_attention" in layer_types or not layer_types:
            return int(window)
    return None


# --------------------------------------------------------------------------- weights
def _read_state_dict(directory: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory (sharded or not), names as stored."""
    present = [name for name in _WEIGHT_FILES if (directory / name).is_file()]
    if not present:
        raise ValueError(f"no weights in {directory}: expected one of {', '.join(_WEIGHT_FILES)}")
    name = present[0]
    if name.endswith(".index.json"):
        weight_map = json.loads((directory / name).read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise ValueError(f"{directory / name} lists shard files that do not exist: {', '.join(missing)}")
    else:
        files = [name]
    tensors: dict[str, Tensor] = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors.update(load_file(directory / file))
        else:
            tensors.update(torch.load(directory / file, map_location="cpu", weights_only=True))
    return tensors


def _to_vexact_names(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Map HF causal-LM names (``model.layers.0...``, ``lm_head.weight``) onto ``Transformer``'s.

    Dropped on purpose: RoPE ``inv_freq`` buffers (recomputed from the config) and, for tied
    embeddings, a stored ``lm_head.weight`` (transformers ties it to ``embed_tokens`` too).
    """
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight"):
            continue
        out[name.removeprefix("model.")] = tensor
    return out


def _load_weights(model: Transformer, tensors: dict[str, Tensor], source: str) -> None:
    """Copy every parameter, or none: names and shapes must match exactly (no partial load)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        parts = [f"{label} {len(names)} tensor(s): {', '.join(names[:5])}" + (" ..." if names[5:] else "")
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise ValueError(f"{source} does not match its config: {'; '.join(parts)}")
    for name, param in params.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"config implies {tuple(param.shape)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])  # copy_ casts to the model's dtype and device


def read_checkpoint_config(directory: Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory, with one clear error if it is missing
    or unreadable."""
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory not found: {directory}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {directory} (expected a Hugging Face checkpoint directory)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None


def from_pretrained(path_or_model: str | Path | Any, backend: str = "exact", dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu", max_seq_len: int | None = None) -> Transformer:
    """A vexact ``Transformer`` with the weights of a Hugging Face checkpoint.

    ``path_or_model``: a local checkpoint directory (``config.json`` + weights) or a
    ``transformers`` ``*ForCausalLM`` object of a supported architecture (its weights are copied,
    the object is left unchanged). ``backend`` and ``dtype`` are as for ``Transformer``; weights
    are cast to ``dtype`` (float32 or bfloat16). ``max_seq_len`` (default: the checkpoint's
    ``max_position_embeddings``, capped at its sliding window) sizes the RoPE table.
    Raises ValueError with one message for a missing directory or file, an unsupported
    architecture, or weights that do not match the config.
    """
    dtype = resolve_dtype(dtype)
    if isinstance(path_or_model, (str, Path)):
        directory = Path(path_or_model)
        hf_config = read_checkpoint_config(directory)
        config = model_config_from_hf(hf_config, max_seq_len)
        tensors, source = _read_state_dict(directory), f"checkpoint {directory}"
    elif hasattr(path_or_model, "config") and hasattr(path_or_model, "state_dict"):
        hf_model = path_or_model
        class_name = type(hf_model).__name__
        if class_name not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture: got a {class_name} object; vexact supports {_SUPPORTED_TEXT}")
        config = model_config_from_hf({**hf_model.config.to_dict(), "architectures": [class_name]}, max_seq_len)
        tensors, source = hf_model.state_dict(), f"{class_name} object"
    else:
        raise ValueError(f"path_or_model must be a checkpoint directory or a transformers model, "
                         f"got {type(path_or_model).__name__}")
    model = Transformer(config, backend=backend, dtype=dtype, device=device, init_seed=None)
    _load_weights(model, _to_vexact_names(tensors, config), source)
    return model


def load_tokenizer(directory: str | Path) -> Any | None:
    """``transformers.AutoTokenizer`` from a checkpoint directory (local files only), or None if it has none."""
    directory = Path(directory)
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


# --------------------------------------------------------------------------- tiny checkpoints
def _tiny_hf_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, tie: bool | None,
                    rope_scaling: bool) -> Any:
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size + 16,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if rope_scaling else None
        return transformers.LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie,
                                        rope_parameters=rope)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=bool(tie),
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=bool(tie))
    if arch == "qwen3":  # explicit head_dim != hidden_size / heads, as in real Qwen3 models
        return transformers.Qwen3Config(**common, head_dim=2 * hidden_size // 4, tie_word_embeddings=bool(tie))
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, vocab_size: int = 128, hidden_size: int = 64,
                       num_layers: int = 2, tie: bool | None = None, rope_scaling: bool = False) -> Any:
    """A small random-init ``transformers`` causal LM of a supported architecture, in eval mode.

    Norm weights and biases are randomised too (transformers initialises them to 1 / 0), so a
    mis-mapped norm or bias cannot hide in a parity test. ``initializer_range`` 0.2 gives
    peaked next-token distributions, like a trained model's, so greedy decoding has clear winners.
    """
    import transformers

    config = _tiny_hf_config(arch, vocab_size, hidden_size, num_layers, tie, rope_scaling)
    torch.manual_seed(seed)
    model = getattr(transformers, SUPPORTED_ARCHITECTURES[arch])(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


# The tiny variants the parity tests (and ``python -m vexact.real.measure --parity-tiny``) check: every supported
# architecture, tied and untied heads, and Llama-3 RoPE scaling. Prompts are ragged, up to 40 tokens.
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {}),
    "llama3-rope-untied": ("llama", {"rope_scaling": True, "tie": False}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
PARITY_PROMPTS: list[list[int]] = [[5, 6, 7, 8, 9], [40], list(range(10, 50)), [100, 3, 99, 4, 98, 5, 97]]


@torch.no_grad()
def parity_with_transformers(hf_model: Any, prompts: list[list[int]]) -> dict[str, float]:
    """How closely vexact reproduces transformers' logits for ``hf_model`` (an fp32 ``*ForCausalLM``) on ``prompts``.

    ``fp32_max_abs_exact`` / ``fp32_max_abs_native``: max |vexact logit - transformers logit| in fp32.
    bf16 cannot be compared directly (the two round at different places), so it is judged against
    transformers' fp32 logits: ``bf16_mean_abs_err_vexact`` vs ``bf16_mean_abs_err_transformers``
    (transformers' own bf16 error), plus ``bf16_max_abs_vs_transformers`` = max |vexact bf16 -
    transformers bf16|. ``logit_max_abs``: the size of the logits, for scale.
    """
    import copy

    ids, mask = padded_with_mask(prompts)
    valid = mask.bool()

    def hf_logits(model: Any) -> Tensor:
        return model(input_ids=ids, attention_mask=mask).logits.float()[valid]

    def vexact_logits(model: Transformer) -> Tensor:
        return model.logits(model(ids)).float()[valid]

    reference = hf_logits(hf_model)
    hf_bf16 = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16))
    ours_bf16 = vexact_logits(from_pretrained(hf_model, backend="exact", dtype=torch.bfloat16))
    out = {f"fp32_max_abs_{b}": float((vexact_logits(from_pretrained(hf_model, backend=b)) - reference).abs().max())
           for b in ("exact", "native")}
    out.update(bf16_mean_abs_err_vexact=float((ours_bf16 - reference).abs().mean()),
               bf16_mean_abs_err_transformers=float((hf_bf16 - reference).abs().mean()),
               bf16_max_abs_vs_transformers=float((ours_bf16 - hf_bf16).abs().max()),
               logit_max_abs=float(reference.abs().max()))
    return out


def char_tokenizer() -> Any:
    """A local character-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then printable ASCII and newline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_tiny_checkpoint(directory: str | Path, arch: str = "llama", seed: int = 0, tokenizer: bool = True,
                         **model_kwargs: Any) -> Path:
    """Save ``make_tiny_hf_model(arch, seed, ...)`` (and, with ``tokenizer``, ``char_tokenizer()``) in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = make_tiny_hf_model(arch, seed, **model_kwargs)
    model.save_pretrained(directory)
    if tokenizer:
        tok = char_tokenizer()
        if len(tok) > model.config.vocab_size:
            raise ValueError(f"vocab_size {model.config.vocab_size} is smaller than the tokenizer ({len(tok)})")
        tok.save_pretrained(directory)
    return directory
