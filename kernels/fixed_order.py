"""Building blocks that are invariant *by construction*: only exactly rounded elementwise IEEE ops.

An elementwise fp32 add, mul or div is exactly rounded, so its result depends only on its
operands -- not on the SIMD width, the element's position, alignment, thread count or library.
Everything here is built from such ops (plus bit manipulation), so its output for an element,
or a row, depends only on that element's or row's values, on any host:

- ``tree_sum``: a row summed by halving (the CPU kernels' reduction everywhere);
- ``bmm``: a batched matmul whose every output element is a halving-tree sum of exactly
  rounded products (the fallback for a host whose BLAS fails a probe, see ``host_guard``);
- ``exp`` (fp32), ``log`` (fp32, fp64), ``cos`` (fp64 sampling angles): polynomials after
  Cody-Waite range reduction (the fallback for a host whose vectorised math fails a probe).
  Accuracy: within a few ulps of the correctly rounded value (tests check it against torch
  with a stated tolerance);
- ``sqrt`` (fp32 correctly rounded, fp64 within an ulp): Newton's iteration in fp64 and an exact
  midpoint test (the fallback for a host whose vectorised sqrt fails its probe: torch's CPU sqrt
  is a library function, not the IEEE operation).

These are slower than BLAS and the vectorised math library; they exist so that "exact" never
depends on an unchecked property of the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# Elements per [rows, cols, K] product block in ``bmm`` (16 MiB of fp32): bounds the scratch memory.
PRODUCT_BLOCK = 1 << 22


def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over ``dim`` (default the last) by halving: the result depends only on the values along ``dim``;
    trailing zeros do not change it.

    A width D that is not a power of two is treated as zero-padded to the next one, P. The first
    level adds x[i] + x[i + P/2] where both exist and x[i] + 0.0 where the partner is padding
    (so -0.0 becomes +0.0 exactly as with real zero padding) without materialising the padded
    row; later levels add halves in place in that one scratch buffer. Width 0 gives zeros (the empty sum)."""
    dim = dim % x.dim()
    width = x.shape[dim]
    if width == 0:  # the empty sum (a batch of zero rows): +0.0, as torch.sum gives; the halving below needs width >= 1
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
    if width == 1:
        return x.select(dim, 0)
    half = 1 << ((width - 1).bit_length() - 1)  # P / 2
    paired = width - half
    if paired == half:
        buf = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    else:
        shape = list(x.shape)
        shape[dim] = half
        buf = x.new_empty(shape)
        torch.add(x.narrow(dim, 0, paired), x.narrow(dim, half, paired), out=buf.narrow(dim, 0, paired))
        torch.add(x.narrow(dim, paired, half - paired), 0.0, out=buf.narrow(dim, paired, half - paired))
    while half > 1:
        half //= 2
        buf = buf.narrow(dim, 0, half).add_(buf.narrow(dim, half, half))
    return buf.select(dim, 0)


