"""Exact CPU backend: batch-invariant, thread-count-invariant kernels built from torch ops.

Why torch's own ops are not enough (measured on this project's CI machines): ``x @ W`` picks a
different BLAS kernel for M = 1, for small M and for some thread counts, so a row's result depends
on how many rows sit beside it; SDPA's last prefill row differs from a single-query decode; wide
sums change with the thread count.

How this module gets exactness anyway -- three building blocks, each invariant:

1. **Fixed-shape matmul tiles** (``_tiled_matmul``): rows are zero-padded to whole row tiles
   (4, 8, 16, 32 or 64 rows: the smallest that holds them, 64-row tiles beyond) and the output width
   to a multiple of ``COL_BLOCK`` (16); one batched GEMM then runs the same kernel for every tile,
   whatever M is. Each output element's K-reduction therefore always runs through the same kernel
   in the same order -- *if* the host BLAS gives a row the same bits for every tile height, position
   in the tile, number of tiles and thread count. That is a measured property of the host (MKL on
   x86-64 has it; numpy's OpenBLAS on an AVX-512 host did not), so it is never assumed: ``HOST``
   (``host_guard.HostGuard``) probes it at first use for each shape class and, where it fails,
   runs that class through ``fixed_order.bmm`` (a halving tree of exactly rounded products per
   output element: invariant by construction, slower) and warns. Attention tiles its rows the same way.
2. **Halving-tree sums** (``fixed_order.tree_sum``): a row is summed by repeatedly adding its two
   halves. Each step is an elementwise IEEE add (exactly rounded, identical in vector and scalar
   code), so the result depends only on the row's values -- invariant by construction.
   Zero padding at the end of a row does not change the result (x + 0 == x), which lets a
   decode step (short key row) and a prefill row (long, masked key row) sum identically.
3. **Chunked library math** (``_unary``): ``exp``/``log``/``sqrt`` run over the flattened tensor in
   chunks of ``CHUNK`` elements, a multiple of 64 below ATen's default parallel grain size
   (32768): an op with a vectorised body and a scalar tail (whose rounding can differ, e.g.
   Sleef's ``sigmoid``) then only ever runs the vectorised body. Whether the library's exp/log/sqrt
   give an element the same bits at every position is again a host property, probed by ``HOST``;
   where it fails, ``fixed_order.exp`` / ``log`` / ``sqrt`` (from exactly rounded ops) take over. (torch's
   CPU sqrt is such a library function, not the IEEE operation: it is not always correctly rounded.)

So every op is exact on any host: by construction, or by a probed property with a by-construction
fallback. ``host_report()`` says which path each op took (``vexact check`` prints it); the environment
variable ``VEXACT_CPU_EXACT_PATH=fixed-order`` forces the by-construction path everywhere. The torch-op
compositions around the library calls (tree sums, masks, operand layouts) also exist as compiled loops
(``compiled_loops``): the same operations element by element, the same bits, fewer aten calls.

Everything is computed in fp32 (bf16 inputs are upcast: a bf16 x bf16 product is exact in
fp32) and rounded once to the output dtype. Backward passes (``autograd.exact_forward_vjp``,
``_ExactAttention``) are analytic VJPs on values the exact forward saved -- no second forward -- built from
the same blocks: guarded GEMM tiles (a weight gradient reduces over tokens in fixed chunks, ``_transposed_matmul``),
halving trees and the chunked exp. So the gradients are thread-count invariant too (each op's "Backward
contract"); they still depend on the batch they are computed over (only the forward is compared across paths).

Speed (see ``benchmarks/`` and the README's "Benchmarks" section): the exact forward runs
the same BLAS GEMMs as native ops, on padded tiles; what it adds is padding, the tree sums'
extra passes and Python dispatch of more, smaller ops. The fixed-order fallback is much slower
(its GEMM does not use BLAS); ``benchmarks/host_guard.py`` measures the ratio.
"""

from __future__ import annotations

from functools import partial
from types import ModuleType, SimpleNamespace

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_loops, native
from .autograd import exact_forward_vjp
from .compiled_loops import tree_sum as _tree_sum
from .host_guard import HostGuard

NAME = "cpu_exact"

ROW_BLOCKS = (4, 8, 16, 32, 64)  # GEMM tile heights: the smallest holding a call's rows, else 64-row tiles
COL_BLOCK = 16  # output columns are padded to a multiple of this (odd N changed MKL's threading)
CHUNK = 32704  # elements per transcendental call: < ATen GRAIN_SIZE (32768), multiple of 64
REDUCE_BLOCK = 256  # tokens per chunk of a weight gradient's reduction (backward; see _transposed_matmul)
KEY_BLOCK = 64  # keys per attention tile, from position 0
# A weight gradient whose right operand would be copied once per row tile with more than this many extra elements
# runs one GEMM call per row tile instead (the same tiles; below it, the extra calls cost more than the copy).
ROW_TILE_CALLS_FROM = 1 << 20
# A weight gradient on views (``_transposed_matmul_views``) cuts N into slabs of this many output rows, and runs only
# with at most VIEW_PARTIALS_MAX partial-product elements per slab (chunks * slab * K: 64 MiB of fp32).
VIEW_SLAB_ROWS = 4096
VIEW_PARTIALS_MAX = 1 << 24
VIEW_PROBE_CHUNKS, VIEW_PROBE_SEED = 2, 20261126  # the same_bits probes: whole chunks per call (plus a partial), seed
# A linear layer's tiles run as one GEMM (``_stacked_matmul``) only up to this many multiply-adds: its same_bits
# probe (per tile count) costs about three such GEMMs at first use.
STACKED_MACS_MAX = 1 << 34
ALIGNMENT = 64  # bytes: GEMM operands start on this boundary (torch's CPU allocator gives it to every new tensor)
# The process's guard: probes the host properties the fast paths rely on (see host_guard), per shape class.
HOST = HostGuard(ROW_BLOCKS)
# What each op's invariance rests on besides construction (reported by ``host_report``).
HOST_PROPERTIES = {"embedding": (), "linear": ("gemm_rows", "same_bits"), "rms_norm": ("elementwise_sqrt",),
                   "silu_mul": ("elementwise_exp",),
                   "rope": (), "entropy": ("elementwise_exp",),
                   "attention": ("gemm_rows", "elementwise_exp"),
                   "log_softmax": ("elementwise_exp", "elementwise_log"),
                   "token_logprobs": ("elementwise_exp", "elementwise_log")}


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_block(rows: int, heights: tuple[int, ...] = ROW_BLOCKS) -> int:
    """GEMM tile height for ``rows`` rows: the smallest of ``heights`` (the guard's allowed heights for the GEMM's
    shape class, a subset of ROW_BLOCKS) that holds them, else the largest.

    MKL gave every output row the same bits for tile heights 4..64 (measured with 1-16 threads,
    1-256 tiles per bmm, K up to 1536): a row's K-reduction does not depend on how many rows
    share its tile. Heights 1 and 2 do differ (a narrower kernel), hence 4 as the smallest.
    Small tiles keep a decode step from paying for rows it does not have: its attention tile
    holds ``group`` real query rows (2 in the default model), and a 16-row tile multiplied
    zeros 8x over in the scores and P @ V GEMMs and their masks. (Measured on one host: on every
    host ``HOST`` probes it before relying on it.)"""
    for block in heights:
        if rows <= block:
            return block
    return heights[-1]


