"""The exact CPU kernels' GEMM tiles: their shapes, where an arrangement pays, the ``same_bits`` probes' inputs, the
operands' padding and alignment, and the guard's answers and first-use checks kept once -- what every product's
module (``gemm_linear``, ``gemm_weight_gradient``, ``gemm_batched``) builds on. How the products use them:
``gemm_linear``'s overview.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import compiled_loops
from .host_guard import HostGuard, order_revealing

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


def dtype_label(dtype: torch.dtype) -> str:
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


def aligned_contiguous(t: Tensor) -> Tensor:
    """``t`` itself when contiguous and starting at an ``ALIGNMENT``-byte boundary (as every fresh torch CPU
    allocation does), else a fresh contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def rows_aligned(x: Tensor) -> Tensor:
    """A 2-D operand whose columns a GEMM may read on views: ``x`` itself where its rows are unit-stride, do not
    overlap and it starts on an ``ALIGNMENT``-byte boundary (a transposed view, or rows of a wider tensor), else
    ``aligned_contiguous``'s contiguous copy. One column: the same memory with column stride 1 (torch calls an [M, 1]
    tensor contiguous whatever its column stride, which is never read; the weight gradient's compiled slabs require 1,
    and a host's GEMM may pick its kernel by it -- so one layout, whatever the caller's)."""
    if x.shape[1] == 1 and x.stride(1) != 1:
        x = x.as_strided(x.shape, (x.stride(0), 1), x.storage_offset())
    if x.stride(1) == 1 and x.stride(0) >= x.shape[1] and x.data_ptr() % ALIGNMENT == 0:
        return x
    return aligned_contiguous(x)


def zero_padded(x: Tensor, shape: tuple[int, ...]) -> Tensor:
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


