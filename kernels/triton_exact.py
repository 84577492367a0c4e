"""Exact Triton backend: batch-invariant, deterministic GPU kernels.

Why: an RL rollout decodes with a KV cache, one token at a time, in whatever batch the
scheduler forms; training recomputes the same tokens in one full-sequence forward. With
ordinary kernels the two disagree in the last bits, because a GPU library picks its
tiling (and split-K, and reduction tree) from the shapes it is given, and the shapes differ.
This module removes that freedom: every reduction an output element depends on runs in an
order that is fixed by the kernel's *compile-time* constants alone, never by the number of
rows, the sequence length, or the batch.

The design, op by op (each public function's docstring states its contract):

* **linear** -- one tile configuration (BLOCK_M, BLOCK_N, BLOCK_K) per dtype, whatever M is.
  Each program owns one [BLOCK_M, BLOCK_N] output tile and its *whole* K reduction, in one
  fixed-order loop (no split-K, no atomics, no autotuning). Rows beyond M are masked to zero,
  so a row's value does not depend on its neighbours or its position in the tile.
* **rms_norm, log_softmax, token_logprobs, entropy** -- one program per row, walking the row in
  fixed BLOCK-sized chunks in order, accumulating in fp32 lanes that are combined by
  ``tl.sum`` / ``tl.max`` (a reduction tree fixed by BLOCK). A row depends only on itself.
  (Interpreted, ``tl.sum`` and ``tl.dot`` are replaced: see "Interpreter mode".)
* **silu_mul, rope** -- elementwise: every element runs the same instruction sequence.
* **attention** -- one FlashAttention-style kernel for prefill *and* decode. A program takes
  BLOCK_M rows of one (sequence, kv head), a row being a (query, q head) of the kv head's
  grouped-query group -- BLOCK_M fixed, so a decode step (T = 1) runs the same tile shape
  with masked rows, its group's heads in one tile -- and walks the KV cache in BLOCK_N-key blocks
  *from position 0 in order* with an fp32 online softmax. Invisible keys get a large finite
  negative score, so their probability is exactly 0; a block that is invisible to a query is
  then an exact no-op for it (alpha = exp(0) = 1, p = 0). Hence a query at position p gets
  the same bits inside a long prefill as in a decode step against a cache of length p + 1.

Accumulation is always fp32 and results are rounded to the output dtype at the end, with two
deliberate extra roundings: silu_mul rounds silu(gate) to the input dtype before multiplying
(as torch does), and on a GPU attention feeds bf16/fp16 probabilities to the P @ V ``tl.dot``
(as FlashAttention does). fp32 matmuls use ``input_precision="ieee"`` (no TF32) so they agree
with torch's fp32 reference.

Interpreter mode: without a CUDA device the kernels run in the Triton interpreter
(``TRITON_INTERPRET=1``, numpy underneath): correct but slow, for tests and tiny models.
Differences there: the tile shapes are the interpreter's own (see ``_MATMUL_TILES``);
block products and block sums are not np.matmul / np.sum, whose summation order is the host
BLAS's and numpy's, but a fixed pairwise tree of exactly rounded fp32 products and adds
(``_block_dot``, ``_block_sum``), so invariance does not rest on the host; low-precision
tiles are upcast to fp32 before the product because the interpreter's bf16 arithmetic works
on raw bit patterns; and fp32 -> bf16 rounding is done by hand because the interpreter's
cast truncates. Results are exact and invariant in either mode, but interpreter and GPU
results are not bitwise equal to each other.

Backward passes must be reproducible run to run (only the forward must be exact). attention's is three Triton
kernels (FlashAttention-2 style, no atomics: see ``attention``); rms_norm's, rope's, silu_mul's and entropy's are
analytic VJPs in plain torch ops on fixed shapes (``autograd.exact_forward_vjp``); log_softmax's and
token_logprobs' recompute the native op and take its VJP (``autograd.exact_forward``); linear's is two matmuls.
"""

from __future__ import annotations

import importlib
import math
import os

import torch
from torch import Tensor

from . import checks, native
from .autograd import exact_forward, exact_forward_vjp, exact_linear, matmul_linear_backward
from .decode_tiles import DECODE_BLOCK_N, DECODE_ROWS_MAX

# Compile-only: the GPU code paths and tiles without a device, so that the kernels can be compiled for CUDA
# targets and their code audited (vexact_kernels.triton_audit sets it in its own worker process). Launching
# a kernel then fails in _check_device (CPU tensors).
COMPILE_ONLY = os.environ.get("VEXACT_TRITON_COMPILE_ONLY") == "1"

# The interpreter must be chosen before triton decorates any kernel: ``triton.jit`` reads
# ``triton.knobs.runtime.interpret`` at decoration time (live from the environment unless
# the knob was set in Python). The import comes after this line on purpose.
if not torch.cuda.is_available() and not COMPILE_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

NAME = "triton"


def _use_interpreter() -> bool:
    """Decide once whether kernels run in the Triton interpreter, and make it so.

    Without CUDA there is nothing to compile for, so the interpreter is forced (unless compile-only). Setting the
    environment variable is not enough when triton was imported earlier in the process:
    the knob may have been set to False in Python, and -- found by experiment with triton
    3.9 -- triton.language's own ``@jit`` helpers (``tl.sum``, ``tl.max``, ``tl.zeros``, ...)
    were then decorated as compiled functions, which raise when an interpreted kernel calls
    them. In that case they are re-decorated by reloading ``triton.language.standard``.
    """
    if torch.cuda.is_available() or COMPILE_ONLY:
        return bool(triton.knobs.runtime.interpret)
    if not triton.knobs.runtime.interpret:
        triton.knobs.runtime.interpret = True
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(tl.standard.sum, InterpretedFunction):
        # Reloading re-runs the module's @jit decorators (now interpreting) and re-attaches
        # the tensor member functions (x.sum(), ...); then refresh tl's re-exported names.
        importlib.reload(tl.standard)
        for name, value in list(vars(tl).items()):
            if isinstance(value, JITFunction) and isinstance(getattr(tl.standard, name, None), InterpretedFunction):
                setattr(tl, name, getattr(tl.standard, name))
    return True


