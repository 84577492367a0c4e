"""The compiled Triton kernels, audited without a GPU.

Why: the exact Triton backend is batch-invariant only if the code Triton *generates* keeps the promises the source
makes (``triton_exact``'s docstring): every output is reduced by one program in a fixed order, and that order is
set by compile-time tiles alone. A GPU is not needed to check this: Triton compiles for a CUDA target on any
host (ptxas ships in its wheel). So every kernel variant -- each kernel of the backend's modules (``triton_exact``
and ``triton_attention``: ``TritonModules``), fp32 and bf16, with the tiles, warps and options the wrappers launch
it with -- is compiled here for sm_80 (A100) and sm_90 (H100),
and the compiled code is checked:

* **atomics**: no atomic or reducing memory operation -- ``tt.atomic_rmw`` / ``tt.atomic_cas`` /
  ``tt.descriptor_reduce`` in TTIR and TTGIR, ``atom`` / ``red`` / ``multimem.red`` / ``cp.reduce.async`` in PTX.
  An atomic accumulation's order is the order in which programs happen to arrive.
* **split**: no reduction split across programs. Data flow on the TTIR: every program-id axis the kernel reads must
  reach the address of every store. If an axis does not (split-K over ``program_id(2)``, say), programs along it
  write the same outputs, which they can only combine by atomics or a race. Nor any cross-program channel: one
  CTA per cluster (``ttg.num-ctas`` = 1), no cluster barriers or distributed shared memory in PTX, no cooperative
  grid launch.
* **rows**: one binary whatever the row count. The launch arguments are built for several row counts
  (``ROW_COUNTS``: decode's 1, a ragged 17, ...) and put through Triton's own launch-time specialisation (its
  binder: integers divisible by 16 or equal to 1 are specialised unless ``do_not_specialize``); every distinct
  specialisation is compiled and their reductions (``tt.dot`` / ``ttng.warp_group_dot`` and ``tt.reduce`` with
  their layouts, and the loops around them) compared. A kernel with a reduction must have exactly one binary; an
  elementwise kernel may get a second one for a divisibility (wider loads) but has no reduction to reorder.
* **tiles**: the block shapes of every compiled dot and reduction are those of the dtype's tile table
  (``triton_exact``'s ``_MATMUL_TILES`` and ``_ROW_BLOCK``, ``triton_attention``'s ``_ATTENTION_TILES`` and
  ``_ATTENTION_BACKWARD_TILES``), and the warp count is the table's.
* **digests**: sha256 of each variant's TTGIR (locations stripped, values renumbered: ``numbered_values``) and PTX
  (debug lines, labels and sections stripped),
  recorded in ``kernels/triton_audit.json`` with the triton version, so that a toolchain or kernel change that
  alters the compiled code shows in ``tests/kernels/test_triton_audit.py``; re-record after a deliberate change.

The launch arguments mirror the wrappers (``triton_exact._linear_forward``, ``triton_attention._attention_forward``,
...) at one model shape (``SHAPE``: SmolLM-135M-like, the benchmarks' ``llama100m``); tiles and options are read from
the backend's modules themselves. Kernels are compiled in a worker process (``--worker``) that imports them in
compile-only mode (``VEXACT_TRITON_COMPILE_ONLY=1``, interpreter off): a process that already imported them
interpreted holds interpreter kernels, which cannot be compiled. The worker uses a fresh Triton cache, so
every run really compiles.

    python -m vexact_kernels.triton_audit            # compile, check, print the table, compare the digests
    python -m vexact_kernels.triton_audit --record   # ... and write kernels/triton_audit.json

Exit status: 0 all checks pass and the digests match the recording; 1 a check fails, a kernel does not compile,
or a digest differs (or the recording was made with another triton version); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .decode_tiles import DECODE_BLOCK_N

RECORD_PATH = Path(__file__).with_name("triton_audit.json")
RECORD_COMMAND = "python -m vexact_kernels.triton_audit --record"
TARGETS = {"sm_80": 80, "sm_90": 90}  # CUDA compute capabilities: A100, H100
DTYPES = ("fp32", "bf16")
ROW_COUNTS = (1, 2, 16, 17, 1000)
DECODE_TILE_COUNT = len(DECODE_BLOCK_N)  # the linear kernel's decode tiles per dtype (triton_exact._DECODE_TILES)
# The benchmarks' llama100m model (SmolLM-135M-like); head_dim 64. The cache and vocab are per-call sizes.
SHAPE = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, batch=2, prefix=40)

COMPILE_ONLY_ENV = {"VEXACT_TRITON_COMPILE_ONLY": "1", "TRITON_INTERPRET": "0"}


# --------------------------------------------------------------------------- the audited modules
@dataclass(frozen=True)
class TritonModules:
    """The exact Triton backend's modules, as the compile-only worker imports them: the one list of the modules whose
    kernels the audit must compile (``kernels``), and where each launch builder reads its tiles and options."""

    common: ModuleType  # triton_common: the mode, the compile options, the input precision
    attention: ModuleType  # triton_attention: attention's kernels, their tiles, LOG2_E
    exact: ModuleType  # triton_exact: every other kernel, and its tiles

    def kernels(self) -> dict[str, Any]:
        """Every kernel of the modules -- each ``@triton.jit`` function named ``*_kernel`` -- by name."""
        from triton.runtime.jit import JITFunction

        return {name: value for module in vars(self).values() for name, value in vars(module).items()
                if isinstance(value, JITFunction) and name.endswith("_kernel")}  # fmt: skip


# --------------------------------------------------------------------------- launch arguments
# Each builder returns (args, kwargs) for one launch of a kernel at a row count, as the kernel's wrapper
# (``triton_exact._linear_forward``, ``triton_attention._attention_forward``, ...) would pass them. CPU tensors stand
# in for CUDA ones: the binder reads only their dtype and address alignment.
@dataclass(frozen=True)
class Variant:
    """One compiled variant: a kernel of the Triton backend (``TritonModules``) at a dtype, with its launch builder
    and the dot and reduction shapes its tiles promise (``dots``: (M, K, N) per product; ``reduces``: block shape
    per tree)."""

    name: str
    kernel: str
    dtype: str
    launch: Callable[[TritonModules, Any, int], tuple[tuple, dict]]
    dots: Callable[[TritonModules, Any], list[tuple[int, ...]]]
    reduces: Callable[[TritonModules, Any], list[tuple[int, ...]]]


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}[name]


def _empty(*shape: int, dtype) -> Any:
    import torch

    return torch.empty(shape, dtype=dtype)


def _canonical_tiles(modules: TritonModules, dtype) -> tuple:
    return modules.exact._MATMUL_TILES[dtype]


def _decode_tiles(index: int) -> Callable:
    """The linear kernel's ``index``-th decode tile (``triton_exact._DECODE_TILES``, widest first), which a call of
    at most ``DECODE_ROWS_MAX`` rows runs where its first-use check on the device passes."""
    return lambda modules, dtype: modules.exact._DECODE_TILES[dtype][index]


def _linear_launch(bias: bool, tiles_of: Callable = _canonical_tiles) -> Callable:
    def launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
        k, n = SHAPE["hidden"], SHAPE["intermediate"]
        x, w, y = _empty(rows, k, dtype=dtype), _empty(n, k, dtype=dtype), _empty(rows, n, dtype=dtype)
        b = _empty(n, dtype=dtype) if bias else w
        block_m, block_n, block_k, num_warps, num_stages = tiles_of(modules, dtype)
        args = (x, w, b, y, rows, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1))
        kwargs = dict(
            HAS_BIAS=bias,
            CAST_TO_FP32=modules.common.INTERPRETING,
            INPUT_PRECISION=modules.common.input_precision(dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
            **modules.common.COMPILE_OPTIONS,
        )
        return args, kwargs

    return launch


def _linear_dots(tiles_of: Callable = _canonical_tiles) -> Callable:
    def dots(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
        block_m, block_n, block_k = tiles_of(modules, dtype)[:3]
        return [(block_m, block_k, block_n)]
    return dots


def _attention_tensors(dtype, rows: int) -> tuple:
    """(q, k, v, q_start, out-shaped tensor, lse-shaped fp32 tensor, cache_len) for ``rows`` queries per sequence
    (1: a decode step); the cache holds a prefix plus the new queries."""
    batch, heads, kv_heads, head_dim = SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    cache_len = SHAPE["prefix"] + rows
    q, out = _empty(batch, rows, heads, head_dim, dtype=dtype), _empty(batch, rows, heads, head_dim, dtype=dtype)
    k, v = (_empty(batch, cache_len, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    q_start = _empty(batch, dtype=_torch_dtype("int64"))
    lse = _empty(batch * heads, rows, dtype=_torch_dtype("fp32"))
    return q, k, v, q_start, out, lse, cache_len


def _attention_options(modules: TritonModules, dtype, tiles: tuple, **extra: Any) -> dict:
    """The launch options an attention kernel (forward or backward) gets from ``triton_attention``: its tiles
    (BLOCK_M, BLOCK_N, num_warps, num_stages), the dtype's precision and the compile options (``triton_common``)."""
    block_m, block_n, num_warps, num_stages = tiles
    common = modules.common
    return dict(CAST_TO_FP32=common.INTERPRETING, INPUT_PRECISION=common.input_precision(dtype), **extra,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(), num_warps=num_warps, num_stages=num_stages,
                **common.COMPILE_OPTIONS)


