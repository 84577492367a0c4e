"""Autograd glue shared by the exact backends: an exact forward with a deterministic backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class _ExactForwardNativeBackward(torch.autograd.Function):
    """Forward = exact kernel; backward = the VJP of the native twin, recomputed.

    The exact forward is what rollout and training must agree on; gradients only need to be
    deterministic, and torch's standard ops are (same shapes, same thread count)."""

    @staticmethod
    def forward(ctx, exact_fn, native_fn, static, *tensors):  # type: ignore[override]
        ctx.native_fn, ctx.static = native_fn, static
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return exact_fn(*tensors, *static)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
            out = ctx.native_fn(*inputs, *ctx.static)
            wanted = [t for t, need in zip(inputs, needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (None, None, None, *[next(grads) if need else None for need in needs])


def exact_forward(exact_fn: Callable, native_fn: Callable, tensors: tuple, static: tuple = ()) -> Tensor:
    """Run ``exact_fn(*tensors, *static)``, differentiable through ``native_fn`` when needed."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _ExactForwardNativeBackward.apply(exact_fn, native_fn, static, *tensors)
    return exact_fn(*tensors, *static)
