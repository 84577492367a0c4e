"""Backward contracts of the Triton backend (``vexact_kernels.triton_exact``): attention's own backward kernels
(FlashAttention-2 style, ``triton_attention``) and the analytic VJPs of rms_norm, rope and silu_mul.

Without a GPU these run in the Triton interpreter (slow): shapes are tiny but span several 16-wide attention
blocks, ragged edges and a GQA group of 2. Correctness is checked against float64 autograd of the reference op
(attention: the SDPA math backend that was the backward before, ``triton_attention._attention_backward_reference``)
with ``assert_close`` at the tolerances in ``GRAD_TOL``; determinism and the unchanged forward bits with
``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_optional

from vexact_kernels import TRITON_PIP, native

require_optional("triton", TRITON_PIP)  # the optional triton extra: the whole module needs it
from vexact_kernels import triton_attention  # noqa: E402
from vexact_kernels import triton_exact as exact  # noqa: E402

pytestmark = pytest.mark.slow  # the Triton interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16)
# Gradients vs float64 autograd on the same (dtype-rounded) inputs. fp32: only summation order and fp32 rounding
# differ. bf16: the gradients are rounded to bf16 (8 significant bits) and, on a GPU, P and dS enter the block
# products in bf16, as in FlashAttention.
GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SCALE = 0.3

# (batch, new queries T, q heads, kv heads, cache length L, q_start per sequence): every case has GQA group 2.
ATTENTION_CASES = {
    "decode_ragged": (3, 1, 4, 2, 40, [0, 17, 33]),  # one query each, at ragged cache positions
    "prefill_from_0": (2, 20, 4, 2, 20, [0, 0]),  # T > 1 at q_start 0, two query blocks
    "prefill_at_ragged_offsets": (2, 9, 4, 2, 30, [5, 21]),  # a chunk continuing a prompt
    "cache_longer_than_used": (2, 6, 4, 2, 64, [3, 10]),  # keys after the last query's position unused
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded normal samples (drawn on the CPU, so the same everywhere) on DEVICE, in dtype."""
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def _attention_inputs(case: str, dtype: torch.dtype, head_dim: int = 16):
    batch, q_len, q_heads, kv_heads, cache_len, starts = ATTENTION_CASES[case]
    g = _gen(sum(map(ord, case)))
    q = _randn(g, batch, q_len, q_heads, head_dim, dtype=dtype)
    k = _randn(g, batch, cache_len, kv_heads, head_dim, dtype=dtype)
    v = _randn(g, batch, cache_len, kv_heads, head_dim, dtype=dtype)
    upstream = _randn(g, batch, q_len, q_heads, head_dim, dtype=dtype)
    return (q, k, v), torch.tensor(starts, device=DEVICE), upstream


def _grads(fn, inputs, static, upstream, dtype=None):
    """(output, grads of every input) of fn(*inputs, *static) with upstream gradient ``upstream``; inputs and
    upstream converted to ``dtype`` first when given."""
    leaves = [(t if dtype is None else t.to(dtype)).detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, *static)
    out.backward(upstream if dtype is None else upstream.to(dtype))
    return out.detach(), [t.grad for t in leaves]


def _reference_grads(inputs, static, upstream):
    """float64 autograd of the SDPA math reference on the same values (on the CPU: float64 everywhere)."""
    cpu = [t.cpu() for t in inputs]
    static = tuple(s.cpu() if isinstance(s, torch.Tensor) else s for s in static)
    return _grads(triton_attention._attention_backward_reference, cpu, static, upstream.cpu(), torch.float64)[1]


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_gradients_match_float64_reference(case, dtype):
    inputs, q_start, upstream = _attention_inputs(case, dtype)
    out, grads = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    reference = _reference_grads(inputs, (q_start, SCALE), upstream)
    for name, grad, ref, x in zip("qkv", grads, reference, inputs):
        assert grad.shape == x.shape and grad.dtype == x.dtype, name
        torch.testing.assert_close(grad.cpu().double(), ref, **GRAD_TOL[dtype], msg=lambda m, n=name: f"d{n}: {m}")


