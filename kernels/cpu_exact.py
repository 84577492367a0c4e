"""Exact CPU backend: the nine ops, batch-invariant and thread-count-invariant, built from torch ops.

Why torch's own ops are not enough: ``x @ W`` picks another BLAS kernel for M = 1, for small M and for some thread
counts, so a row's result depends on how many rows sit beside it; SDPA's last prefill row differs from a
single-query decode; wide sums change with the thread count.

Three building blocks, each invariant:

1. **Fixed-shape GEMM tiles** (``gemm_tiles``; the products and their overview: ``gemm_linear``): rows zero-padded to
   whole row tiles, output columns to a multiple of 16, so every output element's reduction runs through the same GEMM
   kernel in the same order whatever the batch -- *if* the host's BLAS gives a row the same bits for every tile height,
   position in the tile, number of tiles and thread count. That is a measured property of the host, never assumed:
   ``HOST`` (``host_guard.HostGuard``) probes it at first use for each shape class and, where it fails, runs that class
   through ``fixed_order.bmm`` (invariant by construction, slower) and warns. Attention tiles its rows the same way.
2. **Halving-tree sums** (``fixed_order.tree_sum``): a row is summed by repeatedly adding its two halves, each step
   an exactly rounded elementwise add, so the result depends only on the row's values. Zero padding at the end of
   a row changes nothing (x + 0 == x), so a decode step (short key row) and a prefill row (long, masked key row)
   sum identically.
3. **Chunked library math** (``elementwise``): ``exp``/``log``/``cos``/``sqrt`` run over the flattened tensor in
   chunks of ``CHUNK`` elements, so an op with a vectorised body and a scalar tail (whose rounding can differ) only
   ever runs the vectorised body. That the library gives an element the same bits at every position is again a
   host property, probed by ``HOST``; where it fails, ``fixed_order.exp`` / ``log`` / ``cos`` / ``sqrt`` take over.
   (torch's CPU sqrt is such a library function, not the IEEE operation: it is not always correctly rounded.)

So every op is exact on any host: by construction, or by a probed property with a by-construction fallback.
``host_report()`` says which path each op took (``vexact check`` prints it); ``VEXACT_CPU_EXACT_PATH=fixed-order``
forces the by-construction path everywhere. The torch-op compositions around the library calls (tree sums, masks,
operand layouts) also exist as compiled loops (``compiled_loops``): the same operations element by element, the
same bits, fewer aten calls.

Everything is computed in fp32 (bf16 inputs are upcast: a bf16 x bf16 product is exact in fp32) and rounded once
to the output dtype -- except a bf16 linear layer's GEMMs (no bias) where the guard found the host's bf16 GEMM
invariant for the shape class: they run it (exact products, fp32 accumulation in the library's order, one rounding).
Backward passes (``autograd.exact_forward_vjp``, ``cpu_attention._ExactAttention``) are analytic VJPs on
values the exact forward saved -- no second forward -- built from the same blocks, so the gradients are
thread-count invariant too (each op's "Backward contract"); they still depend on the batch they are computed over
(only the forward is compared across paths).

The ops follow one decoder's data flow: ``embedding``, ``rms_norm``, ``linear``, ``rope``, ``attention``,
``silu_mul``, then the heads' ``log_softmax``, ``token_logprobs`` and ``entropy``; each section starts with the op
and its contract. What exactness costs in time: ``benchmarks/`` and docs/results/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

from . import (
    checks,
    compiled_loops,
    cpu_attention,
    fused_linears,
    gemm_linear,
    gemm_weight_gradient,
    linear_repeats,
    native,
)
from .autograd import exact_forward_vjp
from .compiled_loops import tree_sum as _tree_sum
from .contract import FUSED_OP_NAMES
from .cpu_elementwise import CHUNK, VECTOR_MULTIPLE, unary
from .gemm_tiles import ROW_BLOCKS, fp32
from .host_guard import BMM_PATH, ONEDNN_ROWS, UPCAST_PATH, HostGuard

NAME = "cpu_exact"
ROWS_INVARIANT = True
"""Every op's result for a row depends on that row alone, however the rows are cut (each op's invariance contract):
a caller may split its rows in any way without a bit changing (``vexact.engine.head``'s backward)."""

HOST = HostGuard(ROW_BLOCKS)
"""The process's guard: probes the host properties the fast paths rely on (``host_guard``), per shape class."""
HOST_PROPERTIES = {"embedding": (), "linear": ("gemm_rows", ONEDNN_ROWS, "same_bits"),
                   "rms_norm": ("elementwise_sqrt",), "silu_mul": ("elementwise_exp",),
                   "rope": (), "entropy": ("elementwise_exp",),
                   "attention": ("gemm_rows", "elementwise_exp"),
                   "log_softmax": ("elementwise_exp", "elementwise_log"),
                   "token_logprobs": ("elementwise_exp", "elementwise_log")}
"""What each op's invariance rests on besides construction (reported by ``host_report``)."""


# --------------------------------------------------------------------------- input checks
# The ops' input checks (``checks``): one contract with the Triton kernels. Re-exported: the model's dtypes and
# resolve_dtype derive from FLOAT_DTYPES here.
FLOAT_DTYPES, INDEX_DTYPES = checks.FLOAT_DTYPES, checks.INDEX_DTYPES


# --------------------------------------------------------------------------- chunked library math
def elementwise(name: str, x: Tensor, *, host: HostGuard = HOST, op: str = "sampling") -> Tensor:
    """``name`` (exp, log, cos or sqrt) of every element of ``x`` (fp32 or fp64; exp fp32 only where the path is
    ``fixed-order``'s: one ValueError naming the dtype), each element's bits independent of the tensor's size and the
    element's position (chunked, through the path ``host`` chose for this host).

    A tensor on a GPU takes torch's own op: there each element goes through one device function whatever the
    tensor's size or the element's place (no vectorised variant that rounds otherwise), and the host guard, which
    probes the CPU's library, says nothing about it."""
    if x.device.type != "cpu":
        return getattr(torch, name)(x)
    return unary(name, x, host, op)



# --------------------------------------------------------------------------- embedding
EMBEDDING_PAD_BUDGET = 1 << 16
"""Gradient rows laid out per chunk of the embedding backward (``_sum_rows_by_token``): tokens are grouped so that
a chunk holds at most this many (zero-padded) rows of D elements, to bound its memory. How tokens are grouped
changes no bit (zero padding does not change a tree sum)."""


def embedding(tokens: Tensor, weight: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """Rows of ``weight`` [V, D] picked by ``tokens`` (int64 [...]) -> [..., D] in weight.dtype.

    Invariance contract: a gather -- each output row is ``weight[token]`` bit for bit, whatever the batch.
    Backward contract: grad_weight[v] is the halving-tree sum, in position order, of the gradient rows of the
    positions holding token v (``_sum_rows_by_token``): it depends only on (tokens, grad), never on the thread
    count. ``host`` is unused (nothing here rests on a host property); kept for the common op signature.
    """
    checks.embedding("cpu_exact.embedding", tokens, weight)  # one call per forward: its ids are read
    return exact_forward_vjp(_embedding_forward, _embedding_with_saved, _embedding_vjp, (weight,), (tokens,))


def _embedding_forward(weight: Tensor, tokens: Tensor) -> Tensor:
    return torch.nn.functional.embedding(tokens, weight)


def _embedding_with_saved(weight: Tensor, tokens: Tensor) -> tuple[Tensor, tuple]:
    return _embedding_forward(weight, tokens), (tokens, weight.shape[0], weight.dtype)


def _embedding_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    tokens, vocab, dtype = saved
    rows = fp32(grad).reshape(-1, grad.shape[-1])
    return (_sum_rows_by_token(tokens.reshape(-1), rows, vocab, dtype),)


def _sum_rows_by_token(tokens: Tensor, rows: Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """out[v] = halving-tree sum, in position order, of the ``rows`` whose token is v; [vocab, D] fp32, rounded to
    ``dtype`` (the compiled loops round only the rows of the tokens that occur: the same values).

    Each token's rows are laid side by side ([tokens, occurrences, D], zero-padded to the chunk's largest count)
    and summed by ``tree_sum`` over the occurrences. Zero padding does not change a tree sum, so how tokens are
    grouped into chunks (by count, to bound memory) does not change any bit: out[v] depends only on v's rows and
    their order -- never on the thread count (unlike an ``index_add_``, whose order is the library's affair)."""
    loops = compiled_loops.library()
    if loops is not None and rows.dtype == torch.float32:  # the same chunks and trees in one call
        return loops.sum_rows_by_token(tokens, rows, vocab, EMBEDDING_PAD_BUDGET, dtype)
    count = tokens.numel()
    out = rows.new_zeros(vocab, rows.shape[1])
    if count == 0:
        return out.to(dtype)
    order = torch.argsort(tokens, stable=True)  # position order within each token
    unique, counts = torch.unique_consecutive(tokens[order], return_counts=True)
    group = torch.repeat_interleave(torch.arange(unique.numel()), counts)  # group of each sorted row
    rank = torch.arange(count) - (counts.cumsum(0) - counts).repeat_interleave(counts)  # occurrence number
    sorted_rows = rows[order]
    by_count = torch.argsort(counts, descending=True, stable=True)
    slot = torch.full((unique.numel(),), -1, dtype=torch.long)
    start = 0
    while start < by_count.numel():
        width = int(counts[by_count[start]])
        chosen = by_count[start : start + max(1, EMBEDDING_PAD_BUDGET // width)]
        slot.fill_(-1)
        slot[chosen] = torch.arange(chosen.numel())
        member = slot[group] >= 0
        laid = rows.new_zeros(chosen.numel(), width, rows.shape[1])
        laid[slot[group][member], rank[member]] = sorted_rows[member]
        out[unique[chosen]] = _tree_sum(laid, dim=1)
        start += chosen.numel()
    return out.to(dtype)


# --------------------------------------------------------------------------- rms_norm
def rms_norm(x: Tensor, weight: Tensor, eps: float, *, host: HostGuard = HOST) -> Tensor:
    """Llama RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, fp32 inside.

    Invariance contract: each output row depends only on that input row, the weight and eps
    -- never on the number of rows, their order, padding or the thread count (halving-tree
    sum, the host's sqrt -- probed for position and thread independence, else ``fixed_order.sqrt`` -- and an
    exactly rounded reciprocal; no rsqrt, whose vector and scalar paths round differently).
    Backward contract: the analytic VJP from the saved fp32 x and 1/rms; grad_x row by row, grad_weight over the
    rows, both by halving trees -- never dependent on the thread count.
    """
    checks.rms_norm("cpu_exact.rms_norm", x, weight, eps)
    return exact_forward_vjp(_rms_norm_exact, _rms_norm_with_saved, _rms_norm_vjp, (x, weight), (eps, host))


def _rms_norm_parts(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> tuple[Tensor, Tensor, Tensor]:
    """(output, fp32 x, fp32 1/rms [..., 1]). The sqrt is the host's (a library function, probed like exp)."""
    xf = fp32(x)
    loops = compiled_loops.library()
    if loops is not None and xf.numel():  # the same ops row by row, in one pass each side of the sqrt
        mean_sq = loops.rms_norm_mean_square(xf, eps)
        inv_rms = unary("sqrt", mean_sq, host, "rms_norm", inplace=True).reciprocal_().unsqueeze(-1)
        return loops.rms_norm_scale(xf, inv_rms, fp32(weight)).to(x.dtype), xf, inv_rms
    mean_sq = _tree_sum(xf * xf).div_(x.shape[-1])
    inv_rms = unary("sqrt", mean_sq.add_(eps), host, "rms_norm", inplace=True).reciprocal_().unsqueeze(-1)
    return torch.mul(xf, inv_rms).mul_(fp32(weight)).to(x.dtype), xf, inv_rms


def _rms_norm_exact(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> Tensor:
    return _rms_norm_parts(x, weight, eps, host)[0]


def _rms_norm_with_saved(x: Tensor, weight: Tensor, eps: float, host: HostGuard) -> tuple[Tensor, tuple]:
    out, xf, inv_rms = _rms_norm_parts(x, weight, eps, host)
    return out, (xf, inv_rms, weight, x.dtype)


def _rms_norm_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2: dx = r * (g w - x r^2 mean(g w x)), dw = sum(g x r)."""
    xf, inv_rms, weight, dtype = saved
    g = fp32(grad)
    grad_x = grad_w = None
    loops = compiled_loops.library()
    if loops is not None and xf.numel():  # the same ops row by row, in one pass (compiled_loops)
        grad_x, grad_w = loops.rms_norm_backward(g, xf, inv_rms, fp32(weight), needs[0], needs[1])
        return grad_x.to(dtype) if needs[0] else None, grad_w.to(weight.dtype) if needs[1] else None
    if needs[0]:
        # inv_rms * (gw - xf * (inv_rms * inv_rms) * dot): the same exactly rounded ops on the same operands, in
        # the same order, written into one scratch tensor instead of a new tensor per step
        gw = g * fp32(weight)
        dot = _tree_sum(gw * xf).div_(xf.shape[-1]).unsqueeze(-1)
        scratch = torch.mul(xf, inv_rms * inv_rms).mul_(dot)
        grad_x = torch.mul(inv_rms, torch.sub(gw, scratch, out=scratch), out=scratch).to(dtype)
    if needs[1]:
        grad_w = _tree_sum(torch.mul(g, xf).mul_(inv_rms).reshape(-1, xf.shape[-1]), dim=0).to(weight.dtype)
    return grad_x, grad_w


# --------------------------------------------------------------------------- linear
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, host: HostGuard = HOST) -> Tensor:
    """y = x @ weight.T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N] in x.dtype.

    Invariance contract: each output row depends only on the same input row, the weight and
    the bias -- never on how many rows there are, the row's position among them, padding
    rows, or the torch thread count. fp32 accumulation; bias added in fp32; one rounding to
    x.dtype. bf16 x and weight without a bias: the host's bf16 GEMM (fp32 accumulation in its own order, one
    rounding) where ``HOST`` found it invariant for the shape class -- the one path of that class for every call
    (``gemm_linear.tiled_dtype``) -- else fp32 from upcast operands.
    Precondition: the weight's values change only through writes that bump its version counter (autograd-visible
    in-place ops: vexact's optimizer, ``copy_`` under no_grad, ``load_state_dict``) or by rebinding ``.data``: what
    is laid out from a weight is kept per version (``weight_versions``). After any other write (a torch
    ``fused=True`` optimizer step, a write through ``.data`` or ``.numpy()``) call
    ``vexact_kernels.forget_weight(weight)``, or the next call computes with the old values.
    Tiling: rows in GEMM tiles of 4, 8, 16, 32, 48 or 64 rows (``gemm_tiles.row_block``), columns padded to
    a multiple of 16.
    Backward contract: every gradient depends only on (x, weight, grad) -- never on the thread count.
    grad_x rows are tiled as the forward's; grad_weight and grad_bias reduce over the tokens in fixed chunks
    (``gemm_weight_gradient.transposed_matmul``) added by a halving tree, each chunk on the host's GEMM one GEMM per
    256-row slab of grad_weight on one thread (``gemm_weight_gradient._reduction_slabs``; in ``auto`` one GEMM per chunk
    on views of grad and x where the guard found that this gives the slabs' bits: ``same_bits``); in bf16 on the
    host's bf16 GEMM, up to ``gemm_tiles.LIBRARY_REDUCE_MAX`` tokens in one chunk (one rounding).
    A call like an earlier one on this weight and x's shape (a decode loop's: no gradient recorded, no bias) runs the
    plan that call ran (``linear_repeats``): the same GEMMs on the same operands."""
    if bias is None and (out := linear_repeats.run(x, weight, host)) is not None:  # a decode loop's repeated call
        return out
    checks.linear("cpu_exact.linear", x, weight, bias)
    if bias is None:  # bias None passed as a static argument: _linear_forward(x, weight, None, host)
        out = exact_forward_vjp(_linear_forward, _linear_with_saved, _linear_vjp, (x, weight), (None, host))
        linear_repeats.remember(x, weight, host, out)
        return out
    return exact_forward_vjp(_linear_forward, _linear_with_saved, _linear_vjp, (x, weight, bias), (host,))


def linears(x: Tensor, weights: Sequence[Tensor], *, host: HostGuard = HOST) -> tuple[Tensor, ...]:
    """``tuple(linear(x, w) for w in weights)`` (no biases): linear layers of one input, as a layer's q/k/v projections
    and an MLP's gate/up. x: [..., K], each weight [N_i, K] -> a tuple of [..., N_i] in x.dtype.

    Invariance contract: each output is ``linear(x, w)``'s, bit for bit (so ``linear``'s contract holds for it) --
    never dependent on the other weights, on whether the call ran fused, or on the thread count. ``linear``'s
    precondition holds for each weight (``vexact_kernels.forget_weight`` after a write its version counter misses).

    A decode loop's repeated call runs them as one GEMM on the weights packed as one where the host's oneDNN gives each
    weight's columns their own bits (``fused_linears``: checked at first use); elsewhere (a gradient recorded, a first
    call, a host where the check fails) each linear runs as ``linear``."""
    if (out := fused_linears.run(x, weights, host)) is not None:
        return out
    return tuple(linear(x, w, host=host) for w in weights)


def linear_backward(x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool, *, host: HostGuard = HOST
                    ) -> tuple[Tensor | None, Tensor | None]:
    """``linear``'s VJP (no bias) without its forward: (grad_x, grad_weight) as its autograd computes them (the same
    calls, the same bits), None where not needed. What a backward that recomputes its logits calls
    (``vexact.engine.head``)."""
    grads = _linear_vjp((x, weight, False, host), grad, (need_x, need_w))
    return grads[0], grads[1]


def linear_backward_probes(rows: int, weight: Tensor, *, host: HostGuard = HOST) -> None:
    """Run now the host probes that ``linear_backward`` of ``rows`` fp32 tokens against an fp32 ``weight`` runs for
    its weight gradient at first use (``gemm_weight_gradient.probe_transposed_matmul``; other dtypes: at first use).
    What a backward that will hold large buffers until that call calls first (``vexact.engine.head``)."""
    if weight.dtype == torch.float32:
        gemm_weight_gradient.probe_transposed_matmul(rows, weight.shape[0], weight.shape[1], torch.float32, host,
                                                     "linear")


def _in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` without the call where ``t`` has it already (a linear layer makes such conversions on every
    call, each a dispatch even when it returns ``t``; a bf16 GEMM's output is bf16 already)."""
    return t if t.dtype == dtype else t.to(dtype)


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, host: HostGuard) -> Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    # a bias is added in fp32 before the one rounding: a bf16 GEMM's output is rounded already
    dtype = torch.float32 if bias is not None else gemm_linear.tiled_dtype(x2d, weight, host)
    out = gemm_linear.tiled_matmul(_in_dtype(x2d, dtype), weight, host)
    if bias is not None:
        out = out + fp32(bias)
    return _in_dtype(out, x.dtype).view(*x.shape[:-1], weight.shape[0])


def _linear_with_saved(x: Tensor, weight: Tensor, bias: Tensor | None, host: HostGuard) -> tuple[Tensor, tuple]:
    return _linear_forward(x, weight, bias, host), (x, weight, bias is not None, host)


def _linear_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """dx = g @ W (rows = tokens, like the forward), dW = g.T @ x and db = sum of g (reductions over tokens:
    fixed chunks and a halving tree). fp32 inside, one rounding to each input's dtype; bf16 GEMMs where the guard
    admitted the class (``gemm_linear.tiled_dtype``, ``gemm_weight_gradient.transposed_dtype``)."""
    x, weight, has_bias, host = saved
    g2d = grad.reshape(-1, grad.shape[-1])
    upcast: list[Tensor] = []

    def g_in(dtype: torch.dtype) -> Tensor:  # the gradient in a GEMM's compute dtype, upcast at most once
        if dtype == g2d.dtype:
            return g2d
        if not upcast:
            upcast.append(fp32(g2d))
        return upcast[0]

    grad_x = grad_w = grad_b = None
    if needs[0]:
        weight_t = weight.t()
        dtype = gemm_linear.tiled_dtype(g2d, weight_t, host)
        grad_x = _in_dtype(gemm_linear.tiled_matmul(g_in(dtype), weight_t, host, "linear"), x.dtype).view(x.shape)
    if needs[1]:
        x2d = x.reshape(-1, x.shape[-1])
        dtype = gemm_weight_gradient.transposed_dtype(g2d, x2d, host, "linear")
        grad_w = _in_dtype(gemm_weight_gradient.transposed_matmul(g_in(dtype), _in_dtype(x2d, dtype), host, "linear",
                                                                  b_source=x),
                           weight.dtype)
    if has_bias and needs[2]:
        grad_b = _tree_sum(g_in(torch.float32), dim=0)
    return (grad_x, grad_w, grad_b)[: len(needs)]


# --------------------------------------------------------------------------- rope
def rope(x: Tensor, cos: Tensor, sin: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """Rotary embedding (rotate-half convention). x: [B, T, H, hd]; cos/sin: [B, T, hd/2] fp32.

    Invariance contract: each output element depends only on its own (x pair, cos, sin)
    elements. Only exactly rounded elementwise mul/add/sub are used (no fused ops), so the
    native implementation already satisfies the contract: it is the definition. Where the compiled loops
    are built (fp32 or bf16 x on the CPU), its ops run element by element in one pass, forward and backward
    (``loops.rope_forward`` / ``rope_backward``: the same rounded operations in the same order, and the VJP as
    autograd accumulates it, so the same bits -- infinities, zeros' signs and NaNs made on the way included; only
    where two NaN inputs of opposite signs meet in one product may the NaN's sign differ;
    ``tests/kernels/test_compiled_loops.py``).
    Backward contract: each gradient element depends only on its own grad pair, cos and sin elements.
    """
    checks.rope("cpu_exact.rope", x, cos, sin)
    if _rope_loops(x, cos, sin) is None:
        return native.rope(x, cos, sin)
    return exact_forward_vjp(_rope_compiled, _rope_with_saved, _rope_vjp, (x,), (cos, sin))


def _rope_loops(x: Tensor, cos: Tensor, sin: Tensor) -> ModuleType | None:
    """The compiled loops where they take this rotary embedding, else None (``native.rope``'s torch ops): fp32 or bf16
    x on the CPU, fp32 cos and sin that need no gradient (a gradient for them: autograd's own)."""
    if (x.device.type != "cpu" or x.dtype not in FLOAT_DTYPES or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or cos.requires_grad or sin.requires_grad):
        return None
    return compiled_loops.library()


def _rope_compiled(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return compiled_loops.library().rope_forward(x, cos, sin)


def _rope_with_saved(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, tuple]:
    return _rope_compiled(x, cos, sin), (cos, sin)


def _rope_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    cos, sin = saved
    return (compiled_loops.library().rope_backward(grad, cos, sin) if needs[0] else None,)


# --------------------------------------------------------------------------- attention
def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float, *,
              host: HostGuard = HOST) -> Tensor:
    """Causal grouped-query attention of new queries against a KV cache (prefill and decode).

    q: [B, T, Hq, hd]; k_cache, v_cache: [B, L, Hkv, hd]; q_start: [B] int64. Query t of
    sequence b sits at position q_start[b] + t and sees cache positions 0 .. q_start[b] + t.

    Invariance contract: a query's output depends only on its own vector and its own
    sequence's keys/values at positions <= its position -- never on the batch, other
    sequences, T (prefill vs decode), cache contents after its position (which must be
    finite), or the thread count. So decode step t equals row t of a prefill bit for bit.

    Tiling: per (sequence, KV head) the group's query heads are folded into rows and padded to
    row tiles of 4, 8, 16, 32, 48 or 64 rows (the smallest that holds them; 64 beyond); keys are cut into
    64-key tiles from position 0; every (row tile, key tile) pair is one GEMM
    ([R x hd] @ [hd x 64] for the scores, [R x 64] @ [64 x hd] for P @ V). A query row's
    scores and P @ V are K-reductions of that row alone (over hd, over 64 keys), and the host
    GEMM gives them the same bits for any tile height from 4 to 64 rows where ``HOST``'s probe
    passed (else the fixed-order GEMM, invariant by construction, runs them;
    ``tests/kernels/test_kernels.py`` checks decode == prefill, which compares 4-row with 64-row tiles).
    Masked scores give probability exactly 0, so
    tiles past a query's position add exact zeros to the position-ordered tree sums, and a
    short decode row reduces like a long prefill row.
    Backward contract: the softmax-attention VJP from the saved exact probabilities, through fixed-tile GEMMs
    and halving trees: the gradients depend only on (q, k, v, grad), never on the thread count.
    Without a gradient, a cache written through ``kv_rows.write`` (the model's cache) keeps its keys and values laid
    out as the tiles read them between calls (``kv_rows``: the same values, so the same bits), and where the guard
    runs torch's own GEMM and exp the forward's steps are one compiled call making the same calls
    (``cpu_attention._library_attention``).
    """
    checks.attention("cpu_exact.attention", q, k_cache, v_cache, q_start, scale)
    if q.shape[1] == 0:  # no queries: an empty output, as native's and Triton's (the tiles have no row to hold)
        return exact_forward_vjp(_no_queries, _no_queries_with_saved, _no_queries_vjp, (q, k_cache, v_cache))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        return cpu_attention.attention_with_gradient(q, k_cache, v_cache, q_start, scale, host)
    return cpu_attention.attention_exact(q, k_cache, v_cache, q_start, scale, host)


def _no_queries(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """``attention``'s output for T = 0 queries: [B, 0, Hq, hd] in q's dtype."""
    return q.new_empty(q.shape)


def _no_queries_with_saved(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, tuple]:
    return _no_queries(q, k_cache, v_cache), (q, k_cache, v_cache)


def _no_queries_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """No query read a key or value: every gradient is zero (the cache's too, as native's)."""
    return tuple(torch.zeros_like(t) if need else None for t, need in zip(saved, needs))


# --------------------------------------------------------------------------- silu_mul
def silu_mul(gate: Tensor, up: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """SwiGLU activation silu(gate) * up, elementwise.

    Invariance contract: each output element depends only on the matching gate and up
    elements -- not on the tensor's size or the element's position (torch's own ``silu`` /
    ``sigmoid`` round differently in their vector body and scalar tail; here silu is
    g / (1 + exp(-g)) with chunked exp and exactly rounded add/div).
    Backward contract: the analytic VJP, elementwise from chunked exp and exactly rounded ops -- each gradient
    element depends only on the matching gate, up and grad elements (not on the tensor's size or threads).
    """
    checks.silu_mul("cpu_exact.silu_mul", gate, up)
    return exact_forward_vjp(_silu_mul_exact, _silu_mul_with_saved, _silu_mul_vjp, (gate, up), (host,))


def _silu(gate: Tensor, host: HostGuard) -> Tensor:
    """fp32 silu(gate) = g / (1 + exp(-g)) as a new tensor (chunked exp, exactly rounded add and div)."""
    g = fp32(gate)
    denom = unary("exp", g.neg(), host, "silu_mul", inplace=True).add_(1.0)
    return torch.div(g, denom, out=denom)


def _silu_mul_loops(gate: Tensor, up: Tensor, host: HostGuard) -> ModuleType | None:
    """The compiled loops where they take this SwiGLU's forward, else None: the torch ops. fp32 gate and up; bf16
    gate and up where the guard chose the library exp (the loop's upcast gate, then the torch ops' bf16 product)."""
    if gate.dtype == up.dtype == torch.float32:
        return compiled_loops.library()
    if gate.dtype == up.dtype == torch.bfloat16:
        return _library_math(host, "silu_mul", "exp")
    return None


def _silu_mul_vjp_loops(grad: Tensor, gate: Tensor, up: Tensor) -> ModuleType | None:
    """The compiled loops where they take this SwiGLU's VJP, else None: grad, gate and up all fp32 or all bf16 (the VJP
    uses the forward's saved 1 + exp(-gate): no library function of its own)."""
    if grad.dtype == gate.dtype == up.dtype and gate.dtype in FLOAT_DTYPES:
        return compiled_loops.library()
    return None


def _silu_mul_compiled(gate: Tensor, up: Tensor, host: HostGuard, loops: ModuleType) -> tuple[Tensor, Tensor, Tensor]:
    """(out, 1 + exp(-gate), silu) of gate and up (as ``_silu_mul_loops`` admits them): the chunked exp, then the
    add, divide and multiply of ``_silu_mul_with_saved`` in one compiled pass."""
    if gate.dtype == torch.bfloat16 or _library_math(host, "silu_mul", "exp") is not None:  # and the chunked exp
        out, denom, silu = loops.silu_mul_exp_forward(gate, up, CHUNK, VECTOR_MULTIPLE)
        return out, denom, silu
    denom = unary("exp", gate.neg(), host, "silu_mul", inplace=True)
    silu, out = loops.silu_mul_forward(gate.contiguous(), denom, up.contiguous())
    return out, denom, silu


def _silu_mul_exact(gate: Tensor, up: Tensor, host: HostGuard) -> Tensor:
    if (loops := _silu_mul_loops(gate, up, host)) is not None:
        return _silu_mul_compiled(gate, up, host, loops)[0]
    silu = _silu(gate, host)
    if gate.dtype == torch.float32 and up.dtype == torch.float32:
        return silu.mul_(up)
    return silu.to(gate.dtype) * up


def _silu_mul_with_saved(gate: Tensor, up: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    """The forward's ops one by one (as ``_silu`` and ``_silu_mul_exact``), keeping 1 + exp(-gate) and silu(gate) for
    the backward: it needs both, and computing them again cost a negation, a chunked exp, an add and a divide."""
    if (loops := _silu_mul_loops(gate, up, host)) is not None:  # the add, divide and multiply below in one pass
        out, denom, silu = _silu_mul_compiled(gate, up, host, loops)
        return out, (gate, up, denom, silu, host)
    g = fp32(gate)
    denom = unary("exp", g.neg(), host, "silu_mul", inplace=True).add_(1.0)
    silu = torch.div(g, denom)
    out = torch.mul(silu, up) if gate.dtype == torch.float32 and up.dtype == torch.float32 else silu.to(gate.dtype) * up
    return out, (gate, up, denom, silu, host)


def _silu_mul_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """With s = sigmoid(gate) = 1 / (1 + exp(-gate)): d up = g * silu(gate) = g * gate * s and
    d gate = g * up * s * (1 + gate * (1 - s)); fp32 from the forward's 1 + exp(-gate) and silu (saved) and exactly
    rounded ops, one rounding."""
    gate, up, denom, silu, host = saved
    if (loops := _silu_mul_vjp_loops(grad, gate, up)) is not None:  # the ops below, one pass
        factor = silu if silu.dtype == gate.dtype else silu.to(gate.dtype)  # (bf16: rounded, as below)
        grad_gate, grad_up = loops.silu_mul_backward(grad.contiguous(), gate.contiguous(), up.contiguous(),
                                                     denom.contiguous(), factor.contiguous(), needs[0], needs[1])
        return (grad_gate if needs[0] else None), (grad_up if needs[1] else None)
    gf, g = fp32(gate), fp32(grad)
    grad_gate = grad_up = None
    if needs[0]:
        s = torch.reciprocal(denom)  # exactly rounded
        ds = (1.0 - s).mul_(gf).add_(1.0).mul_(s)  # s * (1 + gate * (1 - s))
        grad_gate = ds.mul_(g).mul_(fp32(up)).to(gate.dtype)
    if needs[1]:  # the forward's silu, rounded to the gate's dtype as the forward does
        grad_up = torch.mul(fp32(silu.to(gate.dtype)), g).to(up.dtype)
    return grad_gate, grad_up


# --------------------------------------------------------------------------- log_softmax
def log_softmax(logits: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """log_softmax over the last dim, fp32 result.

    Invariance contract: each output row depends only on that logits row -- never on the
    number of rows, their order, the vocabulary being split into chunks, or thread count.
    Computed as (x - max) - log(tree_sum(exp(x - max))).
    Backward contract: g - softmax * sum(g) from the saved output, row by row (chunked exp, halving-tree sum):
    never dependent on the thread count.
    """
    checks.rows("cpu_exact.log_softmax", "logits", logits)
    return exact_forward_vjp(_log_softmax_exact, _log_softmax_with_saved, _log_softmax_vjp, (logits,), (host,))


def _shift_and_log_normalizer(logits: Tensor, host: HostGuard, op: str) -> tuple[Tensor, Tensor]:
    xf = fp32(logits)
    row_max = xf.amax(dim=-1, keepdim=True)  # max is exact in any order
    shifted = xf - row_max
    return shifted, unary("log", _tree_sum(unary("exp", shifted, host, op)), host, op)


def _log_softmax_exact(logits: Tensor, host: HostGuard) -> Tensor:
    shifted, log_normalizer = _shift_and_log_normalizer(logits, host, "log_softmax")
    return shifted - log_normalizer.unsqueeze(-1)


def _log_softmax_with_saved(logits: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    out = _log_softmax_exact(logits, host)
    return out, (out, logits.dtype, host)


def _log_softmax_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d logits = g - softmax * sum(g) (chunked exp, halving-tree sum)."""
    out, dtype, host = saved
    g = fp32(grad)
    softmax = unary("exp", out, host, "log_softmax")
    return (g - softmax.mul_(_tree_sum(g).unsqueeze(-1))).to(dtype),


# --------------------------------------------------------------------------- token_logprobs
def token_logprobs(logits: Tensor, targets: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """log p(target) per row: logits [..., V], targets [...] int64 -> fp32 [...].

    Invariance contract: as ``log_softmax`` (and bitwise equal to ``log_softmax(x)[target]``):
    each value depends only on its own logits row and target.
    Backward contract: g * (onehot - softmax) from the forward's shifted logits x - max (saved, or formed again from
    the logits and each row's max where the compiled loops run: the same rounding, the same bits), elementwise
    (chunked exp): never dependent on the thread count.
    """
    checks.token_logprobs("cpu_exact.token_logprobs", logits, targets)
    return exact_forward_vjp(_token_logprobs_exact, _token_logprobs_with_saved, _token_logprobs_vjp, (logits,),
                             (targets, host))


def _library_math(host: HostGuard, op: str, *names: str) -> ModuleType | None:
    """The compiled loops where the guard chose the library function for each of ``names`` (fp32), else None."""
    loops = compiled_loops.library()
    if loops is None or any(host.elementwise(name, torch.float32, op) is not getattr(torch, name) for name in names):
        return None
    return loops


def _token_logprobs_loops(xf: Tensor, targets: Tensor, host: HostGuard) -> ModuleType | None:
    """The compiled loops where they take ``token_logprobs`` of the fp32 logits ``xf`` (its forward, with or
    without what the VJP keeps, and that VJP): the guard chose the library exp and log, one target per row, a
    vocabulary of at least 2. Else None: the torch ops."""
    if xf.shape[-1] >= 2 and targets.shape == xf.shape[:-1]:
        return _library_math(host, "token_logprobs", "exp", "log")
    return None


def _token_logprobs_exact(logits: Tensor, targets: Tensor, host: HostGuard) -> Tensor:
    xf = fp32(logits)
    if (loops := _token_logprobs_loops(xf, targets, host)) is not None:
        # the ops below in one compiled call: the same ATen amax, exp and log calls on the same chunks, the same
        # trees (its chunks and rows spread over threads, each result from one thread)
        return loops.token_logprobs_forward(xf, targets, CHUNK, VECTOR_MULTIPLE)
    shifted = xf - xf.amax(dim=-1, keepdim=True)  # max is exact in any order
    picked = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # exp in place: the same values as _shift_and_log_normalizer, one buffer fewer
    op = "token_logprobs"
    return picked - unary("log", _tree_sum(unary("exp", shifted, host, op, inplace=True)), host, op)


class _LogitsAndRowMax(NamedTuple):
    """What the compiled ``token_logprobs`` forward keeps for its VJP in place of the shifted logits: the fp32 logits,
    each row's max, and the loops that form x - max again in the VJP's one pass."""

    logits: Tensor
    row_max: Tensor
    loops: ModuleType


def _token_logprobs_with_saved(logits: Tensor, targets: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    """The output, and for the VJP each row's log normalizer and either the shifted logits x - max (the torch ops)
    or the fp32 logits and each row's max (the compiled loops, which form x - max again, the same bits, in the pass
    that needs it: one [..., V] buffer fewer, written and read once less)."""
    xf = fp32(logits)
    if (loops := _token_logprobs_loops(xf, targets, host)) is not None:
        out, row_max, log_normalizer = loops.token_logprobs_forward_saving(xf, targets, CHUNK, VECTOR_MULTIPLE)
        return out, (_LogitsAndRowMax(xf, row_max, loops), log_normalizer, targets, logits.dtype, host)
    shifted, log_normalizer = _shift_and_log_normalizer(logits, host, "token_logprobs")
    out = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normalizer
    return out, (shifted, log_normalizer, targets, logits.dtype, host)


def _token_logprobs_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d logits = g * (onehot(target) - softmax)."""
    shifted, log_normalizer, targets, dtype, host = saved
    if isinstance(shifted, _LogitsAndRowMax):  # the compiled forward kept these: the ops below in one pass
        grad_logits = shifted.loops.token_logprobs_backward(shifted.logits, shifted.row_max, log_normalizer, targets,
                                                            fp32(grad), CHUNK, VECTOR_MULTIPLE)
        return (grad_logits.to(dtype),)
    g = fp32(grad).unsqueeze(-1)
    grad_logits = unary("exp", shifted - log_normalizer.unsqueeze(-1), host, "token_logprobs", inplace=True).mul_(-g)
    grad_logits.scatter_add_(-1, targets.unsqueeze(-1), g)
    return (grad_logits.to(dtype),)


# --------------------------------------------------------------------------- entropy
def entropy(log_probs: Tensor, *, host: HostGuard = HOST) -> Tensor:
    """-sum(p log p) over the last dim of a ``log_softmax`` output: fp32 [..., V] -> [...].

    Invariance contract: each value depends only on its own row (chunked exp, halving-tree sum) -- never on the
    number of rows or the thread count. Backward contract: -g p (1 + log p), elementwise: the same.
    """
    checks.rows("cpu_exact.entropy", "log_probs", log_probs)
    return exact_forward_vjp(_entropy_exact, _entropy_with_saved, _entropy_vjp, (log_probs,), (host,))


def _entropy_exact(log_probs: Tensor, host: HostGuard) -> Tensor:
    lp = fp32(log_probs)
    return _tree_sum(unary("exp", lp, host, "entropy").mul_(lp)).neg_()


def _entropy_with_saved(log_probs: Tensor, host: HostGuard) -> tuple[Tensor, tuple]:
    lp = fp32(log_probs)
    probs = unary("exp", lp, host, "entropy")
    return _tree_sum(probs * lp).neg_(), (probs, lp, log_probs.dtype)


def _entropy_vjp(saved: tuple, grad: Tensor, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """d/d lp_i of -sum(exp(lp) lp) = -p_i (1 + lp_i)."""
    probs, lp, dtype = saved
    return ((lp + 1.0).mul_(probs).mul_(fp32(grad).unsqueeze(-1)).neg_().to(dtype),)


# --------------------------------------------------------------------------- another guard; what the guard found
def with_host(host: HostGuard) -> SimpleNamespace:
    """This backend's ops bound to another ``HostGuard`` (e.g. ``HostGuard(ROW_BLOCKS, mode="fixed-order")``).

    Same names and signatures as the module's own ops, so it can stand wherever an op module does."""
    ops = {name: partial(globals()[name], host=host) for name in (*HOST_PROPERTIES, *FUSED_OP_NAMES,
                                                                 "linear_backward", "linear_backward_probes")}
    return SimpleNamespace(NAME=f"{NAME}[{host.mode}]", ROWS_INVARIANT=ROWS_INVARIANT, host=host, **ops)


def ops_in_mode(mode: str) -> SimpleNamespace:
    """This backend's ops on a fresh guard in ``mode`` (``HostGuard.mode``: ``auto``, ``canonical``, ``fixed-order``
    ...), its probes run anew: what a host whose guard takes that mode computes (benchmarks and tests compare them)."""
    return with_host(HostGuard(ROW_BLOCKS, mode=mode))


def host_report(host: HostGuard = HOST) -> dict:
    """Which path each op takes on this host and what the probes found (``vexact check`` prints it).

    An op's path: ``by construction`` (it relies on no host property), ``fast`` / ``fixed-order`` (all its
    probed shape classes took that path), ``mixed``, or ``not used yet`` (no probe has run for it). A bf16 GEMM class
    that computes in fp32 (``fp32-upcast``) runs the fp32 class's path, listed too, so it counts as neither; nor does
    an fp32 class whose ``onednn_rows`` probe failed (``torch.bmm``: its ``gemm_rows`` class is listed too).
    ``library_dtype_gemm``: each bf16 GEMM class and its path -- ``blas`` / ``blas-1-thread`` (the host's bf16 GEMM)
    or ``fp32-upcast``."""
    report = host.report()
    ops = {}
    # the sampler's Gumbel noise (vexact.engine.sampling) also runs through this guard: fp64 log and cos
    # and the optimizer's sqrt (vexact.rl.optim: the gradient norm, AdamW's denominator)
    extra = {"sampling": ("elementwise_log", "elementwise_cos", "elementwise_sqrt"), "optimizer": ("elementwise_sqrt",)}
    for op, properties in {**HOST_PROPERTIES, **extra}.items():
        probes = [p for p in report["probes"] if op in p["ops"]]
        paths = {"fixed-order" if p["path"] == "fixed-order" else "fast" for p in probes
                 if p["path"] not in (UPCAST_PATH, BMM_PATH)}  # (each also runs another class's path, listed too)
        if not properties:
            path = "by construction"
        elif not paths:
            path = "not used yet"
        else:
            path = paths.pop() if len(paths) == 1 else "mixed"
        ops[op] = {"path": path, "relies_on": list(properties),
                   "shape_classes": [f"{p['property']}: {p['shape_class']}" for p in probes]}
    classes = [{"shape_class": p["shape_class"], "path": p["path"]} for p in report["probes"]
               if p.get("fallback") == UPCAST_PATH]
    return {**report, "ops": ops, "library_dtype_gemm": classes, "loops": compiled_loops.status()}
