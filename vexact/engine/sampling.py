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


def _mix32_lanes_(x: Tensor, scratch: Tensor) -> Tensor:
    """``_mix32`` in place on int32 lanes holding the 32-bit patterns: the same bits at half the memory traffic of
    int64 and no temporaries (the sampler's [B, V] hash). A product keeps its low 32 bits as int32 wraps around; a
    right shift of a negative lane brings in ones, masked off to give the logical shift."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B - 2**32), (16, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        scratch &= (1 << (32 - shift)) - 1
        x ^= scratch
        if factor is not None:
            x *= factor
    return x


def counter_uniform(seed: int, sequence_ids: Tensor, positions: Tensor, width: int) -> Tensor:
    """Uniform(0, 1) float64 [B, width], a pure function of (seed, sequence_ids[b], positions[b], column)."""
    key = _mix32(torch.full_like(sequence_ids, seed & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ (sequence_ids & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    # per column: _mix32(_mix32(key ^ column) ^ (seed >> 32)), on int32 lanes (_mix32_lanes_)
    signed_key = (key - ((key >> 31) << 32)).to(torch.int32)  # the same 32 bits as an int32
    bits = signed_key[:, None] ^ torch.arange(width, device=sequence_ids.device, dtype=torch.int32)[None, :]
    scratch = torch.empty_like(bits)
    _mix32_lanes_(bits, scratch)
    high = seed >> 32 & _MASK32
    if high:  # x ^ 0 is x: a seed below 2^32 skips the pass
        bits ^= high - ((high >> 31) << 32)
    _mix32_lanes_(bits, scratch)
    uniform = bits.to(torch.int64)
    uniform &= _MASK32  # back to the unsigned value
    uniform = uniform.double()
    uniform += 0.5
    uniform *= 2.0**-32  # exactly the division by 2^32 (a power of two)
    return uniform  # strictly inside (0, 1)


def counter_normal(seed: int, sequence_ids: Tensor, positions: Tensor, width: int) -> Tensor:
    """Standard normal float64 [B, width] keyed like ``counter_uniform`` (Box-Muller)."""
    u1 = counter_uniform(seed, sequence_ids, positions, width)
    u2 = counter_uniform(seed ^ 0x5BD1E995, sequence_ids, positions, width)
    radius = elementwise("sqrt", -2.0 * elementwise("log", u1))  # the host's sqrt, guarded like log and cos
    return radius * elementwise("cos", (2.0 * torch.pi) * u2)


def gumbel_noise(seed: int, sequence_ids: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Gumbel(0, 1) noise [B, V] in float64 for rows keyed by (seed, sequence_ids[b], positions[b])."""
    minus_log = elementwise("log", counter_uniform(seed, sequence_ids, positions, vocab_size)).neg_()
    return elementwise("log", minus_log).neg_()  # -log(-log(u)); negation in place is exact


def sample_tokens(scaled_logits: Tensor, seed: int, sequence_ids: Tensor, positions: Tensor,
                  greedy: bool) -> Tensor:
    """Token per row: argmax(logits + Gumbel) (a draw from softmax(logits)), or argmax when greedy."""
    if greedy:
        return scaled_logits.argmax(dim=-1)
    noise = gumbel_noise(seed, sequence_ids, positions, scaled_logits.shape[-1])
    noise += scaled_logits  # in float64 (fp32 logits widen exactly): the bits of logits.double() + noise
    return noise.argmax(dim=-1)
