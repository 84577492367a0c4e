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


class _ExactLinear(torch.autograd.Function):
    """Exact forward (the backend's ``linear_forward``); backward with plain, deterministic matmuls."""

    @staticmethod
    def forward(ctx, linear_forward, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x, grad_w = matmul_linear_backward(x, weight, grad_out, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_x, grad_w, grad_b


def matmul_linear_backward(x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool
                           ) -> tuple[Tensor | None, Tensor | None]:
    """A bias-free linear layer's VJP with plain matmuls: (grad @ W, grad.T @ x) -- or None where not needed."""
    g2d = grad.reshape(-1, grad.shape[-1])
    grad_x = (g2d @ weight).view(x.shape) if need_x else None
    grad_w = g2d.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
    return grad_x, grad_w


def exact_linear(linear_forward: Callable, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear_forward(x, weight, bias)``, differentiable (matmul backward) when grad is needed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _ExactLinear.apply(linear_forward, x, weight, bias)
    return linear_forward(x, weight, bias)


class _ExactForwardOwnBackward(torch.autograd.Function):
    """Forward = exact kernel that also returns what its backward needs; backward = an analytic VJP.

    Cheaper than ``_ExactForwardNativeBackward`` (no second, native forward in the backward) and
    just as deterministic: the VJP is plain torch ops on fixed shapes."""

    @staticmethod
    def forward(ctx, forward_saving, vjp, static, *tensors):  # type: ignore[override]
        out, ctx.saved = forward_saving(*tensors, *static)
        ctx.vjp = vjp
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        if ctx.saved is None:  # what torch's own ops say for a freed graph, where the VJP would fail deep inside
            raise RuntimeError("Trying to backward through an exact kernel's graph a second time: its saved values are "
                               "freed after the first backward (retain_graph=True does not keep them); run the "
                               "forward again")
        grads = ctx.vjp(ctx.saved, grad_out, ctx.needs_input_grad[3:])
        ctx.saved = None  # freed now, not when the graph goes: a caller's loss often outlives its backward
        return (None, None, None, *grads)


def exact_forward_vjp(exact_fn: Callable, forward_saving: Callable, vjp: Callable, tensors: tuple,
                      static: tuple = ()) -> Tensor:
    """``exact_fn(*tensors, *static)``; when grad is needed, ``forward_saving`` (same output, plus saved
    values) and the backward ``vjp(saved, grad_out, needs_input_grad) -> grads per tensor``."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _ExactForwardOwnBackward.apply(forward_saving, vjp, static, *tensors)
    return exact_fn(*tensors, *static)
