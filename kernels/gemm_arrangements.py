"""The exact CPU kernels' matrix products: fixed GEMM tile arrangements, and the faster ones the guard admits.

Three products serve the ops of ``cpu_exact``:

- ``tiled_matmul``: x @ W.T, a linear layer's forward and its input gradient (rows = tokens);
- ``transposed_matmul``: a.T @ b, a linear layer's weight gradient (a reduction over the tokens);
- ``batched_matmul``: a @ b per batch entry, attention's backward products.

Each has a *canonical arrangement*: rows zero-padded to whole row tiles (``row_block``), output columns to a
multiple of ``COL_BLOCK``, a reduction over tokens cut into fixed chunks added by a halving tree, every operand
contiguous and ``ALIGNMENT``-aligned -- so an output element's reduction runs through the same GEMM kernel in the
same order whatever the batch, provided the host's GEMM gives a row the same bits for every tile height, position
and tile count (the guard's ``gemm_rows`` probe, per shape class; where it fails, ``host.bmm`` runs the fixed-order
GEMM). A large fp32 linear layer's class may run torch's oneDNN linear op instead of ``torch.bmm`` (the guard's
``onednn_rows``, probed the same way): through ``host.bmm``, in the canonical tiles, since the faster arrangements
below are arrangements of ``torch.bmm``'s calls. Why these tile shapes, with the measurements behind them:
docs/reference/kernels.md, "Why these tiles".

The canonical arrangement copies no weight per call: each copy it needs of a weight (an input gradient's W.T made
contiguous, a padded or cast weight) is laid out once per weight version and kept (``arranged_weight``, bounded by
``ARRANGED_BYTES_MAX``). In bf16, where oneDNN's ``bmm`` would copy the shared, transposed operand before its GEMM
(``bmm_copies_operand``), a class's canonical tiles take the operand once per tile as a transposed batch instead,
the layout oneDNN multiplies as it is (``operand_per_tile``): a forward's weight as stored, with no copy at
all, one GEMM per tile or the canonical call itself (``_laid_out_tiles``). The same GEMM calls on the same values in
the same layout, so no bit depends on which (``tests/kernels/test_arranged_weights.py``).
Nor does ``tiled_matmul`` decide anew on every call: its decisions (the
guard's answers, the arrangement, the tile height, the operand) are made once per call key and kept (``TiledPlan``),
so a decode step's linear layer costs a lookup and its GEMM (``tests/kernels/test_tiled_plans.py``).

A *faster arrangement* of the same library calls (fewer copies, one GEMM instead of many) runs only where the
guard's ``same_bits`` probe found that it gives the canonical arrangement's bits for the class
(``HostGuard.arrangement_agrees``), so no result depends on it:

- ``tiled_matmul``'s tiles stacked into one GEMM (``_stacked_matmul``), with the weight as stored where it is an
  input gradient's (no transposing copy); where the last tile is partial and the weight small, the whole tiles
  multiplied where x holds them and the last tile apart (``_split_mm``: no copy of every row);
- ``transposed_matmul``'s chunk GEMMs on views of its inputs (``_transposed_matmul_views``), the last chunk on its
  real rows where that length agrees too.

bf16 operands: where the guard admitted the host's bf16 GEMM for the class (``HostGuard.compute_dtype``, asked through
``tiled_dtype`` / ``transposed_dtype``), ``tiled_matmul`` and ``transposed_matmul`` run their canonical arrangement on
the bf16 operands as they are, each output rounded once to bf16 by the GEMM; elsewhere the caller upcasts them and
they compute in fp32. The faster arrangements below are probed in fp32 and run for fp32 only.

A third form is no arrangement of its own but the same tiles grouped into other calls (``transposed_matmul``'s
tiles one call per row tile: ``_transposed_matmul_by_row_tile``), which the ``gemm_rows`` probe already covers. A
weight gradient whose chunk class runs the host's own GEMM has a canonical arrangement of its own: each chunk in
slabs of ``SLAB_ROWS`` output rows, each GEMM on one thread (``_reduction_slabs``).
Where the compiled loops are built and the class runs torch's own GEMM (``HostGuard.library_gemm``), the steps
around the GEMM run in one compiled call on the same operands (``compiled_loops``).

A plan that runs oneDNN's linear op (an fp32 ``onednn_rows`` class's canonical tiles; a bf16 class's ``stacked``
arrangement, whose ``torch.mm`` is oneDNN's) runs it, after ``PACK_AFTER_CALLS`` calls of one weight version, on the
weight packed once in oneDNN's own layout (``host_guard.onednn_packed``): the same GEMM without laying the weight out
per call, used only where a first-use check found its bits equal to the call it replaces (``_packed_agrees``).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_loops
from .compiled_loops import tree_sum as _tree_sum
from .fixed_order import tree_sum_of
from .host_guard import (
    LIBRARY_DTYPES,
    ONEDNN_MIN_WEIGHT,
    HostGuard,
    _with_threads,
    onednn_linear,
    onednn_packed,
    onednn_packing,
    operand_layout,
    order_revealing,
)

# --------------------------------------------------------------------------- the tile shapes
ROW_BLOCKS = (4, 8, 16, 32, 48, 64)
"""GEMM tile heights: a call's rows are padded to the smallest that holds them, else to 64-row tiles. Small tiles
keep a decode step from multiplying rows it does not have; heights 1 and 2 are left out because they ran a narrower
kernel with other bits on MKL, and 64 is the tallest tile the guard's probe covers (``host_guard.PROBE_ROWS``).
48 is for a host whose GEMM runs a call of at most 32 rows on another kernel (oneDNN's bf16 GEMM on an Intel Xeon
with AMX): there the guard drops 4-32, and a decode step of up to 32 rows multiplies 48 rows, not 64 (AMX works in
16-row tiles: three instead of four)."""
COL_BLOCK = 16
"""Output columns (and attention's reductions) are zero-padded to a multiple of this: the fp32 width of an AVX-512
register. MKL ran columns of widths that are not multiples of 16 through a narrower kernel at some thread counts."""
ALIGNMENT = 64
"""Bytes: every GEMM operand starts on this boundary, as every fresh tensor from torch's CPU allocator does (the
guard probes fresh tensors): a BLAS may take another path for a misaligned operand."""
MIN_REDUCE_BLOCK, REDUCE_BLOCK = 64, 256
"""Tokens per chunk of a weight gradient's reduction: the smallest power of two from ``MIN_REDUCE_BLOCK`` holding the
tokens, at most ``REDUCE_BLOCK`` (``_reduction_block``). Three fixed chunk lengths, so the guard probes few classes,
and a batch of up to 256 tokens is one chunk (no tree)."""
LIBRARY_REDUCE_MAX = 1024
"""Tokens a bf16 weight gradient reduces in one chunk on the host's bf16 GEMM, its length padded to a multiple of
``REDUCE_BLOCK`` (512, 768 or 1024 above 256 tokens). A bf16 GEMM rounds its output once, so it cannot return the fp32
partial sums that chunks add: up to this many tokens one chunk holds them all (one rounding, as native bf16 has);
beyond it the chunks run in fp32. A weight gradient is never compared across rollout and training, so its chunking
may follow the dtype; the few lengths keep the guard's classes few. Each such chunk GEMM runs with 1 thread, by
construction (``one_thread_reduction``)."""

# --------------------------------------------------------------------------- where an arrangement pays
ROW_TILE_CALLS_FROM = 1 << 20
"""Elements (4 MiB of fp32). The canonical weight gradient holds every (chunk, row tile) pair in one GEMM call, so it
copies each chunk's right operand once per row tile: (row tiles - 1) x chunks x K_pad x chunk extra elements. Above
this many, one call per row tile runs instead (the same tiles, ``_transposed_matmul_by_row_tile``); below it the
extra calls cost more than the copy. The zero_mismatch model's widest layers (gate and up: N = 176, three row tiles,
K = 64) add 2 x 64 x 256 = 32,768 elements per 256-token chunk, so they stay below it up to 31 chunks (7,936 tokens
per gradient); llama100m's LM head is far above it (767 x 2 x 576 x 256, about 2.3e8, for 312 tokens)."""
STACKED_MACS_MAX = 1 << 34
"""Multiply-adds (about 1.7e10): the largest linear layer whose tiles may run as one GEMM. Its ``same_bits`` probe
(per tile count) costs about three GEMMs of the layer's size at first use, a one-time cost that this bounds."""
APART_WEIGHT_BYTES_MAX = 1 << 18
"""Bytes (256 KiB): the largest weight operand for which ``tiled_matmul``'s stacked GEMM multiplies its last, partial
tile in a GEMM of its own (``_last_tile_apart``) instead of copying every row into a zero-padded operand: the whole
tiles are multiplied where x holds them. A second GEMM call reads the weight again, which costs less than the copy
only while the weight is small: the RL update's leaf (32 sequences of 29 tokens, the default model's 64- to
176-wide layers, fp32, 1 thread) took 0.94-1.00x its time with every row copied, and the zero_mismatch RL step 0.96x
(0.98x at 2 threads); llama100m's 576-wide layers at 312 rows took 1.06-1.13x one call alone (the journal, session
38)."""
VIEW_SLAB_ROWS = 4096
"""A weight gradient on views (``_transposed_matmul_views``) cuts its N output rows
into slabs of this many, each its own GEMM calls and tree, to bound the partial products held at once (llama's LM
head: N = 49152, 12 slabs). A multiple of ``SLAB_ROWS`` and of every tile height (``ROW_BLOCKS``)."""
VIEW_PARTIALS_MAX = 1 << 24
"""Partial-product elements per slab (chunks x slab rows x K: 64 MiB of fp32), a memory bound: a weight gradient with
more runs the canonical arrangement instead."""

# --------------------------------------------------------------------------- the same_bits probes' inputs
ARRANGEMENT_PROBE_SEED = 20261126
"""The seed of the same_bits probes' inputs. Any fixed seed would do: the values must be random (every mantissa bit
in play, so another rounding shows) and the same in every process (a verdict must not depend on the run); the
digits are the date the probe was written, nothing more."""
VIEW_PROBE_CHUNKS = 2
"""Whole chunks in a views probe (where the chunk is ``REDUCE_BLOCK``, so there are several), plus a partial one."""
VIEW_PROBE_OUTPUTS, VIEW_PROBE_DRAWS_MAX = 4096, 64
"""Outputs a views probe compares at least: a class of fewer (N x K) compares that many over several seeded draws of
its inputs (at most ``VIEW_PROBE_DRAWS_MAX``). Where a class has few outputs, another order may touch only some of
them, and random inputs round those alike often: a weight gradient of N = 2 rows over a 7-token chunk, K = 17, on
the AMD host -- the views rounded three of its 34 outputs otherwise than the slabs, for 3 inputs in 4, and the one
seeded draw was the fourth (its class then ran the views: other bits than ``canonical``'s)."""


