"""The folder ``kernels/`` is imported as ``vexact_kernels`` (why: see the end): vexact's kernel library.

Every backend is a module exposing the same functions -- the ``KernelOps`` contract (``contract.py``, whence
``OP_NAMES``): ``embedding``, ``linear``, ``rms_norm``, ``silu_mul``, ``rope``, ``attention``, ``log_softmax``,
``token_logprobs``, ``entropy`` -- with the same
signatures and semantics (``native.py`` is the plain-torch reference):

- ``"native"``: plain torch ops; fast, realistic, and *not* batch-invariant.
- ``"exact"``: batch-invariant, bit-deterministic kernels -- Triton for CUDA tensors,
  ``cpu_exact`` for CPU tensors.
- ``"triton"``: the Triton kernels forced (on CPU through the Triton interpreter: slow,
  tiny models only).

The exact CPU kernels keep what they lay out from a weight while its version counter says it is unchanged: after a
write that leaves the counter as it was (a torch ``fused=True`` optimizer step, a write through ``.data``), call
``forget_weight(weight)`` (``weight_versions``).

The Triton kernels need the optional ``triton`` package (``TRITON_PIP``); without it every backend works on CPU
tensors except ``"triton"``, which is refused with one ValueError naming the pip line.

Why not ``import kernels``: a PyPI package named ``kernels`` exists (Hugging Face's hub kernels; transformers 5.25
and newer require it and import it), so this library is installed under ``vexact_kernels``; imported by the folder's
own name (a checkout's root on ``sys.path``) it hands that name to the PyPI package, or is an empty module
(``folder_name``).
"""

from __future__ import annotations

if __name__ == "kernels":  # this folder found by its name through a checkout's root on sys.path: not this library
    from .folder_name import hand_the_name_to_the_pypi_package, not_this_library

    if not hand_the_name_to_the_pypi_package(__path__):
        __getattr__ = not_this_library
else:
    from . import cpu_exact, native
    from .backends import (
        BACKENDS,
        EXACT_BACKENDS,
        TRITON_PIP,
        bit_settings,
        get_ops,
        kernel_paths,
        kernel_settings,
        triton_installed,
    )
    from .contract import FUSED_OP_NAMES, OP_NAMES, KernelOps
    from .weight_versions import forget_weight

    __all__ = ["BACKENDS", "EXACT_BACKENDS", "FUSED_OP_NAMES", "OP_NAMES", "TRITON_PIP", "KernelOps", "bit_settings",
               "forget_weight", "get_ops", "kernel_paths", "kernel_settings", "triton_installed", "cpu_exact", "native"]
