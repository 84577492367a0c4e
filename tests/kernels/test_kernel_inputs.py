"""Bad input to the exact kernels' public ops (``vexact_kernels.cpu_exact``; ``BAD`` also runs on ``triton_exact``
in ``test_triton_inputs.py``): one TypeError (a dtype) or ValueError (a
shape, a device, q_start, an id) naming the op and the argument, raised by the shared checks (``checks``) before any
kernel runs -- never a deep error from inside a GEMM arrangement or a compiled loop, never a result (an integer input
truncated, an fp64 one computed in fp32, a query before position 0 seeing no key). And what is accepted: a transposed
or strided operand gives the contiguous operand's bits (torch.equal), an empty batch an empty result."""

from __future__ import annotations

import pytest
import torch

from vexact_kernels import cpu_exact

G = torch.Generator().manual_seed(0)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


X, W, B = _r(5, 16), _r(32, 16), _r(32)
Q, K, V, START = _r(2, 3, 4, 8), _r(2, 5, 2, 8), _r(2, 5, 2, 8), torch.tensor([0, 2])
COS, SIN = _r(2, 3, 4), _r(2, 3, 4)
LOGITS, TARGETS = _r(4, 11), torch.tensor([0, 3, 10, 2])

BAD = [
    # (call, exception, what the message names)
    (lambda ops: ops.linear(X.half(), W.half()), TypeError, "linear: x has dtype float16"),
    (lambda ops: ops.linear(X.double(), W.double()), TypeError, "linear: x has dtype float64"),
    (lambda ops: ops.linear(X.int(), W.int()), TypeError, "linear: x has dtype int32"),
    (lambda ops: ops.linear(X, W.bfloat16()), TypeError, "weight has dtype bfloat16 but x float32"),
    (lambda ops: ops.linear(X, W, B.bfloat16()), TypeError, "bias has dtype bfloat16 but x float32"),
    (lambda ops: ops.linear(_r(5, 15), W), ValueError, "K = x's last dimension (got x [5, 15]"),
    (lambda ops: ops.linear(X, _r(16)), ValueError, "weight must be [N, K]"),
    (lambda ops: ops.linear(X, W, _r(31)), ValueError, "bias must be [N]"),
    (lambda ops: ops.linear(torch.tensor(1.0), W), ValueError, "x needs a last dimension"),
    (lambda ops: ops.linear(X, W.to("meta")), ValueError, "weight is on meta but x on cpu"),
    (lambda ops: ops.embedding(torch.tensor([1, 2]).float(), W), TypeError, "tokens has dtype float32"),
    (lambda ops: ops.embedding(torch.tensor([1, 2]), _r(10)), ValueError, "weight must be [V, D]"),
    (lambda ops: ops.embedding(torch.tensor([1, 32]), W), ValueError, "token ids must lie in [0, V), V = 32"),
    (lambda ops: ops.embedding(torch.tensor([-1, 2]), W), ValueError, "got ids in [-1, 2]"),
    (lambda ops: ops.rms_norm(X.int(), _r(16), 1e-6), TypeError, "rms_norm: x has dtype int32"),
    (lambda ops: ops.rms_norm(X, _r(15), 1e-6), ValueError, "weight must be [D]"),
    (lambda ops: ops.rms_norm(_r(3, 0), _r(0), 1e-6), ValueError, "x needs a last dimension"),
    (lambda ops: ops.silu_mul(X, _r(5, 15)), ValueError, "gate and up must have one shape"),
    (lambda ops: ops.silu_mul(X, _r(1, 16)), ValueError, "gate and up must have one shape"),
    (lambda ops: ops.silu_mul(_r(5, 15), X), ValueError, "gate and up must have one shape"),
    (lambda ops: ops.silu_mul(X, X.bfloat16()), TypeError, "up has dtype bfloat16 but gate float32"),
    (lambda ops: ops.silu_mul(X.int(), X.int()), TypeError, "silu_mul: gate has dtype int32"),
    (lambda ops: ops.rope(Q, _r(2, 3, 3), SIN), ValueError, "cos and sin [B, T, hd/2]"),
    (lambda ops: ops.rope(Q.int(), COS, SIN), TypeError, "rope: x has dtype int32"),
    (lambda ops: ops.rope(Q, _r(2, 4, 4), _r(2, 4, 4)), ValueError, "may be 1) (got x [2, 3, 4, 8], cos [2, 4"),
    (lambda ops: ops.rope(Q, _r(3, 3, 4), _r(3, 3, 4)), ValueError, "may be 1) (got x [2, 3, 4, 8], cos [3, 3"),
    (lambda ops: ops.attention(Q[0], K, V, START, 0.3), ValueError, "q must be [B, T, Hq, hd]"),
    (lambda ops: ops.attention(_r(2, 3, 3, 8), K, V, START, 0.3), ValueError, "Hq a multiple of Hkv"),
    (lambda ops: ops.attention(_r(2, 3, 4, 4), K, V, START, 0.3), ValueError, "(got q [2, 3, 4, 4]"),
    (lambda ops: ops.attention(Q, K, _r(2, 5, 2, 4), START, 0.3), ValueError, "one shape [B, L, Hkv, hd]"),
    (lambda ops: ops.attention(Q, K, V, START[:1], 0.3), ValueError, "q_start [B]"),
    (lambda ops: ops.attention(Q, K[:1], V[:1], START, 0.3), ValueError, "(got q [2, 3, 4, 8], k_cache [1, 5, 2, 8]"),
    (lambda ops: ops.attention(Q, K, V, START.float(), 0.3), TypeError, "q_start has dtype float32"),
    (lambda ops: ops.attention(Q, K, V, torch.tensor([-1, 0]), 0.3), ValueError, "q_start must be >= 0"),
    (lambda ops: ops.attention(Q, K.bfloat16(), V, START, 0.3), TypeError, "k_cache has dtype bfloat16"),
    (lambda ops: ops.attention(Q.double(), K.double(), V.double(), START, 0.3), TypeError, "q has dtype float64"),
    (lambda ops: ops.attention(Q[:0], K[:0], V[:0], START[:0], 0.3), ValueError, "no sequences"),
    (lambda ops: ops.log_softmax(LOGITS.int()), TypeError, "log_softmax: logits has dtype int32"),
    (lambda ops: ops.log_softmax(LOGITS.double()), TypeError, "log_softmax: logits has dtype float64"),
    (lambda ops: ops.log_softmax(_r(4, 0)), ValueError, "logits needs a last dimension"),
    (lambda ops: ops.token_logprobs(LOGITS, TARGETS.int()), TypeError, "targets has dtype int32; expected int64"),
    (lambda ops: ops.token_logprobs(LOGITS, TARGETS[:3]), ValueError, "targets must be logits' shape"),
    (lambda ops: ops.token_logprobs(LOGITS, TARGETS[:, None]), ValueError, "targets must be logits' shape"),
    (lambda ops: ops.entropy(LOGITS.int()), TypeError, "entropy: log_probs has dtype int32"),
    (lambda ops: ops.entropy(_r(4, 0)), ValueError, "log_probs needs a last dimension"),
]


def assert_one_clear_error(call, ops, error: type[Exception], message: str) -> None:
    """``call(ops)`` raises ``error`` from the shared checks, naming ``ops``' op and ``message``."""
    with pytest.raises(error) as raised:
        call(ops)
    assert f"{ops.__name__.rsplit('.', 1)[-1]}." in str(raised.value) and message in str(raised.value), raised.value
    # raised by the op's own check, not from inside the kernels
    assert raised.traceback[-1].path.name == "checks.py"


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input_is_one_clear_error(call, error, message):
    assert_one_clear_error(call, cpu_exact, error, message)
