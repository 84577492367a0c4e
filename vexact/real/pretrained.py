"""Load Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) into vexact's ``Transformer``.

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

A checkpoint is a user's file, possibly broken or hostile, so ``read_checkpoint`` checks before it
allocates, and every refusal is one ValueError naming the file (and the tensor or config key):

- ``config.json`` / an index: not UTF-8 JSON, nested too deeply, over 64 MiB, not a JSON object;
  a size key missing or not a positive integer, a RoPE/epsilon value not a finite positive number.
  An index's ``weight_map`` must map names to plain file names in the directory (no paths), of
  the index's format, that exist, and each listed tensor must be in the shard it names.
- safetensors: each header is checked by the library itself (``safe_open``: dtype x shape = byte
  span, tensors tile the data, nothing past the end: truncated or corrupt files are refused, with
  the offending size or tensor named) -- then, still before any tensor is read or any model built, every
  tensor's name, shape and dtype is checked against the config: a shape the config does not
  imply names the config keys that disagree and both shapes (``vocab_size=10**12`` fails here,
  not in the allocator), a wrong ``num_hidden_layers`` names the layers present, a non-float
  dtype (integer, bool, 8-bit) is refused, as are missing, unexpected and duplicated tensors
  (in two shards, or as ``model.x`` and ``x``).
- ``.bin``: pickles cannot be inspected without unpickling, so first the config's parameter count
  must fit the files (16 bits each) and no zip archive may unpack to more than 8 bytes per
  parameter (plus 16 MiB); then ``vexact.records.runlog.load_tensor_file`` (weights-only: a pickle
  that would run code or build objects is "refusing to unpickle FILE: not a plain tensor file (it names X)");
  then the content must be a dict of dense tensors, checked like a safetensors header before the
  model is built.
- values: a NaN/Inf weight is refused at load (file, tensor, counts), and so is a finite weight
  that overflows the requested dtype (e.g. fp32 3.4e38 in bf16).
- RoPE: ``Transformer`` precomputes a table of max_seq_len positions; a max_position_embeddings
  that would need more than 2^28 entries is refused unless ``max_seq_len`` is passed.

Small random-init checkpoints of every supported architecture, and the parity check against transformers, are
``vexact.real.tiny``'s.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.model import ModelConfig, ModelConfigError, Transformer, parameter_count, resolve_dtype, short_dtype_name
from ..records.runlog import load_tensor_file

# model_type -> the causal-LM class transformers builds for it (config.json "architectures").
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # also SmolLM / SmolLM2 (model_type "llama")
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",  # mixture of experts with a shared expert
    "qwen3_moe": "Qwen3MoeForCausalLM",  # mixture of experts (Qwen3-30B-A3B)
}
_SUPPORTED_TEXT = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED_ARCHITECTURES.items())
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _unsupported(what: str, found: object, supported: str) -> ValueError:
    return ValueError(f"unsupported checkpoint: {what} is {_short(found)}; vexact supports {supported} "
                      f"(architectures: {_SUPPORTED_TEXT})")


def _short(value: object, limit: int = 80) -> str:
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
        raise ValueError(f"{source}: {key} must be a positive integer, got {_short(value)}")
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
    raise ValueError(f"{source}: {key} must be a finite positive number, got {_short(value)}")


def _flag(hf: dict[str, Any], key: str, default: bool, source: str) -> bool:
    """``hf[key]`` as a JSON boolean (absent or null: ``default``); a string such as "false" is refused -- read as
    Python truth it was True (tie_word_embeddings "false" tied the head and dropped the stored lm_head.weight)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {_short(value)}")
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
        raise ValueError(f"unsupported architecture: the checkpoint asks for model_type={_short(model_type)} "
                         f"(architectures {_short(architectures, 200)}); vexact supports {_SUPPORTED_TEXT}")
    expected = SUPPORTED_ARCHITECTURES[model_type]
    if architectures and architectures != [expected]:
        raise ValueError(f"unsupported architecture: the checkpoint asks for {str(architectures)[:200]} with "
                         f"model_type {model_type!r}; vexact loads causal language models only: {_SUPPORTED_TEXT}")
    quantization = hf.get("quantization_config")
    if quantization:
        raise _unsupported("quantization_config",
                           quantization.get("quant_method", "set") if isinstance(quantization, dict) else quantization,
                           "unquantised fp32/bf16/fp16 weights")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise _unsupported("hidden_act", act, "'silu' (SwiGLU MLP)")
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", True, "MLPs without bias")
    if model_type not in ("qwen2", "qwen2_moe") and hf.get("attention_bias"):
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
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {_short(layers)}")
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
        raise ValueError(f"{source}: rope_parameters / rope_scaling must be a JSON object, got {_short(params)}")
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
        raise ValueError(f"{source}: rope_scaling {_short(scaling, 200)} and rope_parameters {_short(parameters, 200)} "
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
            raise ValueError(f"{source}: layer_types must be a list, got {_short(layer_types)}")
        if "sliding_attention" in layer_types or not layer_types:
            return _positive_int(hf, "sliding_window", source)
    return None


# --------------------------------------------------------------------------- weights
# Everything below checks what it can before allocating anything: a checkpoint is a user's file, possibly broken,
# possibly hostile. Safetensors headers give every tensor's dtype and shape without reading the data; pickled
# ``.bin`` files cannot be inspected without unpickling, so they are bounded by their size first and unpickled
# with ``vexact.records.runlog.load_tensor_file`` (the weights-only unpickler; anything else is refused).
_MAX_JSON_BYTES = 64 << 20  # config.json / index.json: a few KiB (a 400B model's index is under 1 MiB)
_MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit
_MAX_ROPE_ELEMENTS = 1 << 28  # positions x head_dim / 2: a 4M-position, head_dim-128 table (2 GiB fp32) fits
_BIN_SLACK_BYTES = 16 << 20  # pickle records, buffers: what a .bin may hold beyond 8 bytes per parameter
_LAYER_NAME = re.compile(r"layers\.(\d+)\.")
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")  # floating-point weights; anything else is quantised or not a weight
_TORCH_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class _TensorInfo:
    """What is known of a stored tensor before (or without) reading its data."""

    file: str
    dtype: str  # safetensors spelling: F32, BF16, I64, ...
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    """A checkpoint read and checked by ``read_checkpoint``: its ``ModelConfig``, its tensors under ``Transformer``'s
    names (all there, shapes and dtypes as the config implies, every value finite), and for each the file and
    stored name it came from (for error messages). ``build_model`` turns it into a ``Transformer``."""

    config: ModelConfig
    tensors: dict[str, Tensor]
    origin: dict[str, tuple[str, str]]  # vexact name -> (file, stored name)
    source: str  # "checkpoint DIR" or "LlamaForCausalLM object"


def _read_json(path: Path, what: str) -> Any:
    """A small JSON file, or one ValueError naming it (too large, unreadable, not UTF-8, not JSON)."""
    try:
        with open(path, "rb") as f:
            content = f.read(_MAX_JSON_BYTES + 1)  # bounded even where st_size lies (a /proc file, a growing file)
        if len(content) > _MAX_JSON_BYTES:
            raise ValueError(f"{path} is over {_MAX_JSON_BYTES >> 20} MiB; a {what} is a few KiB, refusing to parse it")
        return json.loads(content.decode("utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not valid JSON: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the {what} ({err.strerror or type(err).__name__})") from None


def _weight_files(directory: Path) -> tuple[list[Path], Path | None, dict[str, str]]:
    """(weight files, the index file or None, the index's weight_map) of a checkpoint directory.

    An index must be a JSON object whose ``weight_map`` maps tensor names to plain file names in the directory
    (no paths: an index cannot point outside its checkpoint), ``.safetensors`` files for a safetensors index."""
    present = [name for name in _WEIGHT_FILES if (directory / name).is_file()]
    if not present:
        raise ValueError(f"no weights in {directory}: expected one of {', '.join(_WEIGHT_FILES)}")
    name = present[0]
    if not name.endswith(".index.json"):
        return [directory / name], None, {}
    index = directory / name
    content = _read_json(index, "weight index")
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: malformed index: expected a JSON object with a non-empty \"weight_map\" "
                         "of tensor names to shard files")
    for tensor, shard in weight_map.items():
        if (not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or "\\" in shard
                or any(ord(c) < 32 for c in shard)):
            raise ValueError(f"{index}: malformed index: tensor {_short(tensor)} maps to {_short(shard)}, not a "
                             "file name in the checkpoint directory")
        safetensors_index = name.startswith("model.safetensors")
        if safetensors_index != shard.endswith(".safetensors"):
            raise ValueError(f"{index}: malformed index: shard {_short(shard)} is not a "
                             f"{'.safetensors' if safetensors_index else 'torch pickle (.bin)'} file")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise ValueError(f"{index} lists shard files that do not exist: {', '.join(f[:100] for f in missing[:5])}"
                         + (f" (and {len(missing) - 5} more)" if missing[5:] else ""))
    return [directory / f for f in files], index, weight_map


def _safetensors_header(path: Path) -> dict[str, _TensorInfo]:
    """Every tensor's dtype and shape, from safetensors' own ``safe_open``: opening a file validates its header
    (it parses, each tensor's bytes match its dtype and shape, the tensors tile the data exactly, nothing past the
    end, a bounded header size) and reads no tensor data. A file it refuses is one ValueError naming the file, with
    the reason spelled out (``_why_refused``)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: _TensorInfo(str(path), part.get_dtype(), tuple(part.get_shape()))
                    for name, part in slices.items()}
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or type(err).__name__})") from None
    except (SafetensorError, RuntimeError, ValueError, TypeError) as err:  # what the library raises for a bad file
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({_why_refused(path, err)})") from None


def _why_refused(path: Path, err: Exception) -> str:
    """Why ``safe_open`` refused ``path``, in the terms of the file: its size, the header length it claims, the
    tensor whose byte span is wrong. The library's own reason names the check that failed but none of these; this
    re-reads the header (length + JSON, both bounded) only to name them, and falls back to the library's words."""
    reason = str(err).strip().splitlines()[0].removeprefix("Error while deserializing header: ")[:160] or "refused"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than the 8-byte header length"
            length = int.from_bytes(head, "little")
            if length > min(_MAX_SAFETENSORS_HEADER, size - 8):
                return f"its header claims {length:,} bytes, the file has {size:,}"
            header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "its header is not valid JSON"
    except OSError:
        return reason
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data_len, spans = size - 8 - length, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            needed = math.prod(shape) * _ITEMSIZE[dtype]
        except (TypeError, KeyError, ValueError):
            return f"malformed header entry for tensor {_short(name)}"
        if end > data_len:
            return f"tensor {_short(name)} needs bytes up to {end:,} of the data, the file holds {data_len:,}"
        if end - start != needed:
            return (f"tensor {_short(name)} of shape {shape} and dtype {dtype} needs {needed:,} bytes, its "
                    f"data_offsets span {end - start:,}")
        spans.append((start, end))
    position = 0
    for start, end in sorted(spans):
        if start != position:
            return "its tensors' data overlap or leave gaps"
        position = end
    if position != data_len:
        return f"{data_len - position:,} bytes after the last tensor"
    return reason


def _read_safetensors(path: Path, names: list[str]) -> dict[str, Tensor]:
    """The named tensors of a safetensors file whose header ``_safetensors_header`` accepted (read by the same
    ``safe_open``)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError):
        raise ValueError(f"{path}: corrupt safetensors file (its tensors could not be read)") from None


def _bin_data_bytes(path: Path) -> tuple[int, bool]:
    """(the most tensor data ``path`` can unpack to, whether that is a zip archive's declared size), read without
    unpickling. torch.save writes a zip archive, and unpickling it allocates each record's declared (uncompressed)
    size; a legacy (pre-1.6) file is bounded by its size."""
    try:
        size = path.stat().st_size
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                return sum(info.file_size for info in archive.infolist()), True
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        pass  # not readable as a zip: load_tensor_file reports it
    return size, False


def _read_bin(path: Path) -> dict[str, Tensor]:
    """A ``pytorch_model.bin`` (shard): weights-only unpickling, then a dict of named plain tensors or an error."""
    content = load_tensor_file(path)
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a dict of tensor names to tensors, got a {type(content).__name__}")
    for name, tensor in content.items():
        if not isinstance(name, str) or not isinstance(tensor, Tensor):
            raise ValueError(f"{path}: entry {_short(name)} is a {type(tensor).__name__}, not a named tensor")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise ValueError(f"{path}: tensor {_short(name)} is a {tensor.layout} / quantised tensor; vexact loads "
                             "dense floating-point weights")
    return content


def _param_count(config: ModelConfig) -> int:
    """Parameters ``Transformer(config)`` has, by arithmetic (nothing is built)."""
    return parameter_count(config)


def _config_sizes(config: ModelConfig) -> str:
    return (f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
            f"intermediate_size={config.intermediate_size}, num_hidden_layers={config.num_layers}, "
            f"num_attention_heads={config.num_heads}, num_key_value_heads={config.num_kv_heads}, "
            f"head_dim={config.head_dim}")


def _check_bin_sizes(config: ModelConfig, config_name: str, files: list[Path]) -> None:
    """Before unpickling: the config's parameters must fit in the files (at 16 bits each, the smallest weight
    dtype), and no file may unpack to more than 8 bytes per parameter (plus slack) -- a zip bomb, or a checkpoint
    of another config."""
    params = _param_count(config)
    sizes = [(path, *_bin_data_bytes(path)) for path in files]
    total = sum(size for _, size, _ in sizes)
    if 2 * params > total:
        raise ValueError(f"{config_name} implies {params:,} parameters ({_config_sizes(config)}), at least "
                         f"{2 * params:,} bytes at 16 bits each, but the weight file(s) hold only {total:,} bytes of "
                         "data: the config does not describe these weights")
    for path, size, declared in sizes:
        if declared and size > 8 * params + _BIN_SLACK_BYTES:
            raise ValueError(f"{path}: its records unpack to {size:,} bytes, more than the {params:,} parameters "
                             f"{config_name} implies can use (8 bytes each at most); refusing to unpickle it")


def _check_rope_table(config: ModelConfig, config_name: str) -> None:
    """``Transformer`` precomputes RoPE for every position up to max_seq_len: refuse a table no machine holds."""
    elements = config.max_seq_len * (config.head_dim // 2)
    if elements > _MAX_ROPE_ELEMENTS:
        raise ValueError(f"{config_name}: max_position_embeddings={config.max_seq_len:,} would make vexact's RoPE "
                         f"table {config.max_seq_len:,} positions x {config.head_dim // 2} frequencies "
                         f"({elements * 8 / 2**30:,.0f} GiB in float64); pass max_seq_len= (the longest sequence "
                         "you need) to from_pretrained")


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[tuple[str, ...], ...]]]:
    """``Transformer(config)``'s parameters by name: (shape, for each dimension the config keys whose product it is).
    Computed, not built: nothing is allocated (``tests/engine/test_real_faults.py`` checks it against
    ``Transformer``)."""
    vocab, hidden, inter, head = ("vocab_size",), ("hidden_size",), ("intermediate_size",), ("head_dim",)
    q, kv = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
    values = _config_values(config)
    layer: list[tuple[str, tuple[tuple[str, ...], ...]]] = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (q, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, q))]
    if config.qkv_bias:
        layer += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)), ("self_attn.v_proj.bias", (kv,))]
    if config.qk_norm:
        layer += [("self_attn.q_norm.weight", (head,)), ("self_attn.k_norm.weight", (head,))]
    layer += [("post_attention_layernorm.weight", (hidden,))]
    dense = [("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter))]
    moe = [("mlp.gate.weight", (("num_experts",), hidden))]
    expert = ("moe_intermediate_size",)
    for e in range(config.num_experts):
        moe += [(f"mlp.experts.{e}.gate_proj.weight", (expert, hidden)), (f"mlp.experts.{e}.up_proj.weight",
                (expert, hidden)), (f"mlp.experts.{e}.down_proj.weight", (hidden, expert))]
    if config.shared_expert_intermediate_size:
        shared = ("shared_expert_intermediate_size",)
        moe += [("mlp.shared_expert.gate_proj.weight", (shared, hidden)),
                ("mlp.shared_expert.up_proj.weight", (shared, hidden)),
                ("mlp.shared_expert.down_proj.weight", (hidden, shared)),
                ("mlp.shared_expert_gate.weight", ((), hidden))]
    dims: dict[str, tuple[tuple[str, ...], ...]] = {"embed_tokens.weight": (vocab, hidden)}
    moe_layers = set(config.moe_layers)
    for i in range(config.num_layers):
        dims.update((f"layers.{i}.{name}", d) for name, d in layer + (moe if i in moe_layers else dense))
    dims["norm.weight"] = (hidden,)
    if not config.tie_embeddings:
        dims["lm_head.weight"] = (vocab, hidden)
    return {name: (tuple(math.prod(values[k] for k in keys) for keys in d), d) for name, d in dims.items()}


def _plan(config: ModelConfig, infos: dict[str, _TensorInfo], source: str, config_name: str) -> dict[str, str]:
    """Check stored tensors (names, dtypes, shapes; nothing read yet) against the config; vexact name -> stored name.

    Dropped on purpose: RoPE ``inv_freq`` buffers (recomputed from the config) and, for tied embeddings, a stored
    ``lm_head.weight`` (transformers ties it to ``embed_tokens`` too). Refused, each with one message: two stored
    names for one parameter, a layer count other than num_hidden_layers, missing or unexpected tensors (no partial
    load), a shape other than the config implies (naming the config keys that disagree), a non-float dtype.
    """
    kept: dict[str, str] = {}
    for stored in infos:
        if stored.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and stored == "lm_head.weight"):
            continue
        name = stored.removeprefix("model.")
        if name in kept:
            raise ValueError(f"{source}: tensors {_short(kept[name])} and {_short(stored)} are both {name!r}")
        kept[name] = stored
    layers = {int(m.group(1)) for name in kept if (m := _LAYER_NAME.match(name))}
    present = max(layers) + 1 if layers else 0
    if present != config.num_layers:
        held = f"tensors of layers 0..{present - 1}" if present else "no layer tensors"
        raise ValueError(f"{config_name}: num_hidden_layers={config.num_layers} disagrees with the weights: "
                         f"{source} holds {held}")
    per_layer = 9 + 3 * config.qkv_bias + 2 * config.qk_norm + 3 * config.num_experts
    if config.num_layers * per_layer > 4 * len(kept) + 1000:  # a hostile layer index: never enumerate billions
        raise ValueError(f"{source} does not match its config: {config_name} implies "
                         f"{config.num_layers * per_layer:,}+ tensors, the weights hold {len(kept):,}")
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(kept))
    unexpected = sorted(set(kept) - set(expected))
    if missing or unexpected:
        parts = [f"{label} {len(names)} tensor(s): {', '.join(n[:100] for n in names[:5])}"
                 + (" ..." if names[5:] else "")
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise ValueError(f"{source} does not match its config: {'; '.join(parts)}")
    values = _config_values(config)
    for name, (shape, dims) in expected.items():
        info = infos[kept[name]]
        if info.shape != shape:
            wrong = [keys for i, keys in enumerate(dims) if i >= len(info.shape) or info.shape[i] != shape[i]] or dims
            keys = list(dict.fromkeys(k for ks in wrong for k in ks))
            said = ", ".join(f"{k}={values[k]}" for k in keys)
            raise ValueError(f"{config_name}: {said} disagree{'s' if len(keys) == 1 else ''} with the weights: "
                             f"tensor {kept[name]!r} in {info.file} has shape {info.shape}, the config implies "
                             f"{shape} = ({', '.join(' x '.join(ks) for ks in dims)})")
        if info.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"{source}: tensor {kept[name]!r} in {info.file} has dtype {info.dtype}; vexact loads "
                             f"floating-point weights ({', '.join(_WEIGHT_DTYPES)}), not integer, boolean or 8-bit "
                             "(quantised) tensors")
    return kept


def _config_values(config: ModelConfig) -> dict[str, int]:
    """The config.json sizes a tensor's shape is a product of, by their HF keys."""
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "num_experts": config.num_experts,
            "moe_intermediate_size": config.expert_intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size}


