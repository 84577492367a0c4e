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
Differences there: the tile shapes are the interpreter's own (see ``_MATMUL_TILES``,
``triton_attention._ATTENTION_TILES``); block products and block sums are not np.matmul / np.sum, whose summation
order is the host BLAS's and numpy's, but a fixed pairwise tree of exactly rounded fp32 products and adds
(``triton_common.block_dot``, ``block_sum``), so invariance does not rest on the host; low-precision tiles are
upcast to fp32 before the product because the interpreter's bf16 arithmetic works on raw bit patterns; and fp32 ->
bf16 rounding is done by hand because the interpreter's cast truncates (``triton_common.cast``). Results are exact
and invariant in either mode, but interpreter and GPU results are not bitwise equal to each other.

Backward passes must be reproducible run to run (only the forward must be exact). attention's is three Triton
kernels (FlashAttention-2 style, no atomics: see ``attention``); rms_norm's, rope's, silu_mul's and entropy's are
analytic VJPs in plain torch ops on fixed shapes (``autograd.exact_forward_vjp``); log_softmax's and
token_logprobs' recompute the native op and take its VJP (``autograd.exact_forward``); linear's is two matmuls.

The backend's modules, each with one job, lowest first (each imports only those above it in this list):

- ``triton_common``: the mode (compiled, or interpreted: decided before any kernel is decorated), the pieces every
  kernel uses in it (``cast``, ``block_dot`` / ``block_sum``, ``MASKED_SCORE``), the compile options and the device
  check;
- ``triton_attention``: attention's forward kernel and its three backward kernels, their launches and their tiles;
- ``triton_exact`` (this module): the backend's ops (``NAME``, the ``KernelOps`` functions and ``exp``), each with
  its contracts, and the kernels and tiles of every op but attention, whose op calls ``triton_attention``.

``triton_audit`` compiles every kernel of these modules for CUDA targets and checks the compiled code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import checks, native, triton_attention, triton_common
from .autograd import exact_forward, exact_forward_vjp, exact_linear, matmul_linear_backward
from .decode_tiles import DECODE_BLOCK_N, DECODE_ROWS_MAX
from .triton_common import COMPILE_OPTIONS, MASKED_SCORE, block_dot, block_sum, cast, check_device, input_precision

# isort: split
# triton after triton_common, which decides before triton is imported whether the kernels are interpreted
import triton
import triton.language as tl

NAME = "triton"

