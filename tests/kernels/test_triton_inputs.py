"""Bad input to the Triton kernels' public ops (``vexact_kernels.triton_exact``): the exact CPU kernels' contract
(``test_kernel_inputs.BAD``, the same shared checks), so each case is one TypeError or ValueError naming
``triton_exact.<op>`` and the argument -- where before a Triton kernel read past a too-short operand (silent
garbage or NaN), computed an fp64 or integer input, or failed deep inside (a KeyError on the tile table). Plus what
is Triton's own: a strided bias (read with stride 1 by the kernel) and CPU tensors given to the compiled kernels.

Without a GPU the kernels run in the Triton interpreter; the checks run before any kernel, so this is quick."""

from __future__ import annotations

import pytest
import torch
from conftest import require_optional

from vexact_kernels import TRITON_PIP

require_optional("triton", TRITON_PIP)  # the optional triton extra: the whole module needs it

from test_kernel_inputs import BAD, COS, SIN, START, W, X, _r, assert_one_clear_error  # noqa: E402

from vexact_kernels import checks, triton_common  # noqa: E402
from vexact_kernels import triton_exact as exact  # noqa: E402

pytestmark = pytest.mark.slow  # importing triton, and the interpreter


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input_is_one_clear_error(call, error, message):
    assert_one_clear_error(call, exact, error, message)


def test_a_strided_bias_gives_the_contiguous_bias_bits():
    """The linear kernel reads the bias with stride 1: a strided one (a slice of a wider vector) read its
    neighbours' values."""
    bias = _r(64)[::2]
    assert torch.equal(exact.linear(X, W, bias), exact.linear(X, W, bias.contiguous()))


def test_strided_operands_give_the_contiguous_operands_bits():
    xt, wt = _r(16, 5).t(), _r(16, 32).t()
    assert torch.equal(exact.linear(xt, wt), exact.linear(xt.contiguous(), wt.contiguous()))
    q = _r(2, 4, 3, 8).transpose(1, 2)
    k, v = _r(2, 2, 5, 8).transpose(1, 2), _r(2, 2, 5, 8).transpose(1, 2)
    assert torch.equal(exact.attention(q, k, v, START, 0.3),
                       exact.attention(q.contiguous(), k.contiguous(), v.contiguous(), START, 0.3))
    assert torch.equal(exact.rope(q, COS, SIN), exact.rope(q.contiguous(), COS, SIN))
    assert torch.equal(exact.rope(q, COS[:1], SIN[:1]), exact.rope(q, COS[:1].expand(2, 3, 4), SIN[:1].expand(2, 3, 4)))


def test_cpu_tensors_given_to_the_compiled_kernels_are_one_error_naming_the_op(monkeypatch):
    """Outside the interpreter (a GPU host) CPU tensors cannot reach a compiled kernel: one ValueError naming the op
    and the argument (the message named neither)."""
    monkeypatch.setattr(triton_common, "INTERPRETING", False)
    with pytest.raises(ValueError, match=r"triton_exact\.linear: x is on cpu; the compiled kernels need CUDA tensors"):
        exact.linear(X, W)
    with pytest.raises(ValueError, match=r"triton_exact\.silu_mul: gate is on cpu"):
        exact.silu_mul(X, X)
    with pytest.raises(ValueError, match=r"triton_exact\.entropy: log_probs is on cpu"):
        exact.entropy(X)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the checks' CUDA path)")
def test_the_checks_read_no_cuda_values(monkeypatch):
    """On CUDA tensors the checks read metadata only (reading values synchronises the device, per layer per decode
    step): token ids, q_start and expert ids go unread there."""
    from vexact_kernels import moe_exact

    def refuse(*args, **kwargs):
        raise AssertionError("a check read a CUDA tensor's values")

    monkeypatch.setattr(torch, "aminmax", refuse)
    tokens, weight = torch.tensor([1, 2], device="cuda"), _r(32, 16).cuda()
    checks.embedding("triton_exact.embedding", tokens, weight)
    assert torch.equal(exact.embedding(tokens, weight), weight[tokens])
    q, k, v = _r(2, 3, 4, 8).cuda(), _r(2, 5, 2, 8).cuda(), _r(2, 5, 2, 8).cuda()
    exact.attention(q, k, v, START.cuda(), 0.3)
    log_probs = _r(3, 8).log_softmax(-1).cuda()
    moe_exact.routing_weights(log_probs, torch.tensor([[0, 2], [1, 5], [3, 7]], device="cuda"), True)
