"""Exact routing for mixture-of-experts layers: the expert ranking, the routing weights and the combination.

A token's MoE output must depend only on its own hidden row -- never on which other tokens share its experts, the
batch arrangement or the thread count -- so that rollout and training route and combine it identically. The expert
matmuls already have that property (``linear``'s invariance contract: each output row depends only on its input
row, whatever the number of rows); what routing adds is done here, from comparisons and exactly rounded elementwise
operations only:

- **ranking** (``rank_experts``): the experts of a row by descending score with a fixed tie-break -- among equal
  scores the *lowest expert index* wins -- a stable sort, pure comparisons (no arithmetic, so no rounding);
- **weights** (``routing_weights``): p_e = exp(log p_e) of the chosen experts (``exp``, position-invariant: on CPU
  tensors the host-guarded, chunked exp of the exact CPU kernels; on CUDA tensors the elementwise Triton kernel
  ``triton_exact.exp``), optionally divided by their sum (``norm_topk_prob``); the sum
  is taken in expert-index order by elementwise adds, so a row's weights depend only on that row;
- **combination** (``combine``): sum over the chosen experts, in expert-index order, of weight x expert output, in
  fp32 (the caller rounds once to the model dtype).

The routing (ranking, weights, combination) is the same code for every kernel backend, like the sampler's Gumbel
noise: backends differ in the ops the MoE block runs through them (the router's linear and log-softmax, the
experts), which is where a native backend's routing differs from the exact one's.
Backward: the exp's VJP is grad x exp(x) (one exactly rounded product); the rest is torch's elementwise and
gather/scatter autograd on distinct indices -- each gradient element written once, so no result depends on the
thread count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import checks
from .backends import _triton  # a function: triton itself is imported at its first call
from .cpu_exact import elementwise

OP = "moe_routing"  # the op name the host guard's probes record for the routing's exp


def rank_experts(scores: Tensor) -> Tensor:
    """Expert indices of each row of ``scores`` [..., E], best first: descending score, ties to the lower index.

    Invariance contract: a row's ranking depends only on that row -- never on the other rows, their number or order,
    or the thread count: a stable descending sort, which keeps equal scores in index order (comparisons only, no
    rounding)."""
    checks.rows("moe_exact.rank_experts", "scores", scores)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def _exp_forward(x: Tensor) -> Tensor:
    """The position-invariant fp32 exp for ``x``'s device: the Triton kernel on CUDA tensors (the CPU kernels'
    host guard probes the CPU's library, not the GPU's), the exact CPU kernels' chunked exp elsewhere."""
    if x.is_cuda:
        return _triton().exp(x)
    return elementwise("exp", x, op=OP)


class _Exp(torch.autograd.Function):
    """exp with a position-invariant forward (``_exp_forward``) and the VJP grad x exp(x)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        out = _exp_forward(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return grad * out


def exp(x: Tensor) -> Tensor:
    """fp32 exp of every element of ``x``, each element's bits independent of the tensor's size, the element's
    position and the thread count; differentiable."""
    if not (isinstance(x, Tensor) and x.dtype in checks.FLOAT_DTYPES):
        checks.tensors("moe_exact.exp", checks.FLOAT_DTYPES, x=x)
    x = x.float()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exp.apply(x)
    return _exp_forward(x)


def sigmoid(x: Tensor) -> Tensor:
    """fp32 1 / (1 + exp(-x)) elementwise (position-invariant exp, exactly rounded add and divide); differentiable."""
    if not (isinstance(x, Tensor) and x.dtype in checks.FLOAT_DTYPES):
        checks.tensors("moe_exact.sigmoid", checks.FLOAT_DTYPES, x=x)
    return torch.reciprocal(exp(-x.float()) + 1.0)


def ordered_sum(parts: Tensor) -> Tensor:
    """Sum over the last dim of ``parts`` [..., k], left to right: one exactly rounded add per element and step, so
    an element's sum depends only on its own k values (no reduction kernel whose order could vary)."""
    if not (isinstance(parts, Tensor) and parts.dim() and parts.shape[-1]):
        checks.tensors("moe_exact.ordered_sum", checks.FLOAT_DTYPES, parts=parts)
        checks.last_dim("moe_exact.ordered_sum", "parts", parts)
    total = parts[..., 0]
    for j in range(1, parts.shape[-1]):
        total = total + parts[..., j]
    return total


