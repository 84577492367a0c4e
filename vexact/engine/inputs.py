"""Validation and padding of token-id prompts/responses shared by rollout and scoring."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor


def _token_ids(seq: object) -> object:
    """A 1-D tensor's or numpy array's ids as a list, numpy integers as ints; anything else as it is (then judged)."""
    if isinstance(seq, np.ndarray) and seq.ndim == 1:  # its items judged as a list's
        return seq.tolist()
    if isinstance(seq, (list, tuple)) and any(isinstance(t, np.integer) for t in seq):
        return [int(t) if isinstance(t, np.integer) else t for t in seq]
    return seq


def check_token_lists(name: str, seqs: object, vocab_size: int, allow_empty_items: bool = False) -> list[list[int]]:
    """Validate a list of token-id lists (each a list of ints, a 1-D tensor or a 1-D integer numpy array); one clear
    ValueError naming the problem."""
    if isinstance(seqs, (Tensor, np.ndarray)):
        kind = "tensor" if isinstance(seqs, Tensor) else "numpy array"
        raise ValueError(f"{name} must be a list of lists of ints, got a {kind} of shape {tuple(seqs.shape)}")
    if not isinstance(seqs, (list, tuple)):
        raise ValueError(f"{name} must be a non-empty list of token-id lists, got a {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError(f"{name} must be a non-empty list of token-id lists, got an empty one")
    out = []
    for i, seq in enumerate(seqs):
        if isinstance(seq, Tensor):
            if seq.dim() != 1:
                raise ValueError(f"{name}[{i}] must be 1-D, got shape {tuple(seq.shape)}")
            seq = seq.tolist()
        seq = _token_ids(seq)
        if not isinstance(seq, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            odd = next((t for t in seq if not isinstance(t, int) or isinstance(t, bool)), None) \
                if isinstance(seq, (list, tuple)) else seq
            raise ValueError(f"{name}[{i}] must be a list of ints, got a {type(odd).__name__} ({odd!r})"[:300])
        if not seq and not allow_empty_items:
            raise ValueError(f"{name}[{i}] is empty")
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append(list(seq))
    return out


MIN_TEMPERATURE = 1e-6
"""The smallest positive temperature: logits divided by less can overflow float32 (a temperature of 1e-40 made
every log-prob NaN); 0 is greedy."""


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float: 0 (greedy) or a finite number >= ``MIN_TEMPERATURE``; else one ValueError."""
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0
            or not math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature {temperature!r} is below {MIN_TEMPERATURE:g}: the scaled logits can overflow "
                         "float32 (NaN log-probs); use 0 for greedy")
    return float(temperature)


def check_model(model: object, ops: object = None) -> None:
    """What ``generate`` and ``token_logprobs`` run: a vexact ``Transformer`` whose parameters are all of one dtype the
    kernels take (fp32 or bf16: a model cast after construction, ``.half()``, failed inside a kernel), and ``ops``
    None or kernel ops (``vexact_kernels.get_ops(name)``: a backend's name failed deep in the forward)."""
    from vexact_kernels import OP_NAMES

    from .model import DTYPES, Transformer

    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a vexact Transformer (vexact.from_pretrained loads a Hugging Face "
                         f"checkpoint as one), got {type(model).__name__}")
    params = list(model.named_parameters())
    first = params[0][1].dtype if params else None
    odd = next(((n, p.dtype) for n, p in params if p.dtype != first or p.dtype not in DTYPES.values()), None)
    if odd is not None:
        raise ValueError(f"model parameters must all be float32 or all bfloat16 (Transformer(dtype=...)); {odd[0]} "
                         f"is {odd[1]}" + (f", {params[0][0]} {first}" if odd[1] != first else ""))
    if ops is not None and not all(hasattr(ops, name) for name in OP_NAMES):
        raise ValueError(f"ops must be kernel ops (vexact_kernels.get_ops('native'), say), got "
                         f"{type(ops).__name__} {ops!r}"[:300])


def tensor_from_numpy(array: Any, what: str) -> Tensor:
    """A numpy array as a tensor of its own dtype (on its memory where it is contiguous); an array of no number dtype
    (object -- a ragged batch --, strings) is one ValueError naming ``what`` (torch's TypeError names neither)."""
    import numpy as np

    array = np.ascontiguousarray(np.asarray(array))
    try:
        return torch.from_numpy(array)
    except TypeError:
        raise ValueError(f"{what} is a numpy array of dtype {array.dtype}, not numbers (a ragged batch: pass a list "
                         "of 1-D arrays)") from None


def check_batch_size(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def pad_right(seqs: list[list[int]], device: torch.device, pad_id: int = 0) -> Tensor:
    """[B, max_len] int64, right-padded with ``pad_id``."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def padded_with_mask(seqs: list[list[int]], pad_id: int = 0, left: bool = False) -> tuple[Tensor, Tensor]:
    """[B, max_len] int64 ids and their 0/1 attention mask (on CPU), for models that take a mask
    (transformers). ``left``: pad before the tokens, so every sequence ends at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def scale_logits(logits: Tensor, temperature: float) -> Tensor:
    """fp32 logits / temperature; temperature 0 (greedy) scores under the unscaled distribution."""
    logits = logits.float()
    return logits if temperature in (0.0, 1.0) else logits / temperature
