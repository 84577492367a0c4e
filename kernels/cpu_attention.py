"""The exact attention on CPU (``cpu_exact.attention``, whose docstring states its contract): the tile layout of one
call (``_AttentionTiles``), the probabilities as halving-tree sums of chunked ``exp`` (``_attention_probs``), the
forward (``attention_exact``), and the forward recorded for autograd (``attention_with_gradient``), whose backward is
the analytic VJP from the saved probabilities (``_ExactAttention``); the guard's answers for a head size asked once
and kept (``_attention_plan``).
"""

from __future__ import annotations

from functools import lru_cache, partial
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from . import checks, compiled_loops, gemm_batched, kv_rows
from .compiled_loops import tree_sum as _tree_sum
from .cpu_elementwise import CHUNK, VECTOR_MULTIPLE, unary
from .gemm_tiles import COL_BLOCK, ceil_to, gemm_class, row_block
from .host_guard import HostGuard

KEY_BLOCK = 64
"""Keys per attention tile, from position 0: a decode step's keys then fall in the tiles a prefill row's do."""


def _check_query_span(q_start: Tensor, q_len: int) -> int:
    """The positions the queries span (the furthest query's position + 1); a ValueError if a query would sit before
    position 0 (it would see no key: its softmax has nothing to normalise). A query past the cache's end is defined:
    it sees the whole cache (keys past it are masked, as in the Triton kernel). Checked where the tiles read
    q_start's bounds anyway, not in ``attention``'s usual-case test (values, not attributes)."""
    _, last = checks.query_starts("cpu_exact.attention", q_start)
    return last + q_len


@lru_cache(maxsize=256)
def _row_positions(row_len: int, group: int, q_len: int, device: torch.device) -> Tensor:
    """The query position (0 .. q_len - 1) of each of an attention call's ``row_len`` tile rows, t-major (row r = t *
    group + g); padding rows act as the sequence's first query (at least one visible key, so their softmax stays
    finite). Made once per argument set (four small ops a call otherwise) and shared: never written."""
    row_t = torch.arange(row_len, device=device) // group
    return torch.where(row_t < q_len, row_t, 0)


class _AttentionPlan(NamedTuple):
    """What the guard's answers decide for an attention call of one head size (``_attention_plan``)."""

    tile_heights: tuple[int, ...]
    """The row-tile heights both GEMMs of a tile allow (``_AttentionTiles._tile_heights``)."""
    library: bool
    """Whether the forward's steps run torch's own calls as they are (``_library_attention``)."""


_ATTENTION_PLANS: dict[tuple, _AttentionPlan] = {}
ATTENTION_PLANS_MAX = 256
"""Attention plans kept at most (then afresh): one per (guard state, head size, thread count, GEMM and exp
installed)."""


def _attention_plan(host: HostGuard, head_dim: int) -> _AttentionPlan:
    """The guard's answers for an attention call of ``head_dim`` (its two GEMM classes' tile heights, whether its
    forward runs torch's own calls), asked once per key and kept: a decode step asks them once per layer otherwise,
    a few microseconds each. The key holds everything the answers read -- the guard's state (``HostGuard.epoch``: a
    new value whenever an answer may change; taken after asking, as a probe run in asking may change it), the thread
    count, and the installed ``torch.bmm`` and ``torch.exp`` (which the guard compares its own with) -- so a kept
    plan is the answers a fresh question would get: no bit depends on it."""
    switches = (head_dim, torch.get_num_threads(), torch.bmm, torch.exp)
    if (plan := _ATTENTION_PLANS.get((id(host), host.epoch, *switches))) is not None:
        return plan
    plan = _AttentionPlan(_AttentionTiles._tile_heights(host, head_dim), _library_attention(host, head_dim))
    if len(_ATTENTION_PLANS) >= ATTENTION_PLANS_MAX:
        _ATTENTION_PLANS.clear()
    _ATTENTION_PLANS[(id(host), host.epoch, *switches)] = plan
    return plan