INTERPRETING = _use_interpreter()

# Score given to invisible keys / padding lanes: finite (no inf - inf = NaN), and so negative
# that exp(it - any real max) is exactly 0 in fp32.
MASKED_SCORE: tl.constexpr = tl.constexpr(-1.0e30)
LOG2_E = 1.0 / math.log(2.0)  # scores are scaled by this so the kernel can use exp2

# The interpreter's fp32 -> bf16 cast truncates (GPUs round to nearest even), so there the
# rounding is done by hand in ``_cast``.
ROUND_BF16_BY_HAND: tl.constexpr = tl.constexpr(INTERPRETING)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even also in the interpreter."""
    if ROUND_BF16_BY_HAND and dtype == tl.bfloat16 and x.dtype == tl.float32:
        # Round the fp32 bit pattern to its top 16 bits: add just under half an ulp, plus
        # one when the kept part is odd (ties to even); carries roll into the exponent.
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# --------------------------------------------------------------------------- block reductions
# Every block product and block sum goes through ``_block_dot`` / ``_block_sum``. Compiled,
# they *are* tl.dot / tl.sum (aliases, so the GPU code is exactly that of direct calls).
# Interpreted, tl.dot would be np.matmul and tl.sum np.sum, whose summation order is the host
# BLAS's and numpy's and may depend on a row's position in the block or on memory layout
# (seen with OpenBLAS on an AVX-512 host: a row of a linear tile got other bits than the same
# row alone). There both are replaced by a fixed pairwise tree over the last axis: level by
# level, elements 2i and 2i + 1 are added. Every add is an elementwise fp32 add, exactly
# rounded, so a result depends only on the values. Widths are block sizes: powers of two.
if INTERPRETING:
    # The tree is written out in both helpers rather than shared because each call of a jit
    # function from a kernel makes the interpreter re-patch triton.language (~0.3 ms). Shapes
    # are annotated constexpr: the interpreter turns plain int assignments into tensors.

    @triton.jit
    def _block_dot(a, b, acc=None, input_precision: tl.constexpr = None):
        """tl.dot for fp32 a: [M, K], b: [K, N]: the [M, N, K] fp32 products (numpy fp32 * fp32,
        exactly rounded) summed over K by the pairwise tree, then acc added. input_precision is
        accepted for tl.dot's signature and ignored (products are always full fp32)."""
        tl.static_assert(a.dtype == tl.float32 and b.dtype == tl.float32, "interpreted dot: upcast to fp32 first")
        rows: tl.constexpr = int(a.shape[0])
        cols: tl.constexpr = int(b.shape[1])
        width: tl.constexpr = int(a.shape[1])
        tl.static_assert(width >= 2 and (width & (width - 1)) == 0, "interpreted dot: K must be a power of two")
        x = a[:, None, :] * tl.trans(b)[None, :, :]
        while width > 2:
            width: tl.constexpr = width // 2
            pairs = tl.split(tl.reshape(x, [rows, cols, width, 2]))
            x = pairs[0] + pairs[1]
        pairs = tl.split(x)
        x = pairs[0] + pairs[1]
        if acc is not None:
            x = acc + x
        return x

    @triton.jit
    def _block_sum(x, axis: tl.constexpr):
        """tl.sum over the last axis by the pairwise tree: [..., W] -> [...] (a scalar for 1-D x)."""
        lead: tl.constexpr = [int(d) for d in x.shape[:-1]]
        width: tl.constexpr = int(x.shape[-1])
        tl.static_assert(axis == len(lead), "interpreted sum: only over the last axis")
        tl.static_assert(width >= 2 and (width & (width - 1)) == 0, "interpreted sum: width must be a power of two")
        while width > 2:
            width: tl.constexpr = width // 2
            pairs = tl.split(tl.reshape(x, lead + [width, 2]))
            x = pairs[0] + pairs[1]
        pairs = tl.split(x)
        return pairs[0] + pairs[1]

else:
    _block_dot = tl.dot
    _block_sum = tl.sum