def routing_weights(log_probs: Tensor, experts: Tensor, normalize: bool) -> Tensor:
    """fp32 weights [..., k] of the chosen ``experts`` [..., k] (int64, ascending) from the router's fp32 log-softmax
    ``log_probs`` [..., E]: p = exp(log p) of each chosen expert, divided by the sum of the k (in expert-index order)
    when ``normalize`` (``norm_topk_prob``).

    Invariance contract: a row's weights depend only on that row's log-probabilities and experts -- never on the other
    rows, the tensor's size, the element's position or the thread count (the position-invariant ``exp``; the sum
    elementwise, left to right: ``ordered_sum``)."""
    _check_routing(log_probs, experts)
    probs = exp(log_probs.gather(-1, experts))
    return probs / ordered_sum(probs).unsqueeze(-1) if normalize else probs


def _check_routing(log_probs: Tensor, experts: Tensor) -> None:
    """Metadata of ``routing_weights``' operands; and, on CPU tensors, the expert ids in [0, E) (torch's gather names
    no id). A CUDA tensor's ids go unread (a device sync per MoE layer and step): there an id out of range is the
    gather's device-side assert."""
    op = "moe_exact.routing_weights"
    if not (isinstance(log_probs, Tensor) and isinstance(experts, Tensor) and log_probs.dtype in checks.FLOAT_DTYPES
            and experts.dtype in checks.INDEX_DTYPES and log_probs.dim() and log_probs.shape[-1]
            and experts.shape[:-1] == log_probs.shape[:-1] and experts.dim() and experts.shape[-1]
            and experts.device == log_probs.device):
        checks.tensors(op, checks.FLOAT_DTYPES, log_probs=log_probs)
        checks.tensors(op, checks.INDEX_DTYPES, experts=experts)
        checks.same_device(op, log_probs=log_probs, experts=experts)
        checks.last_dim(op, "log_probs", log_probs)
        checks.last_dim(op, "experts", experts)
        if experts.shape[:-1] != log_probs.shape[:-1]:
            raise checks.shape_error(op, "log_probs must be [..., E] and experts [..., k]", log_probs=log_probs,
                                     experts=experts)
    checks.ids_in_range(op, experts, log_probs.shape[-1], "expert", ("E", "log_probs' last dimension"))


def combine(weights: Tensor, outputs: Tensor) -> Tensor:
    """fp32 sum_j weights[..., j] x outputs[..., j, :], left to right over the slots.

    ``weights`` [..., k] fp32; ``outputs`` [..., k, D] (each chosen expert's output for the row, slot by slot).

    Invariance contract: a row's result depends only on its own weights and outputs -- never on the other rows, their
    number or the thread count (exactly rounded products and adds, slot by slot)."""
    if not (isinstance(weights, Tensor) and isinstance(outputs, Tensor) and weights.dtype in checks.FLOAT_DTYPES
            and outputs.dtype in checks.FLOAT_DTYPES and weights.dim() and weights.shape[-1]
            and outputs.shape[:-1] == weights.shape and weights.device == outputs.device):
        checks.tensors("moe_exact.combine", checks.FLOAT_DTYPES, weights=weights, outputs=outputs)
        checks.last_dim("moe_exact.combine", "weights", weights)
        if outputs.shape[:-1] != weights.shape:
            raise checks.shape_error("moe_exact.combine", "weights must be [..., k] and outputs [..., k, D]",
                                     weights=weights, outputs=outputs)
    out = weights[..., 0, None] * outputs[..., 0, :].float()
    for j in range(1, weights.shape[-1]):
        out = out + weights[..., j, None] * outputs[..., j, :].float()
    return out