def _attention_launch(store_lse: bool) -> Callable:
    def launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
        heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
        q, k, v, q_start, out, lse, cache_len = _attention_tensors(dtype, rows)
        args = (q, k, v, q_start, out, rows, cache_len, heads, heads // kv_heads, head_dim,
                head_dim**-0.5 * modules.attention.LOG2_E,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                lse if store_lse else out)  # fmt: skip
        return args, _attention_options(modules, dtype, modules.attention._ATTENTION_TILES[dtype], STORE_LSE=store_lse)

    return launch


def _attention_bwd_delta_launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
    _, _, _, _, out, lse, _ = _attention_tensors(dtype, rows)
    dout = _empty(*out.shape, dtype=dtype)
    block_m, _, num_warps, _ = modules.attention._ATTENTION_BACKWARD_TILES[dtype]
    args = (out, dout, lse, rows, SHAPE["heads"], SHAPE["head_dim"], out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2))  # fmt: skip
    return args, dict(BLOCK_M=block_m, BLOCK_D=_block_d(), num_warps=num_warps, **modules.common.COMPILE_OPTIONS)


def _attention_bwd_launch(gradient_of: str) -> Callable:
    """The dK/dV kernel (``gradient_of`` "kv") or the dQ kernel ("q"), as ``_attention_backward`` launches them."""

    def launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
        heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
        q, k, v, q_start, dout, lse, cache_len = _attention_tensors(dtype, rows)
        delta = _empty(*lse.shape, dtype=lse.dtype)
        grads = (_empty(*k.shape, dtype=dtype), _empty(*v.shape, dtype=dtype)) if gradient_of == "kv" else (
            _empty(*q.shape, dtype=dtype),)  # fmt: skip
        args = (q, k, v, q_start, dout, lse, delta, *grads,
                rows, cache_len, heads, heads // kv_heads, head_dim, head_dim**-0.5 * modules.attention.LOG2_E,
                head_dim**-0.5,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                grads[0].stride(0), grads[0].stride(1), grads[0].stride(2))  # fmt: skip
        return args, _attention_options(modules, dtype, modules.attention._ATTENTION_BACKWARD_TILES[dtype])

    return launch


