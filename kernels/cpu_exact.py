"""Exact CPU backend: batch-invariant, thread-count-invariant kernels built from torch ops.

Why torch's own ops are not enough (measured on this project's CI machines, see
``shared/REFERENCE.md``): ``x @ W`` picks a different BLAS kernel for M = 1, for small M and
for some thread counts, so a row's result depends on how many rows sit beside it; SDPA's
last prefill row differs from a single-query decode; wide sums change with the thread count.

How this module gets exactness anyway -- three building blocks, each invariant:

1. **Fixed-shape matmul tiles** (``_tiled_matmul``): rows are zero-padded to a multiple of
   ``ROW_BLOCK`` (64) and the output width to a multiple of ``COL_BLOCK`` (64); one batched
   ``torch.bmm`` then runs the *same* GEMM shape for every 64-row block, whatever M is.
   Each output element's K-reduction therefore always runs through the same kernel in the
   same order. This is invariant by observation (MKL on x86-64), not by proof, which is why
   ``tests/test_kernels.py`` checks it for 1, 2 and 3 threads and odd shapes on every run.
2. **Halving-tree sums** (``_tree_sum``): a row is summed by repeatedly adding its two halves.
   Each step is an elementwise IEEE add (exactly rounded, identical in vector and scalar
   code), so the result depends only on the row's values -- invariant by construction.
   Zero padding at the end of a row does not change the result (x + 0 == x), which lets a
   decode step (short key row) and a prefill row (long, masked key row) sum identically.
3. **Chunked transcendentals** (``_unary``): ``exp``/``log`` run over the flattened tensor in
   chunks of ``CHUNK`` elements -- below ATen's parallel grain size (so one thread does a
   whole chunk) and a multiple of 64 (so every element takes the vectorised path, never the
   scalar tail loop, whose rounding can differ).

Everything is computed in fp32 (bf16 inputs are upcast: a bf16 x bf16 product is exact in
fp32) and rounded once to the output dtype. Backward passes use standard torch ops (see
``autograd.exact_forward``): the forward is exact, the gradients are deterministic run to run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import native
from .autograd import exact_forward, exact_linear

NAME = "cpu_exact"

ROW_BLOCK = 64  # rows per GEMM tile: every matmul call sees exactly this many rows
COL_BLOCK = 64  # output columns are padded to a multiple of this (odd N changed MKL's threading)
CHUNK = 16384  # elements per transcendental call: < ATen GRAIN_SIZE (32768), multiple of 64


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------- building blocks
def _tiled_matmul(x: Tensor, w_t: Tensor) -> Tensor:
    """fp32 [M, K] @ [K, N] -> [M, N] through fixed [ROW_BLOCK, K] x [K, N_pad] GEMM tiles."""
    rows, k = x.shape
    n = w_t.shape[1]
    n_pad = _ceil_to(n, COL_BLOCK)
    if n_pad != n:
        w_t = torch.nn.functional.pad(w_t, (0, n_pad - n))
    blocks = max(1, -(-rows // ROW_BLOCK))
    x_pad = x.new_zeros(blocks * ROW_BLOCK, k)
    x_pad[:rows] = x
    out = torch.bmm(x_pad.view(blocks, ROW_BLOCK, k), w_t.unsqueeze(0).expand(blocks, k, n_pad))
    return out.view(blocks * ROW_BLOCK, n_pad)[:rows, :n]


def _tree_sum(x: Tensor) -> Tensor:
    """Sum over the last dim by halving: [..., D] -> [...]. Depends only on the row's values;
    trailing zeros do not change the result."""
    width = x.shape[-1]
    pow2 = 1 << max(0, (width - 1).bit_length())
    if pow2 != width:
        x = torch.nn.functional.pad(x, (0, pow2 - width))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _unary(fn: Callable[..., Tensor], x: Tensor) -> Tensor:
    """Apply an elementwise torch function chunk by chunk (see module docstring, point 3)."""
    flat = x.contiguous().view(-1)
    total = flat.numel()
    padded = _ceil_to(max(total, 1), 64)
    if padded != total:
        flat = torch.cat([flat, flat.new_zeros(padded - total)])
    out = torch.empty_like(flat)
    for start in range(0, padded, CHUNK):
        fn(flat[start : start + CHUNK], out=out[start : start + CHUNK])
    return out[:total].view(x.shape)


# --------------------------------------------------------------------------- linear


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows = x.reshape(-1, x.shape[-1]).float()
    out = _tiled_matmul(rows, weight.float().t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N] in x.dtype.

    Invariance contract: each output row depends only on the same input row, the weight and
    the bias -- never on how many rows there are, the row's position among them, padding
    rows, or the torch thread count. fp32 accumulation; bias added in fp32; one rounding to
    x.dtype. Tiling: rows in fixed 64-row GEMM tiles, columns padded to a multiple of 64.
    """
    return exact_linear(_linear_forward, x, weight, bias)