def tree_sum_of(count: int, part: Callable[[int], Tensor]) -> Tensor:
    """``tree_sum(torch.stack([part(i) for i in range(count)]), dim=0)``, the same additions, with the parts made
    one at a time so that at most one per tree level is held, not ``count`` (a weight gradient streamed over token
    chunks: each part a [N, K] partial product).

    The halving tree adds x[i] and x[i + P/2] first (P: ``count`` rounded up to a power of two), so the node of
    the indices congruent to r modulo m is node(r, 2m) + node(r + m, 2m); evaluated depth first, the parts are
    asked for in bit-reversed index order (0, P/2, P/4, 3P/4, ...). A missing partner at the first level adds
    0.0, as ``tree_sum`` does."""
    if count == 1:
        return part(0)
    top = 1 << (count - 1).bit_length()

    def node(r: int, m: int) -> Tensor:
        if 2 * m == top:  # the first level: leaves r and r + P/2
            left = part(r)
            return left + part(r + m) if r + m < count else left + 0.0
        return node(r, 2 * m) + node(r + m, 2 * m)

    return node(0, 1)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """fp32 a [T, R, K] @ b [T, K, N] -> [T, R, N]; out[t, r, n] = tree_sum_k(a[t, r, k] * b[t, k, n]).

    Each output element is the halving tree of its K exactly rounded products, so it depends only
    on row ``a[t, r]`` and column ``b[t, :, n]``: invariant by construction (tile height, position,
    batch, threads, host). The products are laid out [rows, K, N] (N innermost, so every tree level
    is a run of long contiguous adds) and formed block by block, at most ``PRODUCT_BLOCK`` elements
    at a time, so memory stays bounded for any shape."""
    tiles, rows, k = a.shape
    cols = b.shape[2]
    out = a.new_empty(tiles, rows, cols)
    if out.numel() == 0 or k == 0:  # nothing to sum (an empty batch of rows), or empty sums: 0.0, as a GEMM gives
        return out.zero_()
    shared = b.stride(0) == 0  # one operand for every tile (an expanded weight): lay it out once
    b_shared = b[0].contiguous() if shared else None

    def operand(t0: int, t1: int, c0: int, c1: int) -> Tensor:
        if shared:
            return b_shared[None, :, c0:c1]
        return b[t0:t1, :, c0:c1].contiguous()

    per_row = k * cols
    if per_row > PRODUCT_BLOCK:  # one row at a time, in column blocks
        col_step = max(1, PRODUCT_BLOCK // k)
        for t in range(tiles):
            for c in range(0, cols, col_step):
                b_block = operand(t, t + 1, c, c + col_step)[0]
                for r in range(rows):
                    out[t, r, c : c + col_step] = tree_sum(a[t, r, :, None] * b_block, dim=-2)
        return out
    per_tile = rows * per_row
    if per_tile > PRODUCT_BLOCK:  # row blocks within each tile
        row_step = PRODUCT_BLOCK // per_row
        for t in range(tiles):
            b_tile = operand(t, t + 1, 0, cols)
            for r in range(0, rows, row_step):
                out[t, r : r + row_step] = tree_sum(a[t, r : r + row_step, :, None] * b_tile, dim=-2)
        return out
    tile_step = PRODUCT_BLOCK // per_tile  # whole tiles at a time
    for t in range(0, tiles, tile_step):
        b_tiles = operand(t, t + tile_step, 0, cols)
        out[t : t + tile_step] = tree_sum(a[t : t + tile_step, :, :, None] * b_tiles[:, None], dim=-2)
    return out


# --------------------------------------------------------------------------- exp, log, cos
_LOG2_E = 1.4426950408889634
# ln 2 split so that n * _LN2_HI is exact for |n| < 2^15 (_LN2_HI has 9 significant bits).
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_OVERFLOW = 88.72283935546875  # above: +inf (largest x with finite exp in fp32)
_EXP_UNDERFLOW = -103.97208404541016  # below: 0 (exp(x) < half the smallest subnormal)
# exp(r) for |r| <= ln2 / 2: Taylor coefficients 1/k!, k = 0..8 (error < 1e-9 relative).
_EXP_COEFFS = tuple(1.0 / math.factorial(k) for k in range(9))
# log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716: coefficients 2 / (2k + 1) of s^(2k+1).
# Per dtype: (ln2 high part, ln2 low part, coefficients). The high part has few enough bits that
# e * high is exact for every binary exponent e of the dtype (fp64: fdlibm's split).
_LOG_CONSTANTS = {
    torch.float32: (_LN2_HI, _LN2_LO, tuple(2.0 / (2 * k + 1) for k in range(7))),  # error < 1e-9
    torch.float64: (6.93147180369123816490e-01, 1.90821492927058770002e-10,
                    tuple(2.0 / (2 * k + 1) for k in range(13))),  # error < 1e-19
}
_SQRT_HALF = 0.7071067811865476
# pi/2 in three parts of 33 bits (fdlibm), so n * part is exact for the small n of sampling angles.
_PIO2_PARTS = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_TWO_OVER_PI = 0.6366197723675814
# cos(r), sin(r) for |r| <= pi/4: Taylor coefficients up to r^18 / r^19 (error < 1e-17).
_COS_COEFFS = tuple((-1.0) ** k / math.factorial(2 * k) for k in range(10))  # of r^(2k)
_SIN_COEFFS = tuple((-1.0) ** k / math.factorial(2 * k + 1) for k in range(10))  # of r^(2k+1)


def _horner(x: Tensor, coeffs: tuple[float, ...]) -> Tensor:
    """sum_k coeffs[k] * x^k with one exactly rounded mul and add per step (no fused multiply-add)."""
    acc = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc.mul_(x).add_(c)
    return acc


def _pow2(n: Tensor) -> Tensor:
    """2.0 ** n as fp32 for integer-valued fp32 n in [-126, 127], built from the exponent bits."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _finish(result: Tensor, out: Tensor | None) -> Tensor:
    return result if out is None else out.copy_(result)


def _check_dtype(name: str, x: Tensor, supported: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in supported:
        raise ValueError(f"fixed_order.{name}: dtype {x.dtype} not supported (expected one of {supported})")


def sqrt(x: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 sqrt(x) correctly rounded (as IEEE 754 requires, which the library's vectorised sqrt need not be:
    torch 2.13's CPU sqrt rounds about 20% of uniform fp32 inputs the other way), fp64 within one ulp; from exactly
    rounded ops.

    The input is scaled by an even power of two into m in [1, 4) (exact), so subnormals and huge values need no
    special case. Newton's iteration y <- (y + m / y) / 2 in fp64 from 1 or 1.5 (within a factor 1.5 of sqrt(m))
    reaches fp64 precision in 6 steps. fp32: the rounded candidate c moves to a neighbour where m lies beyond
    the square of the midpoint between them -- the midpoint has 25 bits, so its square is exact in fp64, and a
    tie cannot occur. Special values as IEEE: sqrt(+-0) = +-0, sqrt(+inf) = +inf, sqrt(x < 0) = NaN."""
    _check_dtype("sqrt", x, (torch.float32, torch.float64))
    wide = x.to(torch.float64)
    finite_positive = (wide > 0.0) & torch.isfinite(wide)
    safe = torch.where(finite_positive, wide, 1.0)
    _, exponent = torch.frexp(safe)  # safe = mantissa * 2^exponent, mantissa in [0.5, 1)
    half_exponent = torch.div(exponent - 1, 2, rounding_mode="floor")  # safe = m * 2^(2 h), m in [1, 4)
    m = torch.ldexp(safe, -2 * half_exponent)
    y = torch.where(m >= 2.0, 1.5, 1.0)
    for _ in range(6):
        y = (y + m / y) * 0.5
    rooted = y.to(x.dtype)
    if x.dtype == torch.float32:
        up = torch.nextafter(rooted, torch.full_like(rooted, torch.inf))
        down = torch.nextafter(rooted, torch.zeros_like(rooted))
        here = rooted.to(torch.float64)
        above = ((here + up.to(torch.float64)) * 0.5) ** 2  # exact squares of the midpoints (50 bits)
        below = ((here + down.to(torch.float64)) * 0.5) ** 2
        rooted = torch.where(m > above, up, torch.where(m < below, down, rooted))
    result = torch.ldexp(rooted.to(torch.float64), half_exponent).to(x.dtype)  # exact: a power-of-two scale
    result = torch.where(finite_positive, result, x)  # +-0, +inf and NaN are their own roots
    return _finish(torch.where(x < 0.0, torch.nan, result), out)


def exp(x: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 exp(x) from exactly rounded ops: x = n ln2 + r, exp(x) = 2^n * p(r).

    Special values as torch: exp(-inf) = 0, exp(+inf) = +inf, NaN stays NaN."""
    _check_dtype("exp", x, (torch.float32,))
    n = torch.round(x * _LOG2_E).clamp_(-151.0, 129.0)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _horner(r, _EXP_COEFFS)
    # 2^n in two factors so that results down to the subnormals are reached without 2^-150.
    n_low = torch.floor(n * 0.5)
    result = p.mul_(_pow2(n_low)).mul_(_pow2(n - n_low))
    result = torch.where(x > _EXP_OVERFLOW, torch.inf, result)
    result = torch.where(x < _EXP_UNDERFLOW, 0.0, result)
    return _finish(torch.where(torch.isnan(x), x, result), out)


def log(x: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32/fp64 log(x) from exactly rounded ops: x = m 2^e, m in [sqrt(1/2), sqrt(2)), log(x) = e ln2 + 2 atanh(s).

    Special values as torch: log(0) = -inf, log(+inf) = +inf, log(x < 0) = NaN, NaN stays NaN."""
    _check_dtype("log", x, tuple(_LOG_CONSTANTS))
    ln2_hi, ln2_lo, coeffs = _LOG_CONSTANTS[x.dtype]
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1): exact
    low = mantissa < _SQRT_HALF
    m = torch.where(low, mantissa * 2.0, mantissa)
    e = (exponent - low.to(exponent.dtype)).to(x.dtype)
    f = m - 1.0  # exact (Sterbenz)
    s = f / (f + 2.0)
    log_m = s * _horner(s * s, coeffs)
    result = e * ln2_hi + (log_m + e * ln2_lo)
    result = torch.where(x == 0.0, -torch.inf, result)
    result = torch.where(x == torch.inf, torch.inf, result)
    return _finish(torch.where((x < 0.0) | torch.isnan(x), torch.nan, result), out)


def cos(x: Tensor, out: Tensor | None = None) -> Tensor:
    """fp64/fp32 cos(x) from exactly rounded ops, for moderate |x| (sampling angles in [0, 2 pi]):
    x = n pi/2 + r, |r| <= pi/4, then +-cos(r) or +-sin(r) by quadrant. Accurate to ~1e-16 for |x| < 1e5."""
    _check_dtype("cos", x, (torch.float32, torch.float64))
    n = torch.round(x * _TWO_OVER_PI)
    r = x
    for part in _PIO2_PARTS:
        r = r - n * part
    r2 = r * r
    cos_r = _horner(r2, _COS_COEFFS)
    sin_r = r * _horner(r2, _SIN_COEFFS)
    quadrant = torch.remainder(n, 4.0)
    result = torch.where((quadrant == 0.0) | (quadrant == 2.0), cos_r, sin_r)
    result = torch.where((quadrant == 1.0) | (quadrant == 2.0), -result, result)
    return _finish(torch.where(torch.isfinite(x), result, torch.nan), out)