# --------------------------------------------------------------------------- operands
def fp32(x: Tensor) -> Tensor:
    """``x`` in fp32 (itself when it is): the kernels compute in fp32 and round once to the output dtype."""
    return x if x.dtype == torch.float32 else x.float()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_block(rows: int, heights: tuple[int, ...] = ROW_BLOCKS) -> int:
    """GEMM tile height for ``rows`` rows: the smallest of ``heights`` (the guard's allowed heights for the GEMM's
    shape class, a subset of ``ROW_BLOCKS``) that holds them, else the largest."""
    for block in heights:
        if rows <= block:
            return block
    return heights[-1]


@functools.lru_cache(maxsize=256)
def gemm_class(k: int, n: int, *, transposed: bool) -> Tensor:
    """A [1, K, N] tensor with the shape and layout of a GEMM's right operand, to ask the guard about the GEMM's class
    (``HostGuard.tile_heights`` and ``library_gemm`` read only an operand's shape and layout, never its values).

    ``transposed``: K contiguous, as a weight [N, K] seen transposed -- overlapping strides over k + n elements, so
    a class as large as llama's LM head (113 MB) is asked about without laying the operand out. Else row-major: a
    [1, K, N] tensor. Made once per (K, N, layout) and shared (nothing reads its values): every linear layer asks
    twice per call, and making it cost as much as the rest of the question."""
    if transposed:
        return torch.empty(k + n).as_strided((1, k, n), (0, 1, 1))
    return torch.empty(1, k, n)


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when contiguous and starting at an ``ALIGNMENT``-byte boundary (as every fresh torch CPU
    allocation does), else a fresh contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _rows_aligned(x: Tensor) -> Tensor:
    """A 2-D operand whose columns a GEMM may read on views: ``x`` itself where its rows are unit-stride, do not
    overlap and it starts on an ``ALIGNMENT``-byte boundary (a transposed view, or rows of a wider tensor), else
    ``_aligned``'s contiguous copy. One column: the same memory with column stride 1 (torch calls an [M, 1] tensor
    contiguous whatever its column stride, which is never read; the weight gradient's compiled slabs require 1, and
    a host's GEMM may pick its kernel by it -- so one layout, whatever the caller's)."""
    if x.shape[1] == 1 and x.stride(1) != 1:
        x = x.as_strided(x.shape, (x.stride(0), 1), x.storage_offset())
    if x.stride(1) == 1 and x.stride(0) >= x.shape[1] and x.data_ptr() % ALIGNMENT == 0:
        return x
    return _aligned(x)


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
    zero_outside(out, x.shape)
    return out