# --------------------------------------------------------------------------- row-wise ops
def _rms_norm_exact(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    mean_sq = _tree_sum(xf * xf) / x.shape[-1]
    inv_rms = 1.0 / torch.sqrt(mean_sq + eps)  # sqrt and / are exactly rounded; rsqrt is not
    return (xf * inv_rms.unsqueeze(-1) * weight.float()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, fp32 inside.

    Invariance contract: each output row depends only on that input row, the weight and eps
    -- never on the number of rows, their order, padding or the thread count (halving-tree
    sum, exactly rounded sqrt/div; no rsqrt, whose vector and scalar paths round differently).
    """
    return exact_forward(_rms_norm_exact, native.rms_norm, (x, weight), (eps,))


def _log_softmax_exact(logits: Tensor) -> Tensor:
    shifted, log_normalizer = _shift_and_log_normalizer(logits)
    return shifted - log_normalizer.unsqueeze(-1)


def _shift_and_log_normalizer(logits: Tensor) -> tuple[Tensor, Tensor]:
    xf = logits.float()
    row_max = xf.amax(dim=-1, keepdim=True)  # max is exact in any order
    shifted = xf - row_max
    return shifted, _unary(torch.log, _tree_sum(_unary(torch.exp, shifted)))


def log_softmax(logits: Tensor) -> Tensor:
    """log_softmax over the last dim, fp32 result.

    Invariance contract: each output row depends only on that logits row -- never on the
    number of rows, their order, the vocabulary being split into chunks, or thread count.
    Computed as (x - max) - log(tree_sum(exp(x - max))).
    """
    return exact_forward(_log_softmax_exact, native.log_softmax, (logits,))


def _token_logprobs_exact(logits: Tensor, targets: Tensor) -> Tensor:
    shifted, log_normalizer = _shift_and_log_normalizer(logits)
    return shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normalizer


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per row: logits [..., V], targets [...] int64 -> fp32 [...].

    Invariance contract: as ``log_softmax`` (and bitwise equal to ``log_softmax(x)[target]``):
    each value depends only on its own logits row and target.
    """
    return exact_forward(_token_logprobs_exact, native.token_logprobs, (logits,), (targets,))


# --------------------------------------------------------------------------- elementwise ops
def _silu_mul_exact(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.float()
    silu = g / (1.0 + _unary(torch.exp, -g))
    return silu.to(gate.dtype) * up


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation silu(gate) * up, elementwise.

    Invariance contract: each output element depends only on the matching gate and up
    elements -- not on the tensor's size or the element's position (torch's own ``silu`` /
    ``sigmoid`` round differently in their vector body and scalar tail; here silu is
    g / (1 + exp(-g)) with chunked exp and exactly rounded add/div).
    """
    return exact_forward(_silu_mul_exact, native.silu_mul, (gate, up))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half convention). x: [B, T, H, hd]; cos/sin: [B, T, hd/2] fp32.

    Invariance contract: each output element depends only on its own (x pair, cos, sin)
    elements. Only exactly rounded elementwise mul/add/sub are used (no fused ops), so the
    native implementation already satisfies the contract and is reused as is.
    """
    return native.rope(x, cos, sin)


# --------------------------------------------------------------------------- attention
def _attention_exact(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    tile = ROW_BLOCK
    # Keys needed: up to the furthest query position, in whole 64-key tiles.
    key_len = _ceil_to(int(q_start.max()) + q_len, tile)
    key_blocks = key_len // tile

    # Rows of one (batch, kv head): the group's query heads for every query, t-major.
    rows = q_len * group
    row_len = _ceil_to(rows, tile)
    row_blocks = row_len // tile
    q_rows = q.float().view(batch, q_len, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q_tiles = q.new_zeros(batch, kv_heads, row_len, head_dim, dtype=torch.float32)
    q_tiles[:, :, :rows] = q_rows.reshape(batch, kv_heads, rows, head_dim)
    # Padding rows act as the sequence's first query (finite results, ignored).
    row_pos = torch.arange(row_len, device=q.device) // group
    row_pos = torch.where(row_pos < q_len, row_pos, 0)
    query_pos = q_start[:, None] + row_pos[None, :]  # [B, row_len]

    def key_tiles(cache: Tensor) -> Tensor:  # [B, L, Hkv, hd] -> [B, Hkv, key_blocks, 64, hd] fp32
        kv = cache[:, :key_len].float()
        if kv.shape[1] < key_len:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, key_len - kv.shape[1]))
        return kv.permute(0, 2, 1, 3).reshape(batch, kv_heads, key_blocks, tile, head_dim)

    k_t, v_t = key_tiles(k_cache), key_tiles(v_cache)
    tiles = batch * kv_heads * row_blocks * key_blocks
    q_b = q_tiles.view(batch, kv_heads, row_blocks, 1, tile, head_dim).expand(-1, -1, -1, key_blocks, -1, -1)
    k_b = k_t.unsqueeze(2).expand(-1, -1, row_blocks, -1, -1, -1)
    scores = torch.bmm(q_b.reshape(tiles, tile, head_dim), k_b.reshape(tiles, tile, head_dim).transpose(1, 2))
    scores = scores.view(batch, kv_heads, row_blocks, key_blocks, tile, tile) * scale

    # Row-wise softmax on the real rows only (decode has 1-2 real rows per 64-row tile):
    # [B, Hkv, row_len, key_blocks, 64] -> the first `rows` rows.
    scores = scores.permute(0, 1, 2, 4, 3, 5).reshape(batch, kv_heads, row_len, key_blocks, tile)[:, :, :rows]
    key_pos = torch.arange(key_len, device=q.device).view(1, 1, 1, key_blocks, tile)
    visible = key_pos <= query_pos[:, None, :rows, None, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=(3, 4), keepdim=True)  # max is exact in any order
    probs = _unary(torch.exp, scores - row_max)  # masked keys: exactly 0
    denom = _tree_sum(_tree_sum(probs))  # within each key tile, then across tiles (zero tails are no-ops)

    # P @ V in fixed [64 x 64] @ [64 x hd] tiles, then a tree over key tiles in position order.
    probs_tiles = probs.new_zeros(batch, kv_heads, row_len, key_blocks, tile)
    probs_tiles[:, :, :rows] = probs
    probs_tiles = probs_tiles.view(batch, kv_heads, row_blocks, tile, key_blocks, tile).transpose(3, 4)
    v_b = v_t.unsqueeze(2).expand(-1, -1, row_blocks, -1, -1, -1)
    partial = torch.bmm(probs_tiles.reshape(tiles, tile, tile), v_b.reshape(tiles, tile, head_dim))
    partial = partial.view(batch, kv_heads, row_blocks, key_blocks, tile, head_dim)
    summed = _tree_sum(partial.permute(0, 1, 2, 4, 5, 3))  # [B, Hkv, row_blocks, 64, hd]
    summed = summed.reshape(batch, kv_heads, row_len, head_dim)[:, :, :rows]
    out = summed / denom.unsqueeze(-1)
    out = out.view(batch, kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, q_len, q_heads, head_dim).to(q.dtype)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    """Causal grouped-query attention of new queries against a KV cache (prefill and decode).

    q: [B, T, Hq, hd]; k_cache, v_cache: [B, L, Hkv, hd]; q_start: [B] int64. Query t of
    sequence b sits at position q_start[b] + t and sees cache positions 0 .. q_start[b] + t.

    Invariance contract: a query's output depends only on its own vector and its own
    sequence's keys/values at positions <= its position -- never on the batch, other
    sequences, T (prefill vs decode), cache contents after its position (which must be
    finite), or the thread count. So decode step t equals row t of a prefill bit for bit.

    Tiling: queries (the group's heads folded into rows) in 64-row tiles, keys in 64-key
    tiles from position 0; every (query tile, key tile) pair is one fixed-shape GEMM. Masked
    scores give probability exactly 0, so tiles past a query's position add exact zeros to
    the position-ordered tree sums, and a short decode row reduces like a long prefill row.
    """
    return exact_forward(_attention_exact, native.attention, (q, k_cache, v_cache), (q_start, scale))
