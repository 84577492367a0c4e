"""The training path's LM head and log-probs over row chunks: memory that does not grow with vocabulary x length.

Scoring N response tokens needs each token's log-prob (and, for ``actor/entropy``, its distribution's entropy)
from an [N, V] row of logits. Held at once, with the log-softmax's copies and their gradients, that is many
N x V buffers (4 x 1,000 tokens at Qwen3's 151,936-token vocabulary grew the peak by 8.9 GiB). ``head_scores``
computes the head over passes of ``pass_rows(V)`` rows instead, and with grad through ``_ChunkedHead`` (like
Liger's fused linear cross-entropy): the forward keeps only the hidden rows, and the backward computes each
group's logits again and their gradients there.

Bits. Every exact op is row-invariant (a row's result depends only on that row), so the log-probs and entropies
are today's, bit for bit, however the rows are cut. The gradients are too on the exact CPU kernels: a weight
gradient reduces over the tokens in ``REDUCE_BLOCK``-token chunks added by a halving tree, each chunk its own
reduction (``gemm_weight_gradient.transposed_matmul``: a short last chunk at its own length), so the backward works
in exactly those groups, each group's part the exact kernels' reduction of its rows, and adds the parts by the
same tree (``fixed_order.tree_sum_of``, depth first: one partial per tree level held). A batch of at most
``REDUCE_BLOCK`` tokens is one group, as it is one chunk. Exceptions, where the chunked path runs at all (more
than ``pass_rows(V)`` tokens in one forward): a bf16 weight gradient of at most
``gemm_tiles.LIBRARY_REDUCE_MAX`` tokens, which the exact kernels reduce in one bf16 GEMM, is here the fp32
tree of fp32 groups, rounded once (as above that length); the native and Triton backends' weight gradients (one
GEMM over every token) become a tree over the groups -- deterministic, as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vexact_kernels.fixed_order import tree_sum_of
from vexact_kernels.gemm_tiles import LIBRARY_REDUCE_MAX, REDUCE_BLOCK
from vexact_kernels.gemm_weight_gradient import last_chunk_length

from .inputs import scale_logits
from .model import KernelOps

HEAD_PASS_ELEMENTS = 1 << 24
"""Logits computed at once (32 MiB of fp32): a pass of the head covers ``pass_rows(V)`` rows. A constant, so how
rows are cut depends on the vocabulary only, never on the batch."""


BACKWARD_PASS_SPLIT = 4
"""Where the backend is row-invariant (``ROWS_INVARIANT``: any cut of the rows gives the same bits), the backward
computes its logits again in passes of a quarter of the forward's rows: each pass's logits, log-softmax and their
gradients are several buffers of its rows x vocabulary, the largest term of a fresh process's peak at 4 x 2,000
tokens. Elsewhere it keeps the forward's passes."""