def _padded_or_aligned(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A GEMM operand: ``x`` zero-padded to ``shape`` (a fresh copy), or ``x`` contiguous and aligned where it has
    that shape already (``_aligned``: itself, or a contiguous copy)."""
    return _aligned(x) if tuple(shape) == tuple(x.shape) else _zero_padded(x, shape)


class _PaddedInputs(threading.local):
    """Per thread: the zero-padded GEMM inputs ``_padded_rows`` reuses, one per (rows, K, dtype), each with the count
    of its leading rows the last call wrote."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, list] = {}


_PADDED_INPUTS = _PaddedInputs()
PADDED_INPUT_BYTES_MAX = 1 << 20
"""Bytes (1 MiB): the largest zero-padded input ``_padded_rows`` keeps per thread and shape; a larger one (a
training call's tiles) is a fresh copy, whose allocation is small beside its copy."""
PADDED_INPUTS_MAX = 16
"""Buffers ``_padded_rows`` keeps per thread at most (the oldest goes first): a decode loop needs one per layer
shape; ragged training calls would otherwise keep one per row count they padded to (at most 16 MiB a thread)."""


def _padded_rows(x: Tensor, rows_padded: int) -> Tensor:
    """``_padded_or_aligned(x, (rows_padded, K))`` for x [M, K]: the same values and layout, as the input of a GEMM
    that only reads it and keeps nothing of it past the call. Where rows are padded, the input is at most
    ``PADDED_INPUT_BYTES_MAX`` and grad mode is off (a kernel's own forward or backward, a decode step: no GEMM
    recorded for autograd, which would keep its input), it is a buffer kept per thread and (rows, K, dtype): x's
    rows copied in, the rows a longer call wrote after them zeroed again -- no allocation per call, and the padding's
    zeros written once, not on every call.

    Why: a decode step multiplies a few rows padded to a whole tile (8 rows in a 48-row tile), every call on fresh
    memory otherwise (llama100m's bf16 decode step on an Intel Xeon with AMX at 2 threads: about 1% of the step, and
    3.5% together with ``linear_repeats``; the journal, session 48). Per thread, so that a GEMM on another thread
    (which runs with the GIL released) never reads a buffer this one is writing."""
    rows, k = x.shape
    if rows == rows_padded:
        return _aligned(x)
    if (buffer := _kept_buffer(x, rows_padded)) is None:
        return _zero_padded(x, (rows_padded, k))
    buffer[:rows].copy_(x)
    return buffer


class _LoopInput(NamedTuple):
    """How a compiled call takes x's rows padded to a plan's tiles: copied into ``buffer`` (``_kept_buffer``), or as
    they are (``buffer`` None: they fill the tiles already)."""

    buffer: Tensor | None


def _loop_input(x: Tensor, rows_padded: int) -> _LoopInput | None:
    """How a compiled call that pads x [..., K] to ``rows_padded`` rows itself takes them (``_LoopInput``); None where
    it cannot (rows to pad and no kept buffer: a fresh zero-padded copy, the Python steps' ``_padded_rows``)."""
    buffer = _kept_buffer(x, rows_padded)
    if buffer is None and x.numel() != rows_padded * x.shape[-1]:
        return None
    return _LoopInput(buffer)


def _kept_buffer(x: Tensor, rows_padded: int) -> Tensor | None:
    """The buffer ``_padded_rows`` keeps for x [M, K] (or [..., K]: its M rows) padded to ``rows_padded`` rows, ready
    for x's rows: its rows from M on zero (those a longer call wrote zeroed again), x's rows for the caller to copy
    in. None where it keeps none: nothing to pad, an input over ``PADDED_INPUT_BYTES_MAX``, grad mode on."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (k == 0 or rows == rows_padded or rows_padded * k * x.element_size() > PADDED_INPUT_BYTES_MAX
            or torch.is_grad_enabled()):
        return None
    buffers = _PADDED_INPUTS.buffers
    entry = buffers.get(key := (rows_padded, k, x.dtype))
    if entry is None:
        if len(buffers) >= PADDED_INPUTS_MAX:
            del buffers[next(iter(buffers))]
        entry = buffers[key] = [x.new_zeros(rows_padded, k), 0]
    buffer, written = entry
    if written > rows:
        buffer[rows:written].zero_()
    entry[1] = rows
    return buffer


def _padded_operand(x: Tensor, shape: tuple[int, ...], full: Tensor | None) -> Tensor:
    """``x`` zero-padded to ``shape``: ``full`` itself where it is that tensor already (the caller's zero-padded
    buffer of which ``x`` is the leading corner, contiguous and aligned, as a fresh copy would be), else a copy
    (``_zero_padded``: with nothing to pad, a clone that keeps ``x``'s strides, whose layout the guard then
    classes)."""
    return full if _is_padded_operand(full, shape) else _zero_padded(x, shape)


def _is_padded_operand(full: Tensor | None, shape: tuple[int, ...]) -> bool:
    """Whether ``full`` may stand for a fresh padded operand of ``shape``: that shape, contiguous and aligned."""
    return (full is not None and tuple(full.shape) == tuple(shape) and full.is_contiguous()
            and full.data_ptr() % ALIGNMENT == 0)


def zero_outside(out: Tensor, corner: tuple[int, ...]) -> None:
    """Zero ``out`` everywhere but its leading ``corner`` (each element once)."""
    for dim, (size, total) in enumerate(zip(corner, out.shape)):
        if total > size:  # this dim's padding, where every earlier dim holds data
            out[(*(slice(0, s) for s in corner[:dim]), slice(size, total))].zero_()


def _probe_operands(dtype: torch.dtype, rows: tuple[int, int], cols: tuple[int, int], draw: int = 0
                    ) -> tuple[Tensor, Tensor]:
    """Seeded probe operands [R, K] and [N, K] in ``dtype``: standard normal (``_seeded_randn``) for fp32; for bf16
    made ``host_guard.order_revealing`` (a bf16 output otherwise hides another accumulation order). ``draw``: which
    of a probe's independent draws (``_seeded_randn``)."""
    a, b = _seeded_randn(rows, cols, draw=draw)
    if dtype != torch.float32:
        a, b = order_revealing(a, b, ARRANGEMENT_PROBE_SEED + draw)
    return a.to(dtype), b.to(dtype)


def _seeded_randn(*shapes: tuple[int, ...], draw: int = 0) -> list[Tensor]:
    """Standard normal tensors of ``shapes``, drawn in order from one generator seeded ``ARRANGEMENT_PROBE_SEED``
    (+ ``draw``: a probe's further independent draws, ``VIEW_PROBE_OUTPUTS``)."""
    gen = torch.Generator().manual_seed(ARRANGEMENT_PROBE_SEED + draw)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


# --------------------------------------------------------------------------- x @ W.T: a linear layer's rows
_DTYPE_PLANS: dict[tuple, torch.dtype] = {}
DTYPE_PLANS_MAX = 4096
"""Entries ``tiled_dtype`` keeps (then it starts afresh): one per (guard state, dtype, K, N, op, thread count); and
as many for ``_views_plan``'s answers."""


def _asked_once(answers: dict[tuple, object], key: tuple, host: HostGuard, ask: Callable[[], object]) -> object:
    """``ask()``, a question to the guard, answered once per ``key`` (whose first entry is ``host.epoch``: the guard's
    state) and kept in ``answers``, at most ``DTYPE_PLANS_MAX`` of them (then afresh). Kept under the epoch after
    asking: a check made in asking may change it."""
    if key in answers:
        return answers[key]
    answer = ask()
    if len(answers) >= DTYPE_PLANS_MAX:
        answers.clear()
    answers[(host.epoch, *key[1:])] = answer
    return answer


def tiled_dtype(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> torch.dtype:
    """The dtype ``tiled_matmul`` computes x [M, K] @ weight [N, K].T in, for x and weight in their own dtypes: theirs
    where both are bf16 and the guard admitted the host's bf16 GEMM for the canonical class (K, N padded, the weight
    transposed and shared by every tile; or once per tile in the layout the weight is stored in, where
    ``operand_per_tile``), else fp32. The caller passes x in that dtype.

    The guard's answer is kept per (guard state: ``HostGuard.epoch``, dtype, K, N, the weight's layout, op, thread
    count), as ``tiled_matmul`` keeps its plans: the same answer, asked once."""
    dtype = x.dtype
    if dtype != weight.dtype or dtype not in LIBRARY_DTYPES:  # (compute_dtype's own first answer, without asking)
        return torch.float32
    row_major = stored_row_major(weight)
    key = (host.epoch, dtype, x.shape[1], weight.shape[0], row_major, op, torch.get_num_threads())

    def ask() -> torch.dtype:
        k, n_pad = x.shape[1], ceil_to(weight.shape[0], COL_BLOCK)
        shared, transposed = canonical_class(weight, dtype, k, n_pad)
        return host.compute_dtype(dtype, gemm_class(k, n_pad, transposed=transposed), shared, op)
    return _asked_once(_DTYPE_PLANS, key, host, ask)


@dataclass(frozen=True)
class TiledPlan:
    """``tiled_matmul``'s decisions for one call key, made once: which arrangement runs (``TILED_ARRANGEMENTS``), its
    tile height and count, and the right operand where it can be held -- ``run(x, weight, host, loops)`` then does
    only the per-call work (x's padding, the GEMM call(s), the slice).

    A plan is a cache of decisions, nothing more: it is made by the very code that decided on every call before
    (``_tiled_plan``), from the same questions to the guard, and is used only where every input of those decisions
    is what it was (the call key: x's shape and dtype; the weight's identity, shape, strides, data pointer and dtype;
    the guard's state, ``HostGuard.epoch``; the op; the thread count; whether the compiled loops and oneDNN are on;
    which ``torch.bmm`` is installed). No decision reads the weight's values, so a plan outlives an in-place update
    of the weight (a training step's new version: the same decisions, made once per weight and call shape rather than
    once per step); what it holds for one version does not. So no bit depends on whether a plan was made or found
    (``tests/kernels/test_tiled_plans.py``).

    The operands it keeps (the weight's own memory, detached: a plan holds no reference to the weight, so the weight
    is freed as before; or the layout ``arranged_weight`` keeps for this weight version; a packed weight) are made at
    the first call on each weight version and kept in ``_WeightPlans.held``, which a new version empties; an operand
    laid out per call (beyond ``ARRANGED_BYTES_MAX``, or a weight whose gradient is being recorded) is made per
    call. Plans are kept per weight (``_PLANS``: dropped with the weight), at most ``PLANS_PER_WEIGHT`` each."""

    arrangement: str
    block: int
    blocks: int
    run: Callable[[Tensor, Tensor, HostGuard, object], Tensor]
    any_rows: bool = False
    """Whether ``run`` takes x [..., K] as it is (and returns [..., n]), not only its rows [M, K]: a plan that switches
    to a weight packed once (``_packed_after_use``), whose compiled call copies x's rows itself (``packed_linear``)."""
    packed: PackedLinear | None = None
    """The packed GEMM the plan switches to (``_packed_after_use``), where it has one: what ``fused_linears`` needs to
    run it on several weights packed as one."""
    laid_out: LaidOutLinear | None = None
    """A ``laid out`` plan's canonical call of a decode step's tiles, where it is one GEMM call on the weight as stored:
    what ``fused_linears`` needs to run it on several weights laid out as one (where not every weight's plan packs)."""


PACKED_CALLS = ("rows", "tiles", "each tile")
"""How ``PackedLinear.call`` gives x's padded rows to oneDNN's linear: stacked, [T x block, K], in one call; as the
tiles [T, block, K] in one call; one call per tile [block, K] (calls of one fixed shape whatever the row count: what a
host whose GEMM's bits follow the rows in a call gives each tile the one-tile call's bits by construction)."""


@dataclass(frozen=True)
class _WeightCall:
    """A plan's GEMM on a forward's weight, described for a call on several weights stacked as one
    (``fused_linears``): ``blocks`` tiles of ``block`` rows against the weight's operand [N_pad, K] in ``dtype``, its
    first ``n`` of ``n_pad`` columns kept; ``form``: which call of the plan it is."""

    form: str
    dtype: torch.dtype
    block: int
    blocks: int
    n: int
    n_pad: int

    def operand(self, weight: Tensor) -> Tensor:
        """The weight's operand [N_pad, K] in the plan's dtype (the canonical operand's matrix)."""
        return canonical_operand(weight, self.dtype, self.n_pad)[0].t()


@dataclass(frozen=True)
class PackedLinear(_WeightCall):
    """A plan's GEMM on the weight packed once (``_packed_run``): oneDNN's linear on x padded to the tiles (given to
    it as ``calls`` says: ``PACKED_CALLS``) against the weight's ``operand`` packed. ``form``: what ``_packed_agrees``
    compares it with (``PACKED_FORMS``)."""

    calls: str

    def agrees(self, k: int) -> bool:
        """Whether the packed call gives the plan's own bits (``_packed_agrees``: checked once per key)."""
        return _packed_agrees(self.form, self.blocks, self.block, k, self.n_pad, self.dtype)

    @property
    def packed_form(self) -> tuple:
        """``arranged_weight``'s form of the packed weight: one per (dtype, N_pad), whatever the plan's rows."""
        return "onednn packed", self.dtype, self.n_pad

    def prepared(self, matrix: Tensor) -> Tensor:
        """``matrix`` [N, K] (operands stacked) as the plan's call multiplies it: packed once."""
        return onednn_packed(matrix)

    def loop_arguments(self) -> tuple[int, bool]:
        """How the compiled calls (``packed_linear``, ``packed_linears``) are told ``calls``: (tiles, one call each)."""
        return (0 if self.calls == PACKED_CALLS[0] else self.blocks), self.calls == PACKED_CALLS[2]

    def call(self, x: Tensor, packed: Tensor) -> Tensor:
        """The packed call on x's rows [M, K]: padded to the plan's tiles (``_padded_rows``), then oneDNN's linear on
        ``packed`` over them as ``calls`` says -> [blocks x block, N] (every column ``packed`` has)."""
        return packed_calls(_padded_rows(x, self.blocks * self.block), packed, self.blocks, self.calls)


@dataclass(frozen=True)
class LaidOutLinear(_WeightCall):
    """A ``laid out`` plan's GEMM in form ``one tile`` or ``one call`` (``_laid_out_tiles``: one ``mm`` of the tile,
    or one ``bmm`` of the tiles, on the weight's ``operand`` seen as a transposed batch, ``stored_operand``), as
    ``fused_linears`` runs it on several weights laid out as one; ``whole_tiles`` as the plan runs its tiles
    (``_column_blocks_agree``)."""

    whole_tiles: bool

    def packed(self) -> PackedLinear:
        """The same tiles on the weight packed once, one oneDNN call per tile (form ``canonical call``: checked
        against this call's bits before use, ``PackedLinear.agrees``): what a group of weights too small to pack
        alone over several tiles runs where their concatenation is large enough (``fused_linears``)."""
        return PackedLinear(PACKED_FORMS[2], self.dtype, self.block, self.blocks, self.n, self.n_pad, PACKED_CALLS[2])

    def agrees(self, k: int) -> bool:
        """The plan's own form was checked against the canonical call when it was made (``_laid_out_agrees``)."""
        return True

    def prepared(self, matrix: Tensor) -> Tensor:
        """``matrix`` [N, K] (operands stacked) as the plan's call multiplies it: a transposed batch [1, K, N], once
        per tile for ``one call`` (``per_tile_operand``)."""
        operand = transposed_batch(matrix.t().unsqueeze(0))
        return per_tile_operand(operand, self.blocks) if self.form == LAID_OUT_FORMS[1] else operand

    def call(self, x: Tensor, prepared: Tensor) -> Tensor:
        """The plan's call on x's rows [M, K] against ``prepared`` -> [M, N] (every column ``prepared`` has)."""
        return _laid_out_tiles(x, prepared, self.block, self.blocks, prepared.shape[2], self.form,
                               whole_tiles=self.whole_tiles)


def packed_calls(rows: Tensor, packed: Tensor, blocks: int, calls: str) -> Tensor:
    """oneDNN's linear on ``packed`` over ``rows`` [blocks x block, K] given to it as ``calls`` says
    (``PACKED_CALLS``) -> [blocks x block, N]: the op calls of ``PackedLinear.call`` and of the first-use checks."""
    if calls == PACKED_CALLS[0]:
        return onednn_linear(rows, packed)  # 2-D in, 2-D out: no view to make per call
    if calls == PACKED_CALLS[1]:
        return onednn_linear(rows.view(blocks, -1, rows.shape[1]), packed).view(rows.shape[0], -1)
    tiles = [onednn_linear(tile, packed) for tile in rows.chunk(blocks)]
    return tiles[0] if blocks == 1 else torch.cat(tiles)


TILED_ARRANGEMENTS = ("stacked, weight as given", "stacked", "laid out", "compiled tiles", "tiles")
"""``TiledPlan.arrangement``: the tiles stacked into one GEMM on the weight as stored, or on the canonical operand;
the tiles on the operand as ``bmm`` lays it out; the canonical tiles in one compiled call; the canonical tiles through
the guard's ``bmm`` (``tiled_matmul``)."""
PLANS_PER_WEIGHT = 64
"""Plans kept per weight (then its plans start afresh): one per (rows, dtype, op, thread count, ...) seen -- a decode
loop needs a few, a training step one per leaf shape and direction, kept from one step's weight version to the
next."""


class _WeightPlans:
    """One weight's plans, and what they keep for its current ``version`` (``held``: operands laid out from it, packed
    runs; emptied when the version moves on, so nothing laid out from an older version is used or kept); dropped with
    the weight (a weak reference's callback)."""

    __slots__ = ("owner", "version", "plans", "held")

    def __init__(self, owner: Tensor, version: int):
        self.owner = weakref.ref(owner, functools.partial(_forget, _PLANS, id(owner)))
        self.version = version
        self.plans: dict[tuple, TiledPlan] = {}
        self.held: dict[int, object] = {}


_PLANS: dict[int, _WeightPlans] = {}  # id(weight owning its storage) -> its plans (a dict by id: a weak-keyed
# dictionary's lookup cost more than the rest of a warm call)


def _forget(plans: dict[int, _WeightPlans], key: int, ref: weakref.ref) -> None:
    """A weight's plans go with it (its weak reference's callback; a new weight under the same id keeps its own).
    ``plans`` is ``_PLANS``, bound in the callback: a weight that outlives the module's globals (one held by a
    script's own globals, freed at interpreter exit) still finds it."""
    kept = plans.get(key)
    if kept is not None and kept.owner is ref:
        del plans[key]


def tiled_matmul(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] through [R, K] x [K, N_pad] GEMM tiles, R = ``row_block(M)``, in x's dtype:
    fp32, or bf16 where ``tiled_dtype`` says so (the weight is cast to it; a bf16 GEMM rounds each output once).

    Canonically one ``host.bmm`` over ceil(M / R) zero-padded row tiles, the (transposed, column-padded) weight
    shared by every tile: each output element's K-reduction runs through the same GEMM kernel whatever M is (BLAS
    or oneDNN where the probe passed, else the fixed-order GEMM). Both operands are contiguous and aligned, as in the
    probe, so a view into a larger tensor never reaches the GEMM.

    Where the class runs torch's own GEMM: the tiles stacked into one GEMM where the guard found their bits
    (``_stacked_agrees``) -- first on the weight as given, where it is row-major already (an input gradient's W,
    whose canonical operand is its transposed copy) -- else the canonical steps in one compiled call.

    The choice is made once per call key and kept (``TiledPlan``): a repeated call of one class looks its plan up
    and runs the GEMM."""
    if x.shape[0] == 0:  # an empty batch of rows: nothing to arrange (a plan's tile count would be 0)
        return x.new_empty(0, weight.shape[0])
    loops = compiled_loops.library()
    plan = kept_plan(x, weight, host, op, loops)
    if plan is None:  # a plan for this call alone
        plan = _tiled_plan(x, weight, host, op, loops, held=None)
    return plan.run(x, weight, host, loops)


def kept_plan(x: Tensor, weight: Tensor, host: HostGuard, op: str, loops: object) -> TiledPlan | None:
    """``tiled_matmul``'s plan for this call, found or made and kept for the weight (``_PLANS``); None where none is
    kept: an inference tensor (no version counter to key a plan on) or a weight whose GEMM autograd records (the
    GEMM on the weight itself, per call). ``loops``: ``compiled_loops.library()``."""
    owner = weight._base
    if owner is None:
        owner = weight
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor
        return None
    if weight.requires_grad and torch.is_grad_enabled():
        return None
    key = (host.epoch, op, x.shape, x.dtype, weight.shape, weight.stride(), weight.data_ptr(), weight.dtype,
           torch.get_num_threads(), plan_switches(x.dtype, loops))
    kept = _PLANS.get(id(owner))
    if kept is None or kept.owner() is not owner:  # a new weight
        kept = _PLANS[id(owner)] = _WeightPlans(owner, version)
    elif kept.version != version:  # a new version of it: its plans stay, what they held for the last version goes
        kept.version = version
        kept.held.clear()
    if (plan := kept.plans.get(key)) is not None:
        return plan
    if len(kept.plans) >= PLANS_PER_WEIGHT:
        kept.plans.clear()
        kept.held.clear()
    plan = _tiled_plan(x, weight, host, op, loops, kept.held)
    kept.plans[(host.epoch, *key[1:])] = plan  # the epoch after deciding (a check made in asking may change it)
    return plan


def plan_switches(dtype: torch.dtype, loops: object) -> tuple:
    """The process switches a plan's choice reads, part of its key: whether the compiled loops are built
    (``loops``: ``compiled_loops.library()``), the installed ``torch.bmm``, and for bf16 oneDNN's switch
    (``bmm_copies_operand``'s)."""
    return loops is None, torch.bmm, dtype == torch.bfloat16 and torch.backends.mkldnn.enabled


def tiled_rows(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> int:
    """The rows ``tiled_matmul`` multiplies for x [M, K] @ weight [N, K].T (x in the dtype ``tiled_dtype`` gives):
    M padded to whole tiles of the height the guard allows for the class (``row_block``). A benchmark's question --
    what the padding costs on a host whose GEMM keeps a row's bits only at taller tiles; it asks the guard as
    ``tiled_matmul`` does (the same probes at first use) and computes nothing."""
    plan = _tiled_plan(x, weight, host, op, compiled_loops.library(), held=None)
    return plan.block * plan.blocks


def _held(weight: Tensor, operand: Tensor) -> bool:
    """Whether ``operand`` is the weight's own memory or a layout ``arranged_weight`` keeps for it (which a plan may
    hold without holding more than ``ARRANGED_BYTES_MAX``)."""
    ptr = operand.untyped_storage().data_ptr()
    if ptr == weight.untyped_storage().data_ptr():
        return True
    owner = weight if weight._base is None else weight._base
    return any(not t.is_mkldnn and ptr == t.untyped_storage().data_ptr()  # (a packed weight: opaque, no storage)
               for _, t in _ARRANGED.get(owner, {}).values())


_SLOTS = itertools.count()
"""Keys of ``_WeightPlans.held``: one per operand (or packed run) a plan keeps for the weight's current version."""


def _operand_of(weight: Tensor, get: Callable[[Tensor], Tensor], held: dict | None) -> Callable[[Tensor], Tensor]:
    """weight -> the operand ``get(weight)``: made once per weight version and kept (detached) in ``held`` (the
    weight's ``_WeightPlans.held``, which ``tiled_matmul`` empties when the version moves on) where ``_held`` allows,
    else made per call (``held`` None: a plan made for one call)."""
    if held is None or not _held(weight, operand := get(weight)):
        return get
    slot = next(_SLOTS)
    held[slot] = operand.detach()

    def this_version(w: Tensor) -> Tensor:
        operand = held.get(slot)
        if operand is None:  # the first call on a new version of the weight: laid out from it again
            operand = get(w)
            if _held(w, operand):
                held[slot] = operand = operand.detach()
        return operand
    return this_version


def _tiled_plan(x: Tensor, weight: Tensor, host: HostGuard, op: str, loops: object, held: dict | None
                ) -> TiledPlan:
    """The decisions of ``tiled_matmul`` for this call (the guard's questions, the arrangement, the tile height), as a
    ``TiledPlan``; ``held``: where the plan may keep its operands for the weight's current version
    (``_operand_of``), None for a plan made for one call."""
    rows, k = x.shape
    n = weight.shape[0]
    n_pad = ceil_to(n, COL_BLOCK)
    dtype = x.dtype
    shared, transposed = canonical_class(weight, dtype, k, n_pad)
    per_tile = not shared
    given = weight.t()  # [K, N]: an input gradient's weight W, contiguous, which the canonical operand copies
    if (loops is not None and n_pad == n and dtype == weight.dtype and given.is_contiguous()
            and given.data_ptr() % ALIGNMENT == 0 and rows * k * n <= STACKED_MACS_MAX):
        if (record := host.library_gemm(dtype, gemm_class(k, n, transposed=transposed), shared, op)) is not None:
            block = row_block(rows, record.tile_heights)
            blocks = -(-rows // block)
            if _stacked_agrees(blocks, block, k, n, transposed=transposed, row_major=True, host=host, op=op,
                               dtype=dtype, per_tile=per_tile):
                as_given = _operand_of(weight, lambda w: w.t(), held)  # (the operand [1, K, N]'s matrix)
                apart = _last_tile_apart(rows, blocks, block, k, n, transposed=transposed, row_major=True, host=host,
                                         op=op, dtype=dtype, per_tile=per_tile)

                def stacked_as_given(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                    return _stacked_mm(x, as_given(w), blocks * block, n, apart)
                return TiledPlan(TILED_ARRANGEMENTS[0], block, blocks, stacked_as_given)

    def canonical() -> Callable[[Tensor], Tensor]:  # the canonical operand [1, K, N_pad], in the class's layout
        if per_tile:
            return _operand_of(weight, lambda w: stored_operand(w, dtype, n_pad), held)
        return _operand_of(weight, lambda w: canonical_operand(w, dtype, n_pad), held)

    # the class of the canonical operand [1, K, N_pad]: the weight transposed (and padded, cast), a K-contiguous view;
    # or, once per tile, row-major where the weight is stored so (an input gradient's W)
    if (record := host.library_gemm(dtype, gemm_class(k, n_pad, transposed=transposed), shared, op)) is not None:
        block = row_block(rows, record.tile_heights)
        blocks = -(-rows // block)
        # bf16: one tile too (the host's bf16 bmm took 4x as long as its matmul on a shared, transposed operand)
        if (loops is not None and (blocks > 1 or dtype != torch.float32)
                and blocks * block * k * n_pad <= STACKED_MACS_MAX
                and _stacked_agrees(blocks, block, k, n_pad, transposed=transposed and k > 1, row_major=False,
                                    host=host, op=op, dtype=dtype, per_tile=per_tile)):
            of = stored_operand if per_tile else canonical_operand
            matrix = _operand_of(weight, lambda w: of(w, dtype, n_pad)[0], held)
            apart = _last_tile_apart(rows, blocks, block, k, n_pad, transposed=transposed and k > 1, row_major=False,
                                     host=host, op=op, dtype=dtype, per_tile=per_tile)

            def stacked(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                return _stacked_mm(x, matrix(w), blocks * block, n, apart)
            packs = (held is not None and dtype == torch.bfloat16 and not stored_row_major(weight)
                     and _packable(k, n_pad, dtype, blocks * block))
            packed = PackedLinear(PACKED_FORMS[0], dtype, block, blocks, n, n_pad, PACKED_CALLS[0]) if packs else None
            if packed:  # (bf16's torch.mm is oneDNN's GEMM; a forward's weight, not an input gradient's W)
                stacked = _packed_after_use(stacked, packed, k, held)
            return TiledPlan(TILED_ARRANGEMENTS[1], block, blocks, stacked, any_rows=packs, packed=packed)
        if per_tile and (plan := _laid_out_plan(weight, dtype, k, n, n_pad, block, blocks, transposed, held)):
            return plan
        if loops is not None and shared:  # the library GEMM: the steps below in one compiled call, on the same operands
            operand = canonical()

            def compiled_tiles(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                return loops.tiled_matmul(x, operand(w), block, n)
            return TiledPlan(TILED_ARRANGEMENTS[3], block, blocks, compiled_tiles)
    if per_tile and (record := host.single_thread_gemm(dtype, gemm_class(k, n_pad, transposed=transposed), shared,
                                                         op)) is not None:
        # a class the guard runs with 1 thread (``blas-1-thread``: an Intel host's bf16 GEMMs at 2 threads): the
        # canonical call's forms as above, each GEMM on one thread, so the canonical call's once-per-tile operand is
        # laid out once per weight version or not at all (its copy per call was most of llama100m's bf16 input
        # gradients on that host)
        block = row_block(rows, record.tile_heights)
        blocks = -(-rows // block)
        if plan := _laid_out_plan(weight, dtype, k, n, n_pad, block, blocks, transposed, held, one_thread=True):
            return plan
    operand = canonical()
    block = row_block(rows, host.tile_heights(dtype, operand(weight), shared, op))
    blocks = -(-rows // block)

    def tiles(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
        x = _padded_or_aligned(x, (blocks * block, k)).view(blocks, block, k)
        right = per_tile_operand(operand(w), blocks) if per_tile else operand(w).expand(blocks, k, n_pad)
        out = host.bmm(x, right, op=op, shared_operand=shared).view(blocks * block, n_pad)
        return out[:rows] if n_pad == n else out[:rows, :n]
    packs = (held is not None and shared and _packable(k, n_pad)
             and host.onednn_gemm(dtype, operand(weight), shared, op) is not None)
    packed = PackedLinear(PACKED_FORMS[1], dtype, block, blocks, n, n_pad, PACKED_CALLS[1]) if packs else None
    if packed:
        tiles = _packed_after_use(tiles, packed, k, held)
    return TiledPlan(TILED_ARRANGEMENTS[4], block, blocks, tiles, any_rows=packs, packed=packed)


def _laid_out_plan(weight: Tensor, dtype: torch.dtype, k: int, n: int, n_pad: int, block: int, blocks: int,
                   transposed: bool, held: dict | None, one_thread: bool = False) -> TiledPlan | None:
    """The ``laid out`` plan of an ``operand_per_tile`` class (``_laid_out_tiles`` in its form, on
    ``laid_out_operand``) where the first-use check found the form's bits the canonical call's
    (``_laid_out_agrees``), else None. ``one_thread``: a ``blas-1-thread`` class, every GEMM on one thread. A decode
    step's call (one tile, or a few) runs on the weight packed once after ``PACK_AFTER_CALLS`` calls, one oneDNN call
    per tile, where ``_packable`` and the first-use check (``_packed_agrees``, form ``canonical call``) allow."""
    form = _laid_out_form(blocks, k, n_pad)
    if not _laid_out_agrees(block, k, n_pad, dtype, form, transposed, one_thread=one_thread):
        return None
    laid = _operand_of(weight, lambda w: laid_out_operand(w, dtype, n_pad, blocks, form), held)
    # a tile's GEMM in column blocks only where they, too, give the canonical call's bits (else whole tiles)
    whole_tiles = form != LAID_OUT_FORMS[1] and not _column_blocks_agree(block, k, n_pad, dtype, transposed,
                                                                         one_thread=one_thread)

    def rows_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [M, K] -> [M, n]
        return _laid_out_tiles(x, laid(w), block, blocks, n, form, one_thread=one_thread, whole_tiles=whole_tiles)

    def compiled_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K] -> [..., n]
        if loops is not None and (given := _loop_input(x, blocks * block)):
            # rows_run's steps in one compiled call (a decode step's: the same copy and bmm, the same bits)
            return loops.bmm_linears(x, given.buffer, laid(w), blocks, [n], [n_pad])[0]
        return _on_rows(rows_run, x, w, host, loops)
    compiled = form == LAID_OUT_FORMS[1] and not one_thread  # the canonical call itself: one bmm
    laid_out = compiled_run if compiled else rows_run
    forward = held is not None and not one_thread and not stored_row_major(weight)  # a forward's weight, kept
    # several tiles only on a weight of at least ONEDNN_MIN_WEIGHT elements: a smaller one's calls, one per tile, cost
    # more than the canonical call's one (the default model's 64 x 176 weights, 128 rows: 1.5x; llama100m's 576 x
    # 1536 ones, 2 to 5 tiles: 0.89-0.94x; the journal, session 59)
    packs = forward and (_packable(k, n_pad, dtype, block) if blocks == 1 else _packable(k, n_pad))
    packed = PackedLinear(PACKED_FORMS[2], dtype, block, blocks, n, n_pad, PACKED_CALLS[2]) if packs else None
    if packed:
        # a decode loop's tiles (where no stacked arrangement runs: a guard in mode ``canonical``, or a host whose
        # ``same_bits`` probe failed): oneDNN's linear on the weight packed once, one call per tile (calls of one
        # shape, whatever the rows), where it gives the canonical call's bits (the call oneDNN's bmm makes reorders
        # the weight every time: llama100m's LM head, 8 rows in a 48-row tile, bf16, on an Intel Xeon with AMX: 10.6
        # ms a call unpacked, 4.4 packed, the journal, session 38; the default model's 128 rows in two 64-row tiles,
        # session 59)
        laid_out = _packed_after_use(laid_out, packed, k, held)
    call = None  # (also where the plan packs: a group of weights some of which pack and some not fuses as this call)
    if forward and form != LAID_OUT_FORMS[2]:
        call = LaidOutLinear(form, dtype, block, blocks, n, n_pad, whole_tiles)
    return TiledPlan(TILED_ARRANGEMENTS[2], block, blocks, laid_out, any_rows=packs or compiled, packed=packed,
                     laid_out=call)


# --------------------------------------------------------------------------- oneDNN's GEMM on a weight packed once
PACK_AFTER_CALLS = 16
"""Calls of one plan (one weight version, one call shape: a decode loop's steps) after which a GEMM that runs oneDNN's
linear (an fp32 class on ``onednn_rows``; a bf16 class's ``stacked`` arrangement, whose ``torch.mm`` is oneDNN's; a
bf16 ``operand_per_tile`` class's canonical call, whose ``bmm`` is oneDNN's) runs it on the weight packed once
(``host_guard.onednn_packed``) instead of the weight as stored. Packing costs about as much as 10-45 calls save (on an
Intel Xeon with AMX: 0.2-0.55 ms per llama100m layer weight, 25-45 ms for its LM head, against about 1 ms saved per LM
head call; ``vexact bench decode_profile --gemm``), so a weight version pays for it only over a rollout's many steps:
a rollout of fewer steps packs nothing, a longer one repays the layers' packing within 10-15 further steps and the LM
head's within 25-45; a training step alone (one forward per version) never packs, but one that follows a rollout on
the same weight version (the RL step's scoring and update) runs on what the rollout packed (``_packed_after_use``)."""
PACKED_FORMS = ("stacked", "tiles", "canonical call")
"""What ``_packed_agrees`` compares the packed call with: the ``stacked`` arrangement's one ``torch.mm``, the
canonical tiles' oneDNN linear on the weight as stored (``tiles``, an fp32 ``onednn_rows`` class), or the canonical
call of the tiles of an ``operand_per_tile`` class (``canonical call``: one ``bmm`` of the tiles, the weight as stored
once per tile, a transposed batch; the packed call one per tile)."""
_PACKED_CHECKS: dict[tuple, bool] = {}


def _packable(k: int, n_pad: int, dtype: torch.dtype = torch.float32, rows: int = 0) -> bool:
    """Whether a class may run on a weight packed once: oneDNN's linear with its packing op here, and a weight of at
    least ``ONEDNN_MIN_WEIGHT`` elements (below it oneDNN's per-call overhead outweighs its kernel) -- or a bf16 GEMM
    of ``rows`` rows that torch runs on oneDNN already (``_onednn_bf16_bmm``), where packing only spares the per-call
    reorder of the weight (llama100m's k/v projections, 576 x 192: its bf16 decode step on an Intel Xeon with AMX
    took 0.95x its time unpacked at 1 thread, 0.98x at 2; the journal, session 34)."""
    if not onednn_packing():
        return False
    return k * n_pad >= ONEDNN_MIN_WEIGHT or _onednn_bf16_bmm(dtype, rows * k * n_pad)


def _packed_after_use(unpacked: Callable, plan: PackedLinear, k: int, held: dict) -> Callable:
    """A plan's run: ``unpacked`` for the first ``PACK_AFTER_CALLS`` calls on a weight version, then -- where
    ``plan.agrees(k)`` (the first-use check that the packed call gives the unpacked one's bits for the class) -- the
    packed run (``_packed_run``) made once per version (given the weight at that call: a plan holds no reference to
    it), or ``unpacked`` for the rest of the version where it makes none (no room under ``ARRANGED_BYTES_MAX``). From
    the first call where the weight is packed for this version already (by another plan of it: a decode loop's, whose
    version a training forward or a scoring pass then multiplies at other row counts): the packing costs nothing more.
    The count and the packed run are kept in ``held`` (the weight's ``_WeightPlans.held``: emptied with each new
    version). No bit depends on which ran."""
    slot = next(_SLOTS)

    def after_use(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K]
        state = held.get(slot)
        if state is None:  # this version's first call: [calls, the packed run]
            state = held[slot] = [0, None]
        if state[1] is None:
            state[0] += 1
            if ((state[0] <= PACK_AFTER_CALLS and _kept_operand(w, plan.packed_form) is None)
                    or not plan.agrees(k)):
                return _on_rows(unpacked, x, w, host, loops)
            state[1] = _packed_run(w, plan) or functools.partial(_on_rows, unpacked)
        return state[1](x, w, host, loops)
    return after_use


def _on_rows(run: Callable, x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
    """``run`` (a plan's run on rows [M, K]) on x [..., K]: on x's rows, its output viewed back as [..., n]."""
    if x.dim() == 2:
        return run(x, w, host, loops)
    out = run(x.reshape(-1, x.shape[-1]), w, host, loops)
    return out.view(*x.shape[:-1], out.shape[-1])


def _packed_run(weight: Tensor, plan: PackedLinear) -> Callable[[Tensor, Tensor, HostGuard, object], Tensor] | None:
    """The plan's GEMM on the weight packed once (laid out once per weight version, ``arranged_weight``): x padded to
    the plan's tiles as before, then oneDNN's linear as ``plan.calls`` says (``PACKED_CALLS``). None where the packed
    copy would not fit under ``ARRANGED_BYTES_MAX`` beside what is laid out already (a packed weight held by a plan
    counts against the bound as every laid-out operand does: a model bigger than the bound is not doubled silently)."""
    n, form = plan.n, plan.packed_form
    if _kept_operand(weight, form) is None and not _room_for(weight.numel() * plan.dtype.itemsize):
        return None
    packed = arranged_weight(weight, form, lambda: onednn_packed(plan.operand(weight)))
    if _kept_operand(weight, form) is not packed:  # (laid out, but over the bound after all: not kept)
        return None
    rows_padded = plan.blocks * plan.block
    tiles, each_tile = plan.loop_arguments()

    def run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K] -> [..., n]
        if loops is not None and (buffer := _kept_buffer(x, rows_padded)) is not None:
            # the steps below in one compiled call (a decode step's: the same copy and op calls, the same bits)
            return loops.packed_linear(x, buffer, packed, tiles, n, each_tile)
        return _on_rows(rows_run, x, w, host, loops)

    def rows_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
        rows = x.shape[0]
        out = plan.call(x, packed)
        if out.shape[1] != n:
            return out[:rows, :n]
        return out if rows == rows_padded else out[:rows]
    return run


def _packed_agrees(form: str, blocks: int, block: int, k: int, n_pad: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear on a weight packed once gives, for ``blocks`` tiles of ``block`` rows of the class (K,
    N_pad, ``dtype``) at the current thread count, the bits of the call it replaces (``PACKED_FORMS``): checked once
    per key on seeded operands (``_probe_operands``), as the canonical path's other forms are (``_checked_once``)."""

    def check() -> bool:
        x, w = _probe_operands(dtype, (blocks * block, k), (n_pad, k))
        packed = onednn_packed(w)
        if form == PACKED_FORMS[0]:
            return torch.equal(onednn_linear(x, packed), torch.mm(x, w.t()))
        if form == PACKED_FORMS[2]:  # the canonical call, on the canonical operand [1, K, N_pad] of w [N_pad, K]
            operand = transposed_batch(w.t().unsqueeze(0))  # (as ``stored_operand``)
            return torch.equal(packed_calls(x, packed, blocks, PACKED_CALLS[2]),
                               _canonical_tiles_call(x, operand, blocks, block))
        tiles = x.view(blocks, block, k)
        return torch.equal(onednn_linear(tiles, packed), onednn_linear(tiles, w))

    return _checked_once(_PACKED_CHECKS, (form, blocks, block, k, n_pad, dtype, torch.get_num_threads()), check)


def _stacked_agrees(blocks: int, block: int, k: int, n_pad: int, *, transposed: bool, row_major: bool,
                    host: HostGuard, op: str, dtype: torch.dtype = torch.float32, per_tile: bool = False,
                    last_apart: bool = False) -> bool:
    """Whether one GEMM over ``blocks`` stacked ``block``-row tiles gives the tiles' own bits (the one ``bmm`` call of
    ``tiled_matmul``, each tile multiplying the shared operand [1, K, N_pad], ``transposed`` or row-major; where
    ``per_tile``, the operand once per tile in that layout: ``per_tile_operand``) for this class on this host;
    ``row_major``: with the operand's values in the row-major layout (an input gradient's weight as it is, where the
    canonical operand is its transposed copy). A ``same_bits`` probe at first use per (tile count, tile height, K,
    N_pad, layouts, ``dtype``: fp32 or bf16), on seeded inputs (``_probe_operands``).

    The tiles keep a row's bits independent of the row count; one GEMM packs the shared operand once instead of
    once per tile (llama's LM head: a 113 MB weight, 5 tiles for 312 tokens), and the weight as it is saves a
    transposing copy of it. Where the library's result for a row would differ, the probe sees it and the tiles
    run.

    ``last_apart``: the same GEMM with its last tile in a GEMM of its own (``_split_mm``), for a call whose last tile
    is partial -- probed on ``blocks * block - 1`` rows (the last tile one row short, as the tiles zero-pad it)."""
    rows = blocks * block - (1 if last_apart else 0)

    def inputs(layout_transposed: bool) -> tuple[Tensor, Tensor]:
        x, w = _probe_operands(dtype, (blocks * block, k), (n_pad, k))  # w: the weight's values, [N_pad, K]
        x[rows:] = 0  # (the tiles' zero padding)
        return x, (w.t() if layout_transposed else w.t().contiguous()).unsqueeze(0)

    def tiles() -> Tensor:
        x, w = inputs(transposed)
        right = per_tile_operand(w, blocks) if per_tile else w.expand(blocks, k, n_pad)
        return torch.bmm(x.view(blocks, block, k), right).view(blocks * block, n_pad)[:rows]

    def stacked() -> Tensor:
        x, w = inputs(transposed and not row_major)
        if last_apart:
            return _split_mm(x[:rows], w[0], blocks * block, n_pad, block)
        return _stacked_matmul(x, w, blocks * block, n_pad)

    layout = ("transposed" if transposed else "row-major") + (" batch" if per_tile else "")
    given = ", the weight as given (row-major)" if row_major else ""
    name = "linear tiles stacked in one GEMM" + (", the last tile apart" if last_apart else "")
    return host.arrangement_agrees(name, f"{blocks}x{block} rows K={k} N={n_pad} {layout}{given} {_name(dtype)}",
                                   tiles, stacked, op)


def _last_tile_apart(rows: int, blocks: int, block: int, k: int, n_pad: int, *, transposed: bool, row_major: bool,
                     host: HostGuard, op: str, dtype: torch.dtype, per_tile: bool) -> int:
    """The tile height where a stacked GEMM of ``rows`` rows (a class whose ``_stacked_agrees`` passed) multiplies its
    last, partial tile apart (``_split_mm``), else 0: where that tile is partial and there are whole tiles before it,
    the weight is small (``APART_WEIGHT_BYTES_MAX``), the class fp32 and the guard found the split's bits the tiles'
    (the same probe, ``last_apart``). Not bf16: on the Intel Xeon with AMX every bf16 class's probe refused it (the
    last tile's GEMM at 2 threads gave other bits than at 1), so asking would only cost the probes."""
    if (blocks < 2 or rows % block == 0 or dtype != torch.float32 or k * n_pad * dtype.itemsize > APART_WEIGHT_BYTES_MAX
            or not _stacked_agrees(blocks, block, k, n_pad, transposed=transposed, row_major=row_major, host=host,
                                   op=op, dtype=dtype, per_tile=per_tile, last_apart=True)):
        return 0
    return block


def _stacked_matmul(x: Tensor, operand: Tensor, padded_rows: int, n: int) -> Tensor:
    """``tiled_matmul``'s tiles as one GEMM: x zero-padded to ``padded_rows`` (the tiles' rows) @ operand[0], sliced
    to [M, n]. Used only where ``_stacked_agrees`` found the tiles' bits."""
    return _stacked_mm(x, operand[0], padded_rows, n)


def _stacked_mm(x: Tensor, operand: Tensor, padded_rows: int, n: int, last_apart: int = 0) -> Tensor:
    """``_stacked_matmul`` on its operand's matrix [K, N_pad] (which a ``TiledPlan`` holds), the output sliced only
    where it has more rows or columns than [M, n]; ``last_apart`` (a tile height, from ``_last_tile_apart``): a
    partial last tile in a GEMM of its own (``_split_mm``)."""
    rows, k = x.shape
    if last_apart and rows % last_apart:
        return _split_mm(x, operand, padded_rows, n, last_apart)
    out = torch.mm(_padded_rows(x, padded_rows), operand)
    if out.shape[1] != n:
        return out[:rows, :n]
    return out if rows == padded_rows else out[:rows]


def _split_mm(x: Tensor, operand: Tensor, padded_rows: int, n: int, block: int) -> Tensor:
    """``_stacked_mm`` with its last, partial tile apart: one GEMM over the whole tiles where x holds them (no copy of
    their rows), one over the last tile zero-padded to ``block`` rows, each into its own rows of one output. Used only
    where ``_stacked_agrees(..., last_apart=True)`` found the tiles' bits."""
    rows, k = x.shape
    x = _aligned(x)
    body = rows - rows % block
    out = x.new_empty(padded_rows, operand.shape[1])
    torch.mm(x[:body], operand, out=out[:body])
    torch.mm(_zero_padded(x[body:], (block, k)), operand, out=out[body:])
    return out[:rows] if out.shape[1] == n else out[:rows, :n]


# --------------------------------------------------------------------------- weights laid out once per version
ARRANGED_BYTES_MAX = 1 << 32
"""Bytes (4 GiB): the most that laid-out weight operands (``arranged_weight``) hold at once in a process. A laid-out
operand is a copy of a weight (transposed, column-padded or cast to the GEMM's dtype): at most one per weight and
form, so training a model holds at most one extra copy of each linear weight (the input gradient's transposed copy;
the forward's operand is the weight itself), about the model's linear weights' size again; a decode loop's weights
packed once (``PACK_AFTER_CALLS``) count too. Beyond this bound new operands are laid out per call as before, and no
weight is packed (slower, the same bits): a 30B-parameter model's weights are not doubled silently."""

# weight (the tensor owning its storage: a view's base) -> {form: (version, operand)}; weakly keyed: gone with it
_ARRANGED = WeakIdKeyDictionary()


class _HeldBytes:
    """The bytes the operands in ``_ARRANGED`` hold, counted as they come and go (``_room_for`` asks on every operand
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
        self.add(-sum(operand.nbytes for _, operand in entries.values()))


_HELD_BYTES = _HeldBytes()


def arranged_weight(weight: Tensor, form: tuple, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, a GEMM operand laid out from ``weight`` (a copy), kept and reused while the weight is unchanged.

    Kept per weight and ``form`` (what ``make`` lays out), with the weight's view (shape, strides, offset, dtype,
    data pointer) and version counter (``Tensor._version``: every in-place write through autograd-visible ops bumps
    it: the optimizer's update, ``load_state_dict``, a ``copy_`` under no_grad) -- one version per form, the
    older one replaced. The operand's values are those of a fresh ``make()`` (the same copy made earlier), so no bit
    changes. Not seen: a write that bypasses the version counter (``param.data.copy_(...)``, which vexact never
    does); an inference tensor has no version counter and is laid out per call. ``make`` returning a view of the
    weight (nothing to copy) is not kept. Bounded by ``ARRANGED_BYTES_MAX``."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter to follow
        return make()
    if (kept := _kept_operand(weight, form)) is not None:
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
    if _room_for(out.nbytes):
        if entries is None:
            entries = _ARRANGED[owner] = {}
            _HELD_BYTES.owner_added(owner, entries)
        entries[key] = (version, out)
        _HELD_BYTES.add(out.nbytes)
    return out


def _room_for(nbytes: int) -> bool:
    """Whether an operand of ``nbytes`` fits beside the operands ``arranged_weight`` keeps now, under
    ``ARRANGED_BYTES_MAX``: the one test of the bound, for a laid-out operand and for a weight about to be packed."""
    return _HELD_BYTES.total + nbytes <= ARRANGED_BYTES_MAX


def _arranged_key(weight: Tensor, form: tuple) -> tuple:
    """``arranged_weight``'s key for an operand of ``form`` laid out from this view of a weight."""
    return form, tuple(weight.shape), weight.stride(), weight.storage_offset(), weight.dtype, weight.data_ptr()


def _kept_operand(weight: Tensor, form: tuple) -> Tensor | None:
    """The operand of ``form`` that ``arranged_weight`` keeps for this version of ``weight``'s view, else None."""
    owner = weight if weight._base is None else weight._base
    hit = _ARRANGED.get(owner, {}).get(_arranged_key(weight, form))
    try:
        return hit[1] if hit is not None and hit[0] == weight._version else None
    except RuntimeError:  # an inference tensor: nothing is kept for it
        return None


def canonical_operand(weight: Tensor, dtype: torch.dtype, n_pad: int) -> Tensor:
    """``tiled_matmul``'s canonical right operand [1, K, N_pad]: ``weight`` [N, K] cast to ``dtype``, zero-padded to
    ``n_pad`` rows, contiguous and aligned (``_padded_or_aligned``), seen transposed -- a view of the weight where
    nothing needs copying (a linear layer's forward), else laid out once per weight version (``arranged_weight``: an
    input gradient's W.T, a padded or cast weight)."""

    if (weight.dtype == dtype and weight.shape[0] == n_pad and weight.is_contiguous()
            and weight.data_ptr() % ALIGNMENT == 0):  # what make() gives (a view of the weight), without its Python
        return weight.detach().t().unsqueeze(0)

    def make() -> Tensor:
        w = weight.detach().to(dtype)
        return _padded_or_aligned(w, (n_pad, w.shape[1]))

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
    return _onednn_bf16_bmm(dtype, block * k * n_pad)


def _onednn_bf16_bmm(dtype: torch.dtype, macs: int) -> bool:
    """Whether torch 2.13's CPU ``bmm`` of ``macs`` multiply-adds per batch entry runs oneDNN's bf16 matmul (the rule
    ``bmm_copies_operand`` states); shared by it and ``operand_per_tile``, which tests replace apart."""
    return (dtype == torch.bfloat16 and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
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
    tile: ``_laid_out_tiles``). The class is a function of (dtype, K, N_pad, the weight's layout) and this torch build,
    never of the rows, so every call of a class has the same bits. (For a forward's weight this changed the canonical
    bits of bf16 linear layers on a host whose oneDNN rounds the two layouts apart; on the AMD EPYC host of the
    benchmarks they are the same bits. An input gradient's are those of the row-major copy on every host.)"""
    return _onednn_bf16_bmm(dtype, ROW_BLOCKS[-1] * k * n_pad)


def canonical_class(weight: Tensor, dtype: torch.dtype, k: int, n_pad: int) -> tuple[bool, bool]:
    """(shared, transposed): how ``tiled_matmul``'s canonical call of ``weight`` takes its operand [1, K, N_pad] --
    shared by every tile, or once per tile as stored (``operand_per_tile``) -- and whether in the transposed layout
    (else row-major: a per-tile class whose weight is stored so, ``stored_row_major``). The one derivation that
    ``tiled_dtype`` and ``tiled_matmul`` both ask the guard with."""
    per_tile = operand_per_tile(dtype, k, n_pad)
    return not per_tile, not (per_tile and stored_row_major(weight))


def stored_row_major(weight: Tensor) -> bool:
    """Whether ``tiled_matmul``'s ``weight`` [N, K] is stored as its transpose (an input gradient's W.T, a view of the
    contiguous W): its operand [K, N] is then row-major as stored. Else (a forward's W, contiguous) the operand is
    the weight seen transposed."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


def stored_operand(weight: Tensor, dtype: torch.dtype, n_pad: int) -> Tensor:
    """The canonical operand [1, K, N_pad] of an ``operand_per_tile`` class, in the layout the weight is stored in: a
    forward's weight [N, K] as a transposed batch (``transposed_batch`` of ``canonical_operand``: the weight itself,
    or its padded or cast copy laid out once per version); an input gradient's (``stored_row_major``) row-major, W
    itself, or its padded or cast copy laid out once per version (``arranged_weight``)."""
    if not stored_row_major(weight):
        return transposed_batch(canonical_operand(weight, dtype, n_pad))
    given = weight.t()
    if given.dtype == dtype and given.shape[1] == n_pad and given.data_ptr() % ALIGNMENT == 0:
        return given.unsqueeze(0)

    def make() -> Tensor:
        return _padded_or_aligned(given.detach().to(dtype), (given.shape[0], n_pad)).unsqueeze(0)

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
    """The operand ``_laid_out_tiles`` multiplies in ``form`` for ``tiles`` tiles of an ``operand_per_tile`` class:
    the canonical operand as stored, [1, K, N_pad] (``stored_operand``); for the canonical call itself (``one call``)
    that operand once per tile (``per_tile_operand``), laid out once per weight version and tile count
    (``arranged_weight``: a decode loop's steps, each the same tile count, copy nothing)."""
    operand = stored_operand(weight, dtype, n_pad)
    if form != LAID_OUT_FORMS[1]:
        return operand
    form_key = ("per tile", dtype, n_pad, tiles, operand_layout(operand))
    return arranged_weight(weight, form_key, lambda: per_tile_operand(operand, tiles))


LAID_OUT_CALL_MAX = 1 << 20
"""Elements. Several tiles of a ``operand_per_tile`` class (``_laid_out_tiles``): where the operand's copies
that the canonical call needs ((tiles - 1) x K x N_pad elements beyond the matrix itself) are at most this many, the
canonical call itself runs; above it, one GEMM per tile on the matrix itself (``_tile_gemms``). Measured on the
2-core AMD host, one thread, bf16, with ``mm`` per tile: the default model's layers (K, N <= 176; 62 tiles of 64 rows
for 3,968 tokens; about 7e5 elements) take 0.24 ms as one call against 1.1 ms as 62 calls (about 17 us per oneDNN
call); llama100m's (K = 576, N = 1536, 5 tiles; 3.5e6) 1.4 ms per tile against 1.7 ms as one call (plus 0.16 ms to
lay the copies out), and its LM head over 320 rows 61 ms against 57 (plus 130)."""
LAID_OUT_FORMS = ("one tile", "one call", "per tile")
"""``_laid_out_tiles``' forms: the one tile's call (on the matrix itself); several tiles in the canonical call (the
matrix once per tile); one call per tile on the matrix itself (``_tile_gemms``). Each is checked at first use
against the canonical call (``_laid_out_agrees``)."""


def _laid_out_form(blocks: int, k: int, n_pad: int) -> str:
    """Which of ``LAID_OUT_FORMS`` ``_laid_out_tiles`` runs for ``blocks`` tiles of a [K, N_pad] operand."""
    if blocks == 1:
        return LAID_OUT_FORMS[0]
    return LAID_OUT_FORMS[1] if (blocks - 1) * k * n_pad <= LAID_OUT_CALL_MAX else LAID_OUT_FORMS[2]


def _laid_out_tiles(x: Tensor, operand: Tensor, block: int, blocks: int, n: int, form: str,
                    one_thread: bool = False, whole_tiles: bool = False) -> Tensor:
    """``tiled_matmul``'s canonical tiles of an ``operand_per_tile`` class in ``form`` (``LAID_OUT_FORMS``) on
    ``laid_out_operand``: one tile, its GEMM as an ``mm`` on the operand's matrix as stored; several, the
    canonical call on that operand once per tile ([blocks, K, N_pad], ``LAID_OUT_CALL_MAX``) or one ``mm`` per tile
    on the operand's matrix as stored, [block, K] @ [K, N_pad] (``_tile_gemms``), as the guard's ``gemm_rows`` probe
    computes its reference rows (one 64-row tile), whose bits it found every tile count's rows to have.
    ``one_thread``: a class the guard runs with 1 thread (``blas-1-thread``), every GEMM on one thread.
    ``whole_tiles``: the GEMMs per tile never in column blocks (a class whose column blocks failed their first-use
    check, ``_column_blocks_agree``)."""
    rows, k = x.shape
    n_pad = operand.shape[2]
    tiles = _padded_rows(x, blocks * block).view(blocks, block, k)
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
    their count, which its first-use check (``_laid_out_agrees``) compares with the canonical call: spread by whole
    tiles (an even count) and by each column block count ``tile_column_blocks`` can give (an uneven one: a divisor
    of the threads), and, for a class that may run on every thread, one call after another."""
    blocks = {min(n, threads // math.gcd(tiles, threads)) for tiles in range(1, threads + 1)}  # 1 and each divisor
    ways = [(True, b) for b in sorted(blocks)]
    return tuple(ways if one_thread else [*ways, (False, 1)])


def _checked_once(checks: dict[tuple, bool], key: tuple, check: Callable[[], bool]) -> bool:
    """``check()``'s answer for ``key``, run at first use and kept in ``checks``: the first-use checks that the
    canonical arrangement's own faster forms (laid-out tiles, slabs shared between threads) give its bits. Forms of
    the canonical path, not ``same_bits`` arrangements, which ask the guard (``HostGuard.arrangement_agrees``) and
    which mode ``canonical`` never takes."""
    if (known := checks.get(key)) is None:
        known = checks[key] = check()
    return known


_LAID_OUT_CHECKS: dict[tuple, bool] = {}
LAID_OUT_CHECK_TILES = dict(zip(LAID_OUT_FORMS, (1, 2, 3)))
"""64-row tiles in ``_laid_out_agrees``' check per form: several where the form has several (three per tile: a count
two threads do not divide evenly)."""


def _laid_out_agrees(block: int, k: int, n_pad: int, dtype: torch.dtype, form: str, transposed: bool = True,
                     one_thread: bool = False) -> bool:
    """Whether ``_laid_out_tiles`` in ``form`` gives the canonical call's bits for this ``operand_per_tile`` class
    here (``transposed``: its operand a transposed batch, else row-major): checked once per (class, tile height,
    form, thread count) on seeded order-revealing operands (``_probe_operands``), ``LAID_OUT_CHECK_TILES`` tiles. The
    forms are the canonical call's own GEMM per tile, on the same operand layout, by whole tiles (their column
    blocks are checked apart: ``_column_blocks_agree``); this catches a torch whose ``bmm`` does otherwise, or a
    per-tile GEMM whose bits follow the threads (then the canonical call runs). ``one_thread``:
    a ``blas-1-thread`` class, whose canonical call and forms run every GEMM on one thread."""
    def check() -> bool:
        blocks = LAID_OUT_CHECK_TILES[form]
        x, operand, canonical = _laid_out_check_operands(blocks, block, k, n_pad, dtype, transposed, one_thread)
        if form == LAID_OUT_FORMS[1]:  # the canonical call on the operand laid out once per tile
            laid = per_tile_operand(operand, blocks)
            return torch.equal(canonical, _laid_out_tiles(x, laid, block, blocks, n_pad, form, one_thread=one_thread))
        # one GEMM per tile (or the one tile's): every way a call of any tile count can run whole tiles
        return _tile_gemm_ways_agree(canonical, x.view(blocks, block, k), operand, one_thread, column_blocks=False)

    key = (dtype, block, k, n_pad, form, transposed, one_thread, torch.get_num_threads())
    return _checked_once(_LAID_OUT_CHECKS, key, check)


def _laid_out_check_operands(blocks: int, block: int, k: int, n_pad: int, dtype: torch.dtype, transposed: bool,
                             one_thread: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(x [blocks x block, K], the operand [1, K, N_pad] in the class's layout, the canonical call's output
    [blocks x block, N_pad]) on seeded order-revealing operands (``_probe_operands``): what the laid-out forms'
    first-use checks compare."""
    x, w = _probe_operands(dtype, (blocks * block, k), (n_pad, k))
    operand = w.unsqueeze(0).transpose(1, 2) if transposed else w.t().contiguous().unsqueeze(0)
    return x, operand, _canonical_tiles_call(x, operand, blocks, block, one_thread)


def _canonical_tiles_call(x: Tensor, operand: Tensor, blocks: int, block: int, one_thread: bool = False) -> Tensor:
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


def _column_blocks_agree(block: int, k: int, n_pad: int, dtype: torch.dtype, transposed: bool = True,
                         one_thread: bool = False) -> bool:
    """Whether ``_tile_gemms``' GEMMs per tile in column blocks (each tile's GEMM as GEMMs of consecutive column
    blocks of the operand: how an uneven tile count gives the threads even shares) give the canonical call's bits
    for this ``operand_per_tile`` class here, as its whole tiles do (``_laid_out_agrees``, forms ``one tile`` and
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
    return _checked_once(_LAID_OUT_CHECKS, key, check)


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
    if dtype != torch.float32 and REDUCE_BLOCK < rows <= LIBRARY_REDUCE_MAX:
        return ceil_to(rows, REDUCE_BLOCK)
    block = MIN_REDUCE_BLOCK
    while block < min(rows, REDUCE_BLOCK):
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
    if a.dtype != b.dtype or a.dtype not in LIBRARY_DTYPES or rows > LIBRARY_REDUCE_MAX:  # (compute_dtype's answer)
        return torch.float32
    b_class = gemm_class(_reduction_block(rows, a.dtype), ceil_to(b.shape[1], COL_BLOCK), transposed=True)
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
as ``tiled_dtype`` keeps its own (``_asked_once``)."""


def _views_plan(rows: int, n: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> str | None:
    """``_views_arrangement(rows, n, k, dtype, host, op)``, asked once per key (``_VIEWS_PLANS``)."""
    key = (host.epoch, rows, n, k, dtype, op, torch.get_num_threads())
    return _asked_once(_VIEWS_PLANS, key, host, lambda: _views_arrangement(rows, n, k, dtype, host, op))


UNPADDED_TAIL, PADDED_TAIL = "unpadded tail", "padded tail"
"""``_views_arrangement``'s answers: the views with the last, partial chunk on its real rows, or zero-padded."""


def _views_arrangement(rows: int, n: int, k: int, dtype: torch.dtype, host: HostGuard, op: str) -> str | None:
    """How ``transposed_matmul`` runs a [rows, n].T @ [rows, k] reduction in ``dtype``: on views
    (``UNPADDED_TAIL`` / ``PADDED_TAIL``) where the guard found their bits the canonical tiles' (probed at first use),
    else None (the tiles)."""
    block = _reduction_block(rows, dtype)
    chunks = -(-rows // block)
    views_fit = chunks * min(n, VIEW_SLAB_ROWS) * k <= VIEW_PARTIALS_MAX
    # the views call torch's GEMM themselves: only where the canonical tiles' class runs it (their right operand,
    # [block, K_pad] per tile: K_pad rows of ``block`` tokens, the transposed layout)
    b_class = gemm_class(block, ceil_to(k, COL_BLOCK), transposed=True)
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
    b_class = gemm_class(length, ceil_to(k, COL_BLOCK), transposed=True)
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
    a, b = _rows_aligned(a), _aligned(b)  # so every chunk and slab view starts aligned too
    block, last = _slab_chunks(rows, a.dtype)
    chunks = -(-rows // block)
    tail_in_slabs = last == block or _chunk_in_slabs(last, k, a.dtype, host, op)
    width = min(n, VIEW_SLAB_ROWS)
    # every chunk in one call where their partial products fit, else (or where the last chunk runs its tiles) one
    # chunk at a time: the same GEMMs and the same tree
    at_once = tail_in_slabs and chunks * width * k <= VIEW_PARTIALS_MAX
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
        length = ceil_to(max(rows, 1), MIN_REDUCE_BLOCK)
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
    b_tail = _padded_or_aligned(b[tail_first:], (last, k))
    parts = a.new_empty(chunks, n, k) if out is None else out

    def products() -> None:
        for c in range(chunks):
            length = last if c == chunks - 1 else block
            a_rows = a[c * block : c * block + length]
            b_rows = b_tail if c == chunks - 1 else b[c * block : (c + 1) * block]
            for lo in range(0, n, SLAB_ROWS):
                region = a_rows[:, lo : lo + SLAB_ROWS]
                left = region if region.shape[0] == length else _zero_padded(region, (length, region.shape[1]))
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
    on seeded order-revealing inputs (``_probe_operands``) of as many chunks as the reduction has at most (bf16: one;
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
        tail = max(last - MIN_REDUCE_BLOCK + 1, block // 2 + 1) if last == block else last
        rows = tail if one_thread_reduction(dtype) or one_task else block + tail
        a_t, b_t = _probe_operands(dtype, (width, rows), (k, rows))  # the reduction over the tokens is their K
        a, b = _rows_aligned(a_t.t().contiguous()), _aligned(b_t.t().contiguous())  # as _reduction_slabs lays them
        alone = _with_threads(1, lambda: loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS))
        return torch.equal(loops.reduction_slab_mms(a, b, block, last, SLAB_ROWS, column_blocks=column_blocks), alone)

    wanted = min(threads, k) if pairs < SLAB_PAIRS_PER_THREAD * threads else 1
    for column_blocks in dict.fromkeys((wanted, 1)):
        one_task = pairs * column_blocks == 1
        key = (dtype, width, k, block, last, threads, column_blocks, one_task)
        if _checked_once(_SPREAD_CHECKS, key, lambda: check(column_blocks, one_task)):  # noqa: B023 (called at once)
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
    k_pad = ceil_to(k, COL_BLOCK)
    height = _reduction_tile_height(block, n, k_pad, a.dtype, host, op)
    last = last_chunk_length(rows, block, a.dtype)
    row_tiles = -(-n // height)
    if last < block:  # a short last chunk (``_short_last_chunk``)
        return _transposed_matmul_by_chunk(a, b, host, op, block)
    one_thread = one_thread_reduction(a.dtype)
    if chunks > 1 and row_tiles > 1 and (row_tiles - 1) * chunks * k_pad * block >= ROW_TILE_CALLS_FROM:
        return _transposed_matmul_by_row_tile(a, b, host, op, b_source, block, height, k_pad)
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
    out = host.bmm(a_tiles, b_tiles.transpose(1, 2), op=op, shared_operand=False, one_thread=one_thread)
    parts = out.view(chunks, row_tiles * height, k_pad)[:, :n, :k]
    return parts[0] if chunks == 1 else _tree_sum(parts, dim=0)


def _reduction_tile_height(block: int, n: int, k_pad: int, dtype: torch.dtype, host: HostGuard, op: str) -> int:
    """The row tile height over a weight gradient's N output rows for its chunk class (``block`` tokens, K_pad)."""
    b_class = gemm_class(block, k_pad, transposed=True)  # [block, K_pad] per tile: K_pad rows of ``block`` tokens
    return row_block(n, host.tile_heights(dtype, b_class, False, op, one_thread=one_thread_reduction(dtype)))


def _in_slabs(n: int, k: int, like: Tensor, slab: Callable[[int, int, Tensor | None], Tensor]) -> Tensor:
    """A weight gradient on views, [n, k], from ``slab(first, last, into)`` over its output rows cut into slabs of
    ``VIEW_SLAB_ROWS``: ``into`` is the output's rows for the slab, which the slab may write itself (returning them),
    else its result is copied there; None where one slab is the whole output (its own result, no copy)."""
    if n <= VIEW_SLAB_ROWS:
        return slab(0, n, None)
    out = like.new_empty(n, k)
    for first in range(0, n, VIEW_SLAB_ROWS):
        last = min(n, first + VIEW_SLAB_ROWS)
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
    or just over half of ``padded_to``). ``dtype``: fp32 or bf16 (``_probe_operands``, over the tokens). A class of
    fewer than ``VIEW_PROBE_OUTPUTS`` outputs compares several draws of those inputs."""
    padded_to = block if padded_to is None else padded_to
    whole = VIEW_PROBE_CHUNKS if block == REDUCE_BLOCK and dtype == torch.float32 else 0
    partial = padded_to // 2 + 1 if tail is None else tail
    draws = min(VIEW_PROBE_DRAWS_MAX, -(-VIEW_PROBE_OUTPUTS // (n * k)))

    def inputs(draw: int) -> list[Tensor]:
        rows = whole * block + partial
        if dtype == torch.float32:
            return _seeded_randn((rows, n), (rows, k), draw=draw)
        a_t, b_t = _probe_operands(dtype, (n, rows), (k, rows), draw)  # the reduction over the tokens is their K
        return [a_t.t().contiguous(), b_t.t().contiguous()]

    def every_draw(arrangement: Callable[..., Tensor]) -> Callable[[], Tensor]:
        return lambda: torch.cat([arrangement(*inputs(draw)).flatten() for draw in range(draws)])

    form = f"last chunk of {tail} rows unpadded" if tail is not None else (
        "last chunk padded" if padded_to == block else f"last chunk padded to {padded_to} rows")
    return host.arrangement_agrees(
        "weight gradient on views", f"block={block} N={n} K={k} {form} {_name(dtype)}",
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
    a, b = _aligned(a), _aligned(b)  # chunk starts are then aligned too (block * N * 4 bytes apart)
    whole, tail = divmod(rows, block)
    body = whole * block
    padded_to = last_chunk_length(rows, block, a.dtype) if tail and not unpadded_tail else tail
    loops = compiled_loops.library()
    if (loops is not None and a.dtype == b.dtype and a.dtype in compiled_loops.DTYPES and a.is_contiguous()
            and b.is_contiguous()):  # the calls below in one compiled call: the same at:: calls on the same views
        return loops.transposed_views(a, b, block, padded_to, unpadded_tail, VIEW_SLAB_ROWS)
    b_tail = _zero_padded(b[body:], (padded_to, k)) if padded_to > tail else b[body:]

    def slab(first: int, last: int, into: Tensor | None) -> Tensor:
        parts = a.new_empty(whole + (tail > 0), last - first, k)
        if whole:
            chunks = a[:body].view(whole, block, n)[:, :, first:last].transpose(1, 2)
            torch.bmm(chunks, b[:body].view(whole, block, k), out=parts[:whole])
        if tail:
            a_tail = a[body:, first:last]
            if padded_to > tail:
                a_tail = _zero_padded(a_tail, (padded_to, last - first))
            torch.bmm(a_tail.t().unsqueeze(0), b_tail.unsqueeze(0), out=parts[whole:])
            if unpadded_tail:
                parts[whole:].add_(0.0)
        return parts[0] if parts.shape[0] == 1 else _tree_sum(parts, dim=0, out=into)
    return _in_slabs(n, k, a, slab)


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
    k_pad, n_pad = ceil_to(k, COL_BLOCK), ceil_to(n, COL_BLOCK)
    b = _padded_operand(b, (batch, k_pad, n_pad), b_full)  # contiguous (when padded): the row-major layout
    block = row_block(rows, host.tile_heights(a.dtype, b[:1], False, op))
    row_tiles = -(-rows // block)
    a = _row_tiles(a, (batch, row_tiles * block, k_pad), a_full, block)
    out = host.bmm(a, _repeated(b, row_tiles), op=op, shared_operand=False).view(batch, row_tiles * block, n_pad)
    return out[:, :rows, :n]


def _row_tiles(a: Tensor, shape: tuple[int, int, int], full: Tensor | None, block: int) -> Tensor:
    """``batched_matmul``'s left operand: ``a`` zero-padded to ``shape`` [B, rows, K] in tiles [B * rows / block,
    block, K] -- what ``_padded_operand(a, shape, full).reshape(...)`` gives, made with fewer copies. With nothing to
    pad, that is a clone keeping ``a``'s strides, viewed as tiles where it can be (a strided operand: kept so), else
    copied contiguous: a contiguous, aligned ``a`` is taken as it is, and a transposed one (attention's p.T) is copied
    once by the compiled loops' blocked transpose (one copy instead of the clone and aten's element-wise transposing
    copy). The same values in the same layout: the same GEMM."""
    tiles = (shape[0] * shape[1] // block, block, shape[2])
    if _is_padded_operand(full, shape):
        return full.view(tiles)
    if tuple(shape) != tuple(a.shape):
        return _zero_padded(a, shape).view(tiles)  # a fresh contiguous copy
    if _is_padded_operand(a, shape):
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
