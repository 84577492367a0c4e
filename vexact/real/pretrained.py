"""Load Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) into vexact's ``Transformer``.

Why: vexact must diagnose users' real models, not only toy ones. ``Transformer`` already uses
Hugging Face's parameter names, so loading is a name check plus a copy -- but only for
architectures whose math ``Transformer.forward`` reproduces exactly. Anything else (another
``model_type``, a non-SiLU MLP, biases the model has no slot for, RoPE variants other than plain
and Llama-3 scaling, quantised weights) is refused with one error naming what the checkpoint asked
for and what is supported: a partial load or a silently different model would make every
mismatch number meaningless.

Modules, in the order a load runs: ``hf_config`` (``config.json`` -> ``ModelConfig``: which architectures, what is
refused), ``hf_checkpoint`` (the weight files read and checked against that config, before anything is allocated),
and this one (the ``Transformer`` built from a checked checkpoint; its tokenizer; export back to a checkpoint).

Small random-init checkpoints of every supported architecture, and the parity check against transformers, are
``vexact.real.tiny``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.model import Transformer, resolve_dtype, short_dtype_name
from .hf_checkpoint import Checkpoint, checkpoint_of_model, read_checkpoint
from .hf_config import hf_config_of


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
    finite (the checks: ``vexact.real.hf_checkpoint``'s docstring); nothing is allocated for weights that do not match.
    """
    if isinstance(path_or_model, (str, Path)):
        checkpoint = read_checkpoint(path_or_model, max_seq_len)
    elif hasattr(path_or_model, "config") and hasattr(path_or_model, "state_dict"):
        checkpoint = checkpoint_of_model(path_or_model, max_seq_len)
    else:
        raise ValueError(f"path_or_model must be a checkpoint directory or a transformers model, "
                         f"got {type(path_or_model).__name__}")
    return build_model(checkpoint, backend, dtype, device)


def load_tokenizer(directory: str | Path) -> Any | None:
    """``transformers.AutoTokenizer`` from a checkpoint directory (local files only), or None if it has none.

    A tokenizer that is there but cannot be loaded is one ValueError naming the directory; a config.json field that
    transformers' own config check refuses (its tokenizer loader reads config.json too) names config.json and the
    field -- a value vexact accepts, as an integral float size such as 128.0, among them."""
    directory = Path(directory)
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except StrictDataclassFieldValidationError as err:  # "Validation error for field 'K':\n    TypeError: Field ..."
        why = str(err).strip().splitlines()[-1].strip().split(": ", 1)[-1].split(". Errors: ")[0][:200]
        raise ValueError(f"{directory / 'config.json'}: transformers refuses it, so its tokenizer cannot be loaded "
                         f"({why})") from None
    except Exception as err:  # a broken tokenizer file: transformers and tokenizers raise many kinds of error
        first = (str(err).strip().splitlines() or [""])[0][:120]
        raise ValueError(f"{directory}: cannot load its tokenizer ({type(err).__name__}: {first})") from None


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
    hf_config = hf_config_of(model.config, dtype, eos_token_id)
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