def pass_rows(vocab_size: int) -> int:
    """Rows of logits per pass of the head: as many as ``HEAD_PASS_ELEMENTS`` hold, at least one."""
    return max(1, HEAD_PASS_ELEMENTS // vocab_size)


def head_scores(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, ops: KernelOps,
                with_entropy: bool, rows_per_pass: int | None = None) -> tuple[Tensor, Tensor | None]:
    """fp32 log p(target) of every row of ``hidden`` [N, D] under the head ``weight`` [V, D] (logits scaled by
    ``temperature`` as ``scale_logits``), and (``with_entropy``) each row's entropy, else None. Differentiable
    in ``hidden`` and ``weight``.

    ``rows_per_pass``: rows of logits held at once (default ``pass_rows(V)``); N at most that runs the head over
    every row in one pass."""
    rows = hidden.shape[0]
    step = pass_rows(weight.shape[0]) if rows_per_pass is None else rows_per_pass
    if rows <= step:
        return _scores(hidden, weight, targets, temperature, ops, with_entropy)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _scores_in_passes(hidden, weight, targets, temperature, ops, with_entropy, step)
    logp, entropy = _ChunkedHead.apply(hidden, weight, targets, temperature, ops, with_entropy, step)
    return logp, entropy if with_entropy else None


def _scores(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, ops: KernelOps,
            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The head over these rows in one pass: logits, their log-probs of ``targets`` and (optionally) entropies."""
    return _scores_of(ops.linear(hidden, weight), targets, temperature, ops, with_entropy)


def _scores_of(head_out: Tensor, targets: Tensor, temperature: float, ops: KernelOps,
               with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` and (optionally) entropies from the head's output rows (the model's dtype)."""
    logits = scale_logits(head_out, temperature)
    logp = ops.token_logprobs(logits, targets)
    return logp, ops.entropy(ops.log_softmax(logits)) if with_entropy else None


def _scores_in_passes(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, ops: KernelOps,
                      with_entropy: bool, step: int) -> tuple[Tensor, Tensor | None]:
    parts = [_scores(hidden[s : s + step], weight, targets[s : s + step], temperature, ops, with_entropy)
             for s in range(0, hidden.shape[0], step)]
    logp = torch.cat([lp for lp, _ in parts])
    return logp, torch.cat([ent for _, ent in parts]) if with_entropy else None


class _ChunkedHead(torch.autograd.Function):
    """Forward: ``_scores`` pass by pass, no graph kept (saved: the hidden rows, the weight, the targets).
    Backward: per group of ``REDUCE_BLOCK`` rows (every row when there are fewer), the group's logits again, the
    gradients of its log-probs and entropies pass by pass, then the head's own VJP over the group; the groups'
    weight-gradient parts added by the exact kernels' halving tree (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ops, with_entropy, step):  # type: ignore[override]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.ops, ctx.with_entropy, ctx.step = temperature, ops, with_entropy, step
        ctx.set_materialize_grads(False)  # an unused output (entropy without an entropy loss) gets no gradient
        logp, entropy = _scores_in_passes(hidden, weight, targets, temperature, ops, with_entropy, step)
        if entropy is None:
            entropy = logp.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if not ctx.with_entropy:
            grad_entropy = None
        rows = hidden.shape[0]
        group = _group_rows(rows, weight.dtype)
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None

        def part(i: int) -> Tensor | None:
            first = i * group
            return _group_backward(ctx, hidden, weight, targets, grad_logp, grad_entropy, first,
                                   min(rows, first + group), group, grad_hidden, need_weight)

        count = -(-rows // group)
        grad_weight = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        probes = getattr(ctx.ops, "linear_backward_probes", None)
        if need_weight and probes is not None:
            # the weight gradient's first-use probes (vocabulary-wide inputs) before any group's output gradient
            # is held: beside one, they set a fresh process's peak at Gemma 3's vocabulary
            for length in {group, _padded_length(rows, rows - 1, group)}:
                probes(length, weight)
        if need_weight:
            grad_weight = tree_sum_of(count, part).to(weight.dtype)
        else:
            for i in range(count):
                part(i)
        return grad_hidden, grad_weight, None, None, None, None, None


def _group_rows(rows: int, dtype: torch.dtype) -> int:
    """Rows per group of the backward: the exact kernels' reduction chunk of a weight gradient over ``rows`` tokens
    where it adds several (``REDUCE_BLOCK``), else every row (at most ``REDUCE_BLOCK``; bf16: at most
    ``LIBRARY_REDUCE_MAX``, which the exact kernels reduce in one bf16 GEMM)."""
    whole = LIBRARY_REDUCE_MAX if dtype != torch.float32 else REDUCE_BLOCK
    return rows if rows <= whole else REDUCE_BLOCK


def _padded_length(rows: int, row: int, group: int) -> int:
    """The rows of the backward group holding ``row`` (of ``rows``): ``group``, the last group zero-padded as the exact
    kernels pad the last chunk (to its own length where it is short)."""
    last_group = row // group == (rows - 1) // group
    return last_chunk_length(rows, group, torch.float32) if last_group else group


def _group_backward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, grad_logp: Tensor | None,
                    grad_entropy: Tensor | None, first: int, last: int, group: int, grad_hidden: Tensor | None,
                    need_weight: bool) -> Tensor | None:
    """Rows ``first:last`` (the last group zero-padded to ``gemm_weight_gradient.last_chunk_length`` rows, as the exact
    kernels pad their last chunk): their hidden gradient written into ``grad_hidden`` and their weight-gradient part
    returned (None when the weight needs none).

    The head's output gradient is built pass by pass (the logits again, then the VJPs of the log-probs and
    entropies), zero (+0.0) on padding rows as a zero-padded reduction chunk is; then the head's VJP
    (``linear_backward``) over the group, so the part is the exact kernels' chunk product bit for bit: in the
    weight's dtype where it computes in fp32 or the group is every row (the whole gradient), else (bf16, several
    groups) from the fp32-upcast operands -- the exact kernels' fp32 chunk products -- rounded once after the tree
    (``_ChunkedHead.backward``)."""
    ops, real = ctx.ops, last - first
    step = max(1, ctx.step // BACKWARD_PASS_SPLIT) if getattr(ops, "ROWS_INVARIANT", False) else ctx.step
    h = hidden[first:last].detach()
    padded = _padded_length(hidden.shape[0], last - 1, group)
    if real < padded:
        h = torch.cat([h, h.new_zeros(padded - real, h.shape[1])])
    w = weight.detach()
    grad_out = h.new_zeros(padded, w.shape[0])  # the head output's gradient, in the model's dtype
    for s in range(0, real, step):
        e = min(real, s + step)
        with torch.no_grad():
            piece = ops.linear(h[s:e], w)
        with torch.enable_grad():
            piece.requires_grad_(True)
            logp, entropy = _scores_of(piece, targets[first + s : first + e], ctx.temperature, ops,
                                       grad_entropy is not None)
            roots = [(t, g[first + s : first + e]) for t, g in ((logp, grad_logp), (entropy, grad_entropy))
                     if g is not None]
            (grad_out[s:e],) = torch.autograd.grad([t for t, _ in roots], [piece], [g for _, g in roots])
    own_dtype = weight.dtype == torch.float32 or group == hidden.shape[0]
    grad_h, part = _linear_backward(ops, h, w, grad_out, grad_hidden is not None, need_weight and own_dtype)
    if grad_hidden is not None:
        grad_hidden[first:last] = grad_h[:real]
    if not need_weight or own_dtype:
        return part
    del grad_h
    return _linear_backward(ops, h.float(), w.float(), grad_out.float(), False, True)[1]


def _linear_backward(ops: KernelOps, x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool
                     ) -> tuple[Tensor | None, Tensor | None]:
    """The head's VJP: the backend's ``linear_backward`` (no second forward) where it has one, else autograd through
    ``ops.linear`` (which computes the forward again)."""
    backward = getattr(ops, "linear_backward", None)
    if backward is not None:
        return backward(x, weight, grad, need_x, need_w)
    with torch.enable_grad():
        x_leaf, w_leaf = x.detach().requires_grad_(need_x), weight.detach().requires_grad_(need_w)
        wanted = [t for t in (x_leaf, w_leaf) if t.requires_grad]
        got = iter(torch.autograd.grad(ops.linear(x_leaf, w_leaf), wanted, grad) if wanted else ())
    return (next(got) if need_x else None), (next(got) if need_w else None)
