"""Seeded, batch-invariant sampling: counter-based Gumbel-max.

A sampled token depends only on (seed, the prompt's index in the ``generate`` call, the
response position) and the logits row -- never on batch size or neighbours. The Gumbel
noise for vocabulary entry v is a pure function of (seed, index, position, v): an integer
hash computed with torch integer ops (exact), turned into a uniform and then Gumbel noise
with the exact kernels' chunked, host-guarded ``log`` and ``cos`` (position-invariant elementwise math).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vexact_kernels.cpu_exact import elementwise

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: int, sequence_ids: Tensor, positions: Tensor, width: int) -> Tensor:
    """Uniform(0, 1) float64 [B, width], a pure function of (seed, sequence_ids[b], positions[b], column)."""
    key = _mix32(torch.full_like(sequence_ids, seed & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ (sequence_ids & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    columns = torch.arange(width, device=sequence_ids.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ columns[None, :]) ^ (seed >> 32 & _MASK32))
    return (bits.double() + 0.5) / 2.0**32  # strictly inside (0, 1)


def counter_normal(seed: int, sequence_ids: Tensor, positions: Tensor, width: int) -> Tensor:
    """Standard normal float64 [B, width] keyed like ``counter_uniform`` (Box-Muller)."""
    u1 = counter_uniform(seed, sequence_ids, positions, width)
    u2 = counter_uniform(seed ^ 0x5BD1E995, sequence_ids, positions, width)
    radius = elementwise("sqrt", -2.0 * elementwise("log", u1))  # the host's sqrt, guarded like log and cos
    return radius * elementwise("cos", (2.0 * torch.pi) * u2)


def gumbel_noise(seed: int, sequence_ids: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Gumbel(0, 1) noise [B, V] in float64 for rows keyed by (seed, sequence_ids[b], positions[b])."""
    uniform = counter_uniform(seed, sequence_ids, positions, vocab_size)
    return -elementwise("log", -elementwise("log", uniform))


def sample_tokens(scaled_logits: Tensor, seed: int, sequence_ids: Tensor, positions: Tensor,
                  greedy: bool) -> Tensor:
    """Token per row: argmax(logits + Gumbel) (a draw from softmax(logits)), or argmax when greedy."""
    if greedy:
        return scaled_logits.argmax(dim=-1)
    noise = gumbel_noise(seed, sequence_ids, positions, scaled_logits.shape[-1])
    return (scaled_logits.double() + noise).argmax(dim=-1)