def _block_d() -> int:
    import triton

    return max(16, triton.next_power_of_2(SHAPE["head_dim"]))


def _attention_dots(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    block_m, block_n = modules.attention._ATTENTION_TILES[dtype][:2]
    return [(block_m, _block_d(), block_n), (block_m, block_n, _block_d())]  # q @ k.T, p @ v


def _attention_reduces(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    block_m, block_n = modules.attention._ATTENTION_TILES[dtype][:2]
    return [(block_m, block_n), (block_m, block_n)]  # row max and row sum of the scores


def _attention_bwd_delta_reduces(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    return [(modules.attention._ATTENTION_BACKWARD_TILES[dtype][0], _block_d())]  # rowsum(dO * O) over head dim


def _attention_bwd_dkdv_dots(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    m, n, d = *modules.attention._ATTENTION_BACKWARD_TILES[dtype][:2], _block_d()
    return [(m, d, n), (m, d, n), (n, m, d), (n, m, d)]  # q @ k.T, dO @ v.T, p.T @ dO, dS.T @ q


def _attention_bwd_dq_dots(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    m, n, d = *modules.attention._ATTENTION_BACKWARD_TILES[dtype][:2], _block_d()
    return [(m, d, n), (m, d, n), (m, n, d)]  # q @ k.T, dO @ v.T, dS @ k


def _row_options(modules: TritonModules) -> dict:
    """The launch options of a row kernel (rms_norm, log_softmax, token_logprobs, entropy): the row block and warps
    (``triton_exact``) and the compile options."""
    return dict(BLOCK=modules.exact._ROW_BLOCK, num_warps=modules.exact._ROW_WARPS, **modules.common.COMPILE_OPTIONS)


def _rms_norm_launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
    n = SHAPE["hidden"]
    x, w, y = _empty(rows, n, dtype=dtype), _empty(n, dtype=dtype), _empty(rows, n, dtype=dtype)
    return (x, w, y, n, 1e-5), _row_options(modules)


def _row_logits_launch(targets: bool) -> Callable:
    def launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
        import torch

        v = SHAPE["vocab"]
        logits = _empty(rows, v, dtype=dtype)
        if targets:
            args = (logits, _empty(rows, dtype=torch.int64), _empty(rows, dtype=torch.float32), v)
        else:
            args = (logits, _empty(rows, v, dtype=torch.float32), v)
        return args, _row_options(modules)

    return launch


def _entropy_launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
    import torch

    v = SHAPE["vocab"]
    args = (_empty(rows, v, dtype=dtype), _empty(rows, dtype=torch.float32), v)  # log-probs [rows, V] -> [rows]
    return args, _row_options(modules)


def _silu_mul_launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
    n = rows * SHAPE["intermediate"]
    gate, up, out = (_empty(n, dtype=dtype) for _ in range(3))
    return (gate, up, out, n), dict(BLOCK=modules.exact._ELEMENTWISE_BLOCK, **modules.common.COMPILE_OPTIONS)


def _exp_launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
    n = rows * SHAPE["hidden"]
    x, out = (_empty(n, dtype=dtype) for _ in range(2))
    return (x, out, n), dict(BLOCK=modules.exact._ELEMENTWISE_BLOCK, **modules.common.COMPILE_OPTIONS)


def _rope_launch(heads_key: str) -> Callable:
    def launch(modules: TritonModules, dtype, rows: int) -> tuple[tuple, dict]:
        import torch
        import triton

        heads, half = SHAPE[heads_key], SHAPE["head_dim"] // 2
        x, out = (_empty(SHAPE["batch"], rows, heads, 2 * half, dtype=dtype) for _ in range(2))
        cos, sin = (_empty(SHAPE["batch"], rows, half, dtype=torch.float32) for _ in range(2))
        kwargs = dict(BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(half),
                      **modules.common.COMPILE_OPTIONS)
        return (x, cos, sin, out, heads, half), kwargs

    return launch


def _none(modules: TritonModules, dtype) -> list[tuple[int, ...]]:
    return []


def _row_block(count: int) -> Callable:
    return lambda modules, dtype: [(modules.exact._ROW_BLOCK,)] * count


def variants() -> list[Variant]:
    """Every audited variant: each kernel of the Triton backend x fp32/bf16 (linear with and without bias and in each
    decode tile, attention's forward without and with the log-sum-exp store the backward needs, attention's three
    backward kernels, rope for the query and the key head count, whose BLOCK_H differ; exp, the MoE routing weights'
    exp, is fp32 only)."""
    kinds = [
        ("linear", "_linear_kernel", _linear_launch(False), _linear_dots(), _none),
        ("linear+bias", "_linear_kernel", _linear_launch(True), _linear_dots(), _none),
        *((f"linear(decode {i})", "_linear_kernel", _linear_launch(False, _decode_tiles(i)),
           _linear_dots(_decode_tiles(i)), _none) for i in range(DECODE_TILE_COUNT)),
        ("attention", "_attention_kernel", _attention_launch(False), _attention_dots, _attention_reduces),
        ("attention+lse", "_attention_kernel", _attention_launch(True), _attention_dots, _attention_reduces),
        ("attention_bwd_delta", "_attention_bwd_delta_kernel", _attention_bwd_delta_launch, _none,
         _attention_bwd_delta_reduces),
        ("attention_bwd_dkdv", "_attention_bwd_dkdv_kernel", _attention_bwd_launch("kv"), _attention_bwd_dkdv_dots,
         _none),
        ("attention_bwd_dq", "_attention_bwd_dq_kernel", _attention_bwd_launch("q"), _attention_bwd_dq_dots, _none),
        ("rms_norm", "_rms_norm_kernel", _rms_norm_launch, _none, _row_block(1)),
        ("log_softmax", "_log_softmax_kernel", _row_logits_launch(False), _none, _row_block(2)),
        ("token_logprobs", "_token_logprobs_kernel", _row_logits_launch(True), _none, _row_block(2)),
        ("entropy", "_entropy_kernel", _entropy_launch, _none, _row_block(1)),
        ("silu_mul", "_silu_mul_kernel", _silu_mul_launch, _none, _none),
        ("rope(q)", "_rope_kernel", _rope_launch("heads"), _none, _none),
        ("rope(k)", "_rope_kernel", _rope_launch("kv_heads"), _none, _none),
    ]
    return [Variant(f"{name}/{dtype}", kernel, dtype, launch, dots, reduces)
            for name, kernel, launch, dots, reduces in kinds for dtype in DTYPES] + [
        Variant("exp/fp32", "_exp_kernel", "fp32", _exp_launch, _none, _none)]  # fmt: skip


# --------------------------------------------------------------------------- compiling
def _bind(kernel: Any, args: tuple, kwargs: dict, target: int) -> tuple:
    """What ``JITFunction.run`` computes before compiling, minus the driver: the target is given instead of read
    off a device. The binder is Triton's own (it specialises integer arguments and pointer alignments)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    gpu = GPUTarget("cuda", target, 32)
    backend = make_backend(gpu)
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)  # fmt: skip
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return gpu, backend, kwargs, bound, specialization, options


def specialization_key(kernel: Any, args: tuple, kwargs: dict, target: int) -> str:
    """The key under which Triton caches the binary of this launch: launches with equal keys run the same code."""
    *_, specialization, options = _bind(kernel, args, kwargs, target)
    return repr((specialization, sorted(options.items())))


def compile_launch(kernel: Any, args: tuple, kwargs: dict, target: int) -> Any:
    """The compiled kernel (``.asm``: ttir, ttgir, ptx, cubin; ``.metadata``) of one launch for CUDA compute
    capability ``target``, from the same inputs as ``JITFunction.run`` (``_pack_args``)."""
    from triton.compiler import ASTSource, compile

    gpu, backend, kwargs, bound, specialization, options = _bind(kernel, args, kwargs, target)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__)


# --------------------------------------------------------------------------- reading the compiled code
_LOC = re.compile(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")
_ALIAS = re.compile(r"^(#[\w.]+) = (.*)$")


def strip_mlir(text: str) -> str:
    """MLIR text without locations (which name the source file and lines): ``#locN = ...`` lines and ``loc(...)``."""
    lines = [line for line in text.splitlines() if not re.match(r"^#loc\d* = ", line)]
    return "\n".join(_LOC.sub("", line) for line in lines) + "\n"


_VALUE = re.compile(r"%[\w.$-]+")


def numbered_values(mlir: str) -> str:
    """MLIR text with its SSA values renamed ``%v0``, ``%v1``, ... in order of first appearance: Triton names a value
    after the source variable it was assigned to (``%kv_head``, ``%k_pos_5``), so a renamed variable or code moved
    into a ``@triton.jit`` helper changes the names and nothing else."""
    names: dict[str, str] = {}
    return _VALUE.sub(lambda m: names.setdefault(m[0], f"%v{len(names)}"), mlir)


def strip_ptx(text: str) -> str:
    """PTX without debug information: ``.file``/``.loc`` lines (the source path and lines), the ``$L__tmpN:`` labels
    that only the DWARF sections refer to (they mark where an inlined ``@triton.jit`` helper's code begins and
    ends, so moving code into a helper adds them), and the DWARF sections."""
    body = text.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in body.splitlines()
                     if not re.match(r"^\s*\.(file|loc)\s|^\$L__tmp\d+:$", line)) + "\n"


def _resolve_aliases(mlir: str) -> str:
    """Inline ``#blocked1 = ...`` style attribute aliases, so that code compares without their numbering."""
    aliases = {}
    body = []
    for line in mlir.splitlines():
        match = _ALIAS.match(line)
        if match:
            aliases[match.group(1)] = match.group(2)
        else:
            body.append(line)
    text = "\n".join(body)
    for name in sorted(aliases, key=len, reverse=True):
        text = re.sub(re.escape(name) + r"(?![\w.])", aliases[name], text)
    return text


_ATOMIC_IR = re.compile(r"\b(tt\.atomic_rmw|tt\.atomic_cas|tt\.descriptor_reduce|ttng\.async_tma_reduce)\b")
_ATOMIC_PTX = re.compile(r"^\s*(?:@!?%\w+\s+)?(atom|red|multimem\.red|cp\.reduce\.async)[.\s]", re.MULTILINE)
_CLUSTER_PTX = re.compile(r"^\s*(?:@!?%\w+\s+)?(barrier\.cluster|mapa|\w[\w.]*shared::cluster)", re.MULTILINE)


def atomics(ttir: str, ttgir: str, ptx: str) -> list[str]:
    """Atomic / reducing memory operations in the compiled code, as 'stage: op' strings (empty: none)."""
    found = [f"{stage}: {op}" for stage, text in (("ttir", ttir), ("ttgir", ttgir))
             for op in sorted(set(_ATOMIC_IR.findall(text)))]  # fmt: skip
    found += [f"ptx: {op}" for op in sorted(set(_ATOMIC_PTX.findall(ptx)))]
    return found


def cross_program(ttgir: str, ptx: str, metadata: Any) -> list[str]:
    """Channels between programs other than atomics: clusters of CTAs, cluster barriers, distributed shared
    memory, cooperative (grid-synchronised) launches."""
    found = []
    ctas = re.search(r'"ttg\.num-ctas" = (\d+)', ttgir)
    if ctas is None or int(ctas.group(1)) != 1:
        found.append(f"ttgir: num-ctas {ctas.group(1) if ctas else 'missing'}")
    found += [f"ptx: {op}" for op in sorted(set(_CLUSTER_PTX.findall(ptx)))]
    if getattr(metadata, "launch_cooperative_grid", False):
        found.append("launch: cooperative grid")
    return found


_RESULT = re.compile(r"^\s*(%[\w.$-]+)(?::(\d+))?\s*=\s*(.*)$")
_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_PROGRAM_ID = re.compile(r"tt\.get_program_id (\w)")
_FOR = re.compile(r"scf\.for (%[\w.$-]+) = (\S+) to (\S+) step (\S+)(?: iter_args\((.*?)\) ->)?")


def _program_id_flow(ttir: str) -> tuple[set[str], list[tuple[str, set[str]]]]:
    """(program-id axes read, [(store, axes its address depends on)]) by data flow over the TTIR.

    A value depends on the values its op reads; the results of a region op (scf.if, tt.reduce) also on what its
    regions yield, and its block arguments on its operands; an ``scf.for`` iteration argument on its initial
    value, the value yielded for it and the loop bounds, and the loop's results on their iteration arguments.
    Iterated to a fixed point (loop-carried values). Atomic ops count as stores."""
    lines = strip_mlir(ttir).splitlines()
    deps: dict[str, set[str]] = {}

    def of(tokens: list[str]) -> set[str]:
        out: set[str] = set()
        for token in tokens:
            out |= deps.get(token, set()) | deps.get(token.split("#")[0], set())
        return out

    def add(name: str, new: set[str]) -> bool:
        if new <= deps.setdefault(name, set()):
            return False
        deps[name] |= new
        return True

    axes: set[str] = set()
    changed = True
    while changed:
        changed = False
        stores: list[tuple[str, set[str]]] = []
        regions: list[tuple[list[str], list[str], set[str]]] = []  # open regions: (results, iter args, inherited)
        for line in lines:
            stripped = line.strip()
            if stripped.startswith("}"):
                region = regions.pop()
                if stripped.endswith("{"):  # "} else {": the same op's next region
                    regions.append(region)
                continue
            match = _RESULT.match(line)
            result, count, op = ("", 0, stripped) if match is None else (match[1], int(match[2] or 1), match[3])
            results = [f"{result}#{i}" for i in range(count)] if count > 1 else [result] if result else []
            if (pid := _PROGRAM_ID.match(op)) is not None:
                axes.add(pid.group(1))
                changed |= add(result, {pid.group(1)})
            elif (loop := _FOR.match(op)) is not None:
                bounds = of(list(loop.group(2, 3, 4)))
                changed |= add(loop.group(1), bounds)
                pairs = re.findall(r"(%[\w.$-]+) = (%[\w.$-]+(?:#\d+)?)", loop.group(5) or "")
                for (arg, init), res in zip(pairs, results):
                    changed |= add(arg, of([init]) | bounds)
                    changed |= add(res, deps[arg])
                regions.append((results, [arg for arg, _ in pairs], bounds))
                continue
            elif op.startswith(("scf.yield", "tt.reduce.return")) and regions:
                owner_results, iter_args, inherited = regions[-1]
                yielded = _VALUE.findall(op)
                if iter_args:
                    for arg, res, value in zip(iter_args, owner_results, yielded):
                        changed |= add(arg, of([value]) | inherited)
                        changed |= add(res, deps[arg])
                else:
                    for res in owner_results:
                        changed |= add(res, of(yielded) | inherited)
                continue
            elif op.startswith("^bb") and regions:
                for arg in re.findall(r"(%[\w.$-]+):", op):
                    changed |= add(arg, regions[-1][2])
                continue
            operands = _VALUE.findall(op)
            if op.startswith(("tt.store", "tt.atomic_rmw", "tt.atomic_cas")):
                stores.append((op.split(" : ")[0], of(operands[:1])))  # the first operand is the address
            for res in results + ([result] if count > 1 else []):
                changed |= add(res, of(operands))
            if stripped.endswith("{"):
                regions.append((results, [], of(operands)))
    return axes, stores


def split_reductions(ttir: str) -> list[str]:
    """Stores whose address does not depend on every program-id axis the kernel reads: programs along that
    axis write the same outputs, i.e. a reduction (or any work) split across programs."""
    axes, stores = _program_id_flow(ttir)
    found = []
    for store, store_axes in stores:
        missing = sorted(axes - store_axes)
        if missing:
            found.append(f"program_id {'/'.join(missing)} does not address `{store}`")
    return found


_SHAPE = re.compile(r"<(\d+(?:x\d+)*)x[a-z]")


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.split("x")) for m in _SHAPE.findall(text)]


def reductions(ttgir: str) -> dict[str, list]:
    """The reductions of the compiled code: ``dots`` as (M, K, N) block shapes, ``reduces`` as input block
    shapes, and ``code``: their TTGIR (layouts inlined, value names and locations dropped) -- each product, each
    tree with its axis, combine ops and operand layout, and the loop headers around them: what decides the
    reduction order."""
    text = _resolve_aliases(strip_mlir(ttgir))
    dots, reduces, code = [], [], []
    in_reduce, chain = False, None  # chain: the result of the last product
    for line in text.splitlines():
        match = _RESULT.match(line)
        op = match.group(3) if match else line.strip()
        anonymous = _VALUE.sub("%", op)
        if in_reduce:
            code.append(anonymous)
            if op.startswith("})"):  # }) : (operand types) -> result types
                reduces.append(_shapes(op)[0])
                in_reduce = False
        elif op.startswith('"tt.reduce"'):
            code.append(anonymous)
            in_reduce = True
        elif re.match(r"(tt\.dot|ttng\.warp_group_dot|ttng\.tc_gen5_mma)\b", op):
            a, b = _shapes(op)[:2]
            accumulator = _VALUE.findall(op)[2]
            if dots and accumulator == chain:  # the K block cut into chained products (sm_80: K = 16 each)
                m, k, n = dots.pop()
                dots.append((m, k + a[-1], n))
            else:
                dots.append((a[-2], a[-1], b[-1]))
            chain = match.group(1) if match else None
            code.append(anonymous)
        elif op.startswith("ttng.warp_group_dot_wait") and chain is not None and _VALUE.findall(op)[0] == chain:
            # sm_90's asynchronous products: a wait hands the product on as its first result; the next product of
            # the same K block accumulates into that result (seen with a register operand cut into K = 16 parts).
            chain = f"{match.group(1)}#0" if match else None
        elif op.startswith("scf.for"):
            code.append(re.sub(r" iter_args\(.*", "", anonymous))
    return {"dots": sorted(dots), "reduces": sorted(reduces), "code": code}


_PRODUCT = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned|mma\.sync\.aligned)\.m(\d+)n\d+(k\d+)([\w.]*)")


def product_steps(ptx: str) -> list[str]:
    """The tensor-core product instructions in ``ptx`` with their N dimension left out (``wgmma m64 k16
    .f32.bf16.bf16``): what sums an output element's K chunk. Tiles that differ only in the columns a program owns
    should compile to the same steps; the linear kernel's decode tiles are held to the canonical tiles' (``problems``),
    the evidence behind the first-use check that decides on the device (``triton_exact.decode_tiles_agree``)."""
    return sorted({f"{'wgmma' if kind.startswith('wgmma') else 'mma'} m{m} {k} {rest}"
                   for kind, m, k, rest in _PRODUCT.findall(ptx)})


def digest(text: str) -> str:
    """sha256 hex digest of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()


def check_kernel(kernel: Any, launches: list[tuple[tuple, dict]], target: int) -> dict[str, Any]:
    """Compile ``kernel`` for every launch (one per row count) for ``target`` and read the compiled code.

    Returns ``binaries`` (distinct specialisations), ``same_reductions`` (every binary's reduction code equal),
    ``atomics``, ``split``, ``cross_program`` (findings; empty lists pass), ``dots``, ``reduces``,
    ``has_reduction``, ``num_warps``, the digests of the first launch's code (``ttgir``, ``ptx``) and
    ``compile_s``. ``violations`` turns it into a verdict."""
    start = time.perf_counter()
    compiled: dict[str, Any] = {}
    for args, kwargs in launches:
        key = specialization_key(kernel, args, kwargs, target)
        if key not in compiled:
            compiled[key] = compile_launch(kernel, args, kwargs, target)
    first = next(iter(compiled.values()))
    ttgir, ptx = first.asm["ttgir"], first.asm["ptx"]
    found = reductions(ttgir)
    codes = [reductions(c.asm["ttgir"])["code"] for c in compiled.values()]
    return {
        "binaries": len(compiled),
        "same_reductions": all(code == codes[0] for code in codes),
        "atomics": sorted({f for c in compiled.values() for f in atomics(c.asm["ttir"], c.asm["ttgir"], c.asm["ptx"])}),
        "split": sorted({f for c in compiled.values() for f in split_reductions(c.asm["ttir"])}),
        "cross_program": sorted(
            {f for c in compiled.values() for f in cross_program(c.asm["ttgir"], c.asm["ptx"], c.metadata)}
        ),
        "dots": [list(d) for d in found["dots"]],
        "reduces": [list(r) for r in found["reduces"]],
        "has_reduction": bool(found["dots"] or found["reduces"]),
        "products": product_steps(ptx),
        "num_warps": first.metadata.num_warps,
        "ttgir": digest(numbered_values(strip_mlir(ttgir))),
        "ptx": digest(strip_ptx(ptx)),
        "compile_s": round(time.perf_counter() - start, 2),
    }


# --------------------------------------------------------------------------- the worker (compile-only process)
def _worker() -> dict[str, Any]:
    """Compile and check every variant for every target; runs in a compile-only process (see the module doc)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from . import triton_attention, triton_common, triton_exact

    modules = TritonModules(common=triton_common, attention=triton_attention, exact=triton_exact)
    if modules.common.INTERPRETING:
        raise RuntimeError("triton_audit worker: the Triton kernels were loaded interpreted; run it through audit()")
    kernels = modules.kernels()
    default_warps = make_backend(GPUTarget("cuda", 80, 32)).parse_options({}).num_warps  # when a launch names none
    results: dict[str, Any] = {}
    for variant in variants():
        dtype = _torch_dtype(variant.dtype)
        kernel = kernels[variant.kernel]
        launches = [variant.launch(modules, dtype, rows) for rows in ROW_COUNTS]
        results[variant.name] = {
            "kernel": variant.kernel,
            "expected": {
                "dots": sorted(list(d) for d in variant.dots(modules, dtype)),
                "reduces": sorted(list(r) for r in variant.reduces(modules, dtype)),
                "num_warps": launches[0][1].get("num_warps", default_warps),
            },
            "targets": {target: check_kernel(kernel, launches, cc) for target, cc in TARGETS.items()},
        }
    return {"triton": triton.__version__, "kernels": sorted(kernels), "row_counts": list(ROW_COUNTS),
            "variants": results}


def run_worker(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``python ARGV`` in a compile-only process (this environment plus ``COMPILE_ONLY_ENV``) with a fresh,
    temporary Triton cache, so that everything is compiled; output captured."""
    with tempfile.TemporaryDirectory(prefix="vexact-triton-audit-") as cache:
        env = {**os.environ, **COMPILE_ONLY_ENV, "TRITON_CACHE_DIR": cache}
        return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=False)


def audit() -> dict[str, Any]:
    """Compile and check every variant (in a worker process) and return its results."""
    proc = run_worker(["-m", "vexact_kernels.triton_audit", "--worker"])
    if proc.returncode != 0:
        raise RuntimeError(f"triton_audit worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------- verdicts, table, recording
def violations(res: dict[str, Any]) -> list[str]:
    """What one kernel's ``check_kernel`` results break of the invariance contract (empty: nothing)."""
    out = [f"atomic {f}" for f in res["atomics"]]
    out += [f"split reduction: {f}" for f in res["split"]]
    out += [f"cross-program channel {f}" for f in res["cross_program"]]
    if not res["same_reductions"]:
        out.append(f"the reduction code differs between row counts ({res['binaries']} binaries)")
    elif res["has_reduction"] and res["binaries"] != 1:
        out.append(f"{res['binaries']} binaries for the row counts (a reduction must have one)")
    return out


def problems(result: dict[str, Any]) -> list[str]:
    """Every contract violation in ``audit()``'s results, as 'variant target: what' lines (empty: all pass):
    ``violations``, compiled tiles or warps other than the tile table's, and kernels the audit does not cover."""
    out = []
    for name, variant in result["variants"].items():
        expected = variant["expected"]
        for target, res in variant["targets"].items():
            where = f"{name} {target}"
            out += [f"{where}: {v}" for v in violations(res)]
            if res["dots"] != expected["dots"] or res["reduces"] != expected["reduces"]:
                out.append(f"{where}: compiled tiles dots {res['dots']} reduces {res['reduces']}, "
                           f"tile table says dots {expected['dots']} reduces {expected['reduces']}")  # fmt: skip
            if res["num_warps"] != expected["num_warps"]:
                out.append(f"{where}: {res['num_warps']} warps, tile table says {expected['num_warps']}")
    for name, variant in result["variants"].items():  # a decode tile sums a column as the canonical tiles do
        if name.startswith("linear(decode"):
            canonical = result["variants"][f"linear/{name.rsplit('/', 1)[1]}"]["targets"]
            for target, res in variant["targets"].items():
                if res["products"] != canonical[target]["products"]:
                    out.append(f"{name} {target}: products {res['products']}, the canonical tiles' "
                               f"{canonical[target]['products']}")
    audited = {v["kernel"] for v in result["variants"].values()}
    out += [f"{k}: a kernel of the Triton backend that the audit does not compile" for k in result["kernels"]
            if k not in audited]  # fmt: skip
    return out


def digests(result: dict[str, Any]) -> dict[str, Any]:
    """The recording: triton version and, per variant and target, the TTGIR and PTX digests."""
    return {
        "triton": result["triton"],
        "command": RECORD_COMMAND,
        "shape": SHAPE,
        "row_counts": result["row_counts"],
        "variants": {
            name: {t: {"ttgir": r["ttgir"], "ptx": r["ptx"]} for t, r in v["targets"].items()}
            for name, v in result["variants"].items()
        },
    }


def load_record(path: Path | None = None) -> dict[str, Any]:
    """The recorded digests (``RECORD_PATH`` unless ``path``)."""
    return json.loads((path or RECORD_PATH).read_text())


def digest_mismatches(result: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Differences between this run's digests and the recording (a version mismatch is one line saying so)."""
    if record["triton"] != result["triton"]:
        return [f"digests were recorded with triton {record['triton']}, this is triton {result['triton']}: "
                f"re-record with `{RECORD_COMMAND}` (after checking the audit passes)"]  # fmt: skip
    now, then = digests(result)["variants"], record["variants"]
    out = [f"{name}: not in the recording" for name in now if name not in then]
    out += [f"{name}: recorded but no longer audited" for name in then if name not in now]
    for name in sorted(set(now) & set(then)):
        for target in sorted(set(now[name]) | set(then[name])):
            for stage in ("ttgir", "ptx"):
                if now[name].get(target, {}).get(stage) != then[name].get(target, {}).get(stage):
                    out.append(f"{name} {target}: {stage} digest differs from the recording")
    if out:
        out.append(f"if the change is deliberate, re-record with `{RECORD_COMMAND}`")
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def table(result: dict[str, Any], record: dict[str, Any] | None) -> str:
    """The audit as a markdown table, one row per variant and target."""
    rows = ["| variant | target | no atomics | one program per output (no split) | no cluster / grid sync "
            "| binaries over row counts | dots (M, K, N) | reduces | warps | digest (ptx) | matches recording |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    then = record["variants"] if record and record["triton"] == result["triton"] else {}
    for name, variant in result["variants"].items():
        for target, r in variant["targets"].items():
            recorded = then.get(name, {}).get(target)
            match = "-" if recorded is None else _yes(recorded == {"ttgir": r["ttgir"], "ptx": r["ptx"]})
            binaries = f"{r['binaries']}" + ("" if r["same_reductions"] else " (reductions differ)")
            dots = " ".join("x".join(map(str, d)) for d in r["dots"]) or "-"
            reduces = " ".join("x".join(map(str, d)) for d in r["reduces"]) or "-"
            rows.append(f"| {name} | {target} | {_yes(not r['atomics'])} | {_yes(not r['split'])} "
                        f"| {_yes(not r['cross_program'])} | {binaries} | {dots} | {reduces} | {r['num_warps']} "
                        f"| `{r['ptx'][:12]}` | {match} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vexact_kernels.triton_audit", description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true", help=f"write the digests to {RECORD_PATH.name}")
    parser.add_argument("--json", metavar="PATH", help="also write the full results as JSON to PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from . import TRITON_PIP, triton_installed

    if not triton_installed():  # the audit compiles with Triton's own compiler
        print(f"error: the Triton audit needs the triton package, which is not installed: {TRITON_PIP}",
              file=sys.stderr)
        return 2
    if args.worker:
        json.dump(_worker(), sys.stdout)
        return 0
    start = time.perf_counter()
    try:
        result = audit()
    except RuntimeError as err:  # a kernel that does not compile for a target fails the audit
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "seconds": round(seconds, 1)}, indent=1))
    found = problems(result)
    if args.record and not found:
        RECORD_PATH.write_text(json.dumps(digests(result), indent=1) + "\n")
    record = load_record() if RECORD_PATH.exists() else None
    mismatches = digest_mismatches(result, record) if record else [f"no recording: run `{RECORD_COMMAND}`"]
    # stdout is the table alone (docs/triton_audit.md embeds it); the time and any failures go to stderr.
    print(f"triton {result['triton']}; row counts {result['row_counts']}; {len(result['variants'])} variants x "
          f"{', '.join(TARGETS)}\n")  # fmt: skip
    print(table(result, record))
    print(f"compiled and checked in {seconds:.0f} s", file=sys.stderr)
    for line in found + mismatches:
        print(f"FAIL {line}", file=sys.stderr)
    if args.record:
        print("error: not recorded: the audit fails" if found else f"recorded {RECORD_PATH.name}", file=sys.stderr)
    return 1 if found or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
