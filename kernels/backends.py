"""The backends' registry: their names (``BACKENDS``), the op module each resolves to on a device (``get_ops``) and
the path each op takes there (``kernel_paths``); the package ``vexact_kernels`` re-exports all of it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from . import cpu_exact, native
from .compiled_loops import LOOPS_ENV, MODES
from .compiled_loops import mode_from_env as loops_mode_from_env
from .contract import OP_NAMES
from .host_guard import MODE_ENV, ONEDNN_ENV

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


def kernel_settings() -> dict[str, str]:
    """The exact CPU kernels' process settings, as the process's guard and loops took them from the environment:
    ``VEXACT_CPU_EXACT_PATH`` (the guard mode), ``VEXACT_CPU_ONEDNN`` and ``VEXACT_CPU_LOOPS``. A run records them
    (``summary.json``'s ``kernel_settings``): hosts aside, they are what can give one config other bits."""
    host = cpu_exact.HOST
    return {MODE_ENV: host.mode, ONEDNN_ENV: "auto" if host.onednn else "off", LOOPS_ENV: loops_mode_from_env()}


BIT_NEUTRAL_SETTINGS = {MODE_ENV: ("auto", "canonical"), ONEDNN_ENV: ("auto",), LOOPS_ENV: MODES}
"""The values of each ``kernel_settings`` entry that compute the default's bits: ``canonical`` computes ``auto``'s
bits by contract (it only declines faster arrangements), and the loops' modes are one computation compiled or not:
identical bits for every non-NaN value and NaN in the same places; a NaN's sign and payload may differ between the
loops' modes (which NaN an IEEE operation passes on, or the default NaN an invalid one makes, is the instruction's
choice: aten's vectorised kernels and a compiled loop may choose differently; ``compiled_loops``)."""


def bit_settings(backend: str, device_kind: str = "cpu") -> dict[str, str]:
    """The ``kernel_settings`` that give ``backend`` other bits than the defaults on a ``device_kind`` device
    (``cpu`` or ``cuda``): ``VEXACT_CPU_EXACT_PATH=fixed-order``, ``VEXACT_CPU_ONEDNN=off``; ``{}`` for the defaults
    and for every backend but the exact CPU kernels. Weights cached under a key (a warm start) hold it in their key:
    trained under one setting, they are no cold start under another."""
    if backend != "exact" or device_kind != "cpu":
        return {}
    return {name: value for name, value in kernel_settings().items() if value not in BIT_NEUTRAL_SETTINGS[name]}


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