class _AttentionTiles:
    """The tile layout of one ``attention`` call (see ``attention``'s docstring).

    Per (sequence b, KV head h) the group's query heads are folded into rows, t-major
    (row r = t * group + g), padded to whole ``block``-row tiles; keys are taken from position 0
    in whole ``KEY_BLOCK``-key tiles. fp32 tensors: ``q`` [B*Hkv, row_len, hd] (already times
    ``scale``), ``k``/``v`` [B*Hkv, key_len, hd]. ``visible`` is the number of leading keys any
    query can see (the furthest query position + 1); keys after it are masked for every row.
    ``kept_rows``: ``k``/``v`` may be the rows ``kv_rows`` keeps for the cache (only read, never kept past the call).
    """

    def __init__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float, host: HostGuard,
                 kept_rows: bool = False):
        batch, q_len, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        self.batch, self.q_len, self.q_heads, self.head_dim, self.kv_heads = batch, q_len, q_heads, head_dim, kv_heads
        self.group = q_heads // kv_heads
        self.rows = q_len * self.group
        self.plan = _attention_plan(host, head_dim)
        self.block = row_block(self.rows, self.plan.tile_heights)
        self.row_blocks = -(-self.rows // self.block)
        self.row_len = self.row_blocks * self.block
        # Keys needed: up to the furthest query position, in whole tiles from position 0.
        self.visible = _check_query_span(q_start, q_len)
        self.key_len = ceil_to(self.visible, KEY_BLOCK)
        self.key_blocks = self.key_len // KEY_BLOCK
        self.cache_len = k_cache.shape[1]
        # A query past the cache's end sees the whole cache: its keys end at the cache, not at its position. The
        # torch ops below clamp its position; the compiled loops mask by position alone, so such a call takes the
        # torch ops (the same bits for every other row: the loops make the same calls on the same values).
        self.past_end = self.visible > self.cache_len
        self.scale = scale
        self.host = host
        self.q = self._query_rows(q)
        if kept_rows:  # a forward without a gradient: the rows a cache keeps between calls (never saved for a backward)
            self.k = kv_rows.rows(k_cache, self.key_len, self._key_rows)
            self.v = kv_rows.rows(v_cache, self.key_len, self._key_rows)
        else:
            self.k = self._key_rows(k_cache)
            self.v = self._key_rows(v_cache)
        self.row_t = _row_positions(self.row_len, self.group, q_len, q.device)
        self.q_start = q_start
        # Every sequence starting at one position (training, a prefill from 0): one mask serves the whole batch.
        # Asked only for several queries per sequence; a decode step's mask is small.
        self.uniform_start = batch == 1 or (q_len > 1 and bool((q_start == q_start[0]).all()))

    def _query_rows(self, q: Tensor) -> Tensor:
        """[B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd] times ``scale``, zero padding rows (finite; their outputs are
        dropped). The scale is applied to q, not to the scores: for the power-of-two scales of head_dim 4^n (16, 64,
        256) both are exact, and the [rows x keys] tile is far larger than q."""
        if (loops := _layout_loops(q)) is not None:  # the steps below in one compiled call (the same at:: calls)
            return loops.attention_query_rows(q, self.kv_heads, self.row_len, self.scale)
        b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
        out = torch.empty(b, h, self.row_len, d, dtype=torch.float32, device=q.device)
        torch.mul(q.view(b, t, h, g, d).permute(0, 2, 1, 3, 4), self.scale,
                  out=out[:, :, : self.rows].view(b, h, t, g, d))
        if self.rows < self.row_len:  # zeros only where no query is written
            out[:, :, self.rows :].zero_()
        return out.view(b * h, self.row_len, d)

    @staticmethod
    def _tile_heights(host: HostGuard, head_dim: int) -> tuple[int, ...]:
        """Row-tile heights allowed for both GEMMs of a tile: the scores (q rows against a key tile, transposed) and
        P @ V (probabilities against a value tile, row-major)."""
        scores = host.tile_heights(torch.float32, gemm_class(head_dim, KEY_BLOCK, transposed=True), False, "attention")
        values = host.tile_heights(torch.float32, gemm_class(KEY_BLOCK, head_dim, transposed=False), False, "attention")
        return tuple(h for h in scores if h in values)

    def _key_rows(self, cache: Tensor) -> Tensor:
        """[B, L, Hkv, hd] -> fp32 [B*Hkv, key_len, hd], zero-padded past the cache's end."""
        if cache.device.type == "cpu" and (loops := compiled_loops.library()) is not None:
            return loops.key_rows(cache, self.key_len)  # the copy and fill below in one pass (the same values)
        batch, kv_heads, head_dim = self.batch, self.kv_heads, self.head_dim
        kept = min(self.cache_len, self.key_len)
        out = torch.empty(batch, kv_heads, self.key_len, head_dim, dtype=torch.float32, device=cache.device)
        out[:, :, :kept] = cache[:, :kept].permute(0, 2, 1, 3)
        if kept < self.key_len:  # zeros only past the cache's end
            out[:, :, kept:].zero_()
        return out.view(batch * kv_heads, self.key_len, head_dim)

    def row_tiles(self, per_row: Tensor) -> Tensor:
        """[B*Hkv, row_len, X] -> [B*Hkv*RB*KB, R, X]: each row tile once per key tile (bmm batch order)."""
        bh, rb, kb, width = self.batch * self.kv_heads, self.row_blocks, self.key_blocks, per_row.shape[-1]
        return per_row.view(bh, rb, 1, self.block, width).expand(-1, -1, kb, -1, -1).reshape(-1, self.block, width)

    def key_tiles(self, per_key: Tensor) -> Tensor:
        """[B*Hkv, key_len, X] -> [B*Hkv*RB*KB, C, X]: each key tile once per row tile (bmm batch order)."""
        bh, rb, kb, width = self.batch * self.kv_heads, self.row_blocks, self.key_blocks, per_key.shape[-1]
        return per_key.view(bh, 1, kb, KEY_BLOCK, width).expand(-1, rb, -1, -1, -1).reshape(-1, KEY_BLOCK, width)

    # The three layouts below: in one compiled loop each where the loops are built (the same values; the same aten
    # conversion to another dtype), else these torch ops.
    def to_output(self, rows: Tensor, dtype: torch.dtype, scale: float | None = None) -> Tensor:
        """[B*Hkv, n >= rows, hd] -> [B, T, Hq, hd] in ``dtype`` (padding rows dropped), each value first times
        ``scale`` where one is given (the fp32 product)."""
        if (loops := _layout_loops(rows)) is not None and rows.stride(-1) == 1:
            return loops.attention_to_output(rows, self.batch, self.q_len, self.q_heads, scale, dtype)
        if scale is not None:
            rows = rows * scale
        b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
        real = rows.view(b, h, -1, d)[:, :, : self.rows].reshape(b, h, t, g, d)
        return real.permute(0, 2, 1, 3, 4).reshape(b, t, self.q_heads, d).to(dtype)

    def from_output(self, grad: Tensor) -> Tensor:
        """[B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd] with zero padding rows (inverse of ``to_output``)."""
        if (loops := _layout_loops(grad)) is not None:
            return loops.attention_from_output(grad, self.kv_heads, self.row_len)
        b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
        out = torch.empty(b, h, self.row_len, d, dtype=torch.float32, device=grad.device)
        out[:, :, : self.rows].view(b, h, t, g, d).copy_(grad.view(b, t, h, g, d).permute(0, 2, 1, 3, 4))
        if self.rows < self.row_len:  # zeros only where the gradient is not written
            out[:, :, self.rows :].zero_()
        return out.view(b * h, self.row_len, d)

    def to_cache(self, keys: Tensor, dtype: torch.dtype) -> Tensor:
        """[B*Hkv, n, hd] (the first n keys) -> [B, L, Hkv, hd] (the cache's shape; zero after n)."""
        if (loops := _layout_loops(keys)) is not None:
            return loops.attention_to_cache(keys, self.batch, self.cache_len, dtype)
        b, h, d = self.batch, self.kv_heads, self.head_dim
        out = torch.empty(b, self.cache_len, h, d, dtype=dtype, device=keys.device)
        kept = min(self.cache_len, keys.shape[1])
        out[:, :kept] = keys.view(b, h, keys.shape[1], d)[:, :, :kept].permute(0, 2, 1, 3)
        if kept < self.cache_len:  # zeros only where no key is written (training: none)
            out[:, kept:].zero_()
        return out


def _layout_loops(x: Tensor) -> ModuleType | None:
    """The compiled loops for ``_AttentionTiles``' layouts of ``x`` (fp32 rows, or a float gradient), else None."""
    return compiled_loops.library() if x.device.type == "cpu" else None


def _attention_probs(tiles: _AttentionTiles, loops: ModuleType | None = None, normalized: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Scores, masking and the row-wise softmax pieces of ``attention``.

    Returns (probability tiles [B*Hkv*RB*KB, R, C] for the P @ V GEMMs, their row sums
    [B, Hkv, RB, R, 1] (1 for padding rows), the unnormalised probabilities of the real rows
    and visible keys [B, Hkv, RB, R', V] and their row sums [B, Hkv, RB, R', 1]). ``normalized``: the third
    divided by the fourth instead (what the backward keeps), in the loops' pass over the rows where they run.

    Only the scores GEMMs see whole tiles. The row-wise steps (mask, max, exp, sums) run on the
    real rows (a decode step has ``group`` of them per tile) and the first ``visible`` keys (keys
    after them are masked for every row): row-wise work gives the same bits on a sub-block, and a
    key tile's halving tree over its first ``w`` columns padded to a power of two equals the tree
    over all 64 with zeros after ``w``.

    ``loops``: the compiled loops (``compiled_loops.library()``), which run the steps before and after the exp in one
    pass each, with the same operations on the same values (the same bits; ``tests/kernels/test_compiled_loops.py``), or
    None for the torch ops below."""
    b, h, rb, kb, block, vis = tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.block, \
        tiles.visible
    scores = tiles.host.bmm(tiles.row_tiles(tiles.q), tiles.key_tiles(tiles.k).transpose(1, 2), op="attention",
                             shared_operand=False)
    real = tiles.rows if rb == 1 else block
    width = ceil_to(vis, COL_BLOCK)
    if loops is not None:
        shape = (b, h, rb, kb, block, real, width, KEY_BLOCK, tiles.q_start, tiles.row_t, tiles.uniform_start)
        probs = unary("exp", loops.attention_shifted(scores, *shape), tiles.host, "attention", inplace=True)
        tiles_out, denom_rows, denom = loops.attention_tiles(probs, *shape, normalized)  # masks probs in place
        return tiles_out, denom_rows, probs[..., :vis], denom
    scores = scores.view(b, h, rb, kb, block, KEY_BLOCK).permute(0, 1, 2, 4, 3, 5)  # [B, Hkv, RB, R, KB, C]
    row_t = tiles.row_t.view(rb, block)[:, :real]
    # One mask for the whole batch where every sequence starts at the same position (training): the same booleans.
    starts = tiles.q_start[:1] if tiles.uniform_start else tiles.q_start
    query_pos = starts.view(-1, 1, 1, 1, 1) + row_t.view(1, 1, rb, real, 1)
    if tiles.past_end:  # a query past the cache's end sees the whole cache, no zero key after it
        query_pos = query_pos.clamp(max=tiles.cache_len - 1)
    # Rows of ``vis`` keys widened to ``width``, a multiple of COL_BLOCK, with masked keys: the library's row max ran
    # 5-6x faster on 32-wide rows than on 31-wide ones (a vector body with no scalar tail). The extra keys are masked
    # for every row (-inf, probability exactly 0), which changes no row's max and, as zeros at a row's end, no tree sum.
    visible = torch.arange(width, device=scores.device) <= query_pos  # [B or 1, 1, RB, R', width]
    # Mask (-inf: probability exactly 0) and lay out row-major [B, Hkv, RB, R', width] in one op per key-tile range.
    # Only the first ``width`` keys: every later key is masked for every row (-inf), which changes no row's max.
    full_tiles = vis // KEY_BLOCK
    last = width - full_tiles * KEY_BLOCK  # columns of the last, partial key tile (0: none)
    masked = torch.empty(b, h, rb, real, width, device=scores.device)
    neg_inf = scores.new_full((), float("-inf"))
    if full_tiles:
        span = (full_tiles, KEY_BLOCK)
        torch.where(visible[..., : full_tiles * KEY_BLOCK].unflatten(-1, span), scores[:, :, :, :real, :full_tiles],
                    neg_inf, out=masked[..., : full_tiles * KEY_BLOCK].unflatten(-1, span))
    if last:
        torch.where(visible[..., full_tiles * KEY_BLOCK :], scores[:, :, :, :real, full_tiles, :last], neg_inf,
                    out=masked[..., full_tiles * KEY_BLOCK :])
    row_max = masked.amax(dim=-1, keepdim=True)  # max is exact in any order (contiguous rows: fast)
    # exp of the shifted scores; masked keys: exactly +0.0, the value exp(-inf) has. It is written, not computed: the
    # library exp (MKL's VML here) took a slow path for -inf and underflowing inputs (32704 elements half -inf: 65 us
    # against 5-7 us, on the 2-core Xeon), and a causal mask hides about half the keys. Their input becomes 0 (exp: 1),
    # and the product with the 0/1 mask zeroes them; a visible key's exp gets the same input as before and is
    # multiplied by 1.0 (exact), so the same bits (the probed property: exp is elementwise).
    shifted = torch.where(visible, masked.sub_(row_max), scores.new_zeros(()), out=masked)
    probs = unary("exp", shifted, tiles.host, "attention", inplace=True).mul_(visible.to(masked.dtype))
    # Tree within each key tile, then across tiles in position order (zero tails are no-ops).
    parts = []
    if full_tiles:
        parts.append(_tree_sum(probs[..., : full_tiles * KEY_BLOCK].reshape(b, h, rb, real, full_tiles, KEY_BLOCK)))
    if last:
        parts.append(_tree_sum(probs[..., full_tiles * KEY_BLOCK :]).unsqueeze(-1))
    per_tile = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [B, Hkv, RB, R', KB]
    denom = (_tree_sum(per_tile) if kb > 1 else per_tile[..., 0]).unsqueeze(-1)  # [B, Hkv, RB, R', 1]

    # Probability tiles for P @ V: zeros outside the real rows and visible keys.
    # Zeros written only there (padding rows, the last visible tile's tail, the tiles after it), not over the whole
    # tensor first: a fill of every tile cost as much as the copy of the probabilities.
    tiles_out = torch.empty(b, h, rb, kb, block, KEY_BLOCK, device=scores.device)
    as_rows = tiles_out.permute(0, 1, 2, 4, 3, 5)[:, :, :, :real]  # [B, Hkv, RB, R', KB, C]
    if full_tiles:
        as_rows[..., :full_tiles, :] = probs[..., : full_tiles * KEY_BLOCK].view(b, h, rb, real, full_tiles,
                                                                                 KEY_BLOCK)
    if last:
        as_rows[..., full_tiles, :last] = probs[..., full_tiles * KEY_BLOCK :]
        as_rows[..., full_tiles, last:].zero_()
    used = full_tiles + (1 if last else 0)
    if used < kb:
        as_rows[..., used:, :].zero_()
    if real < block:
        tiles_out[..., real:, :].zero_()
    denom_rows = denom if real == block else torch.nn.functional.pad(denom, (0, 0, 0, block - real), value=1.0)
    probs = probs[..., :vis]
    return tiles_out.view(-1, block, KEY_BLOCK), denom_rows, probs.div_(denom) if normalized else probs, denom


def _attention_forward(tiles: _AttentionTiles, prob_tiles: Tensor, denom: Tensor) -> Tensor:
    """P @ V per (row tile, key tile), a tree over key tiles, then / row sum: [B*Hkv, row_len, hd]."""
    b, h, rb, kb, d = tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.head_dim
    partial = tiles.host.bmm(prob_tiles, tiles.key_tiles(tiles.v), op="attention", shared_operand=False)
    partial = partial.view(b, h, rb, kb, tiles.block, d)
    summed = _tree_sum(partial.permute(0, 1, 2, 4, 5, 3)) if kb > 1 else partial[:, :, :, 0]
    return (summed / denom).view(b * h, tiles.row_len, d)


def attention_with_gradient(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float,
                            host: HostGuard) -> Tensor:
    """``attention_exact``'s output, recorded for autograd: its backward the analytic VJP (``_ExactAttention``)."""
    return _ExactAttention.apply(q, k_cache, v_cache, q_start, scale, host)


def attention_exact(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float,
                    host: HostGuard) -> Tensor:
    """``cpu_exact.attention``'s output (its contract), with no gradient recorded: the model's cache read where
    ``kv_rows`` keeps its rows, and the steps in one compiled call where the plan runs torch's own calls."""
    tiles = _AttentionTiles(q, k_cache, v_cache, q_start, scale, host, kept_rows=True)
    loops = None if tiles.past_end else compiled_loops.library()
    if loops is not None and q.device.type == "cpu" and tiles.plan.library:
        # the steps below in one compiled call: the same at:: calls on the same views (a decode step: one a layer)
        return loops.attention_forward(*_compiled_forward_arguments(tiles, q.dtype))
    prob_tiles, denom, _, _ = _attention_probs(tiles, loops)
    return tiles.to_output(_attention_forward(tiles, prob_tiles, denom), q.dtype)


def _compiled_forward_arguments(tiles: _AttentionTiles, dtype: torch.dtype) -> tuple:
    """``loops.attention_forward``'s (and ``attention_forward_saving``'s) arguments: the tiles' rows and layout."""
    return (tiles.q, tiles.k, tiles.v, tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.block,
            tiles.rows, tiles.visible, KEY_BLOCK, COL_BLOCK, tiles.q_start, tiles.row_t, tiles.uniform_start,
            tiles.q_len, tiles.group, CHUNK, VECTOR_MULTIPLE, dtype)


def _library_attention(host: HostGuard, head_dim: int) -> bool:
    """Whether an attention forward's steps run torch's own calls as they are: both GEMM classes (the scores, the
    P @ V) on the guard's plain library ``bmm`` (``library_gemm``) and its exp the library's -- where
    ``loops.attention_forward`` makes the same calls; False for a fixed-order class or a guard over another GEMM."""
    scores = host.library_gemm(torch.float32, gemm_class(head_dim, KEY_BLOCK, transposed=True), False, "attention")
    values = host.library_gemm(torch.float32, gemm_class(KEY_BLOCK, head_dim, transposed=False), False, "attention")
    return (scores is not None and values is not None
            and host.elementwise("exp", torch.float32, "attention") is torch.exp)


class _ExactAttention(torch.autograd.Function):
    """Exact forward; backward from the forward's own (exact) probabilities with fixed-tile GEMMs.

    Saves the normalised probabilities of the real rows and visible keys instead of
    recomputing a native attention: the gradients are the standard softmax-attention VJP
    (dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale * dS K,
    dK = dS^T (scale * Q)); every product runs through ``gemm_batched.batched_matmul`` (the guard's GEMM on padded
    tiles) and the row sum through a halving tree, so no gradient depends on the thread count."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, q_start, scale, host):  # type: ignore[override]
        tiles = _AttentionTiles(q, k_cache, v_cache, q_start, scale, host)
        loops = None if tiles.past_end else compiled_loops.library()
        if loops is not None and q.device.type == "cpu" and tiles.plan.library:
            # the steps below in one compiled call (as attention_exact's), returning what they return
            out, out_rows, probs = loops.attention_forward_saving(*_compiled_forward_arguments(tiles, q.dtype))
        else:
            prob_tiles, denom, probs, _ = _attention_probs(tiles, loops, normalized=True)
            out_rows = _attention_forward(tiles, prob_tiles, denom)
            out = tiles.to_output(out_rows, q.dtype)
        real = probs.shape[3]
        # [B*Hkv, rows', visible] normalised probabilities of the real rows, divided in place by _attention_probs
        # (the same division, the same bits): no second [rows x keys] buffer beside the probability tiles
        ctx.p = probs.view(tiles.batch * tiles.kv_heads, tiles.row_blocks * real, tiles.visible)
        ctx.tiles, ctx.out_rows, ctx.real = tiles, out_rows, real
        ctx.dtypes = (q.dtype, k_cache.dtype, v_cache.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        tiles, p = ctx.tiles, ctx.p
        rows, vis = p.shape[1], tiles.visible
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # The gradient rows and the queries are held zero-padded ([BH, row_len, hd]): where that is the padded
        # operand of a GEMM below, it is passed as is instead of copied again (``batched_matmul``'s a_full/b_full).
        d_out_full = tiles.from_output(grad_out)
        d_out = d_out_full[:, :rows]  # [BH, rows', hd]; padding rows are zero
        bmm = partial(gemm_batched.batched_matmul, host=tiles.host, op="attention")
        out_rows = ctx.out_rows[:, :rows]
        grad_q = grad_k = grad_v = None
        if need_v:
            grad_v = tiles.to_cache(bmm(p.transpose(1, 2), d_out, b_full=d_out_full), ctx.dtypes[2])
        if need_q or need_k:
            d_p = bmm(d_out, tiles.v[:, :vis].transpose(1, 2), a_full=d_out_full)
            # dS = P * (dP - rowsum(dO * O)) computed in dP's buffer (the same subtraction and product, the same
            # bits), and P released before the dQ / dK GEMMs copy dS into their padded operands: with dP, dS and
            # their difference each its own [rows x keys] buffer beside P, this was the pass's peak at 2,000 tokens
            d_s = _attention_grad_scores(d_p, d_out, out_rows, p)
            del d_p, p
            ctx.p = None
            if need_q:
                grad_q = tiles.to_output(bmm(d_s, tiles.k[:, :vis]), ctx.dtypes[0], scale=tiles.scale)
            if need_k:
                grad_k = tiles.to_cache(bmm(d_s.transpose(1, 2), tiles.q[:, :rows], b_full=tiles.q), ctx.dtypes[1])
        ctx.p = ctx.out_rows = ctx.tiles = None
        return grad_q, grad_k, grad_v, None, None, None


def _attention_grad_scores(d_p: Tensor, d_out: Tensor, out_rows: Tensor, p: Tensor) -> Tensor:
    """The attention backward's dS = P * (dP - rowsum(dO * O)), in dP's buffer: the product, the halving tree over the
    head dim, the subtraction and the product with P -- in one compiled pass where the loops run (the same operations
    on the same values), else these torch ops."""
    loops = compiled_loops.library()
    if loops is not None and d_out.shape[-1] >= 2 and all(t.stride(-1) == 1 for t in (d_p, d_out, out_rows, p)):
        return loops.attention_grad_scores(d_p, d_out, out_rows, p)
    return d_p.sub_(_tree_sum(d_out * out_rows).unsqueeze(-1)).mul_(p)
