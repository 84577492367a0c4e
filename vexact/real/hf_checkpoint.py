"""A Hugging Face checkpoint read and checked: its config, its weight files, every tensor, before a model is built.

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
  then the content must be a dict of dense tensors with values (no meta tensors), checked like a safetensors
  header before the model is built.
- values: a NaN/Inf weight is refused at load (file, tensor, counts), and so is a finite weight
  that overflows the requested dtype (e.g. fp32 3.4e38 in bf16).
- a tied head (``tie_word_embeddings``) with a stored ``lm_head.weight`` loads as transformers 5 loads it: tied
  where the stored head equals ``embed_tokens.weight`` bit for bit, else untied, with the stored head.
- RoPE: ``Transformer`` precomputes a table of max_seq_len positions; a max_position_embeddings
  that would need more than 2^28 entries is refused unless ``max_seq_len`` is passed.

``read_checkpoint`` returns a ``Checkpoint`` (the ``ModelConfig`` and the tensors under ``Transformer``'s names);
``checkpoint_of_model`` does the same for an already built ``transformers`` model.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.model import ModelConfig, parameter_count
from ..records.runlog import load_tensor_file
from .hf_config import SUPPORTED_ARCHITECTURES, SUPPORTED_TEXT, model_config_from_hf, short

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
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
            raise ValueError(f"{index}: malformed index: tensor {short(tensor)} maps to {short(shard)}, not a "
                             "file name in the checkpoint directory")
        safetensors_index = name.startswith("model.safetensors")
        if safetensors_index != shard.endswith(".safetensors"):
            raise ValueError(f"{index}: malformed index: shard {short(shard)} is not a "
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
            return f"malformed header entry for tensor {short(name)}"
        if end > data_len:
            return f"tensor {short(name)} needs bytes up to {end:,} of the data, the file holds {data_len:,}"
        if end - start != needed:
            return (f"tensor {short(name)} of shape {shape} and dtype {dtype} needs {needed:,} bytes, its "
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
            raise ValueError(f"{path}: entry {short(name)} is a {type(tensor).__name__}, not a named tensor")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise ValueError(f"{path}: tensor {short(name)} is a {tensor.layout} / quantised tensor; vexact loads "
                             "dense floating-point weights")
        if tensor.device.type != "cpu":  # map_location="cpu" moves all but meta tensors, which hold no values
            raise ValueError(f"{path}: tensor {short(name)} is on the {tensor.device.type} device, with a shape but "
                             "no values (saved from a model not yet materialised); vexact loads weights with values")
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


def _tensor_count(config: ModelConfig) -> int:
    """How many tensors ``_expected_shapes(config)`` names, by arithmetic: experts only in ``config.moe_layers``."""
    attention = 6 + 3 * config.qkv_bias + 2 * config.qk_norm  # two norms, q/k/v/o, biases, q/k norms
    moe = len(config.moe_layers)
    expert_mlp = 1 + 3 * config.num_experts + 4 * bool(config.shared_expert_intermediate_size)  # router, shared
    return (2 + (not config.tie_embeddings) + config.num_layers * attention + (config.num_layers - moe) * 3
            + moe * expert_mlp)


def _plan(config: ModelConfig, infos: dict[str, _TensorInfo], source: str, config_name: str) -> dict[str, str]:
    """Check stored tensors (names, dtypes, shapes; nothing read yet) against the config; vexact name -> stored name.

    Dropped on purpose: RoPE ``inv_freq`` buffers (recomputed from the config). A stored ``lm_head.weight`` of a
    tied config is kept, checked as an untied head's; ``_settle_tie`` decides by its values. Refused, each with one
    message: two stored names for one parameter, a layer count other than num_hidden_layers, missing or unexpected
    tensors (no partial load), a shape other than the config implies (naming the config keys that disagree), a
    non-float dtype.
    """
    if config.tie_embeddings and "lm_head.weight" in infos:
        config = replace(config, tie_embeddings=False)  # only for the shapes: the head is checked like any tensor
    kept: dict[str, str] = {}
    for stored in infos:
        if stored.endswith("rotary_emb.inv_freq"):
            continue
        name = stored.removeprefix("model.")
        if name in kept:
            raise ValueError(f"{source}: tensors {short(kept[name])} and {short(stored)} are both {name!r}")
        kept[name] = stored
    layers = {int(m.group(1)) for name in kept if (m := _LAYER_NAME.match(name))}
    present = max(layers) + 1 if layers else 0
    if present != config.num_layers:
        held = f"tensors of layers 0..{present - 1}" if present else "no layer tensors"
        raise ValueError(f"{config_name}: num_hidden_layers={config.num_layers} disagrees with the weights: "
                         f"{source} holds {held}")
    implied = _tensor_count(config)
    if implied > 4 * len(kept) + 1000:  # a hostile layer index: never enumerate billions
        raise ValueError(f"{source} does not match its config: {config_name} implies {implied:,} tensors, the "
                         f"weights hold {len(kept):,}")
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


def _settle_tie(config: ModelConfig, tensors: dict[str, Tensor], origin: dict[str, tuple[str, str]]) -> ModelConfig:
    """The config a tied checkpoint that also stores ``lm_head.weight`` runs as, in transformers (5.x, the
    reference): a stored head equal to ``embed_tokens.weight`` bit for bit is tied (dropped from ``tensors`` and
    ``origin``; ``.bin`` files store both names for one tensor), a different one is kept and the head left untied
    (transformers: "both are present ... we will NOT tie them"). Tying it anyway ran another model than transformers
    does: a mismatch no engine has."""
    head = tensors.get("lm_head.weight")
    if not config.tie_embeddings or head is None:
        return config
    embed = tensors["embed_tokens.weight"]
    common = torch.promote_types(head.dtype, embed.dtype)  # transformers compares them loaded in one dtype
    if torch.equal(head.to(common), embed.to(common)):
        del tensors["lm_head.weight"], origin["lm_head.weight"]
        return config
    return replace(config, tie_embeddings=False)


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
            raise ValueError(f"tensor {short(name)} is stored twice: in {infos[name].file} and in {info.file}")
        infos[name] = info


def _check_index(index: Path | None, weight_map: dict[str, str], directory: Path,
                 infos: dict[str, _TensorInfo]) -> None:
    """Every tensor an index lists must be in the shard it names (shards may hold tensors it does not list)."""
    for tensor, shard in weight_map.items():
        info = infos.get(tensor)
        if info is None or Path(info.file) != directory / shard:
            raise ValueError(f"{index}: lists tensor {short(tensor)} in {shard}, but {directory / shard} does not "
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
    config = _settle_tie(config, tensors, origin)
    for name, tensor in tensors.items():
        _check_finite(tensor, origin[name][1], origin[name][0])
    return Checkpoint(config, tensors, origin, source)


def checkpoint_of_model(hf_model: Any, max_seq_len: int | None) -> Checkpoint:
    """The same checks for an already built transformers model (its config and state_dict)."""
    class_name = type(hf_model).__name__
    if class_name not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(f"unsupported architecture: got a {class_name} object; vexact supports {SUPPORTED_TEXT}")
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
    config = _settle_tie(config, tensors, origin)
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
    if directory.is_file():  # config.json itself, say: the directory that holds it is the checkpoint
        raise ValueError(f"{directory} is a file, not a checkpoint directory; pass the directory that holds it "
                         f"({directory.parent})")
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory not found: {directory}{_hub_id_hint(directory)}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {directory} (expected a Hugging Face checkpoint directory)")
    config = _read_json(config_file, "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object (a Hugging Face config), got {type(config).__name__}")
    return config
