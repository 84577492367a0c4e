"""a.T @ b: a linear layer's weight gradient, ``transposed_matmul`` (the overview of the matrix products, their
canonical arrangement and the faster arrangements the guard admits: ``gemm_linear``).

A third form is no arrangement of its own but the same tiles grouped into other calls (``transposed_matmul``'s
tiles one call per row tile: ``_transposed_matmul_by_row_tile``), which the ``gemm_rows`` probe already covers. A
weight gradient whose chunk class runs the host's own GEMM has a canonical arrangement of its own: each chunk in
slabs of ``SLAB_ROWS`` output rows, each GEMM on one thread (``_reduction_slabs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_loops, gemm_tiles
from .compiled_loops import tree_sum as _tree_sum
from .fixed_order import tree_sum_of
from .host_guard import LIBRARY_DTYPES, HostGuard, _with_threads


# --------------------------------------------------------------------------- a.T @ b: a weight gradient
def one_thread_reduction(dtype: torch.dtype) -> bool:
    """Whether a weight gradient's chunk GEMMs in ``dtype`` call the library with 1 thread, by construction
    (``HostGuard``'s ``one_thread`` classes): in a low-precision dtype (``LIBRARY_DTYPES``), yes. A weight gradient's
    GEMM has a long reduction (its chunk: up to ``LIBRARY_REDUCE_MAX`` tokens) and a small output (a row tile by the
    layer's input width), the shape a BLAS parallelises by splitting the reduction between threads; oneDNN's AMX
    kernels on an Intel Xeon did so for a 768-token chunk in three row tiles at 2 threads, but not in the guard's
    probe arrangements, and not in a fresh process -- a choice no probe can cover. With 1 thread there is no choice.
    The threads share out the GEMMs instead, one slab of output rows each (``_reduction_slabs``). fp32 chunks
    are at most ``REDUCE_BLOCK`` tokens and keep the probed path (their slabs, too, run on one thread each)."""
    return dtype in LIBRARY_DTYPES


def _reduction_block(rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk of a reduction over ``rows`` tokens: the smallest power of two from ``MIN_REDUCE_BLOCK`` holding
    them, else ``REDUCE_BLOCK``; in bf16 (the dtype the GEMM computes in) up to ``LIBRARY_REDUCE_MAX`` tokens, one
    chunk of them padded to a multiple of ``REDUCE_BLOCK``."""
    if dtype != torch.float32 and gemm_tiles.REDUCE_BLOCK < rows <= gemm_tiles.LIBRARY_REDUCE_MAX:
        return gemm_tiles.ceil_to(rows, gemm_tiles.REDUCE_BLOCK)
    block = gemm_tiles.MIN_REDUCE_BLOCK
    while block < min(rows, gemm_tiles.REDUCE_BLOCK):
        block *= 2
    return block


def transposed_dtype(a: Tensor, b: Tensor, host: HostGuard, op: str) -> torch.dtype:
    """The dtype ``transposed_matmul`` computes a.T @ b in, for a [M, N] and b [M, K] in their own dtypes: theirs
    where both are bf16, the reduction is one chunk (M <= ``LIBRARY_REDUCE_MAX``: the GEMM's rounded output is the
    result; several chunks add fp32 partial products, which a bf16 GEMM does not give) and the guard admitted the
    host's bf16 GEMM for the class (the chunk, K padded, per-tile operands), else fp32. The caller passes a and b in
    that dtype. (A weight gradient is never compared across rollout and training, so how many tokens it reduces may
    choose.)"""
    rows = a.shape[0]
    # (compute_dtype's answer)
    if a.dtype != b.dtype or a.dtype not in LIBRARY_DTYPES or rows > gemm_tiles.LIBRARY_REDUCE_MAX:
        return torch.float32
    b_class = gemm_tiles.gemm_class(_reduction_block(rows, a.dtype),
                                    gemm_tiles.ceil_to(b.shape[1], gemm_tiles.COL_BLOCK), transposed=True)
    return host.compute_dtype(a.dtype, b_class, False, op, one_thread=one_thread_reduction(a.dtype))


def transposed_matmul(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None = None) -> Tensor:
    """a.T @ b: a [M, N], b [M, K] -> [N, K], a reduction over the M rows (tokens), thread-invariant, in a's and b's
    dtype: fp32, or bf16 where ``transposed_dtype`` says so (one chunk).

    The canonical arrangement (``canonical_transposed_matmul``) is, on the host's own GEMM, each chunk's GEMMs in
    slabs of output rows, each on one thread (``_reduction_slabs``), else the tiles (``_transposed_matmul_tiles``).
    Where an fp32 class runs the library GEMM and the guard found that ``_transposed_matmul_views`` (one GEMM per
    chunk on views, with the process's threads) gives its bits, that arrangement runs instead
    (``HostGuard.arrangement_agrees``): first with the last, partial chunk's GEMM on its real rows only (a shorter
    reduction: it gives the padded one's bits on some hosts for some lengths, so that is probed per length), else
    with that chunk zero-padded. No bit changes.
    ``b_source``: the tensor ``b`` was derived from (``_reduction_operand``).

    A last chunk of at most half a chunk is reduced at its own length (``_short_last_chunk``): the reduction over
    M tokens is the tree of each chunk's own reduction, so no GEMM multiplies more than twice its real rows."""
    rows, n = a.shape
    k = b.shape[1]
    # a one-thread class (bf16) never runs the views: they call the GEMM with the process's threads; an empty
    # reduction has nothing to arrange
    views = None if rows == 0 or one_thread_reduction(a.dtype) else _views_plan(rows, n, k, a.dtype, host, op)
    if views is None:
        return canonical_transposed_matmul(a, b, host, op, b_source)
    return _transposed_matmul_views(a, b, _reduction_block(rows, a.dtype), unpadded_tail=views == UNPADDED_TAIL)


def canonical_transposed_matmul(a: Tensor, b: Tensor, host: HostGuard, op: str,
                                b_source: Tensor | None = None) -> Tensor:
    """``transposed_matmul``'s canonical arrangement, the bits every faster one is checked against: on the host's
    own GEMM, its chunks in slabs of output rows (``_reduction_in_slabs``, ``_reduction_slabs``); elsewhere (the
    fixed-order GEMM, a guard over another GEMM) the tiles (``_transposed_matmul_tiles``)."""
    if a.shape[0] == 0:  # an empty reduction: zeros (what zero-padded tokens give)
        return a.new_zeros(a.shape[1], b.shape[1])
    if _reduction_in_slabs(a.shape[0], b.shape[1], a.dtype, host, op):
        return _reduction_slabs(a, b, host, op)
    return _transposed_matmul_tiles(a, b, host, op, b_source)


_VIEWS_PLANS: dict[tuple, str | None] = {}
"""``_views_arrangement``'s answers, kept per (guard state: ``HostGuard.epoch``, rows, N, K, dtype, op, thread count)
as ``tiled_dtype`` keeps its own (``asked_once``)."""


def _views_plan(rows: int, n: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> str | None:
    """``_views_arrangement(rows, n, k, dtype, host, op)``, asked once per key (``_VIEWS_PLANS``)."""
    key = (host.epoch, rows, n, k, dtype, op, torch.get_num_threads())
    return gemm_tiles.asked_once(_VIEWS_PLANS, key, host, lambda: _views_arrangement(rows, n, k, dtype, host, op))


UNPADDED_TAIL, PADDED_TAIL = "unpadded tail", "padded tail"
"""``_views_arrangement``'s answers: the views with the last, partial chunk on its real rows, or zero-padded."""


def _views_arrangement(rows: int, n: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> str | None:
    """How ``transposed_matmul`` runs a [rows, n].T @ [rows, k] reduction in ``dtype``: on views
    (``UNPADDED_TAIL`` / ``PADDED_TAIL``) where the guard found their bits the canonical tiles' (probed at first use),
    else None (the tiles)."""
    block = _reduction_block(rows, dtype)
    chunks = -(-rows // block)
    views_fit = chunks * min(n, gemm_tiles.VIEW_SLAB_ROWS) * k <= gemm_tiles.VIEW_PARTIALS_MAX
    # the views call torch's GEMM themselves: only where the canonical tiles' class runs it (their right operand,
    # [block, K_pad] per tile: K_pad rows of ``block`` tokens, the transposed layout)
    b_class = gemm_tiles.gemm_class(block, gemm_tiles.ceil_to(k, gemm_tiles.COL_BLOCK), transposed=True)
    if views_fit and host.library_gemm(dtype, b_class, False, op, one_thread=one_thread_reduction(dtype)) is not None:
        tail = rows % block
        if tail and _views_agree(block, n, k, tail, host, op, dtype):
            return UNPADDED_TAIL
        if _views_agree(block, n, k, None, host, op, dtype, last_chunk_length(rows, block, dtype)):
            return PADDED_TAIL
    return None


SLAB_ROWS = 256
"""Output rows per GEMM of a weight gradient's chunk on the host's GEMM (``_reduction_slabs``): a fixed number, so the
calls' shapes depend on the layer and the token count only, never on the thread count. Measured on the 2-core AMD
host, one thread, bf16, 312 tokens: a GEMM of 256 rows runs as fast as one of 4,096 (llama100m's LM head gradient 102
ms against 109; native's one GEMM 103), one of 64 rows (the tiles' height) 20% slower; and llama100m's narrowest
layers (576 rows) still make three slabs to share out between the threads."""


def _reduction_in_slabs(rows: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> bool:
    """Whether the canonical [rows, n].T @ [rows, k] reduction in ``dtype`` is its chunks in slabs
    (``_reduction_slabs``): where its chunk class runs the host's own GEMM, which the slabs then call with one
    thread (``_chunk_in_slabs``). bf16 reduces one chunk (a one-thread class: ``one_thread_reduction``). Elsewhere --
    the fixed-order GEMM, a guard over another GEMM -- the tiles through ``host.bmm``."""
    block = _reduction_block(rows, dtype)
    return (rows <= block or not one_thread_reduction(dtype)) and _chunk_in_slabs(block, k, dtype, host, op)


def _chunk_in_slabs(length: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> bool:
    """Whether a chunk of ``length`` tokens by K runs in slabs: its GEMM class on the host's own GEMM -- in bf16 the
    class's single-thread path (``HostGuard.single_thread_gemm``), in fp32 its library path at any thread count
    (``HostGuard.library_gemm``) or its single-thread one."""
    b_class = gemm_tiles.gemm_class(length, gemm_tiles.ceil_to(k, gemm_tiles.COL_BLOCK), transposed=True)
    if one_thread_reduction(dtype):
        return host.single_thread_gemm(dtype, b_class, False, op, one_thread=True) is not None
    return (host.library_gemm(dtype, b_class, False, op) is not None
            or host.single_thread_gemm(dtype, b_class, False, op) is not None)


def _reduction_slabs(a: Tensor, b: Tensor, host: HostGuard, op: str) -> Tensor:
    """The canonical a.T @ b on the host's GEMM (``_reduction_in_slabs``), a [M, N], b [M, K]: the tokens in chunks
    (``_slab_chunks``), each chunk's product in slabs of ``SLAB_ROWS`` output rows, one GEMM per (chunk, slab) on one
    thread of the chunk's rows of a's slab columns seen transposed by the chunk's rows of b (a partial chunk's rows
    zero-padded to its length), the chunks' products added by the halving tree in chunk order. A short last chunk
    whose own class does not run the host's GEMM is its tiles instead (``_transposed_matmul_tiles``). Each output
    element depends only on its two columns, the chunks and the slab's shape -- never on the thread count: every
    GEMM runs on one thread, whatever the count. The tiles this replaced (one GEMM per 64-row tile, on a transposing
    copy) cost llama100m's LM head gradient twice native's time in bf16 (768 GEMMs over 512 tokens, against 192 over
    320) and `canonical` fp32 training 1.08-1.09x `auto` (the benchmarks page)."""
    rows, n = a.shape
    k = b.shape[1]
    # aligned, so that every chunk and slab view starts aligned too
    a, b = gemm_tiles.rows_aligned(a), gemm_tiles.aligned_contiguous(b)
    block, last = _slab_chunks(rows, a.dtype)
    chunks = -(-rows // block)
    tail_in_slabs = last == block or _chunk_in_slabs(last, k, a.dtype, host, op)
    width = min(n, gemm_tiles.VIEW_SLAB_ROWS)
    # every chunk in one call where their partial products fit, else (or where the last chunk runs its tiles) one
    # chunk at a time: the same GEMMs and the same tree
    at_once = tail_in_slabs and chunks * width * k <= gemm_tiles.VIEW_PARTIALS_MAX
    pairs = (chunks if at_once or chunks == 1 else 1) * -(-width // SLAB_ROWS)  # the (chunk, slab) pairs of a call
    spread = _slabs_spread(width, k, block, last if tail_in_slabs else block, a.dtype, pairs)
    if chunks == 1:  # one chunk (every bf16 reduction; its last is its whole, so in slabs): its GEMMs write the
        # result itself -- the same calls as per output slab (slabs of SLAB_ROWS rows), whether or not partials would
        # fit at once -- into a tensor of its own: a view of a [1, N, K] buffer would make autograd add a tied
        # weight's two gradients out of place (a fresh N x K buffer: llama100m's tied head, 113 MB of page faults per
        # step)
        result = a.new_empty(n, k)
        _slab_products(a, b, block, last, spread, out=result.unsqueeze(0))
        return result

    def output_rows(first: int, end: int, into: Tensor | None) -> Tensor:  # the tree over the chunks for these rows
        a_cols = a[:, first:end]
        if at_once:
            return _tree_sum(_slab_products(a_cols, b, block, last, spread), dim=0, out=into)

        def part(i: int) -> Tensor:
            lo = i * block
            if i < chunks - 1:
                return _slab_products(a_cols[lo : lo + block], b[lo : lo + block], block, block, spread)[0]
            if tail_in_slabs:
                return _slab_products(a_cols[lo:], b[lo:], block, last, spread)[0]
            return _transposed_matmul_tiles(a_cols[lo:], b[lo:], host, op)

        return tree_sum_of(chunks, part)

    return _in_slabs(n, k, a, output_rows)


def _slab_chunks(rows: int, dtype: torch.dtype) -> tuple[int, int]:
    """(chunk length, last chunk's length) of ``_reduction_slabs`` over ``rows`` tokens. bf16: one chunk of the
    tokens zero-padded to a multiple of ``MIN_REDUCE_BLOCK`` (the tiles pad it to a multiple of ``REDUCE_BLOCK``: 312
    tokens to 512). fp32: ``_reduction_block``'s chunks, a short last one at ``last_chunk_length``."""
    if one_thread_reduction(dtype):
        length = gemm_tiles.ceil_to(max(rows, 1), gemm_tiles.MIN_REDUCE_BLOCK)
        return length, length
    block = _reduction_block(rows, dtype)
    return block, last_chunk_length(rows, block, dtype)


def _slab_products(a: Tensor, b: Tensor, block: int, last: int, spread: int, out: Tensor | None = None) -> Tensor:
    """[chunks, N, K]: for each ``block``-row chunk of a [M, N] and b [M, K] (the last zero-padded to ``last`` rows)
    and each ``SLAB_ROWS``-row slab of the N output rows, one GEMM on one thread (``_reduction_slabs``), written into
    ``out`` (contiguous [chunks, N, K]; None: a fresh tensor). ``spread`` (``_slabs_spread``) > 0: every (chunk, slab)
    pair shared out between the threads in one compiled call (``reduction_slab_mms`` in ``csrc/exact_loops.cpp``),
    each pair's GEMM as ``spread`` GEMMs of blocks of its output columns; 0: the same pairs one after another with
    one thread -- in that compiled call where the loops are built, else a Python loop of the same ``mm`` calls on the
    same operands."""
    loops = compiled_loops.library()
    if spread:
        return loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS, out=out, column_blocks=spread)
    if loops is not None:
        return _with_threads(1, lambda: loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS, out=out))
    (rows, n), k = a.shape, b.shape[1]
    chunks = -(-rows // block)
    tail_first = (chunks - 1) * block
    b_tail = gemm_tiles.padded_or_aligned(b[tail_first:], (last, k))
    parts = a.new_empty(chunks, n, k) if out is None else out

    def products() -> None:
        for c in range(chunks):
            length = last if c == chunks - 1 else block
            a_rows = a[c * block : c * block + length]
            b_rows = b_tail if c == chunks - 1 else b[c * block : (c + 1) * block]
            for lo in range(0, n, SLAB_ROWS):
                region = a_rows[:, lo : lo + SLAB_ROWS]
                left = (region if region.shape[0] == length
                        else gemm_tiles.zero_padded(region, (length, region.shape[1])))
                torch.mm(left.t(), b_rows, out=parts[c, lo : lo + SLAB_ROWS])

    _with_threads(1, products)
    return parts


_SPREAD_CHECKS: dict[tuple, bool] = {}


SLAB_PAIRS_PER_THREAD = 2
"""(chunk, slab) pairs per thread below which ``_slab_products`` splits each pair's GEMM into as many blocks of its
output columns as there are threads: fewer pairs do not share out evenly (llama100m's fp32 k/v weight gradient over
312 tokens, a 256- and a 64-token chunk of one slab, gave one thread four times the other's work: 0.52 ms at 2
threads against 0.65 at 1, and 0.36 in column blocks; at 3 pairs per thread, its q/o gradient's six, column blocks
gained 2% and its MLP's lost 2%: the journal, session 60)."""


def _slabs_spread(width: int, k: int, block: int, last: int, dtype: torch.dtype, pairs: int) -> int:
    """How ``_slab_products`` runs ``pairs`` (chunk, slab) pairs: shared out between the threads, each pair's GEMM in
    the returned number of column blocks (``SLAB_PAIRS_PER_THREAD``: as many as the threads where the pairs are few,
    else 1), or 0: one after another with one thread. Shared out where the compiled loops are built, several threads
    run, and ``reduction_slab_mms`` so, at this thread count, gave the bits of the same pairs whole, one after another
    with one thread -- checked once per (output width, K, chunk, last chunk length, dtype, thread count, column blocks)
    on seeded order-revealing inputs (``probe_operands``) of as many chunks as the reduction has at most (bf16: one;
    fp32: two, the last of ``last`` rows, or of over half of ``block`` where it pads to it; a call of one pair
    whole: one chunk, as the call). It catches a library whose GEMM called inside a parallel region rounds otherwise
    than with one thread, whose GEMM of a block of columns rounds otherwise than the whole (then whole pairs, or the
    pairs in turn), or -- one pair whole, one task: no parallel region, the GEMM on the library's own threads --
    whose GEMM at this thread count rounds otherwise (MKL on the AMD EPYC host: a [8, 64] x [64, 24] product at 3
    threads, which the two-chunk probe, two tasks in a region, never ran)."""
    loops = compiled_loops.library()
    threads = torch.get_num_threads()
    if loops is None or threads == 1:
        return 0

    def check(column_blocks: int, one_task: bool) -> bool:
        # a partial last chunk pads (of over half a 64-row chunk: a single row would sum in any order alike); a short
        # one is whole
        tail = max(last - gemm_tiles.MIN_REDUCE_BLOCK + 1, block // 2 + 1) if last == block else last
        rows = tail if one_thread_reduction(dtype) or one_task else block + tail
        # the reduction over the tokens is their K
        a_t, b_t = gemm_tiles.probe_operands(dtype, (width, rows), (k, rows))
        # as _reduction_slabs lays them
        a, b = gemm_tiles.rows_aligned(a_t.t().contiguous()), gemm_tiles.aligned_contiguous(b_t.t().contiguous())
        alone = _with_threads(1, lambda: loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS))
        return torch.equal(loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS, column_blocks=column_blocks), alone)

    wanted = min(threads, k) if pairs < SLAB_PAIRS_PER_THREAD * threads else 1
    for column_blocks in dict.fromkeys((wanted, 1)):
        one_task = pairs * column_blocks == 1
        key = (dtype, width, k, block, last, threads, column_blocks, one_task)
        if gemm_tiles.checked_once(_SPREAD_CHECKS, key, lambda: check(column_blocks, one_task)):  # noqa: B023 (called at once)
            return column_blocks
    return 0


def probe_transposed_matmul(rows: int, n: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> None:
    """Run now the probes that ``transposed_matmul`` of a [rows, n] by [rows, k] reduction in ``dtype`` runs at first
    use (none where they ran already): for a caller about to hold large buffers until that call -- the LM head's
    backward, a group's [256 x vocabulary] output gradient -- so the probes' vocabulary-wide inputs are never held
    beside them (at Gemma 3's vocabulary that pair set a fresh process's peak). The same probes, records and
    decision as at first use: no bit changes."""
    _views_arrangement(rows, n, k, dtype, host, op)


def _short_last_chunk(rows: int, block: int, dtype: torch.dtype) -> bool:
    """Whether a reduction over ``rows`` tokens in chunks of ``block`` ends in a chunk that its own length reduces in
    a shorter GEMM: several chunks, the last partial and holding at most half of ``block`` (``_reduction_block`` of
    its rows is smaller than ``block``). Such a last chunk is its own one-chunk reduction, zero-padded to that
    shorter length (``last_chunk_length``), instead of being padded to ``block`` -- the canonical definition, on
    every path: llama100m's 312-token update pads 56 tokens to 64, not to 256 (the padding was 40% of its weight
    gradients' work)."""
    tail = rows % block
    return rows > block and tail > 0 and _reduction_block(tail, dtype) < block


def last_chunk_length(rows: int, block: int, dtype: torch.dtype) -> int:
    """The length the last chunk of a reduction over ``rows`` tokens is zero-padded to: its own ``_reduction_block``
    where it is short (``_short_last_chunk``), else ``block``."""
    return _reduction_block(rows % block, dtype) if _short_last_chunk(rows, block, dtype) else block


def _transposed_matmul_by_chunk(a: Tensor, b: Tensor, host: HostGuard, op: str, block: int) -> Tensor:
    """The canonical weight gradient where the last chunk is short (``_short_last_chunk``): each chunk's rows their
    own canonical reduction (``_transposed_matmul_tiles`` of one chunk: no tree; the whole chunks at ``block``, the
    last at its own length), the parts added by the same halving tree in chunk order, made one at a time
    (``fixed_order.tree_sum_of``: ``tree_sum``'s additions over the stacked parts). So the reduction over M tokens is
    the tree of its chunks' reductions; the chunked LM head's backward (``vexact.engine.head``) computes exactly
    these parts. One call per chunk: the fallback where the tile views cannot run (``_transposed_matmul_tiles``);
    its chunks lay their right operands out each (no ``b_source`` sharing between layers)."""
    rows = a.shape[0]

    def part(i: int) -> Tensor:
        first = i * block
        return _transposed_matmul_tiles(a[first : first + block], b[first : first + block], host, op)

    return tree_sum_of(-(-rows // block), part)


def _transposed_matmul_tiles(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None = None) -> Tensor:
    """The canonical arrangement of ``transposed_matmul`` where its GEMM class does not run the host's own GEMM (the
    fixed-order GEMM, a guard over another GEMM; elsewhere the slabs: ``canonical_transposed_matmul``).

    A weight gradient sums over every token of the batch, so its reduction length M changes from call to call.
    Rows are cut into chunks of ``_reduction_block(M)`` (zero-padded). Each chunk is a GEMM tile product whose
    K-reduction has that fixed length, [R, block] @ [block, K] for every R-row tile of the N output rows (one
    ``host.bmm`` call for all chunks: a probed shape class, or the fixed-order GEMM), and the chunks' partial
    products are added by a halving tree in chunk order. So each output element depends only on the two columns
    it reduces -- never on the thread count (or where thread boundaries fall).

    The GEMM operands are laid out by ``_chunks_transposed`` in one copy each (the price of exactness is mostly such
    passes over memory on small models); their values, shapes, strides and alignment are the ones a plain
    pad-transpose-copy composition gives (``tests/kernels/test_exact_price_bits.py`` compares the two, call by call), so
    the library call and every bit of its result are unchanged. ``b_source``: the tensor ``b`` was derived from (a
    linear layer's saved input); layers that share an input (q, k and v; gate and up) then share b's layout
    (``_reduction_operand``)."""
    rows, n = a.shape
    k = b.shape[1]
    block = _reduction_block(rows, a.dtype)
    chunks = -(-rows // block)
    padded = chunks * block
    k_pad = gemm_tiles.ceil_to(k, gemm_tiles.COL_BLOCK)
    height = _reduction_tile_height(block, n, k_pad, a.dtype, host, op)
    last = last_chunk_length(rows, block, a.dtype)
    row_tiles = -(-n // height)
    if last < block:  # a short last chunk (``_short_last_chunk``)
        return _transposed_matmul_by_chunk(a, b, host, op, block)
    one_thread = one_thread_reduction(a.dtype)
    if chunks > 1 and row_tiles > 1 and (row_tiles - 1) * chunks * k_pad * block >= gemm_tiles.ROW_TILE_CALLS_FROM:
        return _transposed_matmul_by_row_tile(a, b, host, op, b_source, block, height, k_pad)
    if row_tiles * height == n and (chunks == 1 or row_tiles == 1):
        # no padding rows, one chunk or one row tile: the chunks seen transposed, a view (as reshape gives)
        contiguous = padded == rows and a.is_contiguous() and a.data_ptr() % gemm_tiles.ALIGNMENT == 0
        a_rows = a if contiguous else gemm_tiles.zero_padded(a, (padded, n))
        a_tiles = a_rows.view(chunks, block, n).transpose(1, 2).reshape(chunks * row_tiles, height, block)
    else:  # [chunks * row_tiles, height, block]: each chunk's transpose, zero-padded to whole row tiles, contiguous
        a_tiles = _chunks_transposed(a, block, chunks, row_tiles * height).view(chunks * row_tiles, height, block)
    # every row tile of a chunk multiplies that chunk's [block, K_pad] operand (a transposed layout, as the probe's;
    # one chunk: an expanded view, as reshape gives)
    b_tiles = _reduction_operand(b, block, chunks, k_pad, row_tiles, b_source)
    out = host.bmm(a_tiles, b_tiles.transpose(1, 2), op=op, shared_operand=False, one_thread=one_thread)
    parts = out.view(chunks, row_tiles * height, k_pad)[:, :n, :k]
    return parts[0] if chunks == 1 else _tree_sum(parts, dim=0)


def _reduction_tile_height(block: int, n: int, k_pad: int, dtype: torch.dtype, host: HostGuard, op: str) -> int:
    """The row tile height over a weight gradient's N output rows for its chunk class (``block`` tokens, K_pad)."""
    # [block, K_pad] per tile: K_pad rows of ``block`` tokens
    b_class = gemm_tiles.gemm_class(block, k_pad, transposed=True)
    return gemm_tiles.row_block(n, host.tile_heights(dtype, b_class, False, op, one_thread=one_thread_reduction(dtype)))


def _in_slabs(n: int, k: int, like: Tensor, slab: Callable[[int, int, Tensor | None], Tensor]) -> Tensor:
    """A weight gradient on views, [n, k], from ``slab(first, last, into)`` over its output rows cut into slabs of
    ``VIEW_SLAB_ROWS``: ``into`` is the output's rows for the slab, which the slab may write itself (returning them),
    else its result is copied there; None where one slab is the whole output (its own result, no copy)."""
    if n <= gemm_tiles.VIEW_SLAB_ROWS:
        return slab(0, n, None)
    out = like.new_empty(n, k)
    for first in range(0, n, gemm_tiles.VIEW_SLAB_ROWS):
        last = min(n, first + gemm_tiles.VIEW_SLAB_ROWS)
        rows = out[first:last]
        result = slab(first, last, rows)
        if result.data_ptr() != rows.data_ptr():
            rows.copy_(result)
    return out


def _transposed_matmul_by_row_tile(a: Tensor, b: Tensor, host: HostGuard, op: str, b_source: Tensor | None,
                                   block: int, height: int, k_pad: int) -> Tensor:
    """``_transposed_matmul_tiles`` for several chunks and several row tiles: the same GEMM tiles (the same operands,
    tile by tile) in one ``host.bmm`` call per row tile, over the chunks, then the same halving tree over the chunks.

    One call for every (chunk, row tile) pair needs each chunk's right operand copied once per row tile (a
    per-tile operand, as probed); per row tile, every chunk's operand appears once, so the laid-out operand is
    passed as it is (``ROW_TILE_CALLS_FROM`` says where that pays). A tile's rows do not depend on how many tiles
    share its call (a probed property the kernels rely on everywhere: a call's tile count follows the batch), so no
    bit changes (``tests/kernels/test_exact_price_bits.py`` compares the tiles)."""
    rows, n = a.shape
    k = b.shape[1]
    chunks = -(-rows // block)
    row_tiles = -(-n // height)
    a_tiles = _row_tiles_transposed(a, block, chunks, row_tiles, height)  # [row_tiles, chunks, height, block]
    b_operand = _reduction_operand(b, block, chunks, k_pad, 1, b_source).transpose(1, 2)  # [chunks, block, K_pad]
    out = a.new_empty(n, k)
    for tile in range(row_tiles):
        parts = host.bmm(a_tiles[tile], b_operand, op=op, shared_operand=False,  # [chunks, height, K_pad]
                         one_thread=one_thread_reduction(a.dtype))
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
    once per row tile of the left operand -- the right operand of ``_transposed_matmul_tiles``' GEMM.

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


def _views_agree(block: int, n: int, k: int, tail: int | None, host: HostGuard, op: str,
                 dtype: torch.dtype = torch.float32, padded_to: int | None = None) -> bool:
    """Whether ``_transposed_matmul_views`` gives ``canonical_transposed_matmul``'s bits for this class here: with
    the last chunk's ``tail`` rows unpadded (a class per length), or (``tail`` None) with that chunk padded to
    ``padded_to`` rows (``block``, or a short last chunk's own length: ``last_chunk_length``). A probe at first use
    on seeded inputs whose chunk size is ``block`` too: ``VIEW_PROBE_CHUNKS`` whole chunks (where ``block`` is
    ``REDUCE_BLOCK``: there are several; bf16, which reduces one chunk only: none) and a partial one (``tail`` rows,
    or just over half of ``padded_to``). ``dtype``: fp32 or bf16 (``probe_operands``, over the tokens). A class of
    fewer than ``VIEW_PROBE_OUTPUTS`` outputs compares several draws of those inputs."""
    padded_to = block if padded_to is None else padded_to
    whole = gemm_tiles.VIEW_PROBE_CHUNKS if block == gemm_tiles.REDUCE_BLOCK and dtype == torch.float32 else 0
    partial = padded_to // 2 + 1 if tail is None else tail
    draws = min(gemm_tiles.VIEW_PROBE_DRAWS_MAX, -(-gemm_tiles.VIEW_PROBE_OUTPUTS // (n * k)))

    def inputs(draw: int) -> list[Tensor]:
        rows = whole * block + partial
        if dtype == torch.float32:
            return gemm_tiles.seeded_randn((rows, n), (rows, k), draw=draw)
        # the reduction over the tokens is their K
        a_t, b_t = gemm_tiles.probe_operands(dtype, (n, rows), (k, rows), draw)
        return [a_t.t().contiguous(), b_t.t().contiguous()]

    def every_draw(arrangement: Callable[..., Tensor]) -> Callable[[], Tensor]:
        return lambda: torch.cat([arrangement(*inputs(draw)).flatten() for draw in range(draws)])

    form = f"last chunk of {tail} rows unpadded" if tail is not None else (
        "last chunk padded" if padded_to == block else f"last chunk padded to {padded_to} rows")
    return host.arrangement_agrees(
        "weight gradient on views", f"block={block} N={n} K={k} {form} {gemm_tiles.dtype_label(dtype)}",
        every_draw(lambda a, b: canonical_transposed_matmul(a, b, host, op)),
        every_draw(lambda a, b: _transposed_matmul_views(a, b, block, unpadded_tail=tail is not None)), op)


def _transposed_matmul_views(a: Tensor, b: Tensor, block: int, unpadded_tail: bool) -> Tensor:
    """``_transposed_matmul_tiles``' chunk GEMMs, each [N, block] @ [block, K], on views: chunk c's left operand is
    rows c * block ... of ``a`` seen transposed, its right operand those rows of ``b`` as they are. The last,
    partial chunk is zero-padded (a copy, slab by slab: the whole chunk padded at once would be padded_to x N, 148 MB
    for a weight gradient over Qwen3's vocabulary) to ``block`` rows, or to its own length where it is short
    (``last_chunk_length``), or, ``unpadded_tail``, multiplied on its real rows, its result + 0.0 (padding's zeros
    turn a -0.0 sum into +0.0). The partial products are added by the same halving
    tree in chunk order. N is cut into slabs of ``VIEW_SLAB_ROWS`` output rows, each its own calls and tree. Used
    only where the guard found the canonical bits."""
    rows, n = a.shape
    k = b.shape[1]
    # chunk starts are then aligned too (block * N * 4 bytes apart)
    a, b = gemm_tiles.aligned_contiguous(a), gemm_tiles.aligned_contiguous(b)
    whole, tail = divmod(rows, block)
    body = whole * block
    padded_to = last_chunk_length(rows, block, a.dtype) if tail and not unpadded_tail else tail
    loops = compiled_loops.library()
    if (loops is not None and a.dtype == b.dtype and a.dtype in compiled_loops.DTYPES and a.is_contiguous()
            and b.is_contiguous()):  # the calls below in one compiled call: the same at:: calls on the same views
        return loops.transposed_views(a, b, block, padded_to, unpadded_tail, gemm_tiles.VIEW_SLAB_ROWS)
    b_tail = gemm_tiles.zero_padded(b[body:], (padded_to, k)) if padded_to > tail else b[body:]

    def slab(first: int, last: int, into: Tensor | None) -> Tensor:
        parts = a.new_empty(whole + (tail > 0), last - first, k)
        if whole:
            chunks = a[:body].view(whole, block, n)[:, :, first:last].transpose(1, 2)
            torch.bmm(chunks, b[:body].view(whole, block, k), out=parts[:whole])
        if tail:
            a_tail = a[body:, first:last]
            if padded_to > tail:
                a_tail = gemm_tiles.zero_padded(a_tail, (padded_to, last - first))
            torch.bmm(a_tail.t().unsqueeze(0), b_tail.unsqueeze(0), out=parts[whole:])
            if unpadded_tail:
                parts[whole:].add_(0.0)
        return parts[0] if parts.shape[0] == 1 else _tree_sum(parts, dim=0, out=into)
    return _in_slabs(n, k, a, slab)
