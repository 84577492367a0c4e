"""Compiled loops for the exact CPU kernels: the same bits as their torch-op compositions, fewer aten calls.

On small models the exact path's price is mostly per-op cost, not arithmetic: a halving-tree sum is a dozen aten
calls (views, adds, a scratch buffer), each with its own dispatch, allocation and TensorIterator set-up. The
loops in ``csrc/exact_loops.cpp`` do the same exactly rounded IEEE operations, element by element, in one call
(built with ``-ffp-contract=off`` and without ``-ffast-math``: no fused multiply-add, no reassociation), so they
give the same bits *by construction* -- for every non-NaN value, with NaN in the same places; a NaN's sign and payload
may differ between the loops' modes (which NaN an IEEE operation passes on, or the default NaN an invalid one makes,
is the instruction's choice, and a compiled loop and aten's vectorised kernel may choose differently: fp32 rms_norm,
attention and the token_logprobs gradient do on x86). ``tests/kernels/test_compiled_loops.py`` checks them against
the torch-op versions bitwise, each op on special values in both modes to that contract, and a whole RL step's
weights with and without them.

The extension is built once per machine and source version with torch's C++ extension builder (a C++ compiler
and ninja: the ``ninja`` pip package is a vexact dependency), on first use, into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later processes import the built library
directly. ``python -m vexact_kernels.build_loops`` builds it ahead of time and prints what it found. Processes that
ask at once build it once: the build runs under a ``flock``-based lock beside its folder (``_import_or_build``).

Modes, from the ``VEXACT_CPU_LOOPS`` environment variable (read once, at first use):

- ``auto`` (default): the compiled loops where they build; where they do not (no compiler), the torch-op
  versions, with one RuntimeWarning -- the same bits (a NaN's sign and payload aside, above), only slower;
- ``python``: never build; the torch-op versions everywhere (what tests compare the loops against);
- ``compiled``: the compiled loops or an error (for CI, which must not silently measure the slow path).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock, Timeout
from torch import Tensor

from . import fixed_order

LOOPS_ENV = "VEXACT_CPU_LOOPS"
MODES = ("auto", "python", "compiled")
SOURCE = Path(__file__).parent / "csrc" / "exact_loops.cpp"
# No -ffast-math (its reassociation and flush-to-zero would change bits); -ffp-contract=off: GCC fuses a * b + c
# into one FMA (one rounding instead of two) by default where the target has FMA; never here.
# -fopenmp: at::parallel_for runs its work on torch's OpenMP threads only where built with OpenMP (without it every
# loop ran on the calling thread); the loader then finds the libgomp torch loaded. Linux only: torch's Linux wheels
# use GNU OpenMP, and Apple's compiler has no -fopenmp (there the loops build as before, on one thread).
OPENMP = ("-fopenmp",) if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else ()
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", *OPENMP)
LDFLAGS = OPENMP
DTYPES = (torch.float32, torch.float64)  # what the loops are compiled for; anything else takes the torch ops

_lock = threading.Lock()
# "module" (or None), "path", "reason", "build_seconds", "mode"; in mode compiled where the build failed, "failure" and
# "compiler" (LoopsBuildError's): filled on first use
_state: dict = {}


def mode_from_env() -> str:
    """The mode named by ``VEXACT_CPU_LOOPS`` (default ``auto``); a bad value is an error."""
    mode = os.environ.get(LOOPS_ENV, "auto").strip() or "auto"
    if mode not in MODES:
        raise ValueError(f"{LOOPS_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _build_name() -> str:
    """The library's name: a digest of what its bits depend on (source, flags, torch, Python)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sys.version.split()[0].encode()):
        digest.update(part)
    return f"vexact_exact_loops_{digest.hexdigest()[:16]}"


def _build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """The library built by an earlier process (its ``complete`` marker is written after a successful build)."""
    library = directory / f"{name}.so"
    if not (directory / "complete").exists() or not library.exists():
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary may not be there (a venv's python run
    without activating the venv), so its folder is appended."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # the pip package: its binary lives in ninja.BIN_DIR
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), ninja.BIN_DIR])


def _writable(directory: Path) -> None:
    """Create ``directory`` and check that files can be written in it, before the build: torch's builder would
    fail there later with an error that reads like a compiler's."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as error:
        raise LoopsBuildError(f"cannot write their build folder {directory} ({error.strerror or error}); set "
                              "TORCH_EXTENSIONS_DIR to a writable folder", compiler=False) from error


LOCK_POLL_SECONDS = 0.5


def _build_lock_path(name: str, directory: Path) -> Path:
    """vexact's lock beside the build directory: whoever holds it checks, builds and marks that build complete."""
    return directory.with_name(f"{name}.lock")