def _check_finite(tensor: Tensor, stored: str, where: str) -> None:
    if not torch.isfinite(tensor).all():
        nan, bad = int(torch.isnan(tensor).sum()), int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{where}: tensor {stored!r} has non-finite weights ({nan:,} NaN, {bad - nan:,} Inf of "
                         f"{tensor.numel():,} values); refusing to load a checkpoint that is not finite")


def _merge(infos: dict[str, _TensorInfo], more: dict[str, _TensorInfo]) -> None:
    for name, info in more.items():
        if name in infos:
            raise ValueError(f"tensor {_short(name)} is stored twice: in {infos[name].file} and in {info.file}")
        infos[name] = info


def _check_index(index: Path | None, weight_map: dict[str, str], directory: Path,
                 infos: dict[str, _TensorInfo]) -> None:
    """Every tensor an index lists must be in the shard it names (shards may hold tensors it does not list)."""
    for tensor, shard in weight_map.items():
        info = infos.get(tensor)
        if info is None or Path(info.file) != directory / shard:
            raise ValueError(f"{index}: lists tensor {_short(tensor)} in {shard}, but {directory / shard} does not "
                             "hold it")


def read_checkpoint(directory: str | Path, max_seq_len: int | None = None) -> Checkpoint:
    """Read and check a checkpoint directory: config, weight files, every tensor; see the module docstring.

    Order, so that nothing is allocated for a file that does not match its config: config.json; the index; for
    safetensors, every header (dtypes, shapes, offsets against the file size) checked against the config, then
    the data; for ``.bin``, the files' sizes against the config, then weights-only unpickling, then the same
    checks. Finally every tensor must be finite.
    """
    directory = Path(directory)
    hf_config = read_checkpoint_config(directory)
    config_name = str(directory / "config.json")
    config = model_config_from_hf(hf_config, max_seq_len, source=config_name)
    _check_rope_table(config, config_name)
    source = f"checkpoint {directory}"
    files, index, weight_map = _weight_files(directory)
    infos: dict[str, _TensorInfo] = {}
    if files[0].name.endswith(".safetensors"):
        for path in files:
            _merge(infos, _safetensors_header(path))
        _check_index(index, weight_map, directory, infos)
        plan = _plan(config, infos, source, config_name)
        tensors: dict[str, Tensor] = {}
        for path in files:
            wanted = {name: stored for name, stored in plan.items() if infos[stored].file == str(path)}
            read = _read_safetensors(path, list(wanted.values()))
            tensors.update((name, read[stored]) for name, stored in wanted.items())
    else:
        _check_bin_sizes(config, config_name, files)
        raw: dict[str, Tensor] = {}
        for path in files:
            content = _read_bin(path)
            _merge(infos, {name: _TensorInfo(str(path), _TORCH_DTYPE_NAMES.get(t.dtype, str(t.dtype)),
                                             tuple(t.shape)) for name, t in content.items()})
            raw.update(content)
        _check_index(index, weight_map, directory, infos)
        plan = _plan(config, infos, source, config_name)
        tensors = {name: raw[stored] for name, stored in plan.items()}
        del raw
    origin = {name: (infos[stored].file, stored) for name, stored in plan.items()}
    for name, tensor in tensors.items():
        _check_finite(tensor, origin[name][1], origin[name][0])
    return Checkpoint(config, tensors, origin, source)