# --------------------------------------------------------------------------- configuration
# Fixed tile shapes. They may depend on the dtype and on the mode, never on the data's
# row count or sequence length: changing them changes the reduction order (and so the bits).
# Matmul tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
if INTERPRETING:
    _MATMUL_TILES = {dtype: (64, 64, 32, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    # Attention tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages). Small, so that short test
    # sequences still span several key blocks.
    _ATTENTION_TILES = {dtype: (16, 16, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    _ATTENTION_BACKWARD_TILES = dict(_ATTENTION_TILES)
    _ROW_BLOCK, _ROW_WARPS = 512, 1  # rms_norm / log_softmax chunk width
    _ELEMENTWISE_BLOCK = 4096
else:
    _MATMUL_TILES = {
        torch.float32: (64, 64, 32, 4, 3),
        torch.bfloat16: (64, 128, 64, 4, 3),
        torch.float16: (64, 128, 64, 4, 3),
    }
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
    _ROW_BLOCK, _ROW_WARPS = 1024, 4
    _ELEMENTWISE_BLOCK = 1024

# Decode tiles (``decode_tiles``: what a linear call of at most DECODE_ROWS_MAX rows may run, where a first-use
# check on this device finds every row's bits equal to the canonical tiles', ``decode_tiles_agree``): a 2,048-wide
# projection in 64 x 128 tiles is 16 programs on an H200's 132 SMs, its weights read at a fifth of the memory's
# bandwidth. The canonical BLOCK_M and BLOCK_K with each of DECODE_BLOCK_N's column widths, widest first.
# (BLOCK_M, BLOCK_K, num_warps, num_stages) per dtype:
if INTERPRETING:
    _DECODE_TILE_REST = {dtype: (64, 32, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
else:
    _DECODE_TILE_REST = {
        torch.float32: (64, 32, 4, 3),
        torch.bfloat16: (64, 64, 4, 4),
        torch.float16: (64, 64, 4, 4),
    }
_DECODE_TILES = {dtype: tuple((block_m, block_n, block_k, warps, stages) for block_n in DECODE_BLOCK_N)
                 for dtype, (block_m, block_k, warps, stages) in _DECODE_TILE_REST.items()}


# Pinned rather than left to Triton's default (which flips from fused to unfused mul-add in
# Triton 3.10): either is invariant, but the bits must not change with a Triton upgrade.
# Unfused also rounds each mul and add separately, like the torch reference.
_COMPILE_OPTIONS = dict(enable_fp_fusion=False)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (tl.dot defaults to TF32 on GPUs).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_device(op: str, **named: Tensor) -> None:
    if not INTERPRETING:
        for name, t in named.items():
            if not t.is_cuda:
                raise ValueError(f"triton_exact.{op}: {name} is on {t.device}; the compiled kernels need CUDA tensors "
                                 "(or run with TRITON_INTERPRET=1)")


# --------------------------------------------------------------------------- linear
@triton.jit(do_not_specialize=["n_rows"])  # one compiled kernel for every M, M == 1 included
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    n_rows, n_cols, n_inner,  # M, N, K
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, CAST_TO_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # This program computes y[rows, cols] for one [BLOCK_M, BLOCK_N] tile:
    #   y_tile = sum over k-blocks of x[rows, k-block] @ w[cols, k-block].T
    # walking K from 0 in BLOCK_K steps. The loop order and the tile shape are the same for
    # every tile and every M, so each output element is reduced identically wherever it sits.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    inner = tl.arange(0, BLOCK_K)
    row_mask = rows < n_rows
    col_mask = cols < n_cols

    x_ptrs = x_ptr + rows[:, None] * stride_xm + inner[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + inner[:, None] * stride_wk + cols[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] = w.T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, n_inner, BLOCK_K):
        # Masked lanes load 0, adding exact zeros: a K that is not a multiple of BLOCK_K
        # (or rows past M) cannot change the other elements.
        inner_mask = k_start + inner < n_inner
        x_tile = tl.load(x_ptrs, mask=row_mask[:, None] & inner_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=inner_mask[:, None] & col_mask[None, :], other=0.0)
        if CAST_TO_FP32:  # interpreter: its bf16 arithmetic is wrong; bf16 x bf16 is exact in fp32
            x_tile = x_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = _block_dot(x_tile, w_tile, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, _cast(acc, y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def embedding(tokens: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` [V, D] picked by ``tokens`` -> [..., D]: a gather, exact on every backend (torch's own).

    Invariance contract: each output row is ``weight[token]`` bit for bit. Backward: torch's embedding backward
    (on CUDA a sort-based segment sum: deterministic for a given device and token layout). Token ids are checked to
    lie in [0, V) on CPU tensors only (``checks.token_ids``): on CUDA an id out of range is torch's device-side
    assert."""
    checks.embedding("triton_exact.embedding", tokens, weight)
    return native.embedding(tokens, weight)


Tiles = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, tiles: Tiles | None = None) -> Tensor:
    """``linear``'s forward. ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) in place of the call's own
    (``linear_tiles``), for the first-use checks and the GPU tile survey (``benchmarks.gpu_real --part tiles``)
    alone: the model never passes it, so its bits never depend on it."""
    _check_device("linear", x=x, weight=weight)
    n_inner = x.shape[-1]
    n_cols = weight.shape[0]
    x2d = x.reshape(-1, n_inner)
    y = torch.empty(x2d.shape[0], n_cols, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y.view(*x.shape[:-1], n_cols)
    block_m, block_n, block_k, num_warps, num_stages = tiles or linear_tiles(
        x2d.shape[0], n_inner, n_cols, x.dtype, x.device, bias=bias is not None)
    grid = (triton.cdiv(x2d.shape[0], block_m), triton.cdiv(n_cols, block_n))
    _linear_kernel[grid](
        x2d, weight, bias.contiguous() if bias is not None else weight, y,  # the kernel reads bias with stride 1
        x2d.shape[0], n_cols, n_inner,
        x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, CAST_TO_FP32=INTERPRETING, INPUT_PRECISION=_input_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **_COMPILE_OPTIONS,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n_cols)


def linear_tiles(rows: int, k: int, n: int, dtype: torch.dtype, device: torch.device, *, bias: bool = False
                 ) -> Tiles:
    """The tiles ``linear`` runs a call of ``rows`` rows of [N, K] weights (and a ``bias``, or none) in ``dtype``
    with: the dtype's ``_MATMUL_TILES``; at most ``DECODE_ROWS_MAX`` rows, a decode tile (``_decode_tiles``) where
    one gives the same bits here (``decode_tiles_agree``) -- of those, the widest that gives the device's SMs two
    programs each, else the narrowest. The tile may depend on the call's row count only because every tile it can
    choose gives each row the canonical tiles' bits: the row-invariance contract holds whichever runs."""
    if rows > DECODE_ROWS_MAX:
        return _MATMUL_TILES[dtype]
    key = (k, n, dtype, str(device), bias)
    if (chosen := _DECODE_CHOICES.get(key)) is None:
        agreeing = [t for t in _decode_tiles(dtype) if decode_tiles_agree(t, k, n, dtype, device, bias=bias)]
        wanted = 2 * _processors(device)
        chosen = next((t for t in agreeing if triton.cdiv(n, t[1]) >= wanted), agreeing[-1] if agreeing else None)
        chosen = _DECODE_CHOICES[key] = chosen or _MATMUL_TILES[dtype]
    return chosen


_DECODE_CHOICES: dict[tuple, Tiles] = {}  # (K, N, dtype, device, bias) -> a call's tiles at <= DECODE_ROWS_MAX rows


def _decode_tiles(dtype: torch.dtype) -> tuple[Tiles, ...]:
    """The decode tiles ``linear_tiles`` may choose for ``dtype``, widest first (a function, so tests can offer
    others)."""
    return _DECODE_TILES[dtype]


def _processors(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 in the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_DECODE_TILE_CHECKS: dict[tuple, bool] = {}
DECODE_CHECK_COLUMNS = 1024
"""Weight rows (output columns) the first-use check of a decode tile multiplies at most: a column's reduction is
the same whatever N (the check keeps N's remainder modulo 128, so the last, partial tile is checked too)."""
DECODE_CHECK_ROWS = (1, 17, DECODE_ROWS_MAX)
"""Row counts of the first-use check: each call's rows against the same rows of the canonical tiles'
``DECODE_ROWS_MAX``-row call."""


def decode_tiles_agree(tiles: Tiles, k: int, n: int, dtype: torch.dtype, device: torch.device, *,
                       bias: bool = False) -> bool:
    """Whether ``tiles`` give every row of a call of at most ``DECODE_ROWS_MAX`` rows the bits the dtype's
    ``_MATMUL_TILES`` give it, for [N, K] weights (and a ``bias``: the kernel's other variant) on ``device``:
    checked once per (tiles, K, N class, dtype, device, bias) on seeded random operands whose every mantissa bit is
    set (a different order of the same sums shows in the last bits), at ``DECODE_CHECK_ROWS`` rows. A tile whose
    compiled code sums a column otherwise (another MMA instruction, say) fails here and never runs. The check reads
    a result back to the host: it runs at a call's first use, before a decode step is recorded in a CUDA graph
    (``DecodeStep`` runs the step eagerly first)."""
    columns = min(n, DECODE_CHECK_COLUMNS + n % 128)
    key = (tiles, k, columns, dtype, str(device), bias)
    if (known := _DECODE_TILE_CHECKS.get(key)) is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(DECODE_ROWS_MAX, k, generator=gen).to(dtype).to(device)
        w = torch.randn(columns, k, generator=gen).to(dtype).to(device)
        b = torch.randn(columns, generator=gen).to(dtype).to(device) if bias else None
        reference = _linear_forward(x, w, b, _MATMUL_TILES[dtype])
        known = all(torch.equal(_linear_forward(x[:m], w, b, tiles), reference[:m]) for m in DECODE_CHECK_ROWS)
        _DECODE_TILE_CHECKS[key] = known
    return known


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N] in x.dtype.

    Invariance contract: each output row depends only on the same input row, the weight and
    the bias -- never on how many rows there are (M), the row's position among them, padding
    rows, or other rows' values. So a decode step's projection equals the matching row of
    a full-sequence forward bit for bit.

    Tiling: the output is cut into [BLOCK_M, BLOCK_N] tiles, one program each (grid
    cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)). A program loads [BLOCK_M, BLOCK_K] slices of x and
    [BLOCK_K, BLOCK_N] slices of weight.T and accumulates their ``tl.dot`` in an fp32 tile,
    K from 0 upwards. The tile shape is fixed per dtype (see ``_MATMUL_TILES``); there is no
    split-K. A call of at most ``DECODE_ROWS_MAX`` rows may run a narrower decode tile, where
    a first-use check on the device found it gives every row these same bits
    (``linear_tiles``). Bias is added in fp32, then one rounding to x.dtype.
    In the interpreter the block product is a fixed pairwise tree of exactly rounded fp32
    products (``_block_dot``), not np.matmul: invariance does not rest on the host BLAS.
    """
    checks.linear("triton_exact.linear", x, weight, bias)
    return exact_linear(_linear_forward, x, weight, bias)


def linear_backward(x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool
                    ) -> tuple[Tensor | None, Tensor | None]:
    """``linear``'s VJP (no bias) without its forward, as its autograd has it: plain, deterministic matmuls."""
    return matmul_linear_backward(x, weight, grad, need_x, need_w)


# --------------------------------------------------------------------------- rms_norm
@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, y_ptr, row_len, eps, BLOCK: tl.constexpr):
    # One program per row. Pass 1: sum of squares in BLOCK fp32 lanes, chunk by chunk in
    # order, then one fixed tree (_block_sum) across lanes. Pass 2: scale and store.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_len
    y_row = y_ptr + row * row_len
    lanes = tl.arange(0, BLOCK)

    sum_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, row_len, BLOCK):
        x = tl.load(x_row + start + lanes, mask=start + lanes < row_len, other=0.0).to(tl.float32)
        sum_sq += x * x
    inv_rms = tl.rsqrt(_block_sum(sum_sq, axis=0) / row_len + eps)

    for start in range(0, row_len, BLOCK):
        mask = start + lanes < row_len
        x = tl.load(x_row + start + lanes, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + start + lanes, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + start + lanes, _cast(x * inv_rms * w, y_ptr.dtype.element_ty), mask=mask)


def _rms_norm_exact(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_device("rms_norm", x=x, weight=weight)
    row_len = x.shape[-1]
    x2d = x.reshape(-1, row_len).contiguous()
    y = torch.empty_like(x2d)
    if y.numel():
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, weight.contiguous(), y, row_len, eps, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **_COMPILE_OPTIONS
        )
    return y.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight, fp32 inside.

    Invariance contract: each output row depends only on that input row, the weight and eps
    -- never on the number of rows, their order, padding rows or other rows' values.

    Tiling: one program per row; the row is read in fixed BLOCK-wide chunks, in order, into
    BLOCK fp32 partial sums that ``_block_sum`` combines in a fixed tree. Result in x.dtype.
    """
    checks.rms_norm("triton_exact.rms_norm", x, weight)
    return exact_forward_vjp(_rms_norm_exact, _rms_norm_with_saved, _rms_norm_vjp, (x, weight), (eps,))


def _rms_norm_with_saved(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, tuple]:
    return _rms_norm_exact(x, weight, eps), (x, weight, eps)


def _rms_norm_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2: dx = r * (g w - x r^2 mean(g w x)), dw = sum over rows of
    g x r (cpu_exact's formulas). Plain torch ops on fixed shapes, fp32, one rounding: deterministic; 1/rms is
    recomputed here (a [rows] fp32 vector) rather than stored by the kernel."""
    x, weight, eps = saved
    xf, g, wf = x.float(), grad.float(), weight.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    grad_x = grad_w = None
    if needs[0]:
        gw = g * wf
        dot = (gw * xf).mean(-1, keepdim=True)
        grad_x = (inv_rms * (gw - xf * (inv_rms * inv_rms) * dot)).to(x.dtype)
    if needs[1]:
        grad_w = (g * xf * inv_rms).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return grad_x, grad_w


# --------------------------------------------------------------------------- silu_mul
@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Like torch: silu is computed in fp32 and rounded to the input dtype, then multiplied.
    silu = _cast(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, _cast(silu * up, out_ptr.dtype.element_ty), mask=mask)


def _silu_mul_exact(gate: Tensor, up: Tensor) -> Tensor:
    _check_device("silu_mul", gate=gate, up=up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n_elements = gate.numel()
    if n_elements:
        grid = (triton.cdiv(n_elements, _ELEMENTWISE_BLOCK),)
        _silu_mul_kernel[grid](gate, up, out, n_elements, BLOCK=_ELEMENTWISE_BLOCK, **_COMPILE_OPTIONS)
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation silu(gate) * up, elementwise, result in the inputs' dtype.

    Invariance contract: each output element depends only on the matching gate and up
    elements -- not on the tensor's size, shape or the element's position. Tiling: the
    flattened tensor in fixed BLOCK-wide chunks, one program each; no reductions.
    """
    checks.silu_mul("triton_exact.silu_mul", gate, up)
    return exact_forward_vjp(_silu_mul_exact, _silu_mul_with_saved, _silu_mul_vjp, (gate, up))


def _silu_mul_with_saved(gate: Tensor, up: Tensor) -> tuple[Tensor, tuple]:
    return _silu_mul_exact(gate, up), (gate, up)


def _silu_mul_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """With s = sigmoid(gate): d gate = g * up * s * (1 + gate * (1 - s)), d up = g * silu(gate), silu rounded to
    the gate's dtype as the forward rounds it (cpu_exact's formulas). Elementwise torch ops in fp32, one rounding."""
    gate, up = saved
    gf, g = gate.float(), grad.float()
    s = torch.sigmoid(gf)
    grad_gate = (g * up.float() * s * (1.0 + gf * (1.0 - s))).to(gate.dtype) if needs[0] else None
    grad_up = (g * (gf * s).to(gate.dtype).float()).to(up.dtype) if needs[1] else None
    return grad_gate, grad_up


# --------------------------------------------------------------------------- exp (the MoE routing weights)
@triton.jit
def _exp_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.exp(tl.load(x_ptr + offsets, mask=mask, other=0.0)), mask=mask)


def exp(x: Tensor) -> Tensor:
    """fp32 exp of every element of the fp32 tensor ``x`` (forward only; ``moe_exact.exp`` adds the VJP). Not a
    ``KernelOps`` op: the exp of the MoE routing weights on CUDA tensors (``moe_exact``), which are the same code
    for every backend.

    Invariance contract: each output element depends only on the matching input element -- not on the tensor's
    size, shape or the element's position. Tiling: the flattened tensor in fixed BLOCK-wide chunks, one program
    each; no reductions."""
    _check_device("exp", x=x)
    if x.dtype != torch.float32:
        raise ValueError(f"triton_exact.exp: expected a float32 tensor, got {x.dtype}")
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    if flat.numel():
        grid = (triton.cdiv(flat.numel(), _ELEMENTWISE_BLOCK),)
        _exp_kernel[grid](flat, out, flat.numel(), BLOCK=_ELEMENTWISE_BLOCK, **_COMPILE_OPTIONS)
    return out.view(x.shape)


# --------------------------------------------------------------------------- rope
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, half_dim, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per token (b, t): all heads at once, since they share cos/sin.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (pairs < half_dim)
    first = token * n_heads * 2 * half_dim + heads * 2 * half_dim + pairs  # x1 = x[..., :half]
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + half_dim, mask=mask, other=0.0).to(tl.float32)  # x2 = x[..., half:]
    cos = tl.load(cos_ptr + token * half_dim + pairs, mask=pairs < half_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * half_dim + pairs, mask=pairs < half_dim, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    tl.store(out_ptr + first, _cast(x1 * cos - x2 * sin, out_type), mask=mask)
    tl.store(out_ptr + first + half_dim, _cast(x2 * cos + x1 * sin, out_type), mask=mask)


def _rope_exact(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    _check_device("rope", x=x, cos=cos, sin=sin)
    batch, seq, n_heads, head_dim = x.shape
    half_dim = head_dim // 2
    # cos/sin may broadcast over leading dims, as in the reference (e.g. [1, T, hd/2]).
    cos, sin = (t.expand(batch, seq, half_dim).contiguous() for t in (cos, sin))
    x = x.contiguous()
    out = torch.empty_like(x)
    if out.numel():
        _rope_kernel[(batch * seq,)](
            x, cos, sin, out, n_heads, half_dim,
            BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_HALF=triton.next_power_of_2(half_dim), **_COMPILE_OPTIONS,
        )  # fmt: skip
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention. x: [B, T, H, hd]; cos/sin: [B, T, hd/2] fp32.

    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin) with x1, x2 the two halves of the
    head dim; computed in fp32, result in x.dtype.

    Invariance contract: each output element depends only on its own (x1, x2, cos, sin)
    elements -- not on the batch, the sequence length or the token's position in the tensor
    (positions enter only through the caller's cos/sin). Tiling: one program per token,
    covering all heads as a [H, hd/2] block; no reductions.
    """
    checks.rope("triton_exact.rope", x, cos, sin)
    return exact_forward_vjp(_rope_exact, _rope_with_saved, _rope_vjp, (x, cos, sin))


def _rope_with_saved(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, tuple]:
    return _rope_exact(x, cos, sin), (x, cos, sin)


def _rope_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """The rotation's transpose: dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin (fp32, one rounding to x.dtype).
    cos/sin (rarely differentiated) get sum over heads of g1 x1 + g2 x2 and g2 x1 - g1 x2, summed down to their
    own (broadcast) shape. Plain torch ops on fixed shapes: deterministic."""
    x, cos, sin = saved
    half = x.shape[-1] // 2
    g, xf = grad.float(), x.float()
    g1, g2 = g[..., :half], g[..., half:]
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    grad_x = torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(x.dtype) if needs[0] else None
    x1, x2 = xf[..., :half], xf[..., half:]
    grad_cos = (g1 * x1 + g2 * x2).sum(2).sum_to_size(cos.shape).to(cos.dtype) if needs[1] else None
    grad_sin = (g2 * x1 - g1 * x2).sum(2).sum_to_size(sin.shape).to(sin.dtype) if needs[2] else None
    return grad_x, grad_cos, grad_sin


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
        scores = _block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_cache[None, :]
        scores = tl.where(visible, scores, MASKED_SCORE)

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)  # exactly 1 when nothing new is visible
        p = tl.exp2(scores - m_new[:, None])  # exactly 0 where invisible
        l_i = l_i * alpha + _block_sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = _block_dot(_cast(p, v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + batch * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptrs, _cast(out, out_ptr.dtype.element_ty), mask=(t < q_len)[:, None] & dim_mask[None, :])
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
    _check_device("attention", q=q, k_cache=k_cache, v_cache=v_cache)
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
        CAST_TO_FP32=INTERPRETING, INPUT_PRECISION=_input_precision(q.dtype), STORE_LSE=store_lse,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_attention_block_d(head_dim),
        num_warps=num_warps, num_stages=num_stages, **_COMPILE_OPTIONS,
    )  # fmt: skip
    return out, lse, prepared


def _attention_block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _attention_exact(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
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
    q head, BLOCK_M queries), the row reduced by one fixed tree over BLOCK_D lanes (``_block_sum``)."""
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
    tl.store(delta_ptr + batch_head.to(tl.int64) * q_len + t, _block_sum(o * do, axis=1), mask=t < q_len)


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
    block, in order, each block's products reduced by the fixed-shape ``_block_dot``. So it depends only on the
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
            scores = _block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # log2 units
            visible = (k_pos[None, :] <= (q_start + t)[:, None]) & in_cache[None, :] & q_mask[:, None]
            # where, not a masked score: a padding row (q = 0, lse = 0) would otherwise get p = 1.
            p = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
            dv = _block_dot(tl.trans(_cast(p, do.dtype)), do, dv, input_precision=INPUT_PRECISION)
            dp = _block_dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk = _block_dot(tl.trans(_cast(ds, q.dtype)), q, dk, input_precision=INPUT_PRECISION)

    d_offsets = batch * stride_db + k_pos[:, None] * stride_dl + kv_head * stride_dh + dims[None, :]
    tl.store(dk_ptr + d_offsets, _cast(dk * scale, dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + d_offsets, _cast(dv, dv_ptr.dtype.element_ty), mask=kv_mask)


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
    ``_block_dot``. It depends only on the query's own q, dO, lse, delta and its sequence's keys/values at
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
        scores = _block_dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_cache[None, :] & q_mask[:, None]
        p = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
        dp = _block_dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _block_dot(_cast(ds, k.dtype), k, dq, input_precision=INPUT_PRECISION)

    dq_ptrs = dq_ptr + batch * stride_db + t[:, None] * stride_dt + head * stride_dh + dims[None, :]
    tl.store(dq_ptrs, _cast(dq * scale, dq_ptr.dtype.element_ty), mask=row_mask)


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
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps, **_COMPILE_OPTIONS,
    )  # fmt: skip
    common = (
        q_len, cache_len, q_heads, q_heads // kv_heads, head_dim, scale * LOG2_E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
    )  # fmt: skip
    options = dict(CAST_TO_FP32=INTERPRETING, INPUT_PRECISION=_input_precision(q.dtype), BLOCK_M=block_m,
                   BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages, **_COMPILE_OPTIONS)
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


def _attention_with_saved(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float
                          ) -> tuple[Tensor, tuple]:
    out, lse, prepared = _attention_forward(q, k_cache, v_cache, q_start, scale, store_lse=True)
    return out, (*prepared, out, lse, scale)


def _attention_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    q, k_cache, v_cache, q_start, out, lse, scale = saved
    _check_device("attention", grad=grad)
    dq, dk, dv = _attention_backward(q, k_cache, v_cache, q_start, out, lse, grad, scale, needs[0],
                                     needs[1] or needs[2])
    return dq, (dk if needs[1] else None), (dv if needs[2] else None)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    """Causal grouped-query attention of new queries against a KV cache (prefill and decode).

    q: [B, T, Hq, hd]; k_cache, v_cache: [B, L, Hkv, hd] with Hq % Hkv == 0; q_start: [B]
    int64. Query t of sequence b sits at position q_start[b] + t and attends to cache
    positions 0 .. q_start[b] + t inclusive; query head h reads kv head h // (Hq // Hkv).
    Returns [B, T, Hq, hd] in q.dtype.

    Invariance contract: a query's output depends only on its own vector, ``scale`` and its
    own sequence's keys/values at positions <= its position -- never on the batch size, the
    sequence's place in the batch, other sequences, T (prefill vs decode, or how a prompt
    is chunked), padding queries, or cache contents after its position (which must be
    finite: 0 * inf would be NaN). So decode step t equals row t of a prefill bit for bit.

    Tiling: one program per (sequence, kv head, block of BLOCK_M rows), a row being one
    (query, q head) of the kv head's group, query-major: the group's q heads share one pass
    over their keys and values (a decode step's Hq / Hkv rows, one program). BLOCK_M is
    fixed, so a decode step is the same tile with masked rows. The program streams the
    cache in BLOCK_N-key blocks from position 0 and keeps an fp32 online softmax (running
    max m, normaliser l, accumulator acc), as in FlashAttention. Invisible keys score a
    large finite negative value, so blocks past a query's position change nothing for it.
    In the interpreter the block products and the row sums of p are fixed pairwise trees of
    exactly rounded fp32 operations (``_block_dot``, ``_block_sum``), not np.matmul / np.sum:
    invariance does not rest on the host BLAS or numpy.

    Backward contract (FlashAttention-2 style, three Triton kernels, no atomics): with grad enabled the forward
    also stores each row's log-sum-exp (the output's bits are unchanged); the backward computes delta =
    rowsum(dO * O), then dK/dV with one program per (sequence, kv head, key block) looping over the group's q heads
    and the query blocks in a fixed order, and dQ with one program per (sequence, q head, query block) looping over
    key blocks from 0. Every gradient element is written by one program in a fixed order: run to run the gradients
    are bitwise equal, and no T x L score matrix is materialised. Gradients go to q, k_cache and v_cache as given
    (contiguous, their shapes and dtypes; cache positions no query sees get 0).
    """
    checks.attention("triton_exact.attention", q, k_cache, v_cache, q_start)
    if not q_start.is_cuda:  # a CUDA q_start's values are not read (a device sync): a negative one gives NaN rows
        checks.query_starts("triton_exact.attention", q_start)
    return exact_forward_vjp(_attention_exact, _attention_with_saved, _attention_vjp, (q, k_cache, v_cache),
                             (q_start, scale))


# --------------------------------------------------------------------------- log_softmax
@triton.jit
def _row_log_normalizer(row_ptr, row_len, BLOCK: tl.constexpr):
    """(row max, log sum exp(x - row max)) of one row, in fp32, in a fixed order.

    One pass of per-lane online softmax: lane j keeps the max and the rescaled sum of
    exp over elements j, j + BLOCK, j + 2 BLOCK, ...; the lanes are then combined by fixed
    reduction trees (tl.max, _block_sum)."""
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), MASKED_SCORE, dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, row_len, BLOCK):
        mask = start + lanes < row_len
        x = tl.load(row_ptr + start + lanes, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x, MASKED_SCORE)
        new_max = tl.maximum(lane_max, x)
        # Padding lanes contribute exactly 0 (exp(0) = 1 would otherwise count them).
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.where(mask, tl.exp(x - new_max), 0.0)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    total = _block_sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
    return row_max, tl.log(total)


@triton.jit
def _log_softmax_kernel(logits_ptr, out_ptr, row_len, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_len
    row_max, log_normalizer = _row_log_normalizer(row_ptr, row_len, BLOCK)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, row_len, BLOCK):
        mask = start + lanes < row_len
        x = tl.load(row_ptr + start + lanes, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * row_len + start + lanes, (x - row_max) - log_normalizer, mask=mask)


@triton.jit
def _token_logprobs_kernel(logits_ptr, targets_ptr, out_ptr, row_len, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_len
    row_max, log_normalizer = _row_log_normalizer(row_ptr, row_len, BLOCK)
    target = tl.load(targets_ptr + row)
    valid = (target >= 0) & (target < row_len)
    x = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    # The same expression as in _log_softmax_kernel: bitwise equal to log_softmax[target].
    logprob = (x - row_max) - log_normalizer
    tl.store(out_ptr + row, tl.where(valid, logprob, float("nan")))


def _log_softmax_exact(logits: Tensor) -> Tensor:
    _check_device("log_softmax", logits=logits)
    row_len = logits.shape[-1]
    rows = logits.reshape(-1, row_len).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    if out.numel():
        _log_softmax_kernel[(rows.shape[0],)](
            rows, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **_COMPILE_OPTIONS
        )
    return out.view(logits.shape)


def _token_logprobs_exact(logits: Tensor, targets: Tensor) -> Tensor:
    _check_device("token_logprobs", logits=logits, targets=targets)
    row_len = logits.shape[-1]
    rows = logits.reshape(-1, row_len).contiguous()
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if out.numel() and row_len:
        _token_logprobs_kernel[(rows.shape[0],)](
            rows, flat_targets, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **_COMPILE_OPTIONS
        )
    return out.view(targets.shape)


def log_softmax(logits: Tensor) -> Tensor:
    """log_softmax over the last dim, returned in fp32: (x - max) - log(sum(exp(x - max))).

    Invariance contract: each output row depends only on that logits row -- never on the
    number of rows, their order, padding rows or other rows' values.

    Tiling: one program per row. Pass 1 reads the row in fixed BLOCK-wide chunks, in order,
    keeping a per-lane running max and rescaled sum (online softmax), then combines the
    lanes with fixed trees. Pass 2 writes (x - max) - log(sum).
    """
    checks.rows("triton_exact.log_softmax", "logits", logits)
    return exact_forward(_log_softmax_exact, native.log_softmax, (logits,))


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per row: logits [..., V], targets [...] int64 -> fp32 [...].

    Invariance contract: as ``log_softmax`` -- each value depends only on its own logits row
    and target -- and bitwise equal to ``log_softmax(logits)[..., target]`` (same pass 1,
    same final expression). Only the target's logit is read in pass 2, so the [.., V]
    log-prob tensor is never materialised. A target outside [0, V) yields NaN.
    """
    checks.token_logprobs("triton_exact.token_logprobs", logits, targets)
    return exact_forward(_token_logprobs_exact, native.token_logprobs, (logits,), (targets,))


# --------------------------------------------------------------------------- entropy
@triton.jit
def _entropy_kernel(log_probs_ptr, out_ptr, row_len, BLOCK: tl.constexpr):
    # One program per row: -sum(exp(lp) * lp) in BLOCK fp32 lanes, chunk by chunk in order, then one fixed tree
    # (_block_sum) across the lanes -- the pattern of _rms_norm_kernel's pass 1. Padding lanes load lp = 0, whose
    # term exp(0) * 0 is exactly 0.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = log_probs_ptr + row * row_len
    lanes = tl.arange(0, BLOCK)
    terms = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, row_len, BLOCK):
        lp = tl.load(row_ptr + start + lanes, mask=start + lanes < row_len, other=0.0).to(tl.float32)
        terms += tl.exp(lp) * lp
    tl.store(out_ptr + row, -_block_sum(terms, axis=0))


def _entropy_exact(log_probs: Tensor) -> Tensor:
    _check_device("entropy", log_probs=log_probs)
    row_len = log_probs.shape[-1]
    rows = log_probs.reshape(-1, row_len).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=log_probs.device)
    if out.numel():
        _entropy_kernel[(rows.shape[0],)](
            rows, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **_COMPILE_OPTIONS
        )
    return out.view(log_probs.shape[:-1])


def _entropy_with_saved(log_probs: Tensor) -> tuple[Tensor, tuple]:
    return _entropy_exact(log_probs), (log_probs,)


def _entropy_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d/d lp_i of -sum(exp(lp) lp) = -g p_i (1 + lp_i), elementwise (cpu_exact's formula), in fp32, rounded once
    to the input's dtype. Written as autograd writes it for ``native.entropy`` -- (-g) p + ((-g) lp) p, its two paths
    to lp added -- so that fp32 log-probs get the gradient bits the native formula's autograd gave."""
    (log_probs,) = saved
    lp = log_probs.float()
    probs = lp.exp()
    minus_g = grad.float().neg().unsqueeze(-1)
    return ((minus_g * probs + minus_g * lp * probs).to(log_probs.dtype),)


def entropy(log_probs: Tensor) -> Tensor:
    """-sum(p log p) over the last dim of a ``log_softmax`` output: [..., V] (fp32, or bf16) -> fp32 [...].

    Invariance contract: each value depends only on its own row (and V) -- never on the number of rows, their
    order, padding rows, other rows' values, the launch grid or the thread count. Backward contract: -g p (1 + log p),
    elementwise (torch ops on the device, see ``_entropy_vjp``): each gradient element depends only on its own
    log-prob and its row's upstream gradient.

    Tiling: one program per row; the row is read in fixed BLOCK-wide chunks, in order, into BLOCK fp32 partial sums
    of exp(lp) * lp that ``_block_sum`` combines in a fixed tree; the result is negated. Not bitwise equal to
    ``native.entropy`` (torch's sum, whose split depends on the row count, the thread count and on CUDA the shape)
    nor to ``cpu_exact.entropy`` (its own chunks and exp).
    """
    checks.rows("triton_exact.entropy", "log_probs", log_probs)
    return exact_forward_vjp(_entropy_exact, _entropy_with_saved, _entropy_vjp, (log_probs,))
