"""Weights laid out once per version: ``tiled_matmul``'s canonical operands (``arranged_weight``), and the canonical
tiles of an ``operand_per_tile`` class (``laid_out_tiles``) with their first-use checks (the overview of the
matrix products: ``gemm_linear``).

The canonical arrangement copies no weight per call: each copy it needs of a weight (an input gradient's W.T made
contiguous where its class is oneDNN's size, a padded or cast weight) is laid out once per weight version and kept
(``arranged_weight``, bounded by ``ARRANGED_BYTES_MAX``). In bf16, where oneDNN's ``bmm`` would copy the shared,
transposed operand before its GEMM (``bmm_copies_operand``), a class's canonical tiles take the operand once per tile as
a transposed batch instead, the layout oneDNN multiplies as it is (``operand_per_tile``): a forward's weight as stored,
with no copy at all, one GEMM per tile or the canonical call itself (``laid_out_tiles``). The same GEMM calls on the
same values in the same layout, so no bit depends on which (``tests/kernels/test_arranged_weights.py``).
"""

from __future__ import annotations

import math
import os
import platform
import threading
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_loops, gemm_tiles
from .host_guard import ONEDNN_MIN_WEIGHT, _with_threads, onednn_bf16, operand_layout
from .weight_versions import keeps_per_weight, kept_snapshot

# --------------------------------------------------------------------------- weights laid out once per version
ARRANGED_BYTES_MAX = 1 << 32
"""Bytes (4 GiB): the most that laid-out weight operands (``arranged_weight``) hold at once in a process. A laid-out
operand is a copy of a weight (transposed, column-padded or cast to the GEMM's dtype): at most one per weight and form,
so training a model holds at most one extra copy of each linear weight (below ``ROW_MAJOR_SHARED_MAX`` elements an fp32
forward's transposed copy, the input gradient's operand being W itself; from it the input gradient's transposed copy,
the forward's operand being the weight itself), about the model's linear weights' size again; a decode loop's weights
packed once (``PACK_AFTER_CALLS``) count too. Beyond this bound new operands are laid out per call as before, and no
weight is packed (slower, the same bits): a 30B-parameter model's weights are not doubled silently."""

# weight (the tensor owning its storage: a view's base) -> {form: (version, operand)}; weakly keyed: gone with it
_ARRANGED = WeakIdKeyDictionary()