# --------------------------------------------------------------------------- configuration
# Fixed tile shapes. They may depend on the dtype and on the mode, never on the data's
# row count or sequence length: changing them changes the reduction order (and so the bits).
# (Attention's are triton_attention's: ``_ATTENTION_TILES``, ``_ATTENTION_BACKWARD_TILES``.)
# Matmul tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
if triton_common.INTERPRETING:
    _MATMUL_TILES = {dtype: (64, 64, 32, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    _ROW_BLOCK, _ROW_WARPS = 512, 1  # rms_norm / log_softmax chunk width
    _ELEMENTWISE_BLOCK = 4096
else:
    _MATMUL_TILES = {
        torch.float32: (64, 64, 32, 4, 3),
        torch.bfloat16: (64, 128, 64, 4, 3),
        torch.float16: (64, 128, 64, 4, 3),
    }
    _ROW_BLOCK, _ROW_WARPS = 1024, 4
    _ELEMENTWISE_BLOCK = 1024

# Decode tiles (``decode_tiles``: what a linear call of at most DECODE_ROWS_MAX rows may run, where a first-use
# check on this device finds every row's bits equal to the canonical tiles', ``decode_tiles_agree``): a 2,048-wide
# projection in 64 x 128 tiles is 16 programs on an H200's 132 SMs, its weights read at a fifth of the memory's
# bandwidth. The canonical BLOCK_M and BLOCK_K with each of DECODE_BLOCK_N's column widths, widest first.
# (BLOCK_M, BLOCK_K, num_warps, num_stages) per dtype:
if triton_common.INTERPRETING:
    _DECODE_TILE_REST = {dtype: (64, 32, 1, 1) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
else:
    _DECODE_TILE_REST = {
        torch.float32: (64, 32, 4, 3),
        torch.bfloat16: (64, 64, 4, 4),
        torch.float16: (64, 64, 4, 4),
    }
_DECODE_TILES = {dtype: tuple((block_m, block_n, block_k, warps, stages) for block_n in DECODE_BLOCK_N)
                 for dtype, (block_m, block_k, warps, stages) in _DECODE_TILE_REST.items()}


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
        acc = block_dot(x_tile, w_tile, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, cast(acc, y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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
    check_device("linear", x=x, weight=weight)
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
        HAS_BIAS=bias is not None, CAST_TO_FP32=triton_common.INTERPRETING, INPUT_PRECISION=input_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS,
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
    products (``block_dot``), not np.matmul: invariance does not rest on the host BLAS.
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
    # order, then one fixed tree (block_sum) across lanes. Pass 2: scale and store.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_len
    y_row = y_ptr + row * row_len
    lanes = tl.arange(0, BLOCK)

    sum_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, row_len, BLOCK):
        x = tl.load(x_row + start + lanes, mask=start + lanes < row_len, other=0.0).to(tl.float32)
        sum_sq += x * x
    inv_rms = tl.rsqrt(block_sum(sum_sq, axis=0) / row_len + eps)

    for start in range(0, row_len, BLOCK):
        mask = start + lanes < row_len
        x = tl.load(x_row + start + lanes, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + start + lanes, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + start + lanes, cast(x * inv_rms * w, y_ptr.dtype.element_ty), mask=mask)


def _rms_norm_exact(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    check_device("rms_norm", x=x, weight=weight)
    row_len = x.shape[-1]
    x2d = x.reshape(-1, row_len).contiguous()
    y = torch.empty_like(x2d)
    if y.numel():
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, weight.contiguous(), y, row_len, eps, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **COMPILE_OPTIONS
        )
    return y.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight, fp32 inside.

    Invariance contract: each output row depends only on that input row, the weight and eps
    -- never on the number of rows, their order, padding rows or other rows' values.

    Tiling: one program per row; the row is read in fixed BLOCK-wide chunks, in order, into
    BLOCK fp32 partial sums that ``block_sum`` combines in a fixed tree. Result in x.dtype.
    """
    checks.rms_norm("triton_exact.rms_norm", x, weight, eps)
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
    silu = cast(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, cast(silu * up, out_ptr.dtype.element_ty), mask=mask)


def _silu_mul_exact(gate: Tensor, up: Tensor) -> Tensor:
    check_device("silu_mul", gate=gate, up=up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n_elements = gate.numel()
    if n_elements:
        grid = (triton.cdiv(n_elements, _ELEMENTWISE_BLOCK),)
        _silu_mul_kernel[grid](gate, up, out, n_elements, BLOCK=_ELEMENTWISE_BLOCK, **COMPILE_OPTIONS)
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
    check_device("exp", x=x)
    if x.dtype != torch.float32:
        raise ValueError(f"triton_exact.exp: expected a float32 tensor, got {x.dtype}")
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    if flat.numel():
        grid = (triton.cdiv(flat.numel(), _ELEMENTWISE_BLOCK),)
        _exp_kernel[grid](flat, out, flat.numel(), BLOCK=_ELEMENTWISE_BLOCK, **COMPILE_OPTIONS)
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
    tl.store(out_ptr + first, cast(x1 * cos - x2 * sin, out_type), mask=mask)
    tl.store(out_ptr + first + half_dim, cast(x2 * cos + x1 * sin, out_type), mask=mask)


def _rope_exact(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    check_device("rope", x=x, cos=cos, sin=sin)
    batch, seq, n_heads, head_dim = x.shape
    half_dim = head_dim // 2
    # cos/sin may broadcast over leading dims, as in the reference (e.g. [1, T, hd/2]).
    cos, sin = (t.expand(batch, seq, half_dim).contiguous() for t in (cos, sin))
    x = x.contiguous()
    out = torch.empty_like(x)
    if out.numel():
        _rope_kernel[(batch * seq,)](
            x, cos, sin, out, n_heads, half_dim,
            BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_HALF=triton.next_power_of_2(half_dim), **COMPILE_OPTIONS,
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


# --------------------------------------------------------------------------- attention (its kernels: triton_attention)
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
    exactly rounded fp32 operations (``block_dot``, ``block_sum``), not np.matmul / np.sum:
    invariance does not rest on the host BLAS or numpy.

    Backward contract (FlashAttention-2 style, three Triton kernels, no atomics): with grad enabled the forward
    also stores each row's log-sum-exp (the output's bits are unchanged); the backward computes delta =
    rowsum(dO * O), then dK/dV with one program per (sequence, kv head, key block) looping over the group's q heads
    and the query blocks in a fixed order, and dQ with one program per (sequence, q head, query block) looping over
    key blocks from 0. Every gradient element is written by one program in a fixed order: run to run the gradients
    are bitwise equal, and no T x L score matrix is materialised. Gradients go to q, k_cache and v_cache as given
    (contiguous, their shapes and dtypes; cache positions no query sees get 0).
    """
    checks.attention("triton_exact.attention", q, k_cache, v_cache, q_start, scale)
    if not q_start.is_cuda:  # a CUDA q_start's values are not read (a device sync): a negative one gives NaN rows
        checks.query_starts("triton_exact.attention", q_start)
    return exact_forward_vjp(triton_attention.attention_exact, triton_attention.attention_with_saved,
                             triton_attention.attention_vjp, (q, k_cache, v_cache), (q_start, scale))


# --------------------------------------------------------------------------- log_softmax
@triton.jit
def _row_log_normalizer(row_ptr, row_len, BLOCK: tl.constexpr):
    """(row max, log sum exp(x - row max)) of one row, in fp32, in a fixed order.

    One pass of per-lane online softmax: lane j keeps the max and the rescaled sum of
    exp over elements j, j + BLOCK, j + 2 BLOCK, ...; the lanes are then combined by fixed
    reduction trees (tl.max, block_sum)."""
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
    total = block_sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
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
    check_device("log_softmax", logits=logits)
    row_len = logits.shape[-1]
    rows = logits.reshape(-1, row_len).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    if out.numel():
        _log_softmax_kernel[(rows.shape[0],)](
            rows, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **COMPILE_OPTIONS
        )
    return out.view(logits.shape)


def _token_logprobs_exact(logits: Tensor, targets: Tensor) -> Tensor:
    check_device("token_logprobs", logits=logits, targets=targets)
    row_len = logits.shape[-1]
    rows = logits.reshape(-1, row_len).contiguous()
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if out.numel() and row_len:
        _token_logprobs_kernel[(rows.shape[0],)](
            rows, flat_targets, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **COMPILE_OPTIONS
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
    # (block_sum) across the lanes -- the pattern of _rms_norm_kernel's pass 1. Padding lanes load lp = 0, whose
    # term exp(0) * 0 is exactly 0.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = log_probs_ptr + row * row_len
    lanes = tl.arange(0, BLOCK)
    terms = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, row_len, BLOCK):
        lp = tl.load(row_ptr + start + lanes, mask=start + lanes < row_len, other=0.0).to(tl.float32)
        terms += tl.exp(lp) * lp
    tl.store(out_ptr + row, -block_sum(terms, axis=0))


def _entropy_exact(log_probs: Tensor) -> Tensor:
    check_device("entropy", log_probs=log_probs)
    row_len = log_probs.shape[-1]
    rows = log_probs.reshape(-1, row_len).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=log_probs.device)
    if out.numel():
        _entropy_kernel[(rows.shape[0],)](
            rows, out, row_len, BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS, **COMPILE_OPTIONS
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
    of exp(lp) * lp that ``block_sum`` combines in a fixed tree; the result is negated. Not bitwise equal to
    ``native.entropy`` (torch's sum, whose split depends on the row count, the thread count and on CUDA the shape)
    nor to ``cpu_exact.entropy`` (its own chunks and exp).
    """
    checks.rows("triton_exact.entropy", "log_probs", log_probs)
    return exact_forward_vjp(_entropy_exact, _entropy_with_saved, _entropy_vjp, (log_probs,))
