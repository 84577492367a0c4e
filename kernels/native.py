"""Native backend: plain torch ops (F.linear, SDPA, F.silu, F.log_softmax).

This is the realistic, *mismatching* baseline. Every op has the same signature and
semantics as its exact twin in ``cpu_exact`` / ``triton_exact``, but makes no invariance
promise: torch picks kernels by shape and thread count, so a row's result can change
with the batch it sits in, and a decode step need not equal the matching prefill row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .autograd import matmul_linear_backward

NAME = "native"


def embedding(tokens: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` [V, D] picked by ``tokens`` (int64 [...]) -> [..., D] in weight.dtype."""
    return F.embedding(tokens, weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N]."""
    return F.linear(x, weight, bias)


def linear_backward(x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool
                    ) -> tuple[Tensor | None, Tensor | None]:
    """``linear``'s VJP (no bias) without its forward: (grad @ weight, grad.T @ x), None where not needed. What a
    backward that recomputes its logits calls (``vexact.engine.head``)."""
    return matmul_linear_backward(x, weight, grad, need_x, need_w)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm over the last dim, computed in fp32, result in x.dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation: silu(gate) * up, elementwise, in the inputs' dtype."""
    return F.silu(gate) * up


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention. x: [B, T, H, hd]; cos/sin: [B, T, hd/2] fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
    """Causal grouped-query attention of new queries against a KV cache.

    q: [B, T, Hq, hd]; k_cache, v_cache: [B, L, Hkv, hd] (Hq % Hkv == 0); q_start: [B] int64.
    Query t of sequence b sits at absolute position q_start[b] + t and attends to cache
    positions 0 .. q_start[b] + t inclusive. Returns [B, T, Hq, hd] in q.dtype.
    """
    B, T, Hq, hd = q.shape
    L, Hkv = k_cache.shape[1], k_cache.shape[2]
    q_pos = q_start[:, None] + torch.arange(T, device=q.device)[None, :]  # [B, T]
    k_pos = torch.arange(L, device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    if q.is_cuda:
        return _attention_groups_as_rows(q, k_cache, v_cache, mask, scale)
    k = k_cache.repeat_interleave(Hq // Hkv, dim=2)
    v = v_cache.repeat_interleave(Hq // Hkv, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )
    return out.transpose(1, 2)


def _attention_groups_as_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``attention`` as a GPU engine or trainer computes it: each KV head's group of query heads folded into the
    query rows ([B, Hkv, group x T, hd]), so SDPA reads the cache as it is. Copying the cache to every query head
    (``repeat_interleave``, the CPU's formulation, whose bits the CPU's records hold) writes B x L x Hq x hd per
    layer per step: at qwen3_1_7b, batch 64, a 1,024-position cache, 64% of a native decode step's GPU time on an
    H200, a baseline no engine runs."""
    B, T, Hq, hd = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    rows = q.view(B, T, Hkv, group, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * T, hd)
    row_mask = mask[:, None, None].expand(B, 1, group, T, mask.shape[-1]).reshape(B, 1, group * T, mask.shape[-1])
    out = F.scaled_dot_product_attention(rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=row_mask,
                                         scale=scale)
    return out.view(B, Hkv, group, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, hd)


def log_softmax(logits: Tensor) -> Tensor:
    """log_softmax over the last dim, returned in fp32."""
    return F.log_softmax(logits.float(), dim=-1)


def entropy(log_probs: Tensor) -> Tensor:
    """-sum(p log p) over the last dim of a ``log_softmax`` output (fp32 [..., V] -> [...])."""
    return -(log_probs.exp() * log_probs).sum(-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per row: logits [..., V], targets [...] int64 -> fp32 [...]."""
    return log_softmax(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
