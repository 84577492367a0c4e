"""A KV cache's keys and values as the exact CPU attention lays them out, kept between its calls.

``cpu_exact.attention`` multiplies keys and values laid out as fp32 rows, [B * Hkv, key_len, hd] (``key_len``: the
visible keys in whole 64-key tiles; ``cpu_attention._AttentionTiles``). Laying a cache out afresh on every decode step
reads and writes every visible position of it, in every layer, for one new position each: llama100m's decode step
(8 sequences, bf16, 1 thread) took 310 ms so at 1,900 positions and 220 ms with the rows kept, 146 and 132 ms at 512
(``docs/journal.md``, 2026-12-02, one process, interleaved). So a cache whose writes go through ``write`` (the
model's one cache write) keeps its rows here between calls: each write copies the positions it changed into the rows
(the same conversion as the layout: the same values, so the same bits), and the next call that asks for rows of the
same length gets them without a pass over the cache. A new ``key_len`` (every 64 positions of a decode) lays them
out afresh.

The guard is the cache tensor's version counter (as ``gemm_laid_out.arranged_weight``'s for a weight): every
in-place write to the cache or a view of it moves it on, and the rows are used only where every write since they were
laid out came through ``write`` (which saw the counter at its own step); any other write, and they are laid out
afresh. Not seen: a write that bypasses the counter (``cache.data[...] = ...``, a NumPy view), which vexact never
makes. An inference tensor has no counter: laid out per call. Kept only for CPU caches written through ``write``
(never a training step's keys), dropped with the cache, and bounded by ``ROWS_BYTES_MAX``. The rows are never saved
for a backward: a later write changes them in place (``cpu_exact`` asks for them only where no gradient is recorded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_loops
from .weight_versions import kept_snapshot

ROWS_BYTES_MAX = 1 << 30
"""Bytes (1 GiB): the most that kept rows hold at once in a process. Rows are fp32, twice a bf16 cache's size
(llama100m, 8 sequences at 2,048 positions: 0.75 GiB for its 30 layers' keys and values); beyond the bound a cache's
rows are laid out per call, as without this module (slower, the same bits)."""


@dataclass
class _Kept:
    """One cache's rows: ``rows`` (fp32 [B * Hkv, key_len, hd], or None: none kept), matching the cache at version
    counter ``version`` and view ``layout`` (data pointer, shape, strides, dtype)."""

    version: int
    rows: Tensor | None = None
    layout: tuple = ()


_KEPT = WeakIdKeyDictionary()  # cache tensor -> _Kept; gone with the cache


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter to follow
        return None


def _layout(cache: Tensor) -> tuple:
    return cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype


def write(cache: Tensor, batch_index: Tensor, positions: Tensor, values: Tensor) -> None:
    """``cache[batch_index, positions] = values``: a KV cache's write (``vexact.engine.model``), which its kept rows
    follow. cache [B, L, Hkv, hd]; batch_index and positions broadcast to the written [B', T] entries; values [B', T,
    Hkv, hd]."""
    before = _version(cache)
    cache[batch_index, positions] = values
    if before is None or cache.device.type != "cpu":
        return
    kept = _KEPT.get(cache)
    if kept is None:  # a cache's first write: from now on its rows may be kept
        _KEPT[cache] = _Kept(_version(cache))
        return
    if kept.rows is not None:
        if kept.version == before and kept.layout == _layout(cache):
            _copy_positions(kept.rows, cache, batch_index, positions)
        else:  # a write that did not come through here: the rows are laid out afresh at the next call
            kept.rows = None
    kept.version = _version(cache)


def rows(cache: Tensor, key_len: int, lay_out: Callable[[Tensor], Tensor]) -> Tensor:
    """The cache's fp32 rows of ``key_len`` keys: those kept for it where they match the cache as it is now, else
    ``lay_out(cache)``, which lays them out afresh (kept for the next call where the cache is written through ``write``
    and the rows fit ``ROWS_BYTES_MAX``). The same values either way. The caller only reads them, and never keeps
    them past the call: the next write changes them in place."""
    kept = _KEPT.get(cache)
    if kept is None:  # not a cache written through ``write`` (a training step's keys): nothing to keep
        return lay_out(cache)
    version, layout = _version(cache), _layout(cache)
    if (kept.rows is not None and kept.rows.shape[1] == key_len and kept.version == version
            and kept.layout == layout):
        return kept.rows
    kept.rows = None  # (before counting what the others hold)
    fresh = lay_out(cache)
    held = sum(other.rows.nbytes for _, other in kept_snapshot(_KEPT) if other.rows is not None)
    if held + fresh.nbytes <= ROWS_BYTES_MAX and fresh.is_contiguous() and fresh.dtype == torch.float32:
        kept.rows, kept.version, kept.layout = fresh, version, layout
    return fresh


def _copy_positions(rows: Tensor, cache: Tensor, batch_index: Tensor, positions: Tensor) -> None:
    """The written cache entries copied into ``rows`` (fp32 [B * Hkv, key_len, hd]) again, converted as the layout
    converts them: in one compiled call where the loops are built, else the same copies as torch ops."""
    loops = compiled_loops.library()
    if loops is not None:
        loops.key_rows_at(rows, cache, batch_index, positions)
        return
    batch, length, heads, dim = cache.shape
    key_len = rows.shape[1]
    b = batch_index.expand_as(positions).reshape(-1)
    p = positions.reshape(-1)
    b, p = torch.where(b < 0, b + batch, b), torch.where(p < 0, p + length, p)
    inside = p < min(length, key_len)  # positions past the rows' keys are not in them
    b, p = b[inside], p[inside]
    rows.view(batch, heads, key_len, dim)[b, :, p] = cache[b, p].float()  # [n, Hkv, hd] each
