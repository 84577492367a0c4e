"""Runtime guard for the exact CPU kernels: probe each host property they rely on, never trust it blindly.

The exact CPU kernels (``cpu_exact``) get their speed from two host libraries, and their
exactness then rests on two *measured* properties of them, not on construction:

- ``gemm_rows``: a batched GEMM (``torch.bmm``: MKL, OpenBLAS, Accelerate, ...) gives an output
  row the same bits whatever the tile height (``ROW_BLOCKS``), the row's position in its tile, the
  number of tiles in the call and the torch thread count;
- ``elementwise_exp`` / ``elementwise_log`` / ``elementwise_cos`` / ``elementwise_sqrt``: the vectorised
  ``torch.exp`` / ``torch.log`` / ``torch.cos`` / ``torch.sqrt`` give an element the same bits wherever it sits in
  a chunk (position, alignment, chunk length, threads). (exp and log serve the kernels; log, cos and sqrt in fp64
  serve the counter-based sampler, whose noise must not depend on the batch either; sqrt in fp32 serves RMSNorm,
  the gradient norm and AdamW. sqrt is a library function like the others, not an IEEE operation: torch 2.13's
  CPU sqrt rounds about 20% of uniform fp32 inputs other than the correctly rounded root, ``fixed_order.sqrt``.)

The GEMM classes of a low-precision dtype (``LIBRARY_DTYPES``: bf16) are probed the same way, on the host's GEMM
in that dtype (oneDNN's bf16 GEMM on x86: exact products, fp32 accumulation, one rounding of each output to bf16).
Where it holds, a bf16 class runs it (``blas``, or ``blas-1-thread``) -- the speed of the host's bf16 GEMM, with
another accumulation order than the fp32 GEMM's, so other bits than computing in fp32; where it fails, the class
computes in fp32 from upcast operands (``UPCAST_PATH``: the fp32 class's own path, exact products and one rounding
of the result, what every bf16 GEMM did before), never the fixed-order GEMM in bf16. A bf16 output rounds away most
accumulation-order differences (about 1 in 10^4 outputs shows one on random data), so its probe's rows make them
show: their products cancel pairwise, so that the outputs are the accumulation's rounding errors themselves
(``order_revealing``).

A large fp32 linear-layer class (the shared weight seen transposed, at least ``ONEDNN_MIN_WEIGHT`` elements, on
x86) first tries another library GEMM: ``onednn_rows`` -- torch's own oneDNN linear op (``onednn_linear``: oneDNN's
JIT matmul on the weight as stored, the kernel vLLM's CPU build runs) gives a row the same bits in the same
arrangements as ``gemm_rows`` asks of ``torch.bmm``. Where it holds the class runs oneDNN (path ``onednn``: on the
AMD EPYC this project was built on, about 2x faster than MKL's fp32 GEMM at llama100m's shapes, ``vexact bench
decode_profile --gemm``); where it fails the class is probed and run on ``torch.bmm`` as any other (path
``torch.bmm`` on the oneDNN record: no warning, no bit computed yet). Smaller classes keep ``torch.bmm``, where
oneDNN's per-call overhead outweighs its kernel. A class's bits are oneDNN's or MKL's, never both in one process,
so rollout and training stay bitwise comparable; which one a class takes is a fixed rule plus a probe, never a
timing. (On an Intel Xeon with AMX the two were closer, and MKL's was not the faster end to end: ``onednn_rows`` is
tried there too.) ``VEXACT_CPU_ONEDNN=off`` never tries it: the guard's ``onednn`` choice, which its report names.

A further property only buys speed: ``same_bits`` -- a faster arrangement of the same library calls (a weight
gradient's chunk GEMMs on views of its inputs instead of transposed, tiled copies; a linear layer's row tiles as one
GEMM; an input gradient on its weight as stored) gives the bits of the kernels' own arrangement. Where it fails
the kernels keep their own arrangement (``canonical``), so no bit ever depends on it.

The first two held on the machines this project was built on, and both can fail elsewhere: another BLAS,
another CPU generation (AVX-512 micro-kernels), another torch build. So a ``HostGuard`` probes a
property the first time an op needs it, for each *shape class* that matters (GEMM: K, N, the
operand layout and the compute dtype; elementwise: the function and dtype), and caches the verdict
for the process:

- the probe computes the same random rows in every arrangement the kernels can produce (each tile
  height, shifted positions, many tiles per call) at the current thread count, and compares them
  bitwise with one reference arrangement computed with 1 thread; a thread count seen later is
  verified against the same reference before it is used (the record holds the reference's digest, not its tensor:
  it is computed again, and must have the same bits, before the arrangements are compared with it);
- if every arrangement agrees, the op uses the fast library path (``blas`` / ``vectorised``);
- if a GEMM differs only at more than one thread (MKL splits a long K reduction between threads) while every
  arrangement agrees at 1 thread, the class takes the ``blas-1-thread`` path: the library GEMM, always called
  with 1 torch thread, so its rows are the 1-thread reference's whatever the process's thread count; at several
  threads a call's tiles are shared out between them, each thread's GEMM seeing one thread, where a ``same_bits``
  check finds that gives the 1-thread call's bits (``loops.split_bmm``; else the call runs on 1 thread: that class's
  parallelism lost, not its speed per thread);
- a class its kernel declares ``one_thread`` (a bf16 weight gradient's long reduction chunk: ``gemm_weight_gradient``)
  takes the ``blas-1-thread`` path by construction, probed at 1 thread only: a BLAS may split a long reduction
  between threads where a call's tiles leave a thread idle (oneDNN's AMX kernels on an Intel Xeon did for a
  768-token chunk in three row tiles at 2 threads), a choice that follows the call's tile count and the process's
  history, which no probe can cover; called with 1 thread, the GEMM has no such choice to make;
- if any other arrangement differs, a bf16 class computes in fp32 (``UPCAST_PATH``: slower, never less exact, so
  no warning); any other class of ``fixed_order`` (slower,
  invariant by construction) and a RuntimeWarning names the property, the shape class and the
  arrangement that failed. It is never silently wrong.

The decision is per shape class, never per call: rollout and training calls of one class always
take the same path, so they stay bitwise comparable. ``report()`` says which path each op used
and what the probes found (``vexact check`` prints it).

Modes (``HostGuard(mode=...)``, default from the ``VEXACT_CPU_EXACT_PATH`` environment variable, which
accepts the first three): ``auto`` (probe, fall back where needed), ``canonical`` (probe the library properties as
``auto`` does, but take no ``same_bits`` arrangement: what a host whose ``same_bits`` probes all fail gets, to
measure that host's speed on any host), ``fixed-order`` (always the
by-construction path: no library property is relied on at all; bf16 GEMM classes compute in fp32 on it) and
``unguarded`` (trust the library
without probing -- what vexact did before the guard; only for tests that show what the guard prevents).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import Tensor

from . import compiled_loops, fixed_order

MODES = ("auto", "canonical", "fixed-order", "unguarded")
PROBING_MODES = ("auto", "canonical")  # the modes that probe the library properties
LIBRARY_DTYPES = (torch.bfloat16,)
"""Operand dtypes whose GEMM classes may run the host's GEMM in that dtype where the probe finds it invariant; every
other dtype (and a class whose probe fails) computes in fp32 from upcast operands."""
UPCAST_PATH = "fp32-upcast"  # a LIBRARY_DTYPES class that computes in fp32 (operands upcast, one rounding)
ENV_MODES = ("auto", "canonical", "fixed-order")  # what users may choose; "unguarded" is for tests that show what
# the guard prevents
MODE_ENV = "VEXACT_CPU_EXACT_PATH"
ONEDNN_ENV = "VEXACT_CPU_ONEDNN"
ONEDNN_CHOICES = ("auto", "off")
"""``VEXACT_CPU_ONEDNN``: ``auto`` (the default: a large fp32 linear class tries oneDNN first, ``onednn_rows``) or
``off`` (it never does: every fp32 class is probed and run on ``torch.bmm``, MKL on torch's x86 builds). Other bits
for those classes, the same in rollout and training; for measuring which library GEMM a host runs faster
(``vexact bench end_to_end`` records the choice), or for a user who wants MKL's bits there."""
REFERENCE_THREADS = 1
SINGLE_THREAD_PATH = "blas-1-thread"  # a GEMM class right at 1 thread only: the library, called with 1 thread
SAME_BITS = "same_bits"  # property: a faster arrangement of the same library calls gives the kernels' own bits
ONEDNN_ROWS = "onednn_rows"  # property: torch's oneDNN linear op passes gemm_rows's probe for a large fp32 class
ONEDNN_PATH, BMM_PATH = "onednn", "torch.bmm"  # its two paths: the class runs oneDNN, or is probed on torch.bmm
ONEDNN_MIN_WEIGHT = 1 << 18
"""Elements (K x N) of a shared, transposed fp32 GEMM operand from which the class tries oneDNN (``onednn_rows``):
below it oneDNN's per-call overhead (about 10 us a call on the AMD EPYC) costs more than its faster kernel saves
(llama100m's k/v projections, 576 x 192: 0.81-0.86x of MKL's speed at 8 rows; its q/o, 576 x 576: 1.05-1.22x faster;
``vexact bench decode_profile --gemm``). The RL testbed's and ``vexact check``'s models lie wholly below it."""
FASTER_PATH, CANONICAL_PATH = "faster", "canonical"  # its two paths (neither one is less exact than the other)
MACHINE_THREADS = max(torch.get_num_threads(), os.cpu_count() or 1)  # also probed at first use (see _run_probe)
PROBE_ROWS = 64  # rows per probe: the tallest tile
CROWD_ROWS = 3 * PROBE_ROWS  # the probe rows between as many other rows on each side: many tiles in one call
PROBE_SEED = 20261123
"""The seed of every probe's inputs. Any fixed seed would do: the values must be random (every mantissa bit in play,
so another rounding shows) and the same in every process (a verdict must not depend on the run); the digits are the
date the guard was written, nothing more."""
PROBE_ELEMENTS = 4096
ELEMENTWISE_SHIFTS = (1, 3, 7, 8, 15, 16, 31)  # positions/alignments tried: every residue class of 8 and 16 lanes
_EPOCHS = itertools.count(1)  # HostGuard.epoch: one counter for every guard, so an epoch names one guard's state


CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
"""CPU features that change which GEMM micro-kernels a BLAS runs (and so the bits of a probe): recorded with every
result so that a result names the kind of host it came from."""


@cache
def host_cpu() -> dict:
    """The host's CPU: its model name, architecture and the features of ``CPU_FLAGS_OF_NOTE`` it has (from
    /proc/cpuinfo where there is one). Hosts of one kind differ here (an AMD EPYC; an Intel Xeon with AMX-bf16)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine(), "machine": platform.machine(),
            "flags": [f for f in CPU_FLAGS_OF_NOTE if f in flags]}


def mode_from_env() -> str:
    """The guard mode named by ``VEXACT_CPU_EXACT_PATH`` (default ``auto``); a bad value is an error."""
    mode = os.environ.get(MODE_ENV, "auto").strip() or "auto"
    if mode not in ENV_MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(ENV_MODES)}")
    return mode


def onednn_from_env() -> bool:
    """Whether ``VEXACT_CPU_ONEDNN`` (default ``auto``) lets large fp32 linear classes try oneDNN; a bad value is an
    error."""
    choice = os.environ.get(ONEDNN_ENV, "auto").strip() or "auto"
    if choice not in ONEDNN_CHOICES:
        raise ValueError(f"{ONEDNN_ENV}={choice!r}: expected one of {', '.join(ONEDNN_CHOICES)}")
    return choice == "auto"


@dataclass
class ProbeRecord:
    """What one probe found for one shape class, and the path its ops take."""

    property: str
    shape_class: str
    path: str
    passed: bool | None  # None: not probed (mode fixed-order or unguarded)
    threads_checked: list[int] = field(default_factory=list)
    failure: str | None = None
    note: str | None = None  # why a class that failed somewhere runs the single-thread library path
    seconds: float = 0.0
    ops: set[str] = field(default_factory=set)
    fallback: str = "fixed-order"  # the path a failed probe sends the class to (a bf16 GEMM class: UPCAST_PATH)
    tile_heights: tuple[int, ...] = ()  # gemm_rows: the tile heights whose rows match the reference (the kernels
    # use only these; every height on the fixed-order path)
    reference: Tensor | None = None  # the 1-thread reference outputs, held only while arrangements are compared
    reference_digest: str | None = None  # the reference's bits (``_digest``), kept to verify later thread counts
    make_reference: Callable[[], Tensor] | None = None  # computes the reference again (at 1 thread) for that check
    check: Callable[[], str | None] | None = None  # reruns the arrangements at the current thread count

    def as_dict(self) -> dict:
        return {"property": self.property, "shape_class": self.shape_class, "path": self.path,
                "passed": self.passed, "threads_checked": sorted(self.threads_checked), "failure": self.failure,
                **({"tile_heights": list(self.tile_heights)} if self.property in ("gemm_rows", ONEDNN_ROWS)
                   else {}),
                **({"fallback": self.fallback} if self.fallback in (UPCAST_PATH, BMM_PATH) else {}),
                **({"note": self.note} if self.note else {}),
                "seconds": round(self.seconds, 4), "ops": sorted(self.ops)}


class torch_threads:  # lower case: used like a function, ``with torch_threads(n):``
    """Torch's thread count set to ``threads`` for the block (None: left as it is), and the caller's put back after
    it, also when the block raises or changed the count itself. Torch's thread count is process state: a call that
    runs at its own count (the probe, ``vexact measure``'s ``threads`` setting) must not leave its caller at it.
    ValueError for a count torch would refuse with a RuntimeError of its own. A class, not a generator: it wraps
    every GEMM of a ``blas-1-thread`` class (``_with_threads``), where contextlib's overhead would be 3x this."""

    __slots__ = ("threads", "before")

    def __init__(self, threads: int | None) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.threads = threads

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


def _with_threads(threads: int, fn: Callable[[], object]) -> object:
    """fn() under ``threads`` torch threads (the probe must compare thread counts), the caller's put back after."""
    with torch_threads(threads):
        return fn()


def _digest(t: Tensor) -> str:
    """A digest of ``t``'s dtype, shape and bits (SHA-256): two tensors with one digest are bitwise equal."""
    digest = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # the bits, read in place
    return digest.hexdigest()


def _rows_differing(a: Tensor, b: Tensor) -> int:
    """Rows of a and b ([rows, ...]) that are not bitwise equal (NaN-free probe data)."""
    return int((a != b).reshape(a.shape[0], -1).any(dim=1).sum())


def _tile_starts(height: int) -> list[int]:
    """The first probe row of each tile that covers the ``PROBE_ROWS`` probe rows in tiles of ``height``: whole
    tiles side by side, the last one ending at the last row (overlapping the one before it where ``height`` does not
    divide ``PROBE_ROWS``, as 48 does not: rows 0-47 and 16-63)."""
    return [min(start, PROBE_ROWS - height) for start in range(0, PROBE_ROWS, height)]


def _probe_tiles(rows: Tensor, height: int) -> Tensor:
    """The probe rows [PROBE_ROWS, K] as tiles [T, height, K] (``_tile_starts``): a view where ``height`` divides
    them, else a copy."""
    if PROBE_ROWS % height == 0:
        return rows.view(PROBE_ROWS // height, height, rows.shape[1])
    return torch.stack([rows[start : start + height] for start in _tile_starts(height)])


class HostGuard:
    """Chooses, per shape class, between a host library primitive and its by-construction twin.

    ``bmm``/``exp``/``log``/``cos``/``sqrt`` are the library primitives (torch's by default; tests pass
    deliberately broken ones to show the probe catches them). ``row_blocks`` are the tile heights
    the kernels use, which the GEMM probe must cover."""

    def __init__(self, row_blocks: tuple[int, ...], *, mode: str | None = None, onednn: bool | None = None,
                 bmm: Callable[[Tensor, Tensor], Tensor] = torch.bmm,
                 exp: Callable[..., Tensor] = torch.exp, log: Callable[..., Tensor] = torch.log,
                 cos: Callable[..., Tensor] = torch.cos, sqrt: Callable[..., Tensor] = torch.sqrt):
        mode = mode_from_env() if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"HostGuard mode {mode!r}: expected one of {', '.join(MODES)}")
        if max(row_blocks) > PROBE_ROWS:
            raise ValueError(f"row_blocks {row_blocks}: the probe covers tiles of at most {PROBE_ROWS} rows")
        if list(row_blocks) != sorted(set(row_blocks)) or any(CROWD_ROWS % h for h in row_blocks):
            raise ValueError(f"row_blocks {row_blocks}: expected ascending tile heights, each dividing the probe's "
                             f"{CROWD_ROWS}-row crowd")
        self.mode = mode
        self.onednn = onednn_from_env() if onednn is None else onednn
        """Whether large fp32 linear classes may try oneDNN (``onednn_rows``); default from ``VEXACT_CPU_ONEDNN``."""
        self.row_blocks = tuple(row_blocks)
        self._library_bmm = bmm
        self._library_elementwise = {"exp": exp, "log": log, "cos": cos, "sqrt": sqrt}
        self._records: dict[tuple, ProbeRecord] = {}
        self.epoch = next(_EPOCHS)
        """Names this guard's answers as they stand: a new value (unique in the process, across guards) whenever an
        answer given may change -- a class whose check fails at a thread count verified later (its path then changes
        at every count). A new class changes no answer given. A cache of decisions drawn from the guard's answers
        (``gemm_linear.TiledPlan``, keyed with the thread count) keys on it, and so never outlives them."""

    # ------------------------------------------------------------------ the primitives
    def tile_heights(self, dtype: torch.dtype, b: Tensor, shared_operand: bool, op: str, *,
                     one_thread: bool = False) -> tuple[int, ...]:
        """The tile heights a kernel may use for GEMMs of this shape class (probed at first use): ``dtype`` is a's,
        ``b`` the right operand [T, K, N] as it will be passed to ``bmm`` (or one tile of it, [1, K, N]).

        On the library path: those of ``row_blocks`` whose rows the probe found bitwise equal to one 64-row tile
        (some BLAS give small tiles another micro-kernel: MKL on an AVX-512 Xeon did for 4-row tiles at K >= 128
        and 8-row tiles at K >= 256); on the fixed-order path every height (invariant by construction). A row's bits
        are then the same for every allowed height, so the kernels may choose any of them. ``one_thread``: the
        kernel's class always calls the library with 1 thread (``bmm``)."""
        record = self._gemm_record(dtype, b.shape[1], b, shared_operand, op, one_thread)
        return self.row_blocks if record.path == "fixed-order" else record.tile_heights

    def library_gemm(self, dtype: torch.dtype, b: Tensor, shared_operand: bool, op: str, *,
                     one_thread: bool = False) -> ProbeRecord | None:
        """The class's record where it runs torch's own GEMM (``torch.bmm``) as it is, verified at the current thread
        count -- a caller may then call it itself on the same operands, with the same bits, in tiles of
        ``record.tile_heights``; else None (the fixed-order or single-thread path, or a guard over another GEMM, as
        tests build): go through ``bmm``. Asked per call, like ``bmm``: a class's path can change later."""
        record = self._gemm_record(dtype, b.shape[1], b, shared_operand, op, one_thread)
        return record if self._on_torch_gemm() and is_library(record) else None

    def _on_torch_gemm(self) -> bool:
        """Whether this guard's GEMM is torch's own, unwrapped (not a test's broken or recording ``bmm``): only then may
        a caller run the library call itself on a class's record."""
        return self._library_bmm is torch.bmm and type(self).bmm is HostGuard.bmm

    def onednn_gemm(self, dtype: torch.dtype, b: Tensor, shared_operand: bool, op: str) -> ProbeRecord | None:
        """The class's record where it runs torch's oneDNN linear (path ``onednn``), verified at the current thread
        count -- a caller may then call ``onednn_linear`` itself on the same operands (the weight [N, K] as stored,
        in the class's tiles), with the same bits; else None. Asked per call, like ``library_gemm``."""
        record = self._gemm_record(dtype, b.shape[1], b, shared_operand, op)
        return record if self._on_torch_gemm() and record.path == ONEDNN_PATH else None

    def single_thread_gemm(self, dtype: torch.dtype, b: Tensor, shared_operand: bool, op: str, *,
                           one_thread: bool = False) -> ProbeRecord | None:
        """The class's record where it runs torch's own GEMM (``torch.bmm``) with 1 thread (``blas-1-thread``) -- a
        caller may then call it itself, with 1 thread, on the same operands, with the same bits, in tiles of
        ``record.tile_heights``; else None (any other path, or a guard over another GEMM). Asked per call, like
        ``library_gemm``."""
        record = self._gemm_record(dtype, b.shape[1], b, shared_operand, op, one_thread)
        return record if self._on_torch_gemm() and record.path == SINGLE_THREAD_PATH else None

    def compute_dtype(self, dtype: torch.dtype, b: Tensor, shared_operand: bool, op: str, *,
                      one_thread: bool = False) -> torch.dtype:
        """The dtype a GEMM of ``dtype`` operands of this shape class computes in (``b`` as for ``tile_heights``):
        ``dtype`` itself where it is one of ``LIBRARY_DTYPES`` and its class's probe found the host's GEMM in that
        dtype invariant (the kernels then pass the operands as they are, and get the output rounded to ``dtype``);
        else fp32 (the kernels upcast the operands: the fp32 class's path). Probed at first use; asked per call,
        like ``library_gemm``: a class's path can change later (a thread count verified after the first probe)."""
        if dtype not in LIBRARY_DTYPES:
            return torch.float32
        record = self._gemm_record(dtype, b.shape[1], b, shared_operand, op, one_thread)
        return torch.float32 if record.path == UPCAST_PATH else dtype

    def bmm(self, a: Tensor, b: Tensor, op: str, shared_operand: bool, *, one_thread: bool = False) -> Tensor:
        """a [T, R, K] @ b [T, K, N] through the path chosen for this shape class (R one of ``tile_heights``).

        ``shared_operand``: every tile multiplies the same (expanded) b, as a linear layer's weight;
        otherwise each tile has its own, as attention's key tiles. The class is (dtype, K, N, b's layout,
        shared or not, and ``one_thread``: a class its kernel runs with 1 thread by construction, whatever the
        probes find) -- never T or R, so every call of a class takes one path."""
        record = self._gemm_record(a.dtype, a.shape[2], b, shared_operand, op, one_thread)
        if record.path == UPCAST_PATH:
            raise ValueError(f"HostGuard.bmm: {record.shape_class} computes in fp32 on this host; upcast the operands "
                             "(ask compute_dtype() first)")
        if record.path == "fixed-order":
            return fixed_order.bmm(a, b)
        if a.shape[1] not in record.tile_heights:
            raise ValueError(f"HostGuard.bmm: tile height {a.shape[1]} is not one the probe allowed for "
                             f"{record.shape_class} ({record.tile_heights}); ask tile_heights() first")
        if record.path == SINGLE_THREAD_PATH:
            if a.shape[0] > 1 and torch.get_num_threads() > 1 and (
                    split := self._split_over_threads(a.dtype, a.shape[2], b, shared_operand, one_thread, record, op)):
                return split(a, b)
            return _with_threads(REFERENCE_THREADS, lambda: self._library_bmm(a, b))
        if record.path == ONEDNN_PATH:
            return onednn_linear(a, b[0].t())  # b: the shared weight [N, K] seen transposed, expanded
        return self._library_bmm(a, b)

    def _split_over_threads(self, dtype: torch.dtype, k: int, b: Tensor, shared: bool, one_thread: bool,
                            record: ProbeRecord, op: str) -> Callable[[Tensor, Tensor], Tensor] | None:
        """For a ``blas-1-thread`` class at several threads: ``loops.split_bmm`` (the tiles shared out between the
        threads, each thread's bmm seeing one thread) where the guard's ``same_bits`` check found it gives the 1-thread
        call's bits on the class's probe rows among other tiles, else None (the 1-thread call: slower, the same bits).
        The class's probe already found a tile's rows to have the same bits in calls of any tile count at 1 thread;
        the check makes sure the calls inside a parallel region are those calls. Only on torch's own GEMM, where the
        loops are built."""
        loops = compiled_loops.library()
        if loops is None or not self._on_torch_gemm():
            return None
        n, transposed, height = b.shape[2], operand_layout(b) == "transposed", record.tile_heights[-1]

        def probe(split: bool) -> Tensor:
            rows, other, cols = _gemm_probe_inputs(dtype, k, n)
            tiles = torch.cat([other, rows, other]).view(-1, height, k)  # an odd count of tiles: uneven shares
            operand = _operand(cols, tiles.shape[0], shared, transposed)
            return loops.split_bmm(tiles, operand) if split else self._library_bmm(tiles, operand)
        name = "one-thread GEMMs split over threads" + (" (one thread by construction)" if one_thread else "")
        if self.arrangement_agrees(name, record.shape_class, lambda: probe(False), lambda: probe(True), op):
            return loops.split_bmm
        return None

    def elementwise(self, name: str, dtype: torch.dtype, op: str) -> Callable[..., Tensor]:
        """``fn(x, out=...)``: ``name`` (exp, log, cos or sqrt) elementwise, through the path chosen for (name,
        dtype)."""
        if name not in self._library_elementwise:
            raise ValueError(f"HostGuard.elementwise: unknown function {name!r} (expected exp, log, cos or sqrt)")
        key = (f"elementwise_{name}", dtype)
        record = self._record_for(key, op, lambda: self._probe_elementwise(key, name, op))
        return getattr(fixed_order, name) if record.path == "fixed-order" else self._library_elementwise[name]

    def arrangement_agrees(self, name: str, shape_class: str, canonical: Callable[[], Tensor],
                           faster: Callable[[], Tensor], op: str) -> bool:
        """Whether ``faster`` -- another arrangement of the same library calls (other operand layouts, fewer copies)
        -- gives the bits of ``canonical``, the kernels' own arrangement, for the class (``name``, ``shape_class``).

        Both callables compute the class's probe inputs themselves, seeded. ``canonical`` with 1 thread is the
        reference; ``faster`` is compared with it bitwise at the current and the machine's thread count (and at
        each thread count seen later, before it is used). Where it differs the kernels keep the canonical
        arrangement: slower, never other bits, so no warning. In mode ``fixed-order`` never; ``unguarded`` trusts."""
        key = (SAME_BITS, name, shape_class)
        record = self._record_for(key, op, lambda: self._probe_arrangement(key, canonical, faster, op))
        return record.path == FASTER_PATH

    def report(self) -> dict:
        """Mode, the host's CPU (``host_cpu``) and every probe so far (property, shape class, path, verdict, threads
        checked, ops)."""
        return {"mode": self.mode, "onednn": "auto" if self.onednn else "off", "host": host_cpu(),
                "probes": [r.as_dict() for r in list(self._records.values())]}  # (copied: kernels may probe meanwhile)

    # ------------------------------------------------------------------ probes
    def _gemm_record(self, dtype: torch.dtype, k: int, b: Tensor, shared_operand: bool, op: str,
                     one_thread: bool = False) -> ProbeRecord:
        """The record of the GEMM class (dtype, K, b's N and layout, shared operand or not, one thread by
        construction or not), probed at first use."""
        layout = operand_layout(b)
        if self._onednn_eligible(dtype, k, b.shape[2], layout, shared_operand, one_thread):
            onednn_key = (ONEDNN_ROWS, dtype, k, b.shape[2], layout, shared_operand, one_thread)
            record = self._record_for(onednn_key, op, lambda: self._probe_gemm(onednn_key, op))
            if record.path == ONEDNN_PATH:
                return record
        key = ("gemm_rows", dtype, k, b.shape[2], layout, shared_operand, one_thread)
        return self._record_for(key, op, lambda: self._probe_gemm(key, op))

    def _onednn_eligible(self, dtype: torch.dtype, k: int, n: int, layout: str, shared: bool,
                         one_thread: bool) -> bool:
        """Whether the class tries torch's oneDNN linear before ``torch.bmm`` (``onednn_rows``): an fp32 linear
        layer's class (the shared weight seen transposed) of at least ``ONEDNN_MIN_WEIGHT`` elements, on x86 with
        oneDNN, in a probing mode, on torch's own GEMM (a test's guard over another ``bmm`` keeps it), unless the
        guard was made with oneDNN off (``VEXACT_CPU_ONEDNN=off``)."""
        return (self.onednn and dtype == torch.float32 and shared and layout == "transposed" and not one_thread
                and k * n >= ONEDNN_MIN_WEIGHT and self.mode in PROBING_MODES and onednn_available()
                and self._on_torch_gemm())

    def _record_for(self, key: tuple, op: str, probe: Callable[[], ProbeRecord]) -> ProbeRecord:
        """The class's record (probed at first use), verified for the current thread count, ``op`` noted."""
        record = self._records.get(key) or probe()
        self._verify_threads(record)
        record.ops.add(op)
        return record

    def _new_record(self, key: tuple, shape_class: str, fast_path: str, op: str,
                    fallback: str = "fixed-order") -> ProbeRecord:
        path = fallback if self.mode == "fixed-order" else fast_path
        record = ProbeRecord(property=key[0], shape_class=shape_class, path=path, passed=None, ops={op},
                             fallback=fallback)
        self._records[key] = record
        return record

    def _probe_gemm(self, key: tuple, op: str) -> ProbeRecord:
        prop, dtype, k, n, layout, shared, one_thread = key
        transposed = layout == "transposed"
        form = "shared" if shared else "per-tile"
        if prop == ONEDNN_ROWS:  # the same probe on torch's oneDNN linear; a failure sends the class to torch.bmm
            fallback, fast_path = BMM_PATH, ONEDNN_PATH
        else:
            fallback = UPCAST_PATH if dtype in LIBRARY_DTYPES else "fixed-order"
            fast_path = SINGLE_THREAD_PATH if one_thread else "blas"
        record = self._new_record(key, f"K={k} N={n} {layout} {form} {_dtype_name(dtype)}"
                                  + (" one-thread" if one_thread else ""), fast_path, op, fallback)
        if one_thread and record.path == SINGLE_THREAD_PATH:
            record.note = f"the library GEMM is called with {REFERENCE_THREADS} thread by construction"
        if self.mode not in PROBING_MODES:
            record.tile_heights = self.row_blocks
            return record

        # the inputs are made afresh for each run (seeded: the same values every time) and never held between runs:
        # the record keeps its check for thread counts seen later, and a vocabulary-wide class's inputs are 100+ MB
        def gemm(cols: Tensor, a_tiles: Tensor) -> Tensor:
            if prop == ONEDNN_ROWS:
                return onednn_linear(a_tiles, cols)  # what bmm() calls for the class: the weight [N, K] as stored
            return self._library_bmm(a_tiles, _operand(cols, a_tiles.shape[0], shared, transposed))

        def reference() -> Tensor:
            rows, _, cols = _gemm_probe_inputs(dtype, k, n)
            return gemm(cols, rows.view(1, PROBE_ROWS, k)).reshape(PROBE_ROWS, n)

        def run_arrangements() -> str | None:
            """Each arrangement's rows, compared with the reference; the first failure, described.

            At the first probe a tile height whose rows differ from the reference -- in tiles side by side in one
            call, or in one tile alone (the call every batch of at most that many rows makes: a library may give a
            call of few rows another kernel, as oneDNN's bf16 GEMM on an Intel Xeon with AMX does below 33 rows, which
            tiles side by side never showed) -- is dropped from the class's ``tile_heights`` (the kernels then use
            taller tiles); the class fails if the tallest tile differs, or if within an allowed height a row's bits
            depend on its position or on the number of tiles."""
            ref = record.reference
            rows, other, cols = _gemm_probe_inputs(dtype, k, n)

            def alone(height: int) -> int:  # one tile in its own call: what a batch of at most `height` rows runs
                return _rows_differing(gemm(cols, rows[:height].reshape(1, height, k)).reshape(height, n), ref[:height])

            def side_by_side(height: int, shift: int = 0) -> int:  # the probe rows in tiles of `height`, one call
                tiles = _probe_tiles(rows, height)
                if shift:  # every row `shift` places down its tile, and its output row back
                    out = gemm(cols, tiles.roll(shift, dims=1)).roll(-shift, dims=1)
                else:
                    out = gemm(cols, tiles)
                return sum(_rows_differing(out[t], ref[start : start + height])
                           for t, start in enumerate(_tile_starts(height)))

            if not record.tile_heights:  # first probe: which heights give the reference's bits
                record.tile_heights = tuple(h for h in self.row_blocks if not side_by_side(h) and not alone(h))
                if self.row_blocks[-1] not in record.tile_heights:
                    record.tile_heights = self.row_blocks
                    return f"tile height {self.row_blocks[-1]} (the reference's own) differs from the reference"
            for height in record.tile_heights:  # every allowed tile height: tiles side by side in one call, one alone
                if differing := side_by_side(height):
                    return f"tile height {height}: {differing} rows differ from one {PROBE_ROWS}-row tile"
                if differing := alone(height):
                    return f"one tile of {height} rows alone: {differing}/{height} rows differ from the reference"
                if differing := side_by_side(height, shift=1):
                    return f"tile height {height}, rows moved one place: {differing} rows differ"
            # many tiles per call (batch-parallel threading), the probe rows in the middle; and three of the tallest
            # tiles, a count no thread count above 1 divides evenly, 3 excepted (a BLAS may then split each tile's
            # work between threads instead of giving each thread whole tiles)
            crowd_rows = torch.cat([other, rows, other])  # one copy for both heights (a K-wide class's is 100+ MB)
            for height in dict.fromkeys((record.tile_heights[0], record.tile_heights[-1])):
                crowd = crowd_rows.view(-1, height, k)
                out = gemm(cols, crowd).reshape(-1, n)[PROBE_ROWS : 2 * PROBE_ROWS]
                if differing := _rows_differing(out, ref):
                    return f"{crowd.shape[0]} tiles of {height} rows in one call: {differing}/{PROBE_ROWS} rows differ"
            return None

        return self._run_probe(record, reference, run_arrangements, one_thread=one_thread)

    def _probe_elementwise(self, key: tuple, name: str, op: str) -> ProbeRecord:
        _, dtype = key
        record = self._new_record(key, f"{name} {_dtype_name(dtype)}", "vectorised", op)
        if self.mode not in PROBING_MODES:
            return record
        fn = self._library_elementwise[name]
        values = _elementwise_probe_values(name, dtype)
        total = values.numel()

        def apply(x: Tensor) -> Tensor:
            out = torch.empty_like(x)
            fn(x, out=out)
            return out

        def run_arrangements() -> str | None:
            ref = record.reference
            if not torch.equal(apply(values), ref):
                return "the same call twice differs"
            buffer = torch.cat([values, values])
            for shift in ELEMENTWISE_SHIFTS:
                rolled = apply(values.roll(shift)).roll(-shift)  # every element at another position
                if not torch.equal(rolled, ref):
                    return f"elements moved {shift} places: {int((rolled != ref).sum())}/{total} differ"
                offset = apply(buffer[shift : shift + total])  # same positions, shifted alignment
                expected = torch.cat([ref, ref])[shift : shift + total]
                if not torch.equal(offset, expected):
                    return f"buffer offset by {shift} elements: {int((offset != expected).sum())}/{total} differ"
            for length in (64, 256):  # short chunks, as at the end of a tensor
                pieces = torch.cat([apply(values[i : i + length]) for i in range(0, total, length)])
                if not torch.equal(pieces, ref):
                    return f"chunks of {length}: {int((pieces != ref).sum())}/{total} differ"
            return None

        return self._run_probe(record, lambda: apply(values), run_arrangements)

    def _probe_arrangement(self, key: tuple, canonical: Callable[[], Tensor], faster: Callable[[], Tensor],
                           op: str) -> ProbeRecord:
        _, name, shape_class = key
        # canonical mode: what a host whose every same_bits probe fails gets (for measuring that host's speed anywhere)
        record = self._new_record(key, f"{name}: {shape_class}", CANONICAL_PATH if self.mode == "canonical"
                                  else FASTER_PATH, op)
        if self.mode != "auto":
            return record

        def run_arrangements() -> str | None:
            out = faster()
            if torch.equal(out, record.reference):
                return None
            differing = int((out != record.reference).sum())
            return f"{differing}/{out.numel()} elements differ from the canonical arrangement"

        return self._run_probe(record, canonical, run_arrangements)

    def _run_probe(self, record: ProbeRecord, reference: Callable[[], Tensor],
                   arrangements: Callable[[], str | None], one_thread: bool = False) -> ProbeRecord:
        """The reference with 1 thread, every arrangement at the current thread count and at the machine's
        (``MACHINE_THREADS``), then the verdict. ``one_thread``: a class that always runs with 1 thread is probed at
        1 thread only.

        Why the machine's count too: the thread count changes no bit of a run (it is even a resume-safe key), so a
        class must not pass at 1 thread and fail later at another count once results exist (MKL on an AVX-512
        Xeon splits a K = 1000 reduction between 2 threads). Checking both counts at first use decides the path
        before any result of the class is computed."""
        start = time.perf_counter()
        with torch.no_grad():
            record.reference = _with_threads(REFERENCE_THREADS, reference)
            if one_thread:
                record.failure = _with_threads(REFERENCE_THREADS, arrangements)
                record.threads_checked.append(REFERENCE_THREADS)
                record.seconds += time.perf_counter() - start
                self._decide(record)
                record.reference = None  # no later thread count is checked: nothing to keep
                return record
            record.failure = arrangements()
            threads = torch.get_num_threads()
            if record.failure is not None and threads != REFERENCE_THREADS:
                record.failure = f"{record.failure} ({threads} threads vs {REFERENCE_THREADS})"
            record.threads_checked.append(threads)
            if record.failure is None and MACHINE_THREADS not in record.threads_checked:
                failure = _with_threads(MACHINE_THREADS, arrangements)
                record.failure = None if failure is None else f"{failure} ({MACHINE_THREADS} threads vs 1)"
                record.threads_checked.append(MACHINE_THREADS)
        record.check = arrangements
        if record.failure is not None and record.property == "gemm_rows":
            self._try_single_thread(record, arrangements)
        if record.reference is not None:
            # held as its digest, not its tensor: a vocabulary-wide class's reference is tens of MB, held for the
            # process; a thread count seen later computes it again and checks the digest first (_verify_threads)
            record.reference_digest, record.make_reference = _digest(record.reference), reference
        record.seconds += time.perf_counter() - start
        self._decide(record)
        record.reference = None
        return record

    def _try_single_thread(self, record: ProbeRecord, arrangements: Callable[[], str | None]) -> None:
        """A GEMM class that failed at some thread count: if every arrangement (tile heights chosen afresh) agrees
        with the reference at 1 thread, take the single-thread library path instead of the fixed-order one."""
        failure, heights = record.failure, record.tile_heights
        record.tile_heights = ()
        with torch.no_grad():
            at_one = _with_threads(REFERENCE_THREADS, arrangements)
        if at_one is None:
            record.path, record.failure = SINGLE_THREAD_PATH, None
            record.note = f"{failure}: the library GEMM is called with {REFERENCE_THREADS} thread"
        else:
            record.failure, record.tile_heights = failure, heights

    def _verify_threads(self, record: ProbeRecord) -> None:
        """A thread count not seen yet is checked against the 1-thread reference before it is used."""
        threads = torch.get_num_threads()
        if (record.check is None
                or record.path in ("fixed-order", SINGLE_THREAD_PATH, CANONICAL_PATH, UPCAST_PATH, BMM_PATH)
                or threads in record.threads_checked):
            return
        start = time.perf_counter()
        with torch.no_grad():
            reference_failure = self._restore_reference(record)
            failure = reference_failure or record.check()
        record.threads_checked.append(threads)
        record.seconds += time.perf_counter() - start
        if failure is not None:
            self.epoch = next(_EPOCHS)  # the class's path changes, at every thread count
            record.failure = f"{failure} ({threads} threads vs {REFERENCE_THREADS})"
            # earlier results all equal the reference: no caveat if this holds (not where the reference itself moved:
            # then the 1-thread library call is no reference either)
            if record.property == "gemm_rows" and reference_failure is None:
                self._try_single_thread(record, record.check)
            self._decide(record, earlier_results=record.path != SINGLE_THREAD_PATH)
        record.reference = None

    @staticmethod
    def _restore_reference(record: ProbeRecord) -> str | None:
        """``record.reference`` computed again with 1 thread, as at first use; a failure where its bits are not the
        first reference's (its digest): the 1-thread library call itself changed, so nothing can be compared with it."""
        record.reference = _with_threads(REFERENCE_THREADS, record.make_reference)
        if _digest(record.reference) != record.reference_digest:
            return f"the {REFERENCE_THREADS}-thread reference computed again differs from the one computed at first use"
        return None

    def _decide(self, record: ProbeRecord, earlier_results: bool = False) -> None:
        record.passed = record.failure is None
        if record.passed:
            return
        record.reference = None
        if record.property == SAME_BITS:  # the kernels' own arrangement: every result so far has its bits
            record.path = CANONICAL_PATH
            return
        record.path = record.fallback
        caveat = (" Results computed earlier in this process with the library path (at other thread counts) are "
                  "not bitwise comparable with later ones." if earlier_results else "")
        # a quiet fallback (as exact, only slower or another library's bits before any result): worth a warning only
        # where bits changed mid-run
        quiet = {BMM_PATH: ("the class runs torch.bmm's path", "oneDNN's", "now run torch.bmm's path"),
                 UPCAST_PATH: ("the class computes in fp32 (operands upcast)", "the host's", "now compute it in fp32")}
        if record.fallback in quiet:
            note, whose, now = quiet[record.fallback]
            record.note = f"{record.failure}: {note}"
            if earlier_results:
                warnings.warn(f"vexact exact CPU kernels: {whose} {record.shape_class} GEMM failed "
                              f"'{record.property}' ({record.failure}); ops {', '.join(sorted(record.ops))} {now}."
                              f"{caveat}", RuntimeWarning, stacklevel=4)
            return
        warnings.warn(f"vexact exact CPU kernels: host property '{record.property}' failed for {record.shape_class} "
                      f"({record.failure}); ops {', '.join(sorted(record.ops))} now use the "
                      f"fixed-order path (slower, invariant by construction).{caveat}", RuntimeWarning, stacklevel=4)


def is_library(record: ProbeRecord) -> bool:
    """Whether a GEMM class runs the library GEMM at every thread count (its path can change later in the process: a
    thread count verified after the first probe may send it to the fixed-order or the single-thread path)."""
    return record.path not in ("fixed-order", SINGLE_THREAD_PATH, UPCAST_PATH, ONEDNN_PATH)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN, enabled, with its linear op, on x86 (where oneDNN's fp32 kernels were
    measured faster than MKL's: ``ONEDNN_MIN_WEIGHT``)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [N, K].T through torch's own oneDNN linear op (the one its CPU compiler's linear layers
    call), on the weight as stored; no bias, no fused activation. Its rows' bits are probed before any class uses it
    (``onednn_rows``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


PACK_ROWS_HINT = 32
"""The row count oneDNN is told to pack a linear weight for (``mkldnn._reorder_linear_weight``'s batch size): the
hint vLLM's CPU build gives its own packed GEMM. A hint, not a shape: any row count runs on the packed weight."""


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: avx512bw/vl/dq or
    avx_ne_convert). Without them (an AVX2-only AMD EPYC) its bf16 linear and packing ops raise, and torch's bf16
    ``mm``/``bmm`` run its own GEMM instead."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_packing(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's linear op and its op that packs a linear weight once
    (``torch.ops.mkldnn._reorder_linear_weight``: the weight reordered into oneDNN's blocked layout, an opaque
    tensor that ``onednn_linear`` takes in place of the weight), for weights of ``dtype`` on this CPU (bf16: where
    ``onednn_bf16``)."""
    return (onednn_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (dtype != torch.bfloat16 or onednn_bf16()))


def onednn_packed(weight: Tensor) -> Tensor:
    """``weight`` [N, K] (contiguous) packed once for ``onednn_linear`` (``onednn_packing``): the same GEMM on the
    weight in oneDNN's own layout, which spares the op laying it out per call. Whether its bits are the unpacked op's
    is a host property, checked before any result uses it (``gemm_packed``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def operand_layout(b: Tensor) -> str:
    """The memory layout class of a bmm right operand [T, K, N]: ``transposed`` (K contiguous, as a
    [N, K] weight seen as its transpose) or ``row-major``."""
    return "transposed" if b.stride(1) == 1 and b.shape[1] > 1 else "row-major"


def _operand(cols: Tensor, tiles: int, shared: bool, transposed: bool) -> Tensor:
    """b [tiles, K, N] holding the columns ``cols`` [N, K]: one expanded operand or a copy per tile."""
    base = cols.t() if transposed else cols.t().contiguous()  # [K, N]
    expanded = base.expand(tiles, *base.shape)
    if shared:
        return expanded
    if transposed:
        return cols.expand(tiles, *cols.shape).contiguous().transpose(1, 2)
    return expanded.contiguous()


def _gemm_probe_inputs(dtype: torch.dtype, k: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The GEMM probe's rows [64, K], their neighbours [64, K] and b's columns [N, K], seeded ``PROBE_SEED``: standard
    normal values, made ``order_revealing`` for ``LIBRARY_DTYPES``."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    rows = torch.randn(PROBE_ROWS, k, generator=gen)
    other = torch.randn(PROBE_ROWS, k, generator=gen)  # neighbours that are not zero
    cols = torch.randn(n, k, generator=gen)  # b's columns, [N, K]
    if dtype not in LIBRARY_DTYPES:
        return rows.to(dtype), other.to(dtype), cols.to(dtype)
    (rows, cols), (other, _) = order_revealing(rows, cols, PROBE_SEED), order_revealing(other, cols, PROBE_SEED)
    return rows.to(dtype), other.to(dtype), cols.to(dtype)


def order_revealing(rows: Tensor, cols: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """fp32 probe operands rows [R, K] and cols [N, K] (standard normal) remade so that a GEMM's low-precision output
    (bf16: the fp32 accumulator rounded to 8 bits, which hides another accumulation order in all but about 1 in
    10^4 outputs of random data) shows its accumulation order: every value scaled by 2^-8 .. 2^8 (seeded ``seed``:
    partial sums far larger than the small products, which the accumulation then rounds), and the K positions paired
    at random: in every row a position repeats its partner's value while every column negates its partner's -- the
    products cancel pairwise, so the outputs are the accumulator's rounding errors themselves (0, or the one
    unpaired product of an odd K, in exact arithmetic), and another order shows in most of them. Pairs at random,
    not at a fixed distance: an accumulator whose first step adds exactly the partners (a bf16 dot-pair
    instruction: neighbours; a halving tree: K/2 apart) would cancel them exactly, in every order. Every row, not
    some: a defect tied to row positions must not miss them all. Deterministic: the same operands for the same
    inputs and seed."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = (t * 2.0 ** torch.randint(-8, 9, t.shape, generator=gen) for t in (rows, cols))
    k = rows.shape[1]
    order = torch.randperm(k, generator=gen)
    first, second = order[: k // 2], order[k // 2 : 2 * (k // 2)]
    cols[:, second] = -cols[:, first]
    rows[:, second] = rows[:, first]
    return rows, cols


def _elementwise_probe_values(name: str, dtype: torch.dtype) -> Tensor:
    """Random inputs spanning the range the kernels (and sampling) feed ``name``, plus its special values."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    body = PROBE_ELEMENTS - 256

    def uniform(count: int, low: float, high: float) -> Tensor:
        return low + torch.rand(count, generator=gen, dtype=torch.float64) * (high - low)

    if name == "exp":  # differences of scores and logits: mostly [-30, 0], tails to under/overflow
        values = [uniform(body, -30.0, 0.0), uniform(240, -110.0, 90.0)]
        special = [0.0, -0.0, -torch.inf, torch.inf, -87.5, -103.9, 88.7, 1e-30]
    elif name == "log":  # row sums of exp (>= 1), uniforms in (0, 1) (sampling), any positive value
        values = [uniform(body // 2, 1.0, 1e4), uniform(body - body // 2, 1e-12, 1.0), torch.exp(uniform(240, -85, 85))]
        special = [1.0, 2.0, 0.5, torch.inf, 0.0, 1e-40, 3e38, 1.5]
    elif name == "sqrt":  # mean squares (+ eps), Adam's second moments, squared norms, -2 log(u) of sampling
        values = [torch.exp(uniform(body, -60.0, 60.0)), uniform(240, 0.0, 50.0)]
        special = [0.0, -0.0, torch.inf, 1.0, 2.0, 4.0, 1e-40, 3e38]
    else:  # cos: sampling angles in [0, 2 pi]
        values = [uniform(body, 0.0, 2 * torch.pi), uniform(240, -100.0, 100.0)]
        special = [0.0, torch.pi / 2, torch.pi, 2 * torch.pi, -0.0, 1.0, 3.0, 6.0]
    return torch.cat([*values, torch.tensor(special * 2, dtype=torch.float64)]).to(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
