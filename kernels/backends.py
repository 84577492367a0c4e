"""The backends' registry: their names (``BACKENDS``), the op module each resolves to on a device (``get_ops``) and
the path each op takes there (``kernel_paths``); the package ``vexact_kernels`` re-exports all of it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from . import cpu_exact, native
from .contract import OP_NAMES

BACKENDS = ("exact", "native", "triton")
EXACT_BACKENDS = ("exact", "triton")  # the backends whose rollout and training log-probs must agree bit for bit


TRITON_PIP = 'pip install "vexact[triton]"'
"""How the optional triton package is installed (the ``triton`` extra: ~290 MB, so not a dependency of a CPU
install); the one line every "triton is missing" message names."""


def triton_installed() -> bool:
    """Whether the triton package can be imported (found, not imported: importing triton is slow)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: imports of it are blocked
        return False


def _triton() -> ModuleType:
    if not triton_installed():
        raise ValueError(f"the Triton kernels (backend 'triton', or 'exact' on a CUDA device) need the triton "
                         f"package, which is not installed: {TRITON_PIP}")
    from . import triton_exact  # imported lazily: importing triton is slow

    return triton_exact


def get_ops(backend: str, device: torch.device | str = "cpu") -> ModuleType:
    """The op module for ``backend`` on ``device``.

    ``"exact"`` resolves to Triton on CUDA and to ``cpu_exact`` elsewhere.
    Raises ValueError for an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "native":
        return native
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):  # torch's message names neither the argument nor the spellings
        raise ValueError(f"device must be a torch.device or a name such as cpu, cuda, cuda:1, got {device!r}") from None
    if backend == "triton" or kind == "cuda":
        return _triton()
    return cpu_exact


def kernel_paths(backend: str, device: torch.device | str = "cpu") -> dict:
    """Which path each op of ``backend`` takes on ``device``, and (exact CPU) what the host probes found.

    ``{"backend", "ops": {op: {"path", ...}}, "probes": [...], "mode"}``; ``vexact check`` prints and records it."""
    ops = get_ops(backend, device)
    if ops is cpu_exact:
        return {"backend": backend, "kernels": cpu_exact.NAME, **cpu_exact.host_report()}
    if ops is native:
        path = "native (torch ops: not batch-invariant)"
    else:
        from . import triton_common  # the Triton kernels' mode (get_ops imported them)

        path = ("interpreted (fixed-order block products and sums, by construction)" if triton_common.INTERPRETING
                else "compiled (fixed tiles, by construction)")
    return {"backend": backend, "kernels": ops.NAME, "ops": {op: {"path": path} for op in OP_NAMES}, "probes": []}