def _import_or_build(name: str, directory: Path) -> ModuleType:
    """The library built by an earlier process, else built here -- once per machine however many processes ask.

    torch's builder guards a build with a plain ``O_EXCL`` file, ``<build dir>/lock``, that nothing removes when its
    holder is killed: every later ``load`` then waited for it forever, silently. So the build runs under vexact's own
    ``flock``-based lock (the ``filelock`` package, as the warm-start cache), which the OS releases when its holder
    dies, however it dies; its holder is the only vexact builder alive, so a torch ``lock`` file there is a dead
    builder's and is removed before ``load``."""
    module = _import_built(name, directory)  # built already: no lock needed, ``complete`` is written last
    if module is not None:
        return module
    _writable(directory.parent)  # the lock lives there: an unwritable cache is named with its fix
    lock = FileLock(_build_lock_path(name, directory))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"vexact: waiting for another process that holds {lock.lock_file} and is building the compiled loops "
              f"in {directory}", file=sys.stderr)
        lock.acquire(poll_interval=LOCK_POLL_SECONDS)
    try:
        module = _import_built(name, directory)  # built while this process waited
        if module is not None:
            return module
        stale = directory / "lock"
        if stale.exists():
            print(f"vexact: removing {stale}, left by a build that was killed", file=sys.stderr)
            stale.unlink(missing_ok=True)
        return _build(name, directory)
    finally:
        lock.release()


def _build(name: str, directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    _writable(directory)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:  # torch's builder would fail noisily
        raise RuntimeError(f"no C++ compiler on PATH (looked for {compiler} and g++)")
    _ninja_on_path()
    print(f"vexact: building the exact CPU kernels' compiled loops (once per machine and version) in {directory}",
          file=sys.stderr)
    module = load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                  extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                  verbose=False)
    (directory / "complete").write_text("built\n")
    return module


class LoopsBuildError(RuntimeError):
    """``VEXACT_CPU_LOOPS=compiled`` where the loops do not build: the machine's failure (no compiler, a failed
    build, a build folder that cannot be written), raised on every call of the process, never a quiet fall back to
    the torch ops. ``compiler``: whether a C++ compiler is the fix (False: the message names the fix itself)."""

    def __init__(self, message: str, compiler: bool = True) -> None:
        super().__init__(message)
        self.compiler = compiler


def _known() -> ModuleType | None:
    """What an earlier call settled: the module, None, or (compiled mode) its build failure again."""
    module = _state["module"]
    if module is None and "failure" in _state:
        raise LoopsBuildError(_state["failure"], compiler=_state["compiler"])
    return module


def library() -> ModuleType | None:
    """The compiled library, or None (mode ``python``, or ``auto`` where it does not build); once per process.
    ``LoopsBuildError`` in mode ``compiled`` where they do not build (on every call)."""
    if _state:  # loaded (or given up) already: no lock needed to read it
        return _known()
    with _lock:
        if _state:
            return _known()
        mode = mode_from_env()
        _state.update(module=None, path="torch ops", reason=f"{LOOPS_ENV}=python", build_seconds=None, mode=mode)
        if mode == "python":
            return None
        name = _build_name()
        directory = _build_directory(name)
        started = time.perf_counter()
        try:
            module = _import_or_build(name, directory)
        except Exception as error:  # noqa: BLE001 -- any build failure means: no compiled loops on this host
            last_line = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            # (a LoopsBuildError of the build's own already says what failed, and the fix)
            reason = str(error) if isinstance(error, LoopsBuildError) else f"{type(error).__name__}: {last_line}"
            if mode == "compiled":
                _state.update(reason=f"build failed ({reason})", compiler=getattr(error, "compiler", True),
                              failure=f"{LOOPS_ENV}=compiled, but the compiled loops did not build ({reason})")
                raise LoopsBuildError(_state["failure"], compiler=_state["compiler"]) from error
            _state["reason"] = f"build failed ({reason})"
            warnings.warn(f"vexact: the exact CPU kernels' compiled loops did not build ({reason}); using the "
                          f"torch-op versions (the same bits but a NaN's sign, slower). Set {LOOPS_ENV}=python to "
                          "skip the build.",
                          RuntimeWarning, stacklevel=3)
            return None
        _state.update(module=module, path="compiled", reason=name,
                      build_seconds=round(time.perf_counter() - started, 3))
        return module


def status() -> dict:
    """Which loops the exact CPU kernels use: ``{"path": "compiled" | "torch ops", "reason", "mode", ...}``."""
    library()
    return {k: v for k, v in _state.items() if k != "module"}


def tree_sum(x: Tensor, dim: int = -1, out: Tensor | None = None) -> Tensor:
    """``fixed_order.tree_sum(x, dim)``, the same bits: the compiled loop for fp32/fp64 widths >= 2, else the torch
    ops. (The compiled result is a fresh contiguous tensor; the torch-op one may be a view of a scratch buffer.)
    ``out``: a contiguous tensor of the result's shape and dtype that receives it (the compiled loop writes it there
    itself), returned."""
    width = x.shape[dim] if x.dim() else 0
    module = library() if width >= 2 and x.dtype in DTYPES and x.device.type == "cpu" else None
    if module is None:
        result = fixed_order.tree_sum(x, dim)
        return result if out is None else out.copy_(result)
    return module.tree_sum_into(x, dim, out)


def main() -> int:
    """Build (or find) the compiled loops and print what the exact CPU kernels will use."""
    try:
        found = status()
    except RuntimeError as error:  # VEXACT_CPU_LOOPS=compiled and no build: one line, no traceback
        print(f"compiled loops: {error}", file=sys.stderr)
        return 1
    print(f"compiled loops: {found['path']} ({found['reason']}); mode {found['mode']}"
          + (f"; loaded in {found['build_seconds']} s" if found["build_seconds"] is not None else ""))
    return 0 if found["path"] == "compiled" or found["mode"] == "python" else 1