def test_unseen_cache_positions_get_exact_zero_gradients():
    inputs, q_start, upstream = _attention_inputs("cache_longer_than_used", torch.float32)
    _, (_, dk, dv) = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    q_len = inputs[0].shape[1]
    for b, start in enumerate(q_start.tolist()):
        seen = start + q_len  # positions 0 .. start + q_len - 1 are visible to some query
        assert torch.equal(dk[b, seen:], torch.zeros_like(dk[b, seen:]))
        assert torch.equal(dv[b, seen:], torch.zeros_like(dv[b, seen:]))
        assert dk[b, :seen].abs().amax(-1).gt(0).all() and dv[b, :seen].abs().amax(-1).gt(0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_is_bitwise_deterministic(dtype):
    inputs, q_start, upstream = _attention_inputs("prefill_at_ragged_offsets", dtype)
    _, first = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    _, second = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "gradients differ run to run"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode_ragged", "prefill_from_0", "prefill_at_ragged_offsets"])
def test_forward_with_grad_has_the_no_grad_forward_bits(case, dtype):
    # The grad path's forward also stores the log-sum-exp; the output must be the exact forward's bit for bit.
    inputs, q_start, upstream = _attention_inputs(case, dtype)
    out, _ = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    assert torch.equal(out, triton_attention.attention_exact(*inputs, q_start, SCALE))


def test_stored_lse_is_the_rows_log_sum_exp():
    inputs, q_start, _ = _attention_inputs("prefill_at_ragged_offsets", torch.float32)
    q, k, v = inputs
    _, lse, _ = triton_attention._attention_forward(q, k, v, q_start, SCALE, store_lse=True)
    batch, q_len, q_heads, _ = q.shape
    group = q_heads // k.shape[2]
    scores = torch.einsum("bthd,blhd->bhtl", q.double(), k.double().repeat_interleave(group, 2)) * SCALE
    pos = q_start[:, None] + torch.arange(q_len, device=DEVICE)
    visible = torch.arange(k.shape[1], device=DEVICE)[None, None, :] <= pos[:, :, None]
    expected = scores.masked_fill(~visible[:, None], float("-inf")).logsumexp(-1) / torch.log(torch.tensor(2.0))
    torch.testing.assert_close(lse.view(batch, q_heads, q_len).double(), expected, atol=1e-5, rtol=1e-6)


def test_gradients_flow_to_a_strided_cache_view():
    # A cache slice of a larger buffer (last dim contiguous): the gradient lands in the buffer's slice, zero elsewhere.
    inputs, q_start, upstream = _attention_inputs("prefill_at_ragged_offsets", torch.float32)
    q, k, v = inputs
    k_buffer = torch.cat([k, _randn(_gen(5), *k.shape)], dim=2).detach().requires_grad_()  # 2x the kv heads
    v_buffer = torch.cat([_randn(_gen(6), *v.shape), v], dim=1).detach().requires_grad_()  # 2x the length
    k_view, v_view = k_buffer[:, :, : k.shape[2]], v_buffer[:, v.shape[1] :]
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    exact.attention(q, k_view, v_view, q_start, SCALE).backward(upstream)
    _, (_, dk, dv) = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    assert torch.equal(k_buffer.grad[:, :, : k.shape[2]], dk)
    assert torch.equal(k_buffer.grad[:, :, k.shape[2] :], torch.zeros_like(dk))
    assert torch.equal(v_buffer.grad[:, v.shape[1] :], dv)
    assert torch.equal(v_buffer.grad[:, : v.shape[1]], torch.zeros_like(dv))


def test_only_the_needed_gradients_are_computed_and_they_match():
    inputs, q_start, upstream = _attention_inputs("prefill_from_0", torch.float32)
    _, full = _grads(exact.attention, inputs, (q_start, SCALE), upstream)
    for wanted in range(3):
        leaves = [t.clone().requires_grad_(i == wanted) for i, t in enumerate(inputs)]
        exact.attention(*leaves, q_start, SCALE).backward(upstream)
        assert torch.equal(leaves[wanted].grad, full[wanted])
        assert all(t.grad is None for i, t in enumerate(leaves) if i != wanted)


# --------------------------------------------------------------------------- rms_norm, rope, silu_mul
def _pointwise_case(op: str, dtype: torch.dtype):
    g = _gen(11)
    if op == "rms_norm":
        return [_randn(g, 3, 5, 40, dtype=dtype), _randn(g, 40, dtype=dtype)], (1e-5,)
    if op == "silu_mul":
        return [_randn(g, 6, 37, dtype=dtype), _randn(g, 6, 37, dtype=dtype)], ()
    # rope: cos/sin broadcast over the batch, as a model passes them
    return [_randn(g, 2, 5, 3, 16, dtype=dtype), _randn(g, 1, 5, 8), _randn(g, 1, 5, 8)], ()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "rope", "silu_mul"])
def test_analytic_vjp_matches_float64_autograd_and_is_deterministic(op, dtype):
    inputs, static = _pointwise_case(op, dtype)
    upstream = torch.randn(inputs[0].shape, generator=_gen(12)).to(DEVICE, dtype)
    _, first = _grads(getattr(exact, op), inputs, static, upstream)
    _, second = _grads(getattr(exact, op), inputs, static, upstream)
    cpu = [t.cpu() for t in inputs]
    reference = _grads(getattr(native, op), cpu, static, upstream.cpu(), torch.float64)[1]
    for a, b, ref, x in zip(first, second, reference, inputs):
        assert torch.equal(a, b), "gradients differ run to run"
        assert a.shape == x.shape and a.dtype == x.dtype
        # bf16 inputs, fp32 cos/sin: the tolerance of the gradient's own dtype
        torch.testing.assert_close(a.cpu().double(), ref, **GRAD_TOL[a.dtype])


@pytest.mark.parametrize("op", ["rms_norm", "rope", "silu_mul", "attention"])
def test_backward_paths_are_the_own_kernels(op):
    # The analytic / Triton backward is what autograd records, not the recompute-the-native-op fallback.
    if op == "attention":
        inputs, q_start, _ = _attention_inputs("decode_ragged", torch.float32)
        static = (q_start, SCALE)
    else:
        inputs, static = _pointwise_case(op, torch.float32)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = getattr(exact, op)(*leaves, *static)
    assert type(out.grad_fn).__name__ == "_ExactForwardOwnBackwardBackward"
