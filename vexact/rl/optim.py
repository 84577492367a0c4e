"""The update's arithmetic, thread-invariant: gradient clipping and AdamW from exactly rounded operations.

The exact kernels make every gradient independent of the torch thread count; the update must not undo that.
``torch.nn.utils.clip_grad_norm_`` sums squares with the library's reductions (split between threads for large
tensors), and ``torch.optim.AdamW`` uses ``lerp_`` / ``addcmul_`` / ``addcdiv_``, whose vectorised bodies may fuse a
multiply and an add (one rounding) where their scalar tails do not (two): which elements fall in a tail depends on
how a tensor is cut between threads. Here every step is one exactly rounded IEEE operation (mul, add, sub, div)
applied elementwise, or the host's sqrt (a library function like exp, probed by the exact kernels' guard for
position and thread independence, else ``fixed_order.sqrt``), and the only reduction is a halving tree, so the
update's bits depend only on its inputs -- on any host and thread count. The state layout (``step``, ``exp_avg``,
``exp_avg_sq``) is torch's, so checkpoints load either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from vexact_kernels.compiled_loops import tree_sum
from vexact_kernels.cpu_exact import elementwise

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + CLIP_EPS)


def clip_flat_gradient_(gradient: Tensor, max_norm: float) -> float:
    """Scale the flat fp32 ``gradient`` in place so its L2 norm is at most ``max_norm``; returns the norm before.

    The norm is sqrt of a halving-tree sum of squares; the coefficient is torch's, min(1, max_norm / (norm + 1e-6)).
    A non-finite norm is returned as is (the caller records it), the gradient left untouched."""
    norm = float(elementwise("sqrt", tree_sum(gradient * gradient, dim=0), op="optimizer"))
    if math.isfinite(norm):
        coefficient = min(1.0, max_norm / (norm + CLIP_EPS))
        if coefficient < 1.0:
            gradient.mul_(coefficient)
    return norm


def clip_gradients_(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``clip_flat_gradient_`` over the ``.grad`` of ``params`` (those that have one); returns the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    flat = torch.cat([g.float().reshape(-1) for g in grads])
    norm = clip_flat_gradient_(flat, max_norm)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return norm


class ExactAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, bias-corrected moments) whose update is exactly rounded op by op.

    Same hyper-parameters, state names and results to within rounding as ``torch.optim.AdamW`` (no amsgrad,
    maximize, foreach, fused or capturable variants: a value other than the default is refused)."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ExactAdamW.step takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group.get("fused") or group.get("capturable"):
                raise ValueError("ExactAdamW supports plain AdamW only (no amsgrad, maximize, fused or capturable)")
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                _adamw_update(param, param.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"]),
                              lr, beta1, beta2, eps, decay)
        return None


def _adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, decay: float) -> None:
    """One AdamW step on one tensor; every tensor operation is a single exactly rounded elementwise op (sqrt: the
    host's, guarded)."""
    if decay != 0.0:
        param.mul_(1.0 - lr * decay)
    exp_avg.add_((grad - exp_avg).mul_(1.0 - beta1))  # torch's lerp(exp_avg, grad, 1 - beta1), unfused
    exp_avg_sq.mul_(beta2).add_((grad * grad).mul_(1.0 - beta2))
    step_size = lr / (1.0 - beta1**step)
    denom = elementwise("sqrt", exp_avg_sq, op="optimizer").div_(math.sqrt(1.0 - beta2**step)).add_(eps)
    param.sub_(exp_avg.div(denom).mul_(step_size))
