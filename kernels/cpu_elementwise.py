"""Chunked library math, the third of ``cpu_exact``'s building blocks: ``exp``, ``log``, ``cos`` and ``sqrt`` run over
a flattened tensor in chunks of ``CHUNK`` elements, so an op with a vectorised body and a scalar tail (whose rounding
can differ) only ever runs the vectorised body. Through the path the host guard chose (the library's function where
its ``elementwise_*`` probe passed, else ``fixed_order``'s), in one compiled call where the loops are built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import compiled_loops
from .gemm_tiles import ceil_to
from .host_guard import HostGuard

CHUNK = 32704
"""Elements per call of a library function (exp, log, cos, sqrt): a multiple of 64 (whole vectors of every width
up to 64 lanes, so no scalar tail) below ATen's parallel grain size (32768), so one call never splits across
threads."""
VECTOR_MULTIPLE = 64
"""A tensor's elements are zero-padded to a multiple of this before the chunked calls: its last chunk, too, is whole
vectors."""
UNARY_CODES = {"exp": 0, "log": 1, "cos": 2, "sqrt": 3}
"""The compiled loops' code for each library function (``compiled_loops``' ``unary_chunked``)."""


def unary(name: str, x: Tensor, host: HostGuard, op: str, inplace: bool = False) -> Tensor:
    """Apply ``exp``, ``log``, ``cos`` or ``sqrt`` (the path ``host`` chose) chunk by chunk (the module docstring).

    ``inplace``: ``x`` is a scratch tensor the caller gives up; the result may be written into it."""
    fn = host.elementwise(name, x.dtype, op)
    if fn is getattr(torch, name) and x.dtype in compiled_loops.DTYPES and (loops := compiled_loops.library()):
        # the library function: the loop below in one compiled call, its chunks spread over threads (each chunk
        # still one call on one thread, so the same bits at any thread count)
        return loops.unary_chunked(x, UNARY_CODES[name], CHUNK, VECTOR_MULTIPLE, inplace)
    flat = x.contiguous().view(-1)
    total = flat.numel()
    padded = ceil_to(max(total, 1), VECTOR_MULTIPLE)
    if padded != total:
        flat = torch.cat([flat, flat.new_zeros(padded - total)])
    fresh = flat.data_ptr() != x.data_ptr()  # a copy made here may be overwritten
    out = flat if inplace or fresh else torch.empty_like(flat)
    for start in range(0, padded, CHUNK):
        fn(flat[start : start + CHUNK], out=out[start : start + CHUNK])
    return out[:total].view(x.shape)