def padded_or_aligned(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A GEMM operand: ``x`` zero-padded to ``shape`` (a fresh copy), or ``x`` contiguous and aligned where it has
    that shape already (``aligned_contiguous``: itself, or a contiguous copy)."""
    return aligned_contiguous(x) if tuple(shape) == tuple(x.shape) else zero_padded(x, shape)


class _PaddedInputs(threading.local):
    """Per thread: the zero-padded GEMM inputs ``padded_rows_input`` reuses, one per (rows, K, dtype), each with the
    count of its leading rows the last call wrote."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, list] = {}


_PADDED_INPUTS = _PaddedInputs()
PADDED_INPUT_BYTES_MAX = 1 << 20
"""Bytes (1 MiB): the largest zero-padded input ``padded_rows_input`` keeps per thread and shape; a larger one (a
training call's tiles) is a fresh copy, whose allocation is small beside its copy."""
PADDED_INPUTS_MAX = 16
"""Buffers ``padded_rows_input`` keeps per thread at most (the oldest goes first): a decode loop needs one per layer
shape; ragged training calls would otherwise keep one per row count they padded to (at most 16 MiB a thread)."""


def padded_rows_input(x: Tensor, rows_padded: int) -> Tensor:
    """``padded_or_aligned(x, (rows_padded, K))`` for x [M, K]: the same values and layout, as the input of a GEMM
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
        return aligned_contiguous(x)
    if (buffer := kept_buffer(x, rows_padded)) is None:
        return zero_padded(x, (rows_padded, k))
    buffer[:rows].copy_(x)
    return buffer


class _LoopInput(NamedTuple):
    """How a compiled call takes x's rows padded to a plan's tiles: copied into ``buffer`` (``kept_buffer``), or as
    they are (``buffer`` None: they fill the tiles already)."""

    buffer: Tensor | None


def loop_input(x: Tensor, rows_padded: int) -> _LoopInput | None:
    """How a compiled call that pads x [..., K] to ``rows_padded`` rows itself takes them (``_LoopInput``); None where
    it cannot (rows to pad and no kept buffer: a fresh zero-padded copy, the Python steps' ``padded_rows_input``)."""
    buffer = kept_buffer(x, rows_padded)
    if buffer is None and x.numel() != rows_padded * x.shape[-1]:
        return None
    return _LoopInput(buffer)


def kept_buffer(x: Tensor, rows_padded: int) -> Tensor | None:
    """The buffer ``padded_rows_input`` keeps for x [M, K] (or [..., K]: its M rows) padded to ``rows_padded`` rows,
    ready for x's rows: its rows from M on zero (those a longer call wrote zeroed again), x's rows for the caller to
    copy in. None where it keeps none: nothing to pad, an input over ``PADDED_INPUT_BYTES_MAX``, grad mode on."""
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


def padded_operand(x: Tensor, shape: tuple[int, ...], full: Tensor | None) -> Tensor:
    """``x`` zero-padded to ``shape``: ``full`` itself where it is that tensor already (the caller's zero-padded
    buffer of which ``x`` is the leading corner, contiguous and aligned, as a fresh copy would be), else a copy
    (``zero_padded``: with nothing to pad, a clone that keeps ``x``'s strides, whose layout the guard then
    classes)."""
    return full if is_padded_operand(full, shape) else zero_padded(x, shape)


def is_padded_operand(full: Tensor | None, shape: tuple[int, ...]) -> bool:
    """Whether ``full`` may stand for a fresh padded operand of ``shape``: that shape, contiguous and aligned."""
    return (full is not None and tuple(full.shape) == tuple(shape) and full.is_contiguous()
            and full.data_ptr() % ALIGNMENT == 0)


def zero_outside(out: Tensor, corner: tuple[int, ...]) -> None:
    """Zero ``out`` everywhere but its leading ``corner`` (each element once)."""
    for dim, (size, total) in enumerate(zip(corner, out.shape)):
        if total > size:  # this dim's padding, where every earlier dim holds data
            out[(*(slice(0, s) for s in corner[:dim]), slice(size, total))].zero_()


def probe_operands(dtype: torch.dtype, rows: tuple[int, int], cols: tuple[int, int], draw: int = 0
                    ) -> tuple[Tensor, Tensor]:
    """Seeded probe operands [R, K] and [N, K] in ``dtype``: standard normal (``seeded_randn``) for fp32; for bf16
    made ``host_guard.order_revealing`` (a bf16 output otherwise hides another accumulation order). ``draw``: which
    of a probe's independent draws (``seeded_randn``)."""
    a, b = seeded_randn(rows, cols, draw=draw)
    if dtype != torch.float32:
        a, b = order_revealing(a, b, ARRANGEMENT_PROBE_SEED + draw)
    return a.to(dtype), b.to(dtype)


def seeded_randn(*shapes: tuple[int, ...], draw: int = 0) -> list[Tensor]:
    """Standard normal tensors of ``shapes``, drawn in order from one generator seeded ``ARRANGEMENT_PROBE_SEED``
    (+ ``draw``: a probe's further independent draws, ``VIEW_PROBE_OUTPUTS``)."""
    gen = torch.Generator().manual_seed(ARRANGEMENT_PROBE_SEED + draw)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


# --------------------------------------------------------------------------- answers and checks kept once
DTYPE_PLANS_MAX = 4096
"""Entries ``tiled_dtype`` keeps (then it starts afresh): one per (guard state, dtype, K, N, op, thread count); and
as many for ``_views_plan``'s answers."""


def asked_once(answers: dict[tuple, object], key: tuple, host: HostGuard, ask: Callable[[], object]) -> object:
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


def checked_once(checks: dict[tuple, bool], key: tuple, check: Callable[[], bool]) -> bool:
    """``check()``'s answer for ``key``, run at first use and kept in ``checks``: the first-use checks that the
    canonical arrangement's own faster forms (laid-out tiles, slabs shared between threads) give its bits. Forms of
    the canonical path, not ``same_bits`` arrangements, which ask the guard (``HostGuard.arrangement_agrees``) and
    which mode ``canonical`` never takes."""
    if (known := checks.get(key)) is None:
        known = checks[key] = check()
    return known