# --------------------------------------------------------------------------- building blocks
def _tiled_matmul(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> Tensor:
    """fp32 x [M, K] @ weight[N, K].T -> [M, N] through [R, K] x [K, N_pad] GEMM tiles, R = ``_row_block(M)``.

    One ``host.bmm`` over ceil(M / R) row tiles (zero-padded), the (transposed, column-padded)
    weight shared by every tile: each output element's K-reduction runs through the same GEMM
    kernel whatever M is (BLAS where the probe passed, else the fixed-order GEMM).
    N is padded to a multiple of ``COL_BLOCK`` (16, the AVX-512 width):
    MKL splits the columns of a GEMM between threads, and with widths that are not multiples
    of 16 (e.g. 8, 22, 24, 37, 100 with 3-4 threads) some columns ran through a narrower
    kernel with other roundings; widths that are multiples of 16 gave the same bits as padding
    to 64 (measured on 1-4 threads, K up to 1536).

    Both operands are contiguous and start ``ALIGNMENT``-aligned (``_aligned``), as in the host probe: a
    BLAS may take another path for a misaligned or strided operand (Intel documents alignment as a
    source of differing results), so a view into a larger tensor never reaches the GEMM."""
    rows, k = x.shape
    n = weight.shape[0]
    n_pad = _ceil_to(n, COL_BLOCK)
    loops = compiled_loops.library()
    given = weight.t()  # [K, N]: an input gradient's weight W, contiguous, which the canonical operand copies
    if (loops is not None and n_pad == n and weight.dtype == torch.float32 and given.is_contiguous()
            and given.data_ptr() % ALIGNMENT == 0 and rows * k * n <= STACKED_MACS_MAX):
        if (record := host.library_gemm(x.dtype, _transposed_class(k, n), True, op)) is not None:
            block = _row_block(rows, record.tile_heights)
            blocks = -(-rows // block)
            if _stacked_agrees(blocks, block, k, n, transposed=True, row_major=True, host=host, op=op):
                return _stacked_matmul(x, given.unsqueeze(0), blocks * block, n)
    w = _float(weight)
    w = _zero_padded(w, (n_pad, w.shape[1])) if n_pad != n else _aligned(w)
    operand = w.t().unsqueeze(0)  # [1, K, N_pad]
    if loops is not None and (record := host.library_gemm(x.dtype, operand, True, op)) is not None:
        block = _row_block(rows, record.tile_heights)
        blocks = -(-rows // block)
        if (blocks > 1 and blocks * block * k * n_pad <= STACKED_MACS_MAX
                and _stacked_agrees(blocks, block, k, n_pad, transposed=_layout_is_transposed(operand),
                                    row_major=False, host=host, op=op)):
            return _stacked_matmul(x, operand, blocks * block, n)
        # the library GEMM: the steps below in one compiled call, on the same operands
        return loops.tiled_matmul(x, operand, block, n)
    block = _row_block(rows, host.tile_heights(x.dtype, operand, True, op))
    blocks = -(-rows // block)
    if blocks * block != rows:
        x = _zero_padded(x, (blocks * block, k))
    else:
        x = _aligned(x)
    out = host.bmm(x.view(blocks, block, k), operand.expand(blocks, k, n_pad), op=op, shared_operand=True)
    out = out.view(blocks * block, n_pad)
    return out[:rows] if n_pad == n else out[:rows, :n]


def _transposed_class(k: int, n: int) -> Tensor:
    """A [1, K, N] tensor with the transposed layout (K contiguous) of ``_tiled_matmul``'s canonical operand, to ask
    the guard about its GEMM class without laying that operand out (llama's LM head: 113 MB). Overlapping strides
    over k + n elements: only its shape and layout are read."""
    return torch.empty(k + n).as_strided((1, k, n), (0, 1, 1))


def _layout_is_transposed(operand: Tensor) -> bool:
    """A [T, K, N] GEMM operand in the transposed layout (K contiguous), as the guard classes it."""
    return operand.stride(1) == 1 and operand.shape[1] > 1


def _stacked_agrees(blocks: int, block: int, k: int, n_pad: int, *, transposed: bool, row_major: bool,
                    host: HostGuard, op: str) -> bool:
    """Whether one GEMM over ``blocks`` stacked ``block``-row tiles gives the tiles' own bits (the one ``bmm`` call of
    ``_tiled_matmul``, each tile multiplying the shared operand [1, K, N_pad], ``transposed`` or row-major) for this
    class on this host; ``row_major``: with the operand's values in the row-major layout (an input gradient's weight
    as it is, where the canonical operand is its transposed copy). A ``same_bits`` probe at first use per (tile
    count, tile height, K, N_pad, layouts), on seeded inputs.

    The tiles keep a row's bits independent of the row count; one GEMM packs the shared operand once instead of
    once per tile (llama's LM head: a 113 MB weight, 5 tiles for 312 tokens), and the weight as it is saves a
    transposing copy of it. Where the library's result for a row would differ, the probe sees it and the tiles
    run."""

    def inputs(layout_transposed: bool) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(VIEW_PROBE_SEED)
        x = torch.randn(blocks * block, k, generator=gen)
        w = torch.randn(n_pad, k, generator=gen)  # the weight's values, [N_pad, K]
        return x, (w.t() if layout_transposed else w.t().contiguous()).unsqueeze(0)

    def tiles() -> Tensor:
        x, w = inputs(transposed)
        return torch.bmm(x.view(blocks, block, k), w.expand(blocks, k, n_pad)).view(blocks * block, n_pad)

    def stacked() -> Tensor:
        x, w = inputs(transposed and not row_major)
        return _stacked_matmul(x, w, blocks * block, n_pad)

    layout = "transposed" if transposed else "row-major"
    given = ", the weight as given (row-major)" if row_major else ""
    return host.arrangement_agrees("linear tiles stacked in one GEMM",
                                   f"{blocks}x{block} rows K={k} N={n_pad} {layout}{given} float32", tiles, stacked, op)


def _stacked_matmul(x: Tensor, operand: Tensor, padded_rows: int, n: int) -> Tensor:
    """``_tiled_matmul``'s tiles as one GEMM: x zero-padded to ``padded_rows`` (the tiles' rows) @ operand[0], sliced
    to [M, n]. Used only where ``_stacked_agrees`` found the tiles' bits."""
    rows, k = x.shape
    x = _zero_padded(x, (padded_rows, k)) if padded_rows != rows else _aligned(x)
    out = torch.mm(x, operand[0])
    return out[:rows] if out.shape[1] == n else out[:rows, :n]


def _zero_padded(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``torch.constant_pad_nd(x, ...)`` with zeros after the end of each dim up to ``shape``: the same values and
    layout (a fresh contiguous tensor; with nothing to pad, a clone, as constant_pad_nd gives), with zeros written
    only where ``x`` is not -- constant_pad_nd fills the whole tensor first, a second pass over memory that cost as
    much as the copy on small tensors."""
    if tuple(shape) == tuple(x.shape):
        return x.clone()
    loops = compiled_loops.library()
    if loops is not None:  # the same copy in one pass (compiled_loops)
        return loops.padded_copy(x, shape)
    out = x.new_empty(shape)
    out[tuple(slice(0, size) for size in x.shape)].copy_(x)
    _zero_outside(out, x.shape)
    return out


def _zero_outside(out: Tensor, corner: tuple[int, ...]) -> None:
    """Zero ``out`` everywhere but its leading ``corner`` (each element once)."""
    for dim, (size, total) in enumerate(zip(corner, out.shape)):
        if total > size:  # this dim's padding, where every earlier dim holds data
            out[(*(slice(0, s) for s in corner[:dim]), slice(size, total))].zero_()


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when contiguous and starting at an ``ALIGNMENT``-byte boundary (as every fresh torch CPU
    allocation does), else a fresh contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _unary(name: str, x: Tensor, host: HostGuard, op: str, inplace: bool = False) -> Tensor:
    """Apply ``exp``, ``log``, ``cos`` or ``sqrt`` (the path ``host`` chose) chunk by chunk (module docstring, point 3).

    ``inplace``: ``x`` is a scratch tensor the caller gives up; the result may be written into it."""
    fn = host.elementwise(name, x.dtype, op)
    flat = x.contiguous().view(-1)
    total = flat.numel()
    padded = _ceil_to(max(total, 1), 64)
    if padded != total:
        flat = torch.cat([flat, flat.new_zeros(padded - total)])
    fresh = flat.data_ptr() != x.data_ptr()  # a copy made here may be overwritten
    out = flat if inplace or fresh else torch.empty_like(flat)
    for start in range(0, padded, CHUNK):
        fn(flat[start : start + CHUNK], out=out[start : start + CHUNK])
    return out[:total].view(x.shape)


def elementwise(name: str, x: Tensor, *, host: HostGuard = HOST, op: str = "sampling") -> Tensor:
    """``name`` (exp, log, cos or sqrt) of every element of ``x`` (fp32 or fp64), each element's bits independent of
    the tensor's size and the element's position (chunked, through the path ``host`` chose for this host)."""
    return _unary(name, x, host, op)


def _float(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _reduction_block(rows: int) -> int:
    """Rows per chunk of a backward reduction over tokens (``_transposed_matmul``): the smallest power of two from
    64 holding ``rows``, else ``REDUCE_BLOCK``. A handful of fixed GEMM shapes, so the guard probes few classes."""
    block = 64
    while block < min(rows, REDUCE_BLOCK):
        block *= 2
    return block


def _transposed_matmul(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None = None) -> Tensor:
    """fp32 a.T @ b: a [M, N], b [M, K] -> [N, K], a reduction over the M rows (tokens), thread-invariant.

    The canonical arrangement is ``_transposed_matmul_tiles``. Where this GEMM class runs the library GEMM and the
    guard found that ``_transposed_matmul_views`` (the same chunk GEMMs on views, without the transposing copies and
    row tiles) gives its bits, that arrangement runs instead (``HostGuard.arrangement_agrees``): first with the
    last, partial chunk's GEMM on its real rows only (a shorter reduction: it gives the padded one's bits on some
    hosts for some lengths, so that is probed per length), else with that chunk zero-padded. No bit changes."""
    rows, n = a.shape
    k = b.shape[1]
    block = _reduction_block(rows)
    chunks = -(-rows // block)
    if chunks * min(n, VIEW_SLAB_ROWS) * k <= VIEW_PARTIALS_MAX and _library_reduction(block, k, host, op):
        tail = rows % block
        if tail and _views_agree(block, n, k, tail, host, op):
            return _transposed_matmul_views(a, b, block, unpadded_tail=True)
        if _views_agree(block, n, k, None, host, op):
            return _transposed_matmul_views(a, b, block, unpadded_tail=False)
    return _transposed_matmul_tiles(a, b, host, op, b_source)


def _reduction_class(block: int, k: int) -> Tensor:
    """``_transposed_matmul_tiles``'s right operand's GEMM class: [block, K_pad] per tile, transposed layout (K_pad
    rows of ``block`` tokens) -- a tensor of that shape and layout, to ask the guard about."""
    return torch.empty(1, _ceil_to(k, COL_BLOCK), block).transpose(1, 2)


def _library_reduction(block: int, k: int, host: HostGuard, op: str) -> bool:
    """Whether ``_transposed_matmul_tiles``'s GEMM class runs torch's own GEMM (the views call it themselves)."""
    return host.library_gemm(torch.float32, _reduction_class(block, k), False, op) is not None


def _views_agree(block: int, n: int, k: int, tail: int | None, host: HostGuard, op: str) -> bool:
    """Whether ``_transposed_matmul_views`` gives ``_transposed_matmul_tiles``'s bits for this class on this host: with
    the last chunk's ``tail`` rows unpadded (a class per length), or (``tail`` None) with that chunk padded. A probe
    at first use on seeded inputs whose chunk size is ``block`` too: ``VIEW_PROBE_CHUNKS`` whole chunks (where
    ``block`` is ``REDUCE_BLOCK``: there are several) and the partial one."""
    whole = VIEW_PROBE_CHUNKS if block == REDUCE_BLOCK else 0
    partial = block // 2 + 1 if tail is None else tail

    def inputs() -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(VIEW_PROBE_SEED)
        rows = whole * block + partial
        return torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)

    form = "last chunk padded" if tail is None else f"last chunk of {tail} rows unpadded"
    return host.arrangement_agrees("weight gradient on views", f"block={block} N={n} K={k} {form} float32",
                                   lambda: _transposed_matmul_tiles(*inputs(), host, op),
                                   lambda: _transposed_matmul_views(*inputs(), block, unpadded_tail=tail is not None),
                                   op)


def _transposed_matmul_views(a: Tensor, b: Tensor, block: int, unpadded_tail: bool) -> Tensor:
    """``_transposed_matmul_tiles``'s chunk GEMMs, each [N, block] @ [block, K], on views: chunk c's left operand is
    rows c * block ... of ``a`` seen transposed, its right operand those rows of ``b`` as they are. The last,
    partial chunk is zero-padded to ``block`` rows (a copy) or, ``unpadded_tail``, multiplied on its real rows, its
    result + 0.0 (padding's zeros turn a -0.0 sum into +0.0). The partial products are added by the same halving
    tree in chunk order. N is cut into slabs of ``VIEW_SLAB_ROWS`` output rows (llama's LM head: 49152), each its
    own calls and tree, to bound the partial products' memory. Used only where the guard found the canonical bits."""
    rows, n = a.shape
    k = b.shape[1]
    a, b = _aligned(a), _aligned(b)  # chunk starts are then aligned too (block * N * 4 bytes apart)
    whole, tail = divmod(rows, block)
    body = whole * block
    if tail and not unpadded_tail:
        a_tail, b_tail = _zero_padded(a[body:], (block, n)), _zero_padded(b[body:], (block, k))
    else:
        a_tail, b_tail = a[body:], b[body:]
    out = a.new_empty(n, k) if n > VIEW_SLAB_ROWS else None
    for first in range(0, n, VIEW_SLAB_ROWS):
        last = min(n, first + VIEW_SLAB_ROWS)
        parts = a.new_empty(whole + (tail > 0), last - first, k)
        if whole:
            chunks = a[:body].view(whole, block, n)[:, :, first:last].transpose(1, 2)
            torch.bmm(chunks, b[:body].view(whole, block, k), out=parts[:whole])
        if tail:
            torch.bmm(a_tail[:, first:last].t().unsqueeze(0), b_tail.unsqueeze(0), out=parts[whole:])
            if unpadded_tail:
                parts[whole:].add_(0.0)
        slab = parts[0] if parts.shape[0] == 1 else _tree_sum(parts, dim=0)
        if out is None:
            return slab
        out[first:last] = slab
    return out


def _transposed_matmul_tiles(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None = None) -> Tensor:
    """fp32 a.T @ b: a [M, N], b [M, K] -> [N, K], a reduction over the M rows (tokens), thread-invariant.

    A weight gradient sums over every token of the batch, so its reduction length M changes from call to call.
    Rows are cut into chunks of ``_reduction_block(M)`` (zero-padded). Each chunk is a GEMM tile product whose
    K-reduction has that fixed length, [R, block] @ [block, K] for every R-row tile of the N output rows (one
    ``host.bmm`` call for all chunks: a probed shape class, or the fixed-order GEMM), and the chunks' partial
    products are added by a halving tree in chunk order. So each output element depends only on the two columns
    it reduces -- never on the thread count (or where thread boundaries fall).

    The GEMM operands are laid out by ``_chunks_transposed`` in one copy each (the price of exactness is mostly such
    passes over memory on small models); their values, shapes, strides and alignment are the ones a plain
    pad-transpose-copy composition gives (``tests/test_exact_price_bits.py`` compares the two, call by call), so
    the library call and every bit of its result are unchanged. ``b_source``: the tensor ``b`` was derived from (a
    linear layer's saved input); layers that share an input (q, k and v; gate and up) then share b's layout
    (``_reduction_operand``)."""
    rows, n = a.shape
    k = b.shape[1]
    block = _reduction_block(rows)
    chunks = -(-rows // block)
    padded = chunks * block
    k_pad = _ceil_to(k, COL_BLOCK)
    b_class = _reduction_class(block, k)
    loops = compiled_loops.library()
    record = host.library_gemm(a.dtype, b_class, False, op) if loops is not None else None
    heights = record.tile_heights if record is not None else host.tile_heights(a.dtype, b_class, False, op)
    height = _row_block(n, heights)
    row_tiles = -(-n // height)
    if chunks > 1 and row_tiles > 1 and (row_tiles - 1) * chunks * k_pad * block >= ROW_TILE_CALLS_FROM:
        return _transposed_matmul_by_row_tile(a, b, host, op, b_source, block, height, k_pad)
    if record is not None:  # the library GEMM: the steps below in one compiled call, on the same operands
        b_tiles = _reduction_operand(b, block, chunks, k_pad, row_tiles, b_source)
        return loops.transposed_matmul(a, b_tiles, block, chunks, height, row_tiles, k)
    if row_tiles * height == n and (chunks == 1 or row_tiles == 1):
        # no padding rows, one chunk or one row tile: the chunks seen transposed, a view (as reshape gives)
        contiguous = padded == rows and a.is_contiguous() and a.data_ptr() % ALIGNMENT == 0
        a_rows = a if contiguous else _zero_padded(a, (padded, n))
        a_tiles = a_rows.view(chunks, block, n).transpose(1, 2).reshape(chunks * row_tiles, height, block)
    else:  # [chunks * row_tiles, height, block]: each chunk's transpose, zero-padded to whole row tiles, contiguous
        a_tiles = _chunks_transposed(a, block, chunks, row_tiles * height).view(chunks * row_tiles, height, block)
    # every row tile of a chunk multiplies that chunk's [block, K_pad] operand (a transposed layout, as the probe's;
    # one chunk: an expanded view, as reshape gives)
    b_tiles = _reduction_operand(b, block, chunks, k_pad, row_tiles, b_source)
    out = host.bmm(a_tiles, b_tiles.transpose(1, 2), op=op, shared_operand=False)
    parts = out.view(chunks, row_tiles * height, k_pad)[:, :n, :k]
    return parts[0] if chunks == 1 else _tree_sum(parts, dim=0)


def _transposed_matmul_by_row_tile(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None,
                                   block: int, height: int, k_pad: int) -> Tensor:
    """``_transposed_matmul`` for several chunks and several row tiles: the same GEMM tiles (the same operands, tile
    by tile) in one ``host.bmm`` call per row tile, over the chunks, then the same halving tree over the chunks.

    One call for every (chunk, row tile) pair needs each chunk's right operand copied once per row tile (a
    per-tile operand, as probed); per row tile, every chunk's operand appears once, so the laid-out operand is
    passed as it is. On llama100m's LM head (768 row tiles) that copy was 768 times the operand (taken from
    ``ROW_TILE_CALLS_FROM`` extra elements: on the default model's RL leaves, the extra calls cost more). A tile's
    rows do not depend on how many tiles share its call (a probed property the kernels rely on everywhere: a call's
    tile count follows the batch), so no bit changes (``tests/test_exact_price_bits.py`` compares the tiles)."""
    rows, n = a.shape
    k = b.shape[1]
    chunks = -(-rows // block)
    row_tiles = -(-n // height)
    a_tiles = _row_tiles_transposed(a, block, chunks, row_tiles, height)  # [row_tiles, chunks, height, block]
    b_operand = _reduction_operand(b, block, chunks, k_pad, 1, b_source).transpose(1, 2)  # [chunks, block, K_pad]
    out = a.new_empty(n, k)
    for tile in range(row_tiles):
        parts = host.bmm(a_tiles[tile], b_operand, op=op, shared_operand=False)  # [chunks, height, K_pad]
        first = tile * height
        last = min(n, first + height)
        out[first:last] = _tree_sum(parts[:, : last - first, :k], dim=0)
    return out


def _row_tiles_transposed(a: Tensor, block: int, chunks: int, row_tiles: int, height: int) -> Tensor:
    """[row_tiles, chunks, height, block]: out[r, c, i, j] = a[c * block + j, r * height + i], zero where ``a`` [M, N]
    has no element -- the tiles of ``_chunks_transposed(a, block, chunks, row_tiles * height)``, row tile major, in
    one strided copy per region (whole chunks and row tiles, the last partial chunk, the last partial row tile)."""
    rows, n = a.shape
    out = a.new_empty(row_tiles, chunks, height, block)
    full, tail = divmod(rows, block)
    whole, rest = divmod(n, height)
    body, cut = full * block, whole * height  # the rows of whole chunks, the columns of whole row tiles
    if full and whole:
        out[:whole, :full].copy_(a[:body, :cut].view(full, block, whole, height).permute(2, 0, 3, 1))
    if tail and whole:
        out[:whole, full, :, :tail].copy_(a[body:, :cut].view(tail, whole, height).permute(1, 2, 0))
        out[:whole, full, :, tail:].zero_()
    if rest and full:
        out[whole, :full, :rest].copy_(a[:body, cut:].view(full, block, rest).permute(0, 2, 1))
    if rest and tail:
        out[whole, full, :rest, :tail].copy_(a[body:, cut:].t())
        out[whole, full, :rest, tail:].zero_()
    if rest:
        out[whole, :, rest:].zero_()
    return out


# The right operand of the last weight gradient per input tensor (weakly keyed: gone with the tensor), see below.
_REDUCTION_OPERANDS = WeakIdKeyDictionary()


def _reduction_operand(b: Tensor, block: int, chunks: int, k_pad: int, row_tiles: int,
                       source: Tensor | None) -> Tensor:
    """[chunks * row_tiles, K_pad, block]: each ``block``-row chunk of ``b`` [M, K] transposed (``_chunks_transposed``),
    once per row tile of the left operand -- the right operand of ``_transposed_matmul``'s GEMM.

    Laying it out is a transposing copy (and a copy per row tile), as long as the GEMM itself on the default model.
    The layers that read one input (q, k and v; gate and up) need the same operand for their weight gradients, one
    after the other in the backward, so it is kept per ``source`` (the input tensor ``b`` was derived from) and
    reused while the source is unchanged (its version counter) and the layout asked for is the same. The values
    are those of a fresh layout, so no bit changes; the entry goes when the source tensor is freed."""
    key = (source._version, tuple(b.shape), b.dtype, block, k_pad, row_tiles) if source is not None else None
    if key is not None and (hit := _REDUCTION_OPERANDS.get(source)) is not None and hit[0] == key:
        return hit[1]
    b_t = _chunks_transposed(b, block, chunks, k_pad)
    tiles = b_t.unsqueeze(1).expand(chunks, row_tiles, k_pad, block).reshape(chunks * row_tiles, k_pad, block)
    if key is not None:
        _REDUCTION_OPERANDS[source] = (key, tiles)
    return tiles


def _chunks_transposed(src: Tensor, block: int, chunks: int, width: int) -> Tensor:
    """[chunks, width, block]: ``src`` [M, N] cut into ``block``-row chunks, each transposed, zero where ``src`` has
    no element (rows past M, columns from N to ``width``) -- out[c, i, j] = src[c * block + j, i].

    The values and layout of zero-padding ``src`` and copying its chunks' transposes (``constant_pad_nd`` then
    ``contiguous``), with one transposing copy instead of a padded copy and then a transposing one, and zeros
    written only where the data is not (a whole-tensor zero fill cost as much as the copy on the loaded 2-core host)."""
    loops = compiled_loops.library()
    if loops is not None:  # the same copy in one pass (compiled_loops)
        return loops.chunks_transposed(src, block, chunks, width)
    rows, n = src.shape
    out = src.new_empty(chunks, width, block)
    full, tail = divmod(rows, block)
    if full:
        out[:full, :n].copy_(src[: full * block].view(full, block, n).transpose(1, 2))
    if tail:
        out[full, :n, :tail].copy_(src[full * block :].t())
        out[full, :n, tail:].zero_()
    if width > n:
        out[:, n:].zero_()
    return out


def _batched_matmul(a: Tensor, b: Tensor, host: HostGuard, op: str, a_full: Tensor | None = None,
                    b_full: Tensor | None = None) -> Tensor:
    """fp32 a [B, M, K] @ b [B, K, N] -> [B, M, N] through the guard's GEMM on fixed tiles, thread-invariant.

    For the attention backward, whose reductions run over queries or keys: rows are padded to tiles of
    ``_row_block(M)`` rows, the reduction K to a multiple of ``COL_BLOCK`` and N to a multiple of ``COL_BLOCK``
    (zeros add nothing); every tile of batch entry i multiplies i's own operand. One ``host.bmm`` call, whose
    shape class is (K, N) padded: probed for every thread count it runs at, else the fixed-order GEMM.
    ``a_full`` / ``b_full``: a tensor the caller already holds whose leading corner is ``a`` / ``b`` and which is zero
    elsewhere; where it has the padded operand's shape (contiguous, aligned), it is that operand (no copy)."""
    batch, rows, k = a.shape
    n = b.shape[2]
    k_pad, n_pad = _ceil_to(k, COL_BLOCK), _ceil_to(n, COL_BLOCK)
    b = _padded_operand(b, (batch, k_pad, n_pad), b_full)  # contiguous (when padded): the row-major layout
    block = _row_block(rows, host.tile_heights(a.dtype, b[:1], False, op))
    row_tiles = -(-rows // block)
    a = _padded_operand(a, (batch, row_tiles * block, k_pad), a_full).view(batch * row_tiles, block, k_pad)
    b = b.unsqueeze(1).expand(batch, row_tiles, k_pad, n_pad).reshape(batch * row_tiles, k_pad, n_pad)
    out = host.bmm(a, b, op=op, shared_operand=False).view(batch, row_tiles * block, n_pad)
    return out[:, :rows, :n]


def _batched_rows(rows: int, k: int, n: int, host: HostGuard, op: str) -> int:
    """The padded row count of ``_batched_matmul``'s left operand for [B, rows, k] @ [B, k, n]."""
    operand = torch.empty(1, _ceil_to(k, COL_BLOCK), _ceil_to(n, COL_BLOCK))  # the class: its shape, row-major
    block = _row_block(rows, host.tile_heights(torch.float32, operand, False, op))
    return -(-rows // block) * block


def _padded_operand(x: Tensor, shape: tuple[int, ...], full: Tensor | None) -> Tensor:
    """``x`` zero-padded to ``shape``: ``full`` itself where it is that tensor already (the caller's zero-padded
    buffer of which ``x`` is the leading corner, contiguous and aligned, as a fresh copy would be), else a copy."""
    if (full is not None and tuple(full.shape) == tuple(shape) and full.is_contiguous()
            and full.data_ptr() % ALIGNMENT == 0):
        return full
    return _zero_padded(x, shape)


# --------------------------------------------------------------------------- embedding
EMBEDDING_PAD_BUDGET = 1 << 16  # gradient rows laid out per chunk of the embedding backward (memory bound)


def _embedding_forward(weight: Tensor, tokens: Tensor) -> Tensor:
    return torch.nn.functional.embedding(tokens, weight)


def _embedding_with_saved(weight: Tensor, tokens: Tensor) -> tuple[Tensor, tuple]:
    return _embedding_forward(weight, tokens), (tokens, weight.shape[0], weight.dtype)


def _embedding_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    tokens, vocab, dtype = saved
    rows = _float(grad).reshape(-1, grad.shape[-1])
    return (_sum_rows_by_token(tokens.reshape(-1), rows, vocab).to(dtype),)


def _sum_rows_by_token(tokens: Tensor, rows: Tensor, vocab: int) -> Tensor:
    """out[v] = halving-tree sum, in position order, of the ``rows`` whose token is v; [vocab, D] fp32.

    Each token's rows are laid side by side ([tokens, occurrences, D], zero-padded to the chunk's largest count)
    and summed by ``tree_sum`` over the occurrences. Zero padding does not change a tree sum, so how tokens are
    grouped into chunks (by count, to bound memory) does not change any bit: out[v] depends only on v's rows and
    their order -- never on the thread count (unlike an ``index_add_``, whose order is the library's affair)."""
    loops = compiled_loops.library()
    if loops is not None and rows.dtype == torch.float32:  # the same chunks and trees in one call
        return loops.sum_rows_by_token(tokens, rows, vocab, EMBEDDING_PAD_BUDGET)
    count = tokens.numel()
    out = rows.new_zeros(vocab, rows.shape[1])
    if count == 0:
        return out
    order = torch.argsort(tokens, stable=True)  # position order within each token
    unique, counts = torch.unique_consecutive(tokens[order], return_counts=True)
    group = torch.repeat_interleave(torch.arange(unique.numel()), counts)  # group of each sorted row
    rank = torch.arange(count) - (counts.cumsum(0) - counts).repeat_interleave(counts)  # occurrence number
    sorted_rows = rows[order]
    by_count = torch.argsort(counts, descending=True, stable=True)
    slot = torch.full((unique.numel(),), -1, dtype=torch.long)
    start = 0
    while start < by_count.numel():
        width = int(counts[by_count[start]])
        chosen = by_count[start : start + max(1, EMBEDDING_PAD_BUDGET // width)]
        slot.fill_(-1)
        slot[chosen] = torch.arange(chosen.numel())
        member = slot[group] >= 0
        laid = rows.new_zeros(chosen.numel(), width, rows.shape[1])
        laid[slot[group][member], rank[member]] = sorted_rows[member]
        out[unique[chosen]] = _tree_sum(laid, dim=1)
        start += chosen.numel()
    return out


def embedding(tokens: Tensor, weight: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """Rows of ``weight`` [V, D] picked by ``tokens`` (int64 [...]) -> [..., D] in weight.dtype.

    Invariance contract: a gather -- each output row is ``weight[token]`` bit for bit, whatever the batch.
    Backward contract: grad_weight[v] is the halving-tree sum, in position order, of the gradient rows of the
    positions holding token v (``_sum_rows_by_token``): it depends only on (tokens, grad), never on the thread
    count. ``host`` is unused (nothing here rests on a host property); kept for the common op signature.
    """
    return exact_forward_vjp(_embedding_forward, _embedding_with_saved, _embedding_vjp, (weight,), (tokens,))


# --------------------------------------------------------------------------- linear


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, host: HostGuard) -> Tensor:
    out = _tiled_matmul(_float(x.reshape(-1, x.shape[-1])), weight, host)
    if bias is not None:
        out = out + _float(bias)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def _linear_with_saved(x: Tensor, weight: Tensor, bias: Tensor | None, host: HostGuard) -> tuple[Tensor, tuple]:
    return _linear_forward(x, weight, bias, host), (x, weight, bias is not None, host)


def _linear_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """dx = g @ W (rows = tokens, like the forward), dW = g.T @ x and db = sum of g (reductions over tokens:
    fixed chunks and a halving tree). fp32 inside, one rounding to each input's dtype."""
    x, weight, has_bias, host = saved
    g = _float(grad.reshape(-1, grad.shape[-1]))
    grad_x = grad_w = grad_b = None
    if needs[0]:
        grad_x = _tiled_matmul(g, weight.t(), host, "linear").to(x.dtype).view(x.shape)
    if needs[1]:
        x2d = _float(x.reshape(-1, x.shape[-1]))
        grad_w = _transposed_matmul(g, x2d, host, "linear", b_source=x).to(weight.dtype)
    if has_bias and needs[2]:
        grad_b = _tree_sum(g, dim=0)
    return (grad_x, grad_w, grad_b)[: len(needs)]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, host: HostGuard = HOST) -> Tensor:
    """y = x @ weight.T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N] in x.dtype.

    Invariance contract: each output row depends only on the same input row, the weight and
    the bias -- never on how many rows there are, the row's position among them, padding
    rows, or the torch thread count. fp32 accumulation; bias added in fp32; one rounding to
    x.dtype. Tiling: rows in GEMM tiles of 4, 8, 16, 32 or 64 rows (``_row_block``), columns padded to
    a multiple of 16.
    Backward contract: every gradient depends only on (x, weight, grad) -- never on the thread count.
    grad_x rows are tiled as the forward's; grad_weight and grad_bias reduce over the tokens in fixed chunks
    (``_transposed_matmul``) added by a halving tree (grad_weight's chunk GEMMs on views of grad and x where the
    guard found that this gives the canonical tiles' bits: ``same_bits``).
    """
    if bias is None:
        return exact_forward_vjp(partial(_linear_forward, bias=None, host=host),
                                 partial(_linear_with_saved, bias=None, host=host), _linear_vjp, (x, weight))
    return exact_forward_vjp(_linear_forward, _linear_with_saved, _linear_vjp, (x, weight, bias), (host,))


# --------------------------------------------------------------------------- row-wise ops
def _rms_norm_parts(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> tuple[Tensor, Tensor, Tensor]:
    """(output, fp32 x, fp32 1/rms [..., 1]). The sqrt is the host's (a library function, probed like exp)."""
    xf = _float(x)
    loops = compiled_loops.library()
    if loops is not None and xf.numel():  # the same ops row by row, in one pass each side of the sqrt
        mean_sq = loops.rms_norm_mean_square(xf, eps)
        inv_rms = _unary("sqrt", mean_sq, host, "rms_norm", inplace=True).reciprocal_().unsqueeze(-1)
        return loops.rms_norm_scale(xf, inv_rms, _float(weight)).to(x.dtype), xf, inv_rms
    mean_sq = _tree_sum(xf * xf).div_(x.shape[-1])
    inv_rms = _unary("sqrt", mean_sq.add_(eps), host, "rms_norm", inplace=True).reciprocal_().unsqueeze(-1)
    return torch.mul(xf, inv_rms).mul_(_float(weight)).to(x.dtype), xf, inv_rms


def _rms_norm_exact(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> Tensor:
    return _rms_norm_parts(x, weight, eps, host)[0]


def _rms_norm_with_saved(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> tuple[Tensor, tuple]:
    out, xf, inv_rms = _rms_norm_parts(x, weight, eps, host)
    return out, (xf, inv_rms, weight, x.dtype)


def _rms_norm_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2: dx = r * (g w - x r^2 mean(g w x)), dw = sum(g x r)."""
    xf, inv_rms, weight, dtype = saved
    g = _float(grad)
    grad_x = grad_w = None
    loops = compiled_loops.library()
    if loops is not None and xf.numel():  # the same ops row by row, in one pass (compiled_loops)
        grad_x, grad_w = loops.rms_norm_backward(g, xf, inv_rms, _float(weight), needs[0], needs[1])
        return grad_x.to(dtype) if needs[0] else None, grad_w.to(weight.dtype) if needs[1] else None
    if needs[0]:
        # inv_rms * (gw - xf * (inv_rms * inv_rms) * dot): the same exactly rounded ops on the same operands, in
        # the same order, written into one scratch tensor instead of a new tensor per step
        gw = g * _float(weight)
        dot = _tree_sum(gw * xf).div_(xf.shape[-1]).unsqueeze(-1)
        scratch = torch.mul(xf, inv_rms * inv_rms).mul_(dot)
        grad_x = torch.mul(inv_rms, torch.sub(gw, scratch, out=scratch), out=scratch).to(dtype)
    if needs[1]:
        grad_w = _tree_sum(torch.mul(g, xf).mul_(inv_rms).reshape(-1, xf.shape[-1]), dim=0).to(weight.dtype)
    return grad_x, grad_w


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, host: HostGuard = HOST) -> Tensor:
    """Llama RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, fp32 inside.

    Invariance contract: each output row depends only on that input row, the weight and eps
    -- never on the number of rows, their order, padding or the thread count (halving-tree
    sum, the host's sqrt -- probed for position and thread independence, else ``fixed_order.sqrt`` -- and an
    exactly rounded reciprocal; no rsqrt, whose vector and scalar paths round differently).
    Backward contract: the analytic VJP from the saved fp32 x and 1/rms; grad_x row by row, grad_weight over the
    rows, both by halving trees -- never dependent on the thread count.
    """
    return exact_forward_vjp(_rms_norm_exact, _rms_norm_with_saved, _rms_norm_vjp, (x, weight), (eps, host))


def _shift_and_log_normalizer(logits: Tensor, host: HostGuard, op: str) -> tuple[Tensor, Tensor]:
    xf = _float(logits)
    row_max = xf.amax(dim=-1, keepdim=True)  # max is exact in any order
    shifted = xf - row_max
    return shifted, _unary("log", _tree_sum(_unary("exp", shifted, host, op)), host, op)


def _log_softmax_exact(logits: Tensor, host: HostGuard) -> Tensor:
    shifted, log_normalizer = _shift_and_log_normalizer(logits, host, "log_softmax")
    return shifted - log_normalizer.unsqueeze(-1)


def _log_softmax_with_saved(logits: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    out = _log_softmax_exact(logits, host)
    return out, (out, logits.dtype, host)


def _log_softmax_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d logits = g - softmax * sum(g) (chunked exp, halving-tree sum)."""
    out, dtype, host = saved
    g = _float(grad)
    softmax = _unary("exp", out, host, "log_softmax")
    return (g - softmax.mul_(_tree_sum(g).unsqueeze(-1))).to(dtype),


def log_softmax(logits: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """log_softmax over the last dim, fp32 result.

    Invariance contract: each output row depends only on that logits row -- never on the
    number of rows, their order, the vocabulary being split into chunks, or thread count.
    Computed as (x - max) - log(tree_sum(exp(x - max))).
    Backward contract: g - softmax * sum(g) from the saved output, row by row (chunked exp, halving-tree sum):
    never dependent on the thread count.
    """
    return exact_forward_vjp(_log_softmax_exact, _log_softmax_with_saved, _log_softmax_vjp, (logits,), (host,))


def _token_logprobs_exact(logits: Tensor, targets: Tensor, host: HostGuard) -> Tensor:
    xf = _float(logits)
    shifted = xf - xf.amax(dim=-1, keepdim=True)  # max is exact in any order
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # exp in place: the same values as _shift_and_log_normalizer, one buffer fewer
    op = "token_logprobs"
    return picked - _unary("log", _tree_sum(_unary("exp", shifted, host, op, inplace=True)), host, op)


def _token_logprobs_with_saved(logits: Tensor, targets: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    shifted, log_normalizer = _shift_and_log_normalizer(logits, host, "token_logprobs")
    out = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normalizer
    return out, (shifted, log_normalizer, targets, logits.dtype, host)


def _token_logprobs_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d logits = g * (onehot(target) - softmax)."""
    shifted, log_normalizer, targets, dtype, host = saved
    g = _float(grad).unsqueeze(-1)
    grad_logits = _unary("exp", shifted - log_normalizer.unsqueeze(-1), host, "token_logprobs", inplace=True).mul_(-g)
    grad_logits.scatter_add_(-1, targets.unsqueeze(-1), g)
    return (grad_logits.to(dtype),)


def token_logprobs(logits: Tensor, targets: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """log p(target) per row: logits [..., V], targets [...] int64 -> fp32 [...].

    Invariance contract: as ``log_softmax`` (and bitwise equal to ``log_softmax(x)[target]``):
    each value depends only on its own logits row and target.
    Backward contract: g * (onehot - softmax) from the saved shifted logits, elementwise (chunked exp): never
    dependent on the thread count.
    """
    return exact_forward_vjp(_token_logprobs_exact, _token_logprobs_with_saved, _token_logprobs_vjp, (logits,),
                             (targets, host))


def _entropy_exact(log_probs: Tensor, host: HostGuard) -> Tensor:
    lp = _float(log_probs)
    return _tree_sum(_unary("exp", lp, host, "entropy").mul_(lp)).neg_()


def _entropy_with_saved(log_probs: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    lp = _float(log_probs)
    probs = _unary("exp", lp, host, "entropy")
    return _tree_sum(probs * lp).neg_(), (probs, lp, log_probs.dtype)


def _entropy_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d/d lp_i of -sum(exp(lp) lp) = -p_i (1 + lp_i)."""
    probs, lp, dtype = saved
    return ((lp + 1.0).mul_(probs).mul_(_float(grad).unsqueeze(-1)).neg_().to(dtype),)


def entropy(log_probs: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """-sum(p log p) over the last dim of a ``log_softmax`` output: fp32 [..., V] -> [...].

    Invariance contract: each value depends only on its own row (chunked exp, halving-tree sum) -- never on the
    number of rows or the thread count. Backward contract: -g p (1 + log p), elementwise: the same.
    """
    return exact_forward_vjp(_entropy_exact, _entropy_with_saved, _entropy_vjp, (log_probs,), (host,))


# --------------------------------------------------------------------------- elementwise ops
def _silu(gate: Tensor, host: HostGuard) -> Tensor:
    """fp32 silu(gate) = g / (1 + exp(-g)) as a new tensor (chunked exp, exactly rounded add and div)."""
    g = _float(gate)
    denom = _unary("exp", g.neg(), host, "silu_mul", inplace=True).add_(1.0)
    return torch.div(g, denom, out=denom)


def _silu_mul_loops(gate: Tensor, up: Tensor) -> ModuleType | None:
    """The compiled loops where they take this SwiGLU (fp32 gate and up), else None: the torch ops."""
    return compiled_loops.library() if gate.dtype == up.dtype == torch.float32 else None


def _silu_mul_compiled(gate: Tensor, up: Tensor, host: HostGuard, loops: ModuleType) -> tuple[Tensor, Tensor, Tensor]:
    """(out, 1 + exp(-gate), silu) of fp32 gate and up: the chunked exp, then the add, divide and multiply of
    ``_silu_mul_with_saved`` in one compiled pass."""
    denom = _unary("exp", gate.neg(), host, "silu_mul", inplace=True)
    silu, out = loops.silu_mul_forward(gate.contiguous(), denom, up.contiguous())
    return out, denom, silu


def _silu_mul_exact(gate: Tensor, up: Tensor, host: HostGuard) -> Tensor:
    if (loops := _silu_mul_loops(gate, up)) is not None:
        return _silu_mul_compiled(gate, up, host, loops)[0]
    silu = _silu(gate, host)
    if gate.dtype == torch.float32 and up.dtype == torch.float32:
        return silu.mul_(up)
    return silu.to(gate.dtype) * up


def _silu_mul_with_saved(gate: Tensor, up: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    """The forward's ops one by one (as ``_silu`` and ``_silu_mul_exact``), keeping 1 + exp(-gate) and silu(gate) for
    the backward: it needs both, and computing them again cost a negation, a chunked exp, an add and a divide."""
    if (loops := _silu_mul_loops(gate, up)) is not None:  # the add, divide and multiply below in one pass
        out, denom, silu = _silu_mul_compiled(gate, up, host, loops)
        return out, (gate, up, denom, silu, host)
    g = _float(gate)
    denom = _unary("exp", g.neg(), host, "silu_mul", inplace=True).add_(1.0)
    silu = torch.div(g, denom)
    out = torch.mul(silu, up) if gate.dtype == torch.float32 and up.dtype == torch.float32 else silu.to(gate.dtype) * up
    return out, (gate, up, denom, silu, host)


def _silu_mul_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """With s = sigmoid(gate) = 1 / (1 + exp(-gate)): d up = g * silu(gate) = g * gate * s and
    d gate = g * up * s * (1 + gate * (1 - s)); fp32 from the forward's 1 + exp(-gate) and silu (saved) and exactly
    rounded ops, one rounding."""
    gate, up, denom, silu, host = saved
    if (loops := _silu_mul_loops(gate, up)) is not None and grad.dtype == torch.float32:  # the ops below, one pass
        grad_gate, grad_up = loops.silu_mul_backward(grad.contiguous(), gate.contiguous(), up.contiguous(), denom,
                                                     silu, needs[0], needs[1])
        return (grad_gate if needs[0] else None), (grad_up if needs[1] else None)
    gf, g = _float(gate), _float(grad)
    grad_gate = grad_up = None
    if needs[0]:
        s = torch.reciprocal(denom)  # exactly rounded
        ds = (1.0 - s).mul_(gf).add_(1.0).mul_(s)  # s * (1 + gate * (1 - s))
        grad_gate = ds.mul_(g).mul_(_float(up)).to(gate.dtype)
    if needs[1]:  # the forward's silu, rounded to the gate's dtype as the forward does
        grad_up = torch.mul(_float(silu.to(gate.dtype)), g).to(up.dtype)
    return grad_gate, grad_up


def silu_mul(gate: Tensor, up: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """SwiGLU activation silu(gate) * up, elementwise.

    Invariance contract: each output element depends only on the matching gate and up
    elements -- not on the tensor's size or the element's position (torch's own ``silu`` /
    ``sigmoid`` round differently in their vector body and scalar tail; here silu is
    g / (1 + exp(-g)) with chunked exp and exactly rounded add/div).
    Backward contract: the analytic VJP, elementwise from chunked exp and exactly rounded ops -- each gradient
    element depends only on the matching gate, up and grad elements (not on the tensor's size or threads).
    """
    return exact_forward_vjp(_silu_mul_exact, _silu_mul_with_saved, _silu_mul_vjp, (gate, up), (host,))


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """Rotary embedding (rotate-half convention). x: [B, T, H, hd]; cos/sin: [B, T, hd/2] fp32.

    Invariance contract: each output element depends only on its own (x pair, cos, sin)
    elements. Only exactly rounded elementwise mul/add/sub are used (no fused ops), so the
    native implementation already satisfies the contract and is reused as is.
    """
    return native.rope(x, cos, sin)


# --------------------------------------------------------------------------- attention
class _AttentionTiles:
    """The tile layout of one ``attention`` call (see ``attention``'s docstring).

    Per (sequence b, KV head h) the group's query heads are folded into rows, t-major
    (row r = t * group + g), padded to whole ``block``-row tiles; keys are taken from position 0
    in whole ``KEY_BLOCK``-key tiles. fp32 tensors: ``q`` [B*Hkv, row_len, hd] (already times
    ``scale``), ``k``/``v`` [B*Hkv, key_len, hd]. ``visible`` is the number of leading keys any
    query can see (the furthest query position + 1); keys after it are masked for every row.
    """

    def __init__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float, host: HostGuard):
        batch, q_len, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        self.batch, self.q_len, self.q_heads, self.head_dim, self.kv_heads = batch, q_len, q_heads, head_dim, kv_heads
        self.group = q_heads // kv_heads
        self.rows = q_len * self.group
        self.block = _row_block(self.rows, self._tile_heights(host, head_dim))
        self.row_blocks = -(-self.rows // self.block)
        self.row_len = self.row_blocks * self.block
        # Keys needed: up to the furthest query position, in whole tiles from position 0.
        self.visible = int(q_start.max()) + q_len
        self.key_len = _ceil_to(self.visible, KEY_BLOCK)
        self.key_blocks = self.key_len // KEY_BLOCK
        self.cache_len = k_cache.shape[1]
        self.scale = scale
        self.host = host
        self.q = self._query_rows(q)
        self.k = self._key_rows(k_cache)
        self.v = self._key_rows(v_cache)
        # Query position of every row; padding rows act as the sequence's first query (at
        # least one visible key, so their softmax stays finite).
        row_t = torch.arange(self.row_len, device=q.device) // self.group
        self.row_t = torch.where(row_t < q_len, row_t, 0)
        self.q_start = q_start
        # Every sequence starting at one position (training, a prefill from 0): one mask serves the whole batch.
        # Asked only for several queries per sequence; a decode step's mask is small.
        self.uniform_start = batch == 1 or (q_len > 1 and bool((q_start == q_start[0]).all()))

    def _query_rows(self, q: Tensor) -> Tensor:
        """[B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd] times ``scale``, zero padding rows (finite; their outputs are
        dropped). The scale is applied to q, not to the scores: for the power-of-two scales of head_dim 4^n (16, 64,
        256) both are exact, and the [rows x keys] tile is far larger than q."""
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
        key_tile = torch.empty(1, KEY_BLOCK, head_dim)
        scores = host.tile_heights(torch.float32, key_tile.transpose(1, 2), False, "attention")
        values = host.tile_heights(torch.float32, key_tile, False, "attention")
        return tuple(h for h in scores if h in values)

    def _key_rows(self, cache: Tensor) -> Tensor:
        """[B, L, Hkv, hd] -> fp32 [B*Hkv, key_len, hd], zero-padded past the cache's end."""
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

    def to_output(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """[B*Hkv, n >= rows, hd] -> [B, T, Hq, hd] in ``dtype`` (padding rows dropped)."""
        b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
        real = rows.view(b, h, -1, d)[:, :, : self.rows].reshape(b, h, t, g, d)
        return real.permute(0, 2, 1, 3, 4).reshape(b, t, self.q_heads, d).to(dtype)

    def from_output(self, grad: Tensor) -> Tensor:
        """[B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd] with zero padding rows (inverse of ``to_output``)."""
        b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
        out = torch.empty(b, h, self.row_len, d, dtype=torch.float32, device=grad.device)
        out[:, :, : self.rows].view(b, h, t, g, d).copy_(grad.view(b, t, h, g, d).permute(0, 2, 1, 3, 4))
        if self.rows < self.row_len:  # zeros only where the gradient is not written
            out[:, :, self.rows :].zero_()
        return out.view(b * h, self.row_len, d)

    def to_cache(self, keys: Tensor, dtype: torch.dtype) -> Tensor:
        """[B*Hkv, n, hd] (the first n keys) -> [B, L, Hkv, hd] (the cache's shape; zero after n)."""
        b, h, d = self.batch, self.kv_heads, self.head_dim
        out = torch.empty(b, self.cache_len, h, d, dtype=dtype, device=keys.device)
        kept = min(self.cache_len, keys.shape[1])
        out[:, :kept] = keys.view(b, h, keys.shape[1], d)[:, :, :kept].permute(0, 2, 1, 3)
        if kept < self.cache_len:  # zeros only where no key is written (training: none)
            out[:, kept:].zero_()
        return out


def _attention_probs(tiles: _AttentionTiles, loops: ModuleType | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Scores, masking and the row-wise softmax pieces of ``attention``.

    Returns (probability tiles [B*Hkv*RB*KB, R, C] for the P @ V GEMMs, their row sums
    [B, Hkv, RB, R, 1] (1 for padding rows), the unnormalised probabilities of the real rows
    and visible keys [B, Hkv, RB, R', V] and their row sums [B, Hkv, RB, R', 1]).

    Only the scores GEMMs see whole tiles. The row-wise steps (mask, max, exp, sums) run on the
    real rows (a decode step has ``group`` of them per tile) and the first ``visible`` keys (keys
    after them are masked for every row): row-wise work gives the same bits on a sub-block, and a
    key tile's halving tree over its first ``w`` columns padded to a power of two equals the tree
    over all 64 with zeros after ``w``.

    ``loops``: the compiled loops (``compiled_loops.library()``), which run the steps before and after the exp in one
    pass each, with the same operations on the same values (the same bits; ``tests/test_compiled_loops.py``), or
    None for the torch ops below."""
    b, h, rb, kb, block, vis = tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.block, \
        tiles.visible
    scores = tiles.host.bmm(tiles.row_tiles(tiles.q), tiles.key_tiles(tiles.k).transpose(1, 2), op="attention",
                             shared_operand=False)
    real = tiles.rows if rb == 1 else block
    width = _ceil_to(vis, COL_BLOCK)
    if loops is not None:
        shape = (b, h, rb, kb, block, real, width, KEY_BLOCK, tiles.q_start, tiles.row_t, tiles.uniform_start)
        probs = _unary("exp", loops.attention_shifted(scores, *shape), tiles.host, "attention", inplace=True)
        tiles_out, denom_rows, denom = loops.attention_tiles(probs, *shape)  # masks probs in place
        return tiles_out, denom_rows, probs[..., :vis], denom
    scores = scores.view(b, h, rb, kb, block, KEY_BLOCK).permute(0, 1, 2, 4, 3, 5)  # [B, Hkv, RB, R, KB, C]
    row_t = tiles.row_t.view(rb, block)[:, :real]
    # One mask for the whole batch where every sequence starts at the same position (training): the same booleans.
    starts = tiles.q_start[:1] if tiles.uniform_start else tiles.q_start
    query_pos = starts.view(-1, 1, 1, 1, 1) + row_t.view(1, 1, rb, real, 1)
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
    probs = _unary("exp", shifted, tiles.host, "attention", inplace=True).mul_(visible.to(masked.dtype))
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
    return tiles_out.view(-1, block, KEY_BLOCK), denom_rows, probs[..., :vis], denom


def _attention_forward(tiles: _AttentionTiles, prob_tiles: Tensor, denom: Tensor) -> Tensor:
    """P @ V per (row tile, key tile), a tree over key tiles, then / row sum: [B*Hkv, row_len, hd]."""
    b, h, rb, kb, d = tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.head_dim
    partial = tiles.host.bmm(prob_tiles, tiles.key_tiles(tiles.v), op="attention", shared_operand=False)
    partial = partial.view(b, h, rb, kb, tiles.block, d)
    summed = _tree_sum(partial.permute(0, 1, 2, 4, 5, 3)) if kb > 1 else partial[:, :, :, 0]
    return (summed / denom).view(b * h, tiles.row_len, d)


def _attention_exact(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float,
                     host: HostGuard) -> Tensor:
    tiles = _AttentionTiles(q, k_cache, v_cache, q_start, scale, host)
    prob_tiles, denom, _, _ = _attention_probs(tiles, compiled_loops.library())
    return tiles.to_output(_attention_forward(tiles, prob_tiles, denom), q.dtype)


class _ExactAttention(torch.autograd.Function):
    """Exact forward; backward from the forward's own (exact) probabilities with fixed-tile GEMMs.

    Saves the normalised probabilities of the real rows and visible keys instead of
    recomputing a native attention: the gradients are the standard softmax-attention VJP
    (dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale * dS K,
    dK = dS^T (scale * Q)); every product runs through ``_batched_matmul`` (the guard's GEMM on padded
    tiles) and the row sum through a halving tree, so no gradient depends on the thread count."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, q_start, scale, host):  # type: ignore[override]
        tiles = _AttentionTiles(q, k_cache, v_cache, q_start, scale, host)
        prob_tiles, denom, probs, real_denom = _attention_probs(tiles, compiled_loops.library())
        out_rows = _attention_forward(tiles, prob_tiles, denom)
        real = probs.shape[3]
        # [B*Hkv, rows', visible] normalised probabilities of the real rows
        ctx.p = (probs / real_denom).view(tiles.batch * tiles.kv_heads, tiles.row_blocks * real, tiles.visible)
        ctx.tiles, ctx.out_rows, ctx.real = tiles, out_rows, real
        ctx.dtypes = (q.dtype, k_cache.dtype, v_cache.dtype)
        return tiles.to_output(out_rows, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        tiles, p = ctx.tiles, ctx.p
        rows, vis = p.shape[1], tiles.visible
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # The gradient rows and the queries are held zero-padded ([BH, row_len, hd]): where that is the padded
        # operand of a GEMM below, it is passed as is instead of copied again (``_batched_matmul``'s a_full/b_full).
        d_out_full = tiles.from_output(grad_out)
        d_out = d_out_full[:, :rows]  # [BH, rows', hd]; padding rows are zero
        bmm = partial(_batched_matmul, host=tiles.host, op="attention")
        out_rows = ctx.out_rows[:, :rows]
        grad_q = grad_k = grad_v = None
        if need_v:
            grad_v = tiles.to_cache(bmm(p.transpose(1, 2), d_out, b_full=d_out_full), ctx.dtypes[2])
        if need_q or need_k:
            d_p = bmm(d_out, tiles.v[:, :vis].transpose(1, 2), a_full=d_out_full)
            # d_s written into its zero-padded layout for the dQ GEMM (the same ops, the same values)
            head_dim = tiles.head_dim
            d_s_full = p.new_empty(p.shape[0], _batched_rows(rows, vis, head_dim, tiles.host, "attention"),
                                   _ceil_to(vis, COL_BLOCK))
            d_s = torch.mul(p, d_p - _tree_sum(d_out * out_rows).unsqueeze(-1), out=d_s_full[:, :rows, :vis])
            _zero_outside(d_s_full, d_s.shape)
            if need_q:
                grad_q = tiles.to_output(bmm(d_s, tiles.k[:, :vis], a_full=d_s_full) * tiles.scale, ctx.dtypes[0])
            if need_k:
                grad_k = tiles.to_cache(bmm(d_s.transpose(1, 2), tiles.q[:, :rows], b_full=tiles.q), ctx.dtypes[1])
        ctx.p = ctx.out_rows = ctx.tiles = None
        return grad_q, grad_k, grad_v, None, None, None


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float, *,
              host: HostGuard = HOST) -> Tensor:
    """Causal grouped-query attention of new queries against a KV cache (prefill and decode).

    q: [B, T, Hq, hd]; k_cache, v_cache: [B, L, Hkv, hd]; q_start: [B] int64. Query t of
    sequence b sits at position q_start[b] + t and sees cache positions 0 .. q_start[b] + t.

    Invariance contract: a query's output depends only on its own vector and its own
    sequence's keys/values at positions <= its position -- never on the batch, other
    sequences, T (prefill vs decode), cache contents after its position (which must be
    finite), or the thread count. So decode step t equals row t of a prefill bit for bit.

    Tiling: per (sequence, KV head) the group's query heads are folded into rows and padded to
    row tiles of 4, 8, 16, 32 or 64 rows (the smallest that holds them; 64 beyond); keys are cut into
    64-key tiles from position 0; every (row tile, key tile) pair is one GEMM
    ([R x hd] @ [hd x 64] for the scores, [R x 64] @ [64 x hd] for P @ V). A query row's
    scores and P @ V are K-reductions of that row alone (over hd, over 64 keys), and the host
    GEMM gives them the same bits for any tile height from 4 to 64 rows where ``HOST``'s probe
    passed (else the fixed-order GEMM, invariant by construction, runs them;
    ``tests/test_kernels.py`` checks decode == prefill, which compares 4-row with 64-row tiles).
    Masked scores give probability exactly 0, so
    tiles past a query's position add exact zeros to the position-ordered tree sums, and a
    short decode row reduces like a long prefill row.
    Backward contract: the softmax-attention VJP from the saved exact probabilities, through fixed-tile GEMMs
    and halving trees: the gradients depend only on (q, k, v, grad), never on the thread count.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        return _ExactAttention.apply(q, k_cache, v_cache, q_start, scale, host)
    return _attention_exact(q, k_cache, v_cache, q_start, scale, host)


# --------------------------------------------------------------------------- guard
def with_host(host: HostGuard) -> SimpleNamespace:
    """This backend's ops bound to another ``HostGuard`` (e.g. ``HostGuard(ROW_BLOCKS, mode="fixed-order")``).

    Same names and signatures as the module's own ops, so it can stand wherever an op module does."""
    ops = {name: partial(globals()[name], host=host) for name in HOST_PROPERTIES}
    return SimpleNamespace(NAME=f"{NAME}[{host.mode}]", host=host, **ops)


def host_report(host: HostGuard = HOST) -> dict:
    """Which path each op takes on this host and what the probes found (``vexact check`` prints it).

    An op's path: ``by construction`` (it relies on no host property), ``fast`` / ``fixed-order`` (all its
    probed shape classes took that path), ``mixed``, or ``not used yet`` (no probe has run for it)."""
    report = host.report()
    ops = {}
    # the sampler's Gumbel noise (vexact.engine.sampling) also runs through this guard: fp64 log and cos
    # and the optimizer's sqrt (vexact.rl.optim: the gradient norm, AdamW's denominator)
    extra = {"sampling": ("elementwise_log", "elementwise_cos", "elementwise_sqrt"), "optimizer": ("elementwise_sqrt",)}
    for op, properties in {**HOST_PROPERTIES, **extra}.items():
        probes = [p for p in report["probes"] if op in p["ops"]]
        paths = {"fixed-order" if p["path"] == "fixed-order" else "fast" for p in probes}
        if not properties:
            path = "by construction"
        elif not probes:
            path = "not used yet"
        else:
            path = paths.pop() if len(paths) == 1 else "mixed"
        ops[op] = {"path": path, "relies_on": list(properties),
                   "shape_classes": [f"{p['property']}: {p['shape_class']}" for p in probes]}
    return {**report, "ops": ops, "loops": compiled_loops.status()}