def _checkpoint_of_model(hf_model: Any, max_seq_len: int | None) -> Checkpoint:
    """The same checks for an already built transformers model (its config and state_dict)."""
    class_name = type(hf_model).__name__
    if class_name not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(f"unsupported architecture: got a {class_name} object; vexact supports {_SUPPORTED_TEXT}")
    config_name, source = f"{class_name}.config", f"{class_name} object"
    config = model_config_from_hf({**hf_model.config.to_dict(), "architectures": [class_name]}, max_seq_len,
                                  source=config_name)
    _check_rope_table(config, config_name)
    state = _per_expert(hf_model.state_dict())
    infos = {name: _TensorInfo(source, _TORCH_DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape))
             for name, t in state.items()}
    plan = _plan(config, infos, source, config_name)
    tensors = {name: state[stored] for name, stored in plan.items()}
    origin = {name: (source, stored) for name, stored in plan.items()}
    for name, tensor in tensors.items():
        _check_finite(tensor, origin[name][1], source)
    return Checkpoint(config, tensors, origin, source)


def _per_expert(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A transformers (5.x) MoE model's state dict with its fused expert tensors -- ``mlp.experts.gate_up_proj``
    [E, 2I, D] (gate rows first, then up), ``mlp.experts.down_proj`` [E, D, I] -- split into the per-expert names its
    checkpoints store (``mlp.experts.N.gate_proj.weight`` ...), which ``Transformer`` uses; other tensors unchanged."""
    out = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition("mlp.experts.")
        if leaf == "gate_up_proj" and tensor.dim() == 3:
            size = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :size]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, size:]
        elif leaf == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
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


def build_model(checkpoint: Checkpoint, backend: str = "exact", dtype: torch.dtype | str = torch.float32,
                device: torch.device | str = "cpu") -> Transformer:
    """A ``Transformer`` with ``checkpoint``'s weights cast to ``dtype``; a weight that is finite in the file but
    overflows ``dtype`` (e.g. float32 3.4e38 in bfloat16) is refused, naming the file and tensor."""
    dtype = resolve_dtype(dtype)
    model = Transformer(checkpoint.config, backend=backend, dtype=dtype, device=device, init_seed=None)
    _load_weights(model, checkpoint.tensors, checkpoint.source)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            file, stored = checkpoint.origin[name]
            peak = float(checkpoint.tensors[name].abs().max())
            raise ValueError(f"{file}: tensor {stored!r} is finite but overflows {short_dtype_name(dtype)} "
                             f"(max |value| {peak:.3g}); load it in float32")
    return model


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name, as on huggingface.co


def _hub_id_hint(path: Path) -> str:
    """For a missing path spelled like a Hugging Face hub id (``Qwen/Qwen2.5-0.5B``): say that vexact downloads
    nothing at run time (results must not depend on the network or on a repository changing under them) and how to
    get a local copy; point at the copy in the Hugging Face cache when there is one. Else ""."""
    text = str(path)
    if not _HUB_ID.fullmatch(text) or path.exists():
        return ""
    local = Path("models") / text.split("/")[1]
    hint = (f". If '{text}' is a Hugging Face hub id: vexact reads local files only and downloads nothing at "
            f"run time. Download it first, e.g. huggingface-cli download {text} --local-dir {local} (or hf "
            f"download), then pass --model {local}")
    cached = _hub_cache_snapshot(text)
    if cached is not None:
        hint += f"; a copy is in your Hugging Face cache: --model {cached}"
    return hint


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of ``repo_id``'s ``main`` revision in the local Hugging Face cache, if its config.json
    is there: huggingface_hub's own lookup (``try_to_load_from_cache``: follows ``refs/main``, honours
    HF_HUB_CACHE / HF_HOME as huggingface_hub read them, never touches the network). None without the package."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except (ValueError, OSError):  # an id the hub's rules refuse, an unreadable cache
        return None
    return Path(found).parent if isinstance(found, str) else None


def read_checkpoint_config(directory: Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory, with one clear error if it is missing, unreadable,
    larger than a config can be, not JSON, or not a JSON object."""
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory not found: {directory}{_hub_id_hint(directory)}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {directory} (expected a Hugging Face checkpoint directory)")
    config = _read_json(config_file, "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object (a Hugging Face config), got {type(config).__name__}")
    return config


def from_pretrained(path_or_model: str | Path | Any, backend: str = "exact", dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu", max_seq_len: int | None = None) -> Transformer:
    """A vexact ``Transformer`` with the weights of a Hugging Face checkpoint.

    ``path_or_model``: a local checkpoint directory (``config.json`` + weights) or a
    ``transformers`` ``*ForCausalLM`` object of a supported architecture (its weights are copied,
    the object is left unchanged). ``backend`` and ``dtype`` are as for ``Transformer``; weights
    are cast to ``dtype`` (float32 or bfloat16). ``max_seq_len`` (default: the checkpoint's
    ``max_position_embeddings``, capped at its sliding window) sizes the RoPE table.
    Raises ValueError with one message for a missing directory or file, an unsupported
    architecture, a broken or hostile file, or weights that do not match the config or are not
    finite (see the module docstring); nothing is allocated for weights that do not match.
    """
    if isinstance(path_or_model, (str, Path)):
        checkpoint = read_checkpoint(path_or_model, max_seq_len)
    elif hasattr(path_or_model, "config") and hasattr(path_or_model, "state_dict"):
        checkpoint = _checkpoint_of_model(path_or_model, max_seq_len)
    else:
        raise ValueError(f"path_or_model must be a checkpoint directory or a transformers model, "
                         f"got {type(path_or_model).__name__}")
    return build_model(checkpoint, backend, dtype, device)


def load_tokenizer(directory: str | Path) -> Any | None:
    """``transformers.AutoTokenizer`` from a checkpoint directory (local files only), or None if it has none.

    A tokenizer that is there but cannot be loaded is one ValueError naming the directory."""
    directory = Path(directory)
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # a broken tokenizer file: transformers and tokenizers raise many kinds of error
        first = (str(err).strip().splitlines() or [""])[0][:120]
        raise ValueError(f"{directory}: cannot load its tokenizer ({type(err).__name__}: {first})") from None


# --------------------------------------------------------------------------- export
def _hf_config_of(config: ModelConfig, dtype: torch.dtype, eos_token_id: int | None) -> Any:
    """The transformers config of the architecture whose math ``Transformer(config)`` runs: the inverse of
    ``model_config_from_hf`` (Qwen3 for q/k norms, Qwen2 for q/k/v biases, else Llama)."""
    import transformers

    if config.qk_norm and config.qkv_bias:
        raise ValueError("cannot export a model with both q/k/v biases and q/k norms: no supported architecture "
                         f"has both ({_SUPPORTED_TEXT})")
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


def export_hf_checkpoint(model: Transformer, directory: str | Path, eos_token_id: int | None = None) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (``config.json`` + ``model.safetensors``, the
    model's own dtype) that transformers, vLLM and ``from_pretrained`` load: the way to run another engine on a
    vexact model's weights. The tensors are the model's parameters bit for bit, under transformers' names
    (``model.`` prefix, ``lm_head.weight`` only when untied); ``max_position_embeddings`` is the model's
    ``max_seq_len``. Returns ``directory``."""
    from safetensors.torch import save_file

    if not isinstance(model, Transformer):
        raise ValueError(f"export_hf_checkpoint needs a vexact Transformer, got {type(model).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot export to {directory}: it exists and is not a directory")
    dtype = next(model.parameters()).dtype
    hf_config = _hf_config_of(model.config, dtype, eos_token_id)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(directory)
    save_file(hf_tensors(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def hf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """``model``'s parameters under transformers' names (``model.`` prefix, ``lm_head.weight`` only when untied),
    bit for bit, as detached contiguous CPU copies: the tensors of ``export_hf_checkpoint`` and of a weight update
    sent to another engine."""
    return {name if name == "lm_head.weight" else f"model.{name}": p.detach().cpu().contiguous().clone()
            for name, p in model.named_parameters()}
