"""The exact Triton attention (``triton_exact.attention``, whose docstring states its contract): the forward kernel
(``_attention_kernel``) and its launch (``attention_exact``; ``_attention_forward`` also stores the log-sum-exp a
backward needs), the three FlashAttention-2-style backward kernels and their launch (``_attention_backward``), and
the pair ``exact_forward_vjp`` takes (``attention_with_saved``, ``attention_vjp``), with attention's own tiles
(``_ATTENTION_TILES``, ``_ATTENTION_BACKWARD_TILES``).

Why apart: attention is half of the backend's kernel code (a forward and three backward kernels with their helpers);
``triton_exact`` keeps the op itself -- its signature, its input checks and its contracts -- and calls this module,
as ``cpu_exact.attention`` calls ``cpu_attention``. Of the backend it imports ``triton_common`` alone (the mode,
``cast``, ``block_dot`` / ``block_sum``); ``native`` only for the tests' reference, ``_attention_backward_reference``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import native, triton_common
from .triton_common import COMPILE_OPTIONS, MASKED_SCORE, block_dot, block_sum, cast, check_device, input_precision

# isort: split
# triton after triton_common, which decides before triton is imported whether the kernels are interpreted
import triton
import triton.language as tl

LOG2_E = 1.0 / math.log(2.0)  # scores are scaled by this so the kernel can use exp2

# Fixed tile shapes (as ``triton_exact``'s): they may depend on the dtype and on the mode, never on the data's
# row count or sequence length: changing them changes the reduction order (and so the bits).
if triton_common.INTERPRETING:
    # Attention tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages). Small, so that short test
    # sequences still span several key blocks.
    _ATTENTION_TILES = {dtype: (16, 16, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    _ATTENTION_BACKWARD_TILES = dict(_ATTENTION_TILES)
else:
    _ATTENTION_TILES = {
        torch.float32: (32, 32, 4, 2),
        torch.bfloat16: (64, 64, 4, 2),
        torch.float16: (64, 64, 4, 2),
    }
    # Backward attention tiles, same layout: (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages). Smaller query
    # blocks than the forward's: the dK/dV program holds two fp32 [BLOCK_N, hd] accumulators. Not tuned on a GPU.
    _ATTENTION_BACKWARD_TILES = {
        torch.float32: (32, 32, 4, 2),
        torch.bfloat16: (32, 64, 4, 2),
        torch.float16: (32, 64, 4, 2),
    }


# --------------------------------------------------------------------------- attention
@triton.jit
def _sequence_and_kv_head(program, q_heads, group_size):
    """(sequence, kv head) of a program on a grid whose axis 0 runs over sequence x kv head (the attention forward's
    and the dK/dV backward's grids): the sequence as int64, for its pointer offsets."""
    kv_heads = q_heads // group_size
    return (program // kv_heads).to(tl.int64), program % kv_heads


@triton.jit
def _key_block(k_base, v_base, k_pos, cache_len, stride_kl, stride_vl, dims, dim_mask, CAST_TO_FP32: tl.constexpr):
    """One kv head's keys and values at cache positions ``k_pos`` (a block of them): (which are in the cache, keys,
    values), zeros past the cache's end; fp32 where ``CAST_TO_FP32`` (the interpreter)."""
    in_cache = k_pos < cache_len
    kv_mask = in_cache[:, None] & dim_mask[None, :]
    k = tl.load(k_base + k_pos[:, None] * stride_kl + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + k_pos[:, None] * stride_vl + dims[None, :], mask=kv_mask, other=0.0)
    if CAST_TO_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return in_cache, k, v


@triton.jit(do_not_specialize=["q_len", "cache_len"])  # same binary for prefill and decode
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, q_start_ptr, out_ptr,
    q_len, cache_len, q_heads, group_size, head_dim, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_ob, stride_ot, stride_oh,
    lse_ptr,  # last, so that the other parameters keep their places in the compiled code
    CAST_TO_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Program (batch x kv head, row block): BLOCK_M rows of one sequence, each row one (query, q head) of the kv
    # head's group (grouped-query attention: `group_size` q heads share a kv head), query-major -- row r is query
    # r // group_size of the group's q head r % group_size. So the group's heads share one pass over their keys and
    # values (a decode step's group_size rows, one program), and every row's arithmetic is its own, as in any tile.
    batch_kv = tl.program_id(0)
    row_block = tl.program_id(1)
    batch, kv_head = _sequence_and_kv_head(batch_kv, q_heads, group_size)

    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = row // group_size  # query index within this call
    head = kv_head * group_size + row % group_size
    dims = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, BLOCK_N)
    dim_mask = dims < head_dim
    q_start = tl.load(q_start_ptr + batch)
    q_pos = q_start + t  # absolute positions of the queries

    q_ptrs = q_ptr + batch * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=(t < q_len)[:, None] & dim_mask[None, :], other=0.0)
    if CAST_TO_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    # Online softmax state, fp32. m_i starts at MASKED_SCORE (finite): position 0 is visible
    # to every query and lies in the first block, so m_i is a real score after one step.
    m_i = tl.full((BLOCK_M,), MASKED_SCORE, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # Key blocks from position 0 in order, up to the last query's own position. Stopping
    # earlier or later makes no difference to any query: a block it cannot see is a no-op.
    last_query = (tl.minimum(q_len * group_size, (row_block + 1) * BLOCK_M) - 1) // group_size
    kv_end = tl.minimum(q_start + last_query + 1, cache_len)
    for block_start in range(0, kv_end, BLOCK_N):
        k_pos = block_start + keys
        in_cache, k, v = _key_block(k_base, v_base, k_pos, cache_len, stride_kl, stride_vl, dims, dim_mask,
                                    CAST_TO_FP32)

        # Scores in log2 units (scale * log2(e) folded in) so that exp2 can be used.
        scores = block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_cache[None, :]
        scores = tl.where(visible, scores, MASKED_SCORE)

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)  # exactly 1 when nothing new is visible
        p = tl.exp2(scores - m_new[:, None])  # exactly 0 where invisible
        l_i = l_i * alpha + block_sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = block_dot(cast(p, v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + batch * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptrs, cast(out, out_ptr.dtype.element_ty), mask=(t < q_len)[:, None] & dim_mask[None, :])
    if STORE_LSE:
        # For the backward (p = exp2(score - lse)): the row's log-sum-exp in the kernel's own log2 units, fp32,
        # [B * Hq, T] row-major. Written after `out` and from the same m_i, l_i: `out` is not touched.
        tl.store(lse_ptr + (batch * q_heads + head) * q_len + t, m_i + tl.log2(l_i), mask=t < q_len)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _attention_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float, store_lse: bool
                       ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """(out, lse or None, the prepared (q, k_cache, v_cache, q_start) the kernel read). ``store_lse`` only adds the
    log-sum-exp store (fp32 [B * Hq, T], log2 units) after the output's; the output's bits are the same either way."""
    check_device("attention", q=q, k_cache=k_cache, v_cache=v_cache)
    batch, q_len, q_heads, head_dim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    # Strided views (e.g. a cache slice) are fine; only the head dim must be contiguous.
    q, k_cache, v_cache = (_last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    q_start = q_start.to(device=q.device, dtype=torch.int64).contiguous()
    out = torch.empty(batch, q_len, q_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch * q_heads, q_len, dtype=torch.float32, device=q.device) if store_lse else None
    prepared = (q, k_cache, v_cache, q_start)
    if out.numel() == 0:
        return out, lse, prepared
    block_m, block_n, num_warps, num_stages = _ATTENTION_TILES[q.dtype]
    # kv heads x batch on grid axis 0 (no 65535 limit there), blocks of (query, q head) rows on axis 1.
    grid = (batch * kv_heads, triton.cdiv(q_len * (q_heads // kv_heads), block_m))
    _attention_kernel[grid](
        q, k_cache, v_cache, q_start, out,
        q_len, cache_len, q_heads, q_heads // kv_heads, head_dim, scale * LOG2_E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse if store_lse else out,
        CAST_TO_FP32=triton_common.INTERPRETING, INPUT_PRECISION=input_precision(q.dtype), STORE_LSE=store_lse,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_attention_block_d(head_dim),
        num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out, lse, prepared


def _attention_block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def attention_exact(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    return _attention_forward(q, k_cache, v_cache, q_start, scale, store_lse=False)[0]


def _attention_backward_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    """The attention whose autograd was the backward before the Triton one (kept for tests): SDPA's MATH backend,
    deterministic (the fused backward kernels may use atomics on CUDA), but it materialises every T x L score
    matrix in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return native.attention(q, k_cache, v_cache, q_start, scale)


# ------------------------------------------------------------ attention backward (FlashAttention-2 style)
# Three kernels, none with atomics: every gradient element is written by exactly one program, whose reduction
# runs in an order fixed by the tile constants (``_ATTENTION_BACKWARD_TILES``) and the loop bounds. The
# forward's log-sum-exp (log2 units) gives each probability back as p = exp2(score - lse) without a softmax pass;
# delta = rowsum(dO * O) is the softmax VJP's row term: dS = p * (dP - delta), dP = dO @ V^T.
@triton.jit(do_not_specialize=["q_len"])
def _attention_bwd_delta_kernel(
    out_ptr, dout_ptr, delta_ptr,
    q_len, q_heads, head_dim,
    stride_ob, stride_ot, stride_oh,
    stride_gb, stride_gt, stride_gh,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """delta[(b, h), t] = sum over d of dO * O, fp32, [B * Hq, T] row-major.

    Invariance contract: each delta depends only on its own query row of O and dO -- one program per (sequence,
    q head, BLOCK_M queries), the row reduced by one fixed tree over BLOCK_D lanes (``block_sum``)."""
    batch_head = tl.program_id(0)
    query_block = tl.program_id(1)
    batch = (batch_head // q_heads).to(tl.int64)
    head = batch_head % q_heads
    t = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (t < q_len)[:, None] & (dims < head_dim)[None, :]
    o = tl.load(out_ptr + batch * stride_ob + t[:, None] * stride_ot + head * stride_oh + dims[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + batch * stride_gb + t[:, None] * stride_gt + head * stride_gh + dims[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + batch_head.to(tl.int64) * q_len + t, block_sum(o * do, axis=1), mask=t < q_len)


@triton.jit(do_not_specialize=["q_len", "cache_len"])
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, q_start_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    q_len, cache_len, q_heads, group_size, head_dim, qk_scale, scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_db, stride_dl, stride_dh,
    CAST_TO_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dK = scale * sum dS^T @ Q and dV = sum P^T @ dO for one (sequence, kv head, BLOCK_N cache positions).

    Invariance contract: each dK / dV element is written by this one program alone, and is the fp32 sum over the
    kv head's q heads (in head order) and, within a head, over query blocks from the first that sees the key
    block, in order, each block's products reduced by the fixed-shape ``block_dot``. So it depends only on the
    sequence's q, dO, lse, delta, its own keys/values and q_start -- never on other sequences or on the batch.
    Cache positions no query sees (after the last query's position, or a cache longer than needed) get exact
    zeros."""
    batch_kv = tl.program_id(0)
    key_block = tl.program_id(1)
    batch, kv_head = _sequence_and_kv_head(batch_kv, q_heads, group_size)

    k_pos = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    in_cache = k_pos < cache_len
    kv_mask = in_cache[:, None] & dim_mask[None, :]
    k = tl.load(k_ptr + batch * stride_kb + k_pos[:, None] * stride_kl + kv_head * stride_kh + dims[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + batch * stride_vb + k_pos[:, None] * stride_vl + kv_head * stride_vh + dims[None, :],
                mask=kv_mask, other=0.0)
    if CAST_TO_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    q_start = tl.load(q_start_ptr + batch)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    # Queries before t = block start - q_start see none of these keys: start at the query block holding that t
    # (the blocks skipped would add exact zeros).
    first_block = tl.maximum(key_block * BLOCK_N - q_start, 0) // BLOCK_M
    for g in range(0, group_size):
        head = kv_head * group_size + g
        lse_row = (batch * q_heads + head) * q_len
        for m_start in range(first_block * BLOCK_M, q_len, BLOCK_M):
            t = m_start + rows
            q_mask = t < q_len
            row_mask = q_mask[:, None] & dim_mask[None, :]
            q = tl.load(q_ptr + batch * stride_qb + t[:, None] * stride_qt + head * stride_qh + dims[None, :],
                        mask=row_mask, other=0.0)
            do = tl.load(dout_ptr + batch * stride_gb + t[:, None] * stride_gt + head * stride_gh + dims[None, :],
                         mask=row_mask, other=0.0)
            if CAST_TO_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + lse_row + t, mask=q_mask, other=0.0)
            delta = tl.load(delta_ptr + lse_row + t, mask=q_mask, other=0.0)
            scores = block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # log2 units
            visible = (k_pos[None, :] <= (q_start + t)[:, None]) & in_cache[None, :] & q_mask[:, None]
            # where, not a masked score: a padding row (q = 0, lse = 0) would otherwise get p = 1.
            p = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
            dv = block_dot(tl.trans(cast(p, do.dtype)), do, dv, input_precision=INPUT_PRECISION)
            dp = block_dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk = block_dot(tl.trans(cast(ds, q.dtype)), q, dk, input_precision=INPUT_PRECISION)

    d_offsets = batch * stride_db + k_pos[:, None] * stride_dl + kv_head * stride_dh + dims[None, :]
    tl.store(dk_ptr + d_offsets, cast(dk * scale, dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + d_offsets, cast(dv, dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["q_len", "cache_len"])
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, q_start_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
    q_len, cache_len, q_heads, group_size, head_dim, qk_scale, scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kl, stride_kh,
    stride_vb, stride_vl, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_db, stride_dt, stride_dh,
    CAST_TO_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ = scale * sum dS @ K for one (sequence, q head, BLOCK_M queries).

    Invariance contract: each dQ row is written by this one program alone: the fp32 sum over key blocks from
    position 0 in order (as the forward walks them), each block's product reduced by the fixed-shape
    ``block_dot``. It depends only on the query's own q, dO, lse, delta and its sequence's keys/values at
    positions <= its position -- not on other sequences, the batch, or cache contents after its position."""
    batch_head = tl.program_id(0)
    query_block = tl.program_id(1)
    batch = (batch_head // q_heads).to(tl.int64)
    head = batch_head % q_heads
    kv_head = head // group_size

    t = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, BLOCK_N)
    dim_mask = dims < head_dim
    q_mask = t < q_len
    row_mask = q_mask[:, None] & dim_mask[None, :]
    q_start = tl.load(q_start_ptr + batch)
    q_pos = q_start + t
    q = tl.load(q_ptr + batch * stride_qb + t[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask, other=0.0)
    do = tl.load(dout_ptr + batch * stride_gb + t[:, None] * stride_gt + head * stride_gh + dims[None, :],
                 mask=row_mask, other=0.0)
    if CAST_TO_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse_row = batch_head.to(tl.int64) * q_len
    lse = tl.load(lse_ptr + lse_row + t, mask=q_mask, other=0.0)
    delta = tl.load(delta_ptr + lse_row + t, mask=q_mask, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    last_query = tl.minimum(q_len, (query_block + 1) * BLOCK_M) - 1
    kv_end = tl.minimum(q_start + last_query + 1, cache_len)
    for block_start in range(0, kv_end, BLOCK_N):
        k_pos = block_start + keys
        in_cache, k, v = _key_block(k_base, v_base, k_pos, cache_len, stride_kl, stride_vl, dims, dim_mask,
                                    CAST_TO_FP32)
        scores = block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_cache[None, :] & q_mask[:, None]
        p = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
        dp = block_dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = block_dot(cast(ds, k.dtype), k, dq, input_precision=INPUT_PRECISION)

    dq_ptrs = dq_ptr + batch * stride_db + t[:, None] * stride_dt + head * stride_dh + dims[None, :]
    tl.store(dq_ptrs, cast(dq * scale, dq_ptr.dtype.element_ty), mask=row_mask)


def _attention_backward(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, out: Tensor, lse: Tensor,
                        grad_out: Tensor, scale: float, need_q: bool, need_kv: bool
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk_cache, dv_cache) of ``attention`` from the forward's prepared inputs, output and lse; None where not
    needed. Gradients are new contiguous tensors of the inputs' shapes and dtypes; cache positions no query sees
    get zeros."""
    batch, q_len, q_heads, head_dim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    grad_out = _last_dim_contiguous(grad_out)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
    dk = torch.empty(k_cache.shape, dtype=k_cache.dtype, device=q.device) if need_kv else None
    dv = torch.empty(v_cache.shape, dtype=v_cache.dtype, device=q.device) if need_kv else None
    if q.numel() == 0 or k_cache.numel() == 0:
        return tuple(None if t is None else t.zero_() for t in (dq, dk, dv))  # type: ignore[return-value]
    block_m, block_n, num_warps, num_stages = _ATTENTION_BACKWARD_TILES[q.dtype]
    block_d = _attention_block_d(head_dim)
    delta = torch.empty(batch * q_heads, q_len, dtype=torch.float32, device=q.device)
    _attention_bwd_delta_kernel[(batch * q_heads, triton.cdiv(q_len, block_m))](
        out, grad_out, delta, q_len, q_heads, head_dim,
        out.stride(0), out.stride(1), out.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps, **COMPILE_OPTIONS,
    )  # fmt: skip
    common = (
        q_len, cache_len, q_heads, q_heads // kv_heads, head_dim, scale * LOG2_E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
    )  # fmt: skip
    options = dict(CAST_TO_FP32=triton_common.INTERPRETING, INPUT_PRECISION=input_precision(q.dtype), BLOCK_M=block_m,
                   BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS)
    if need_kv:
        assert dk is not None and dv is not None
        _attention_bwd_dkdv_kernel[(batch * kv_heads, triton.cdiv(cache_len, block_n))](
            q, k_cache, v_cache, q_start, grad_out, lse, delta, dk, dv, *common,
            dk.stride(0), dk.stride(1), dk.stride(2), **options,
        )  # fmt: skip
    if need_q:
        assert dq is not None
        _attention_bwd_dq_kernel[(batch * q_heads, triton.cdiv(q_len, block_m))](
            q, k_cache, v_cache, q_start, grad_out, lse, delta, dq, *common,
            dq.stride(0), dq.stride(1), dq.stride(2), **options,
        )  # fmt: skip
    return dq, dk, dv


def attention_with_saved(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float
                         ) -> tuple[Tensor, tuple]:
    out, lse, prepared = _attention_forward(q, k_cache, v_cache, q_start, scale, store_lse=True)
    return out, (*prepared, out, lse, scale)


def attention_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    q, k_cache, v_cache, q_start, out, lse, scale = saved
    check_device("attention", grad=grad)
    dq, dk, dv = _attention_backward(q, k_cache, v_cache, q_start, out, lse, grad, scale, needs[0],
                                     needs[1] or needs[2])
    return dq, (dk if needs[1] else None), (dv if needs[2] else None)