class _HeldBytes:
    """The bytes the operands in ``_ARRANGED`` hold, counted as they come and go (``room_for`` asks on every operand
    laid out: a sum over every kept operand then cost about 10 us a call where a training step lays out ~90 of them
    per weight version, the default model's in ``canonical``). Under a lock: kernels may run on several Python
    threads."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes

    def owner_added(self, owner: Tensor, entries: dict) -> None:
        weakref.finalize(owner, self._owner_gone, entries)  # (the entries go with the owner, as _ARRANGED's do)

    def _owner_gone(self, entries: dict) -> None:
        self.add(-sum(operand.nbytes for _, (_, operand) in kept_snapshot(entries)))


_HELD_BYTES = _HeldBytes()


def arranged_weight(weight: Tensor, form: tuple, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, a GEMM operand laid out from ``weight`` (a copy), kept and reused while the weight is unchanged.

    Kept per weight and ``form`` (what ``make`` lays out), with the weight's view (shape, strides, offset, dtype,
    data pointer) and version counter (``Tensor._version``, which autograd-visible in-place ops bump: vexact's
    optimizer update, ``load_state_dict``, a ``copy_`` under no_grad) -- one version per form, the older one
    replaced. The operand's values are those of a fresh ``make()`` (the same copy made earlier), so no bit changes.
    Not seen: a write that leaves the version counter as it was (torch's ``fused=True`` optimizers, writes through
    ``.data`` or ``.numpy()``; ``weight_versions``), after which the caller calls ``forget_weight``; an inference
    tensor has no version counter and is laid out per call. ``make`` returning a view of the weight (nothing to copy)
    is not kept. Bounded by ``ARRANGED_BYTES_MAX``."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter to follow
        return make()
    if (kept := kept_operand(weight, form)) is not None:
        return kept
    owner = weight if weight._base is None else weight._base
    key = _arranged_key(weight, form)
    entries = _ARRANGED.get(owner)
    with torch.no_grad():
        out = make()
    if not out.is_mkldnn and out.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return out  # a view of the weight: nothing laid out (an opaque packed weight is always a copy)
    if entries is not None and (older := entries.pop(key, None)) is not None:  # an older version's operand
        _HELD_BYTES.add(-older[1].nbytes)
    if room_for(out.nbytes):
        if entries is None:
            entries = _ARRANGED[owner] = {}
            _HELD_BYTES.owner_added(owner, entries)
        entries[key] = (version, out)
        _HELD_BYTES.add(out.nbytes)
    return out


@keeps_per_weight
def _forget_arranged(shares_memory: Callable[[Tensor], bool]) -> None:
    """``forget_weight``'s part here: the operands laid out from a weight on the given memory, each popped and its
    bytes uncounted once (the entries dict stays, emptied, so the owner's finalizer uncounts nothing twice)."""
    for owner, entries in kept_snapshot(_ARRANGED):
        if not shares_memory(owner):
            continue
        for key, _ in kept_snapshot(entries):
            if (entry := entries.pop(key, None)) is not None:
                _HELD_BYTES.add(-entry[1].nbytes)


def room_for(nbytes: int) -> bool:
    """Whether an operand of ``nbytes`` fits beside the operands ``arranged_weight`` keeps now, under
    ``ARRANGED_BYTES_MAX``: the one test of the bound, for a laid-out operand and for a weight about to be packed."""
    return _HELD_BYTES.total + nbytes <= ARRANGED_BYTES_MAX


def _arranged_key(weight: Tensor, form: tuple) -> tuple:
    """``arranged_weight``'s key for an operand of ``form`` laid out from this view of a weight."""
    return form, tuple(weight.shape), weight.stride(), weight.storage_offset(), weight.dtype, weight.data_ptr()


def kept_for(weight: Tensor, operand: Tensor) -> bool:
    """Whether ``operand`` (a tensor with storage) is in memory that ``arranged_weight`` keeps for ``weight``."""
    ptr = operand.untyped_storage().data_ptr()
    owner = weight if weight._base is None else weight._base
    return any(not t.is_mkldnn and ptr == t.untyped_storage().data_ptr()  # (a packed weight: opaque, no storage)
               for _, (_, t) in kept_snapshot(_ARRANGED.get(owner, {})))


def kept_operand(weight: Tensor, form: tuple) -> Tensor | None:
    """The operand of ``form`` that ``arranged_weight`` keeps for this version of ``weight``'s view, else None."""
    owner = weight if weight._base is None else weight._base
    hit = _ARRANGED.get(owner, {}).get(_arranged_key(weight, form))
    try:
        return hit[1] if hit is not None and hit[0] == weight._version else None
    except RuntimeError:  # an inference tensor: nothing is kept for it
        return None


def canonical_operand(weight: Tensor, dtype: torch.dtype, n_pad: int) -> Tensor:
    """``tiled_matmul``'s canonical right operand [1, K, N_pad]: ``weight`` [N, K] cast to ``dtype``, zero-padded to
    ``n_pad`` rows, contiguous and aligned (``padded_or_aligned``), seen transposed -- a view of the weight where
    nothing needs copying (a linear layer's forward), else laid out once per weight version (``arranged_weight``: an
    input gradient's W.T, a padded or cast weight)."""

    if (weight.dtype == dtype and weight.shape[0] == n_pad and weight.is_contiguous()
            and weight.data_ptr() % gemm_tiles.ALIGNMENT == 0):
        # what make() gives (a view of the weight), without its Python
        return weight.detach().t().unsqueeze(0)

    def make() -> Tensor:
        w = weight.detach().to(dtype)
        return gemm_tiles.padded_or_aligned(w, (n_pad, w.shape[1]))

    return arranged_weight(weight, ("canonical", dtype, n_pad), make).t().unsqueeze(0)


def bmm_copies_operand(dtype: torch.dtype, block: int, k: int, n_pad: int) -> bool:
    """Whether torch's CPU ``bmm`` of [T, block, K] tiles and the canonical operand (a shared [1, K, N_pad] seen
    transposed, expanded to T tiles) first copies that operand into a contiguous [T, K, N_pad] and multiplies the
    copy: torch 2.13's bf16 ``bmm`` runs oneDNN's matmul (oneDNN enabled, a CPU with its bf16 support, x86, the
    GEMM larger than 16^3 multiply-adds, no ``TORCH_MKLDNN_MATMUL_MIN_*`` threshold set), which copies a right
    operand that is neither contiguous nor a transposed batch ([T, K, N] with strides (K N, 1, K)) -- and the
    canonical operand's batch stride is never K N. That copy would be the weight copied per call (most of a bf16
    decode step's time on llama100m); where this holds for a class's tallest tile, its canonical tiles take the
    operand as a transposed batch instead (``operand_per_tile``)."""
    return onednn_bf16_bmm(dtype, block * k * n_pad)


def onednn_bf16_bmm(dtype: torch.dtype, macs: int) -> bool:
    """Whether torch 2.13's CPU ``bmm`` of ``macs`` multiply-adds per batch entry runs oneDNN's bf16 matmul (the rule
    ``bmm_copies_operand`` states); shared by it and ``operand_per_tile``, which tests replace apart."""
    return (dtype == torch.bfloat16 and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and onednn_bf16()
            and not any(os.environ.get(f"TORCH_MKLDNN_MATMUL_MIN_{what}") for what in ("DIM", "SIZE"))
            and macs > 16**3)


def operand_per_tile(dtype: torch.dtype, k: int, n_pad: int) -> bool:
    """Whether ``tiled_matmul``'s canonical tiles of the class (``dtype``, K, N_pad) take the operand once per tile,
    in the layout the weight is stored in (``stored_operand``, ``per_tile_operand``), rather than shared by every
    tile (expanded): where torch's ``bmm`` would copy the shared one (``bmm_copies_operand``, asked for the tallest
    tile: a class's answer).

    Why: oneDNN's bf16 ``bmm`` lays a shared, transposed operand out row-major ([T, K, N] contiguous) before its GEMM,
    but multiplies an operand that is contiguous or a transposed batch (strides (K N, 1, K)) as it is. A forward's
    weight W [N, K] seen transposed is such a batch, and oneDNN's kernel for it is the faster one (llama100m's LM head,
    a decode step's 8 rows: 4.5 ms against 9.6 on the row-major copy); an input gradient's operand is W itself,
    row-major, which the shared form's copy gave anyway. So the canonical call of such a class is the guard's per-tile
    class (``HostGuard.bmm(..., shared_operand=False)``, probed as attention's per-tile keys are) on the operand as
    stored: a forward's weight and an input gradient's are multiplied with no copy at all (one tile, or one GEMM per
    tile: ``laid_out_tiles``). The class is a function of (dtype, K, N_pad, the weight's layout) and this torch build,
    never of the rows, so every call of a class has the same bits. (For a forward's weight this changed the canonical
    bits of bf16 linear layers on a host whose oneDNN rounds the two layouts apart; on the AMD EPYC host of the
    benchmarks they are the same bits. An input gradient's are those of the row-major copy on every host.)"""
    return onednn_bf16_bmm(dtype, gemm_tiles.ROW_BLOCKS[-1] * k * n_pad)


def canonical_class(weight: Tensor, dtype: torch.dtype, k: int, n_pad: int) -> tuple[bool, bool]:
    """(shared, transposed): how ``tiled_matmul``'s canonical call of ``weight`` takes its operand [1, K, N_pad] --
    shared by every tile, or once per tile as stored (``operand_per_tile``) -- and whether in the transposed layout
    (else row-major: in a per-tile class, an input gradient's W as stored, ``stored_row_major``; in a shared class
    below ``ROW_MAJOR_SHARED_MAX``, an input gradient's W as stored, and an fp32 forward's weight transposed into a
    copy, ``row_major_operand``). The one derivation that ``tiled_dtype`` and ``tiled_matmul`` both ask the guard
    with."""
    per_tile = operand_per_tile(dtype, k, n_pad)
    if per_tile:
        row_major = stored_row_major(weight)
    else:
        row_major = k * n_pad < ROW_MAJOR_SHARED_MAX and (stored_row_major(weight) or dtype == torch.float32)
    return not per_tile, not row_major


ROW_MAJOR_SHARED_MAX = ONEDNN_MIN_WEIGHT
"""Elements (K x N_pad): below this, a shared class takes its canonical operand row-major -- an input gradient's W
(``stored_row_major``) as stored, an fp32 forward's weight W [N, K] transposed into a copy [K, N_pad] laid out once per
weight version (``row_major_operand``); from it, the transposed layout -- a forward's W as stored, an input gradient's
W transposed into a copy -- in which an fp32 class tries oneDNN's linear (``host_guard.ONEDNN_MIN_WEIGHT``, the same
bound). Below the bound the class runs torch's ``bmm`` in any case, and MKL's fp32 ``bmm`` multiplies a shared
row-major operand faster than a transposed one: about one GEMM on the stacked tiles' time against about 1.2x it, the
default model's layers at 3,968 rows, one thread, on the Intel Xeon with AMX, the same bits either way. There, the
default model's fp32 linear layers of a training pass in ``canonical``: 1.19x ``auto``'s time with neither row-major,
1.09x with the input gradients' (session 66), and its fp32 training step 1.09x, then 1.06x, then 1.03x with the
forwards' too (``vexact bench guard_modes``, the benchmarks page, sessions 66 and 67). From the bound the transposed
layout stays: oneDNN's linear on it ran llama100m's fp32 training at 2 threads faster than ``bmm`` on W as stored
(canonical / auto 1.02x against 1.15x with every input gradient row-major). A bf16 shared class keeps a forward's
weight as stored (its classes on the hosts measured are ``operand_per_tile`` ones, or compute in fp32)."""


def stored_row_major(weight: Tensor) -> bool:
    """Whether ``tiled_matmul``'s ``weight`` [N, K] is stored as its transpose (an input gradient's W.T, a view of the
    contiguous W): its operand [K, N] is then row-major as stored. Else (a forward's W, contiguous) the operand as
    stored is the weight seen transposed."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


def stored_operand(weight: Tensor, dtype: torch.dtype, n_pad: int) -> Tensor:
    """The canonical operand [1, K, N_pad] of an ``operand_per_tile`` class (or of a shared class that takes an input
    gradient's W row-major: ``canonical_class``), in the layout the weight is stored in: a
    forward's weight [N, K] as a transposed batch (``transposed_batch`` of ``canonical_operand``: the weight itself,
    or its padded or cast copy laid out once per version); an input gradient's (``stored_row_major``) row-major, W
    itself, or its padded or cast copy laid out once per version (``arranged_weight``)."""
    if not stored_row_major(weight):
        return transposed_batch(canonical_operand(weight, dtype, n_pad))
    return row_major_operand(weight, dtype, n_pad)


def row_major_operand(weight: Tensor, dtype: torch.dtype, n_pad: int) -> Tensor:
    """The canonical operand [1, K, N_pad] of a row-major class (``canonical_class``), row-major: an input gradient's
    W as stored (``stored_row_major``), or its padded or cast copy; a forward's weight [N, K] transposed, padded and
    cast into a contiguous copy -- each copy laid out once per weight version (``arranged_weight``)."""
    given = weight.t()
    if (given.is_contiguous() and given.dtype == dtype and given.shape[1] == n_pad
            and given.data_ptr() % gemm_tiles.ALIGNMENT == 0):
        return given.unsqueeze(0)

    def make() -> Tensor:
        return gemm_tiles.padded_or_aligned(given.detach().to(dtype), (given.shape[0], n_pad)).unsqueeze(0)

    return arranged_weight(weight, ("row-major", dtype, n_pad), make)


def transposed_batch(operand: Tensor) -> Tensor:
    """The canonical operand [1, K, N_pad] (its matrix [N_pad, K] contiguous, seen transposed) as a transposed batch:
    the same memory, strides (K N_pad, 1, K), the layout oneDNN's ``bmm`` takes as it is."""
    return operand[0].t().unsqueeze(0).transpose(1, 2)


def per_tile_operand(operand: Tensor, tiles: int) -> Tensor:
    """[T, K, N_pad]: ``operand`` [1, K, N_pad] -- row-major, or a transposed batch (its matrix [N_pad, K] contiguous,
    seen transposed) -- once per tile, in its layout: the canonical right operand of an ``operand_per_tile`` class,
    which oneDNN's ``bmm`` multiplies as it is. One tile: the operand itself (no copy); T tiles: T copies of it in one
    call, as ``bmm`` made of the shared operand before."""
    if operand_layout(operand) == "transposed":
        matrix = operand[0].t()
        return matrix.expand(tiles, *matrix.shape).contiguous().transpose(1, 2)
    return operand.expand(tiles, *operand.shape[1:]).contiguous()


def laid_out_operand(weight: Tensor, dtype: torch.dtype, n_pad: int, tiles: int, form: str) -> Tensor:
    """The operand ``laid_out_tiles`` multiplies in ``form`` for ``tiles`` tiles of an ``operand_per_tile`` class:
    the canonical operand as stored, [1, K, N_pad] (``stored_operand``); for the canonical call itself (``one call``)
    that operand once per tile (``per_tile_operand``), laid out once per weight version and tile count
    (``arranged_weight``: a decode loop's steps, each the same tile count, copy nothing)."""
    operand = stored_operand(weight, dtype, n_pad)
    if form != LAID_OUT_FORMS[1]:
        return operand
    form_key = ("per tile", dtype, n_pad, tiles, operand_layout(operand))
    return arranged_weight(weight, form_key, lambda: per_tile_operand(operand, tiles))


LAID_OUT_CALL_MAX = 1 << 20
"""Elements. Several tiles of a ``operand_per_tile`` class (``laid_out_tiles``): where the operand's copies
that the canonical call needs ((tiles - 1) x K x N_pad elements beyond the matrix itself) are at most this many, the
canonical call itself runs; above it, one GEMM per tile on the matrix itself (``_tile_gemms``). Measured on the
2-core AMD host, one thread, bf16, with ``mm`` per tile: the default model's layers (K, N <= 176; 62 tiles of 64 rows
for 3,968 tokens; about 7e5 elements) take 0.24 ms as one call against 1.1 ms as 62 calls (about 17 us per oneDNN
call); llama100m's (K = 576, N = 1536, 5 tiles; 3.5e6) 1.4 ms per tile against 1.7 ms as one call (plus 0.16 ms to
lay the copies out), and its LM head over 320 rows 61 ms against 57 (plus 130)."""
LAID_OUT_FORMS = ("one tile", "one call", "per tile")
"""``laid_out_tiles``' forms: the one tile's call (on the matrix itself); several tiles in the canonical call (the
matrix once per tile); one call per tile on the matrix itself (``_tile_gemms``). Each is checked at first use
against the canonical call (``laid_out_agrees``)."""


def laid_out_form(blocks: int, k: int, n_pad: int) -> str:
    """Which of ``LAID_OUT_FORMS`` ``laid_out_tiles`` runs for ``blocks`` tiles of a [K, N_pad] operand."""
    if blocks == 1:
        return LAID_OUT_FORMS[0]
    return LAID_OUT_FORMS[1] if (blocks - 1) * k * n_pad <= LAID_OUT_CALL_MAX else LAID_OUT_FORMS[2]


def laid_out_tiles(x: Tensor, operand: Tensor, block: int, blocks: int, n: int, form: str,
                    one_thread: bool = False, whole_tiles: bool = False) -> Tensor:
    """``tiled_matmul``'s canonical tiles of an ``operand_per_tile`` class in ``form`` (``LAID_OUT_FORMS``) on
    ``laid_out_operand``: one tile, its GEMM as an ``mm`` on the operand's matrix as stored; several, the
    canonical call on that operand once per tile ([blocks, K, N_pad], ``LAID_OUT_CALL_MAX``) or one ``mm`` per tile
    on the operand's matrix as stored, [block, K] @ [K, N_pad] (``_tile_gemms``), as the guard's ``gemm_rows`` probe
    computes its reference rows (one 64-row tile), whose bits it found every tile count's rows to have.
    ``one_thread``: a class the guard runs with 1 thread (``blas-1-thread``), every GEMM on one thread.
    ``whole_tiles``: the GEMMs per tile never in column blocks (a class whose column blocks failed their first-use
    check, ``column_blocks_agree``)."""
    rows, k = x.shape
    n_pad = operand.shape[2]
    tiles = gemm_tiles.padded_rows_input(x, blocks * block).view(blocks, block, k)
    if form != LAID_OUT_FORMS[1]:  # one tile, or one GEMM per tile: ``mm`` on the matrix itself
        out = _tile_gemms(tiles, operand, one_thread=one_thread, column_blocks=1 if whole_tiles else None)
    elif one_thread:
        out = _with_threads(1, lambda: torch.bmm(tiles, operand))
    else:
        out = torch.bmm(tiles, operand)
    out = out.view(blocks * block, n_pad)
    return out[:rows] if n_pad == n else out[:rows, :n]


def _tile_gemms(tiles: Tensor, operand: Tensor, *, spread: bool | None = None, one_thread: bool = False,
                column_blocks: int | None = None) -> Tensor:
    """[T, h, N]: one 2-D ``mm`` per tile of ``tiles`` [T, h, K] (contiguous) with ``operand`` [1, K, N]'s matrix
    (contiguous, or a transposed batch: ``transposed_batch``), each into its own rows of one output. (A one-tile
    ``bmm`` was the call before: the same GEMM shape, but oneDNN's batched bf16 path lays the operand out on every
    call -- several times an ``mm``'s time on the AMD EPYC, llama100m's layers and LM head; the first-use check compares
    the ``mm``s with the canonical call as it compared the ``bmm``s.)

    Spread (where the compiled loops are built and several threads run): one compiled call whose tiles are shared
    out between the threads, each tile's GEMM on one thread (``tile_gemms`` in ``csrc/exact_loops.cpp``: a GEMM
    called inside the parallel region runs on its calling thread), so no bit depends on how the threads divide them;
    where the tiles do not give the threads even shares (``tile_column_blocks``), the tiles left over after even
    shares of whole ones (five tiles at 2 threads: the fifth) each as GEMMs of consecutive column blocks of the
    operand, the (tile, block) pairs shared out too. Else one call after
    another, each with the process's threads. ``spread`` None: spread wherever the loops run with several threads
    (five large tiles at 2 threads took 3 + 2 tiles' time spread by whole tiles; one after another, each GEMM on both
    threads, ran a 64-row GEMM at 2 threads). The callers check the result against the canonical call at first use,
    per class and thread count, every way that can run (``tile_gemm_ways``). ``one_thread``: every GEMM on one thread
    (a ``blas-1-thread`` class): spread where the loops run, each GEMM with OpenMP's and MKL's thread-local counts
    held at 1 (oneDNN inside the parallel region else plans for the process's count: another order of K on the Intel
    host), else one after another with 1 thread.
    ``column_blocks``: None, ``tile_column_blocks``' choice for the tiles left over; given (a first-use check's way),
    every tile in that many blocks."""
    loops = compiled_loops.library()
    threads = torch.get_num_threads()
    count = tiles.shape[0]
    whole = 0
    if column_blocks is None:
        column_blocks = tile_column_blocks(count, threads, operand.shape[2])
        whole = count - count % threads
    if one_thread:
        if loops is not None and count * column_blocks > 1 and threads > 1:
            return loops.tile_gemms(tiles, operand, column_blocks, one_thread=True, whole_tiles=whole)
        return _with_threads(1, lambda: _tile_gemms(tiles, operand, spread=False, column_blocks=1))
    if spread is None:
        spread = True
    if loops is not None and spread and count * column_blocks > 1 and threads > 1:
        return loops.tile_gemms(tiles, operand, column_blocks, whole_tiles=whole)
    out = tiles.new_empty(count, tiles.shape[1], operand.shape[2])
    matrix = operand[0]
    for tile in range(count):
        torch.mm(tiles[tile], matrix, out=out[tile])
    return out


def tile_column_blocks(count: int, threads: int, n: int) -> int:
    """Column blocks per tile for the tiles ``_tile_gemms``' spread call of ``count`` tiles at ``threads`` threads has
    left over after giving each thread an even share of whole tiles (``count`` mod ``threads`` of them): 1 where there
    are none, else as many as make their (tile, block) pairs a multiple of the threads (five tiles at 2 threads: the
    fifth in two blocks; one tile, two), at most ``n`` (a block has a column). (Before: every tile in blocks, and
    whole tiles only from 4 per thread, whose uneven share was then at most a quarter more; five of llama100m's tiles
    at 2 threads ran 3-7% faster with four of them whole, the journal, session 60.)"""
    if threads <= 1 or count % threads == 0:
        return 1
    return max(1, min(n, threads // math.gcd(count, threads)))


def tile_gemm_ways(threads: int, n: int, one_thread: bool) -> tuple[tuple[bool, int], ...]:
    """Every (spread, column blocks) way ``_tile_gemms`` can run tiles of one class at ``threads`` threads, whatever
    their count, which its first-use check (``laid_out_agrees``) compares with the canonical call: spread by whole
    tiles (an even count) and by each column block count ``tile_column_blocks`` can give (an uneven one: a divisor
    of the threads), and, for a class that may run on every thread, one call after another."""
    blocks = {min(n, threads // math.gcd(tiles, threads)) for tiles in range(1, threads + 1)}  # 1 and each divisor
    ways = [(True, b) for b in sorted(blocks)]
    return tuple(ways if one_thread else [*ways, (False, 1)])


_LAID_OUT_CHECKS: dict[tuple, bool] = {}
LAID_OUT_CHECK_TILES = dict(zip(LAID_OUT_FORMS, (1, 2, 3)))
"""64-row tiles in ``laid_out_agrees``' check per form: several where the form has several (three per tile: a count
two threads do not divide evenly)."""


def laid_out_agrees(block: int, k: int, n_pad: int, dtype: torch.dtype, form: str, transposed: bool = True,
                     one_thread: bool = False) -> bool:
    """Whether ``laid_out_tiles`` in ``form`` gives the canonical call's bits for this ``operand_per_tile`` class
    here (``transposed``: its operand a transposed batch, else row-major): checked once per (class, tile height,
    form, thread count) on seeded order-revealing operands (``probe_operands``), ``LAID_OUT_CHECK_TILES`` tiles. The
    forms are the canonical call's own GEMM per tile, on the same operand layout, by whole tiles (their column
    blocks are checked apart: ``column_blocks_agree``); this catches a torch whose ``bmm`` does otherwise, or a
    per-tile GEMM whose bits follow the threads (then the canonical call runs). ``one_thread``:
    a ``blas-1-thread`` class, whose canonical call and forms run every GEMM on one thread."""
    def check() -> bool:
        blocks = LAID_OUT_CHECK_TILES[form]
        x, operand, canonical = _laid_out_check_operands(blocks, block, k, n_pad, dtype, transposed, one_thread)
        if form == LAID_OUT_FORMS[1]:  # the canonical call on the operand laid out once per tile
            laid = per_tile_operand(operand, blocks)
            return torch.equal(canonical, laid_out_tiles(x, laid, block, blocks, n_pad, form, one_thread=one_thread))
        # one GEMM per tile (or the one tile's): every way a call of any tile count can run whole tiles
        return _tile_gemm_ways_agree(canonical, x.view(blocks, block, k), operand, one_thread, column_blocks=False)

    key = (dtype, block, k, n_pad, form, transposed, one_thread, torch.get_num_threads())
    return gemm_tiles.checked_once(_LAID_OUT_CHECKS, key, check)


def _laid_out_check_operands(blocks: int, block: int, k: int, n_pad: int, dtype: torch.dtype, transposed: bool,
                             one_thread: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(x [blocks x block, K], the operand [1, K, N_pad] in the class's layout, the canonical call's output
    [blocks x block, N_pad]) on seeded order-revealing operands (``probe_operands``): what the laid-out forms'
    first-use checks compare."""
    x, w = gemm_tiles.probe_operands(dtype, (blocks * block, k), (n_pad, k))
    operand = w.unsqueeze(0).transpose(1, 2) if transposed else w.t().contiguous().unsqueeze(0)
    return x, operand, canonical_tiles_call(x, operand, blocks, block, one_thread)


def canonical_tiles_call(x: Tensor, operand: Tensor, blocks: int, block: int, one_thread: bool = False) -> Tensor:
    """The canonical call of an ``operand_per_tile`` class on ``x`` [blocks x block, K] and ``operand`` [1, K, N_pad]
    -- one ``bmm`` of the tiles with the operand once per tile (``per_tile_operand``), with 1 thread for a
    ``blas-1-thread`` class -- as [blocks x block, N_pad]: what the first-use checks of its faster forms compare
    with."""
    def call() -> Tensor:
        return torch.bmm(x.view(blocks, block, x.shape[1]), per_tile_operand(operand, blocks))
    return (_with_threads(1, call) if one_thread else call()).view(blocks * block, operand.shape[2])


def _tile_gemm_ways_agree(canonical: Tensor, tiles: Tensor, operand: Tensor, one_thread: bool, *,
                          column_blocks: bool) -> bool:
    """Whether every way ``_tile_gemms`` can run ``tiles`` (``tile_gemm_ways``) by whole tiles (``column_blocks``
    False) or in column blocks (True) gives ``canonical``, the canonical call's [T x h, N_pad] output."""
    rows, n_pad = canonical.shape
    return all(torch.equal(canonical, _tile_gemms(tiles, operand, spread=spread, one_thread=one_thread,
                                                  column_blocks=columns).view(rows, n_pad))
               for spread, columns in _tile_gemm_ways_of(n_pad, one_thread, column_blocks))


def _tile_gemm_ways_of(n_pad: int, one_thread: bool, column_blocks: bool) -> list[tuple[bool, int]]:
    """``tile_gemm_ways`` at the current thread count, by whole tiles (``column_blocks`` False) or in column blocks."""
    return [(spread, columns) for spread, columns in tile_gemm_ways(torch.get_num_threads(), n_pad, one_thread)
            if (columns > 1) == column_blocks]


def column_blocks_agree(block: int, k: int, n_pad: int, dtype: torch.dtype, transposed: bool = True,
                         one_thread: bool = False) -> bool:
    """Whether ``_tile_gemms``' GEMMs per tile in column blocks (each tile's GEMM as GEMMs of consecutive column
    blocks of the operand: how an uneven tile count gives the threads even shares) give the canonical call's bits
    for this ``operand_per_tile`` class here, as its whole tiles do (``laid_out_agrees``, forms ``one tile`` and
    ``per tile``): checked once per key as that check is, on the same tiles (a tile's column blocks are the same GEMM
    calls whatever the tile count). Where they do not (a GEMM whose bits follow its column count: oneDNN's bf16 GEMM
    on the Intel Xeon with AMX, llama100m's down projection, [h, 1536] @ [1536, 576], and its input gradient's,
    [64, 576] @ [576, 1536]), the class runs whole tiles. Before this check was apart, their failure refused the form
    itself: a training pass's tiles ran the canonical call, copying the weight once per tile on every call, and a
    decode step's one tile ran it unpacked (a ``bmm`` of 1.7x the packed GEMM's time)."""
    def check() -> bool:
        if not _tile_gemm_ways_of(n_pad, one_thread, column_blocks=True):  # (1 thread: no column blocks to run)
            return True
        blocks = LAID_OUT_CHECK_TILES[LAID_OUT_FORMS[2]]
        x, operand, canonical = _laid_out_check_operands(blocks, block, k, n_pad, dtype, transposed, one_thread)
        return _tile_gemm_ways_agree(canonical, x.view(blocks, block, k), operand, one_thread, column_blocks=True)

    key = (dtype, block, k, n_pad, "per tile, column blocks", transposed, one_thread, torch.get_num_threads())
    return gemm_tiles.checked_once(_LAID_OUT_CHECKS, key, check)
