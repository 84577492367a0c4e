"""What the exact Triton kernels share: the mode they run in, and the pieces every kernel uses in it.

- the mode: compiled for CUDA, or interpreted on CPU (``INTERPRETING``, decided once, before any kernel is
  decorated; ``COMPILE_ONLY`` for the audit's compile-only worker);
- ``cast``: a cast to the output dtype that rounds to nearest even in the interpreter too;
- ``block_dot`` / ``block_sum``: every block product and block sum -- ``tl.dot`` / ``tl.sum`` compiled, fixed
  pairwise trees of exactly rounded fp32 operations interpreted;
- ``MASKED_SCORE``, the score of invisible keys and padding lanes;
- the launch settings every kernel is compiled with (``COMPILE_OPTIONS``, ``input_precision``) and the device
  check every wrapper makes first (``check_device``).

Why apart: ``triton_exact`` (the backend's ops) and ``triton_attention`` (attention's kernels) both build on these,
and the mode must be decided before either module decorates a kernel; so this module comes first and imports
neither. The tile shapes depend on the mode too, but each table belongs to its kernels and lives beside them
(``triton_exact._MATMUL_TILES``, ``triton_attention._ATTENTION_TILES``, ...).
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

# Compile-only: the GPU code paths and tiles without a device, so that the kernels can be compiled for CUDA
# targets and their code audited (vexact_kernels.triton_audit sets it in its own worker process). Launching
# a kernel then fails in check_device (CPU tensors).
COMPILE_ONLY = os.environ.get("VEXACT_TRITON_COMPILE_ONLY") == "1"

# The interpreter must be chosen before triton decorates any kernel: ``triton.jit`` reads
# ``triton.knobs.runtime.interpret`` at decoration time (live from the environment unless
# the knob was set in Python). The import comes after this line on purpose.
if not torch.cuda.is_available() and not COMPILE_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


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

# The interpreter's fp32 -> bf16 cast truncates (GPUs round to nearest even), so there the
# rounding is done by hand in ``cast``.
ROUND_BF16_BY_HAND: tl.constexpr = tl.constexpr(INTERPRETING)


@triton.jit
def cast(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
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
# Every block product and block sum goes through ``block_dot`` / ``block_sum``. Compiled,
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
    def block_dot(a: tl.tensor, b: tl.tensor, acc: tl.tensor | None = None, input_precision: tl.constexpr = None
                  ) -> tl.tensor:
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
    def block_sum(x: tl.tensor, axis: tl.constexpr) -> tl.tensor:
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
    block_dot = tl.dot
    block_sum = tl.sum


# Pinned rather than left to Triton's default (which flips from fused to unfused mul-add in
# Triton 3.10): either is invariant, but the bits must not change with a Triton upgrade.
# Unfused also rounds each mul and add separately, like the torch reference.
COMPILE_OPTIONS = dict(enable_fp_fusion=False)


def input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (tl.dot defaults to TF32 on GPUs).
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(op: str, **named: Tensor) -> None:
    if not INTERPRETING:
        for name, t in named.items():
            if not t.is_cuda:
                raise ValueError(f"triton_exact.{op}: {name} is on {t.device}; the compiled kernels need CUDA tensors "
                                 "(or run with TRITON_INTERPRET=1)")
