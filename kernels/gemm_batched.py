"""a @ b per batch entry: attention's backward products, ``batched_matmul`` (the overview of the matrix products:
``gemm_linear``).
"""

from __future__ import annotations

from torch import Tensor

from . import compiled_loops, gemm_tiles
from .host_guard import HostGuard


# --------------------------------------------------------------------------- a @ b per batch entry (attention)
def batched_matmul(a: Tensor, b: Tensor, host: HostGuard, op: str, a_full: Tensor | None = None,
                   b_full: Tensor | None = None) -> Tensor:
    """fp32 a [B, M, K] @ b [B, K, N] -> [B, M, N] through the guard's GEMM on fixed tiles, thread-invariant.

    For the attention backward, whose reductions run over queries or keys: rows are padded to tiles of
    ``row_block(M)`` rows, the reduction K to a multiple of ``COL_BLOCK`` and N to a multiple of ``COL_BLOCK``
    (zeros add nothing); every tile of batch entry i multiplies i's own operand. One ``host.bmm`` call, whose
    shape class is (K, N) padded: probed for every thread count it runs at, else the fixed-order GEMM.
    ``a_full`` / ``b_full``: a tensor the caller already holds whose leading corner is ``a`` / ``b`` and which is zero
    elsewhere; where it has the padded operand's shape (contiguous, aligned), it is that operand (no copy)."""
    batch, rows, k = a.shape
    n = b.shape[2]
    k_pad, n_pad = gemm_tiles.ceil_to(k, gemm_tiles.COL_BLOCK), gemm_tiles.ceil_to(n, gemm_tiles.COL_BLOCK)
    b = gemm_tiles.padded_operand(b, (batch, k_pad, n_pad), b_full)  # contiguous (when padded): the row-major layout
    block = gemm_tiles.row_block(rows, host.tile_heights(a.dtype, b[:1], False, op))
    row_tiles = -(-rows // block)
    a = _row_tiles(a, (batch, row_tiles * block, k_pad), a_full, block)
    out = host.bmm(a, _repeated(b, row_tiles), op=op, shared_operand=False).view(batch, row_tiles * block, n_pad)
    return out[:, :rows, :n]


def _row_tiles(a: Tensor, shape: tuple[int, int, int], full: Tensor | None, block: int) -> Tensor:
    """``batched_matmul``'s left operand: ``a`` zero-padded to ``shape`` [B, rows, K] in tiles [B * rows / block,
    block, K] -- what ``padded_operand(a, shape, full).reshape(...)`` gives, made with fewer copies. With nothing to
    pad, that is a clone keeping ``a``'s strides, viewed as tiles where it can be (a strided operand: kept so), else
    copied contiguous: a contiguous, aligned ``a`` is taken as it is, and a transposed one (attention's p.T) is copied
    once by the compiled loops' blocked transpose (one copy instead of the clone and aten's element-wise transposing
    copy). The same values in the same layout: the same GEMM."""
    tiles = (shape[0] * shape[1] // block, block, shape[2])
    if gemm_tiles.is_padded_operand(full, shape):
        return full.view(tiles)
    if tuple(shape) != tuple(a.shape):
        return gemm_tiles.zero_padded(a, shape).view(tiles)  # a fresh contiguous copy
    if gemm_tiles.is_padded_operand(a, shape):
        return a.view(tiles)  # the clone's values and layout, without the clone
    if _viewable(a, tiles) or (loops := compiled_loops.library()) is None:
        return a.clone().reshape(tiles)  # a strided operand (the clone viewed), or aten's copy
    return loops.padded_copy(a, shape).view(tiles)


def _repeated(b: Tensor, repeats: int) -> Tensor:
    """b [B, K, N] with each entry ``repeats`` times, [B * repeats, K, N] (``b.unsqueeze(1).expand(...).reshape(...)``):
    where that copies (several entries, several repeats), a transposed ``b`` is first made contiguous by the compiled
    loops' blocked transpose, so aten's copy reads rows (the same values; the copy is contiguous either way)."""
    batch, k, n = b.shape
    expanded = b.unsqueeze(1).expand(batch, repeats, k, n)
    if (repeats > 1 and batch > 1 and not b.is_contiguous() and b.stride(0) != 0
            and (loops := compiled_loops.library()) is not None):
        expanded = loops.padded_copy(b, b.shape).unsqueeze(1).expand(batch, repeats, k, n)
    return expanded.reshape(batch * repeats, k, n)


def _viewable(x: Tensor, shape: tuple[int, ...]) -> bool:
    """Whether ``x`` (its strides) can be viewed as ``shape`` without a copy."""
    try:
        x.view(shape)
    except RuntimeError:
        return False
    return True
