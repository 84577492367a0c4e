"""Bad input to the exact kernels' public ops (``vexact_kernels.cpu_exact``; ``BAD`` also runs on ``triton_exact``
in ``test_triton_inputs.py``, and the MoE routing's ``moe_exact`` here): one TypeError (a dtype) or ValueError (a
shape, a device, q_start, an id) naming the op and the argument, raised by the shared checks (``checks``) before any
kernel runs -- never a deep error from inside a GEMM arrangement or a compiled loop, never a result (an integer input
truncated, an fp64 one computed in fp32, a query before position 0 seeing no key). And what is accepted: a transposed
or strided operand gives the contiguous operand's bits (torch.equal), an empty batch an empty result."""

from __future__ import annotations

import pytest
import torch
from conftest import require_optional

from vexact_kernels import TRITON_PIP, cpu_exact, fixed_order, get_ops, moe_exact
from vexact_kernels.host_guard import MODES

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
    (lambda ops: ops.linear(X, _r(0, 16)), ValueError, "weight needs at least one row"),
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
    (lambda ops: ops.attention(Q, K[:, :0], V[:, :0], START, 0.3), ValueError, "the cache holds no position"),
    (lambda ops: ops.attention(Q, K, V, START, None), TypeError, "attention: scale must be a Python float"),
    (lambda ops: ops.attention(Q, K, V, START, torch.tensor(0.3)), TypeError, "scale must be a Python float"),
    (lambda ops: ops.rms_norm(X, _r(16), "a"), TypeError, "rms_norm: eps must be a Python float, got str"),
    (lambda ops: ops.rms_norm(X, _r(16), torch.tensor(1e-6)), TypeError, "eps must be a Python float, got Tensor"),
    (lambda ops: ops.token_logprobs(LOGITS, torch.tensor([0, 3, 11, 2])), ValueError,
     "target ids must lie in [0, V), V = 11 (logits' last dimension), got ids in [0, 11]"),
    (lambda ops: ops.token_logprobs(LOGITS, torch.tensor([0, -1, 10, 2])), ValueError, "got ids in [-1, 10]"),
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


LOG_PROBS, EXPERTS = _r(3, 8).log_softmax(-1), torch.tensor([[0, 2], [1, 5], [3, 7]])
WEIGHTS, OUTPUTS = _r(3, 2), _r(3, 2, 16)
MOE_BAD = [
    # (call, exception, what the message names); expert ids out of range on CPU tensors (on CUDA they go unread)
    (lambda: moe_exact.rank_experts(_r(3, 0)), ValueError, "rank_experts: scores needs a last dimension"),
    (lambda: moe_exact.rank_experts(torch.tensor([[3, 1]])), TypeError, "rank_experts: scores has dtype int64"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, torch.tensor([[0, 8], [1, 5], [3, 7]]), True), ValueError,
     "expert ids must lie in [0, E), E = 8 (log_probs' last dimension), got ids in [0, 8]"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, torch.tensor([[-1, 2], [1, 5], [3, 7]]), True), ValueError,
     "got ids in [-1, 7]"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, EXPERTS.float(), True), TypeError, "experts has dtype float32"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, EXPERTS[:2], True), ValueError,
     "log_probs must be [..., E] and experts [..., k] (got log_probs [3, 8], experts [2, 2])"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, EXPERTS[0], True), ValueError, "experts [2])"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, EXPERTS[:, :0], True), ValueError, "experts needs a last dimension"),
    (lambda: moe_exact.routing_weights(LOG_PROBS.double(), EXPERTS, True), TypeError, "log_probs has dtype float64"),
    (lambda: moe_exact.routing_weights(LOG_PROBS, EXPERTS.to("meta"), True), ValueError,
     "experts is on meta but log_probs on cpu"),
    (lambda: moe_exact.combine(_r(3, 1), OUTPUTS), ValueError,
     "combine: weights must be [..., k] and outputs [..., k, D] (got weights [3, 1], outputs [3, 2, 16])"),
    (lambda: moe_exact.combine(_r(1, 2), OUTPUTS), ValueError, "(got weights [1, 2]"),
    (lambda: moe_exact.combine(WEIGHTS, _r(3, 16)), ValueError, "outputs [3, 16])"),
    (lambda: moe_exact.combine(WEIGHTS[:, :0], OUTPUTS[:, :0]), ValueError, "weights needs a last dimension"),
    (lambda: moe_exact.combine(WEIGHTS, OUTPUTS.double()), TypeError, "combine: outputs has dtype float64"),
    (lambda: moe_exact.exp(_r(3).double()), TypeError, "exp: x has dtype float64"),
    (lambda: moe_exact.exp([1.0]), TypeError, "exp: x must be a torch.Tensor, got list"),
    (lambda: moe_exact.sigmoid(torch.tensor([1, 2])), TypeError, "sigmoid: x has dtype int64"),
    (lambda: moe_exact.ordered_sum(_r(3, 0)), ValueError, "ordered_sum: parts needs a last dimension"),
]


@pytest.mark.parametrize("call, error, message", MOE_BAD)
def test_bad_moe_routing_input_is_one_clear_error(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert "moe_exact." in str(raised.value) and message in str(raised.value), raised.value
    assert raised.traceback[-1].path.name in ("checks.py", "moe_exact.py")  # the routing's checks, not torch's ops
    assert raised.traceback[-1].name.startswith(("_check", "tensors", "last_dim", "same_device", "combine",
                                                 "ids_in_range"))


def test_the_moe_routing_accepts_what_the_model_passes():
    """int32 or int64 expert ids, fp32 or bf16 operands: the checks refuse none of them (and change no bit)."""
    weights = moe_exact.routing_weights(LOG_PROBS, EXPERTS, True)
    assert torch.equal(moe_exact.routing_weights(LOG_PROBS, EXPERTS.int(), True), weights)
    assert moe_exact.combine(weights, OUTPUTS.bfloat16()).dtype == torch.float32
    assert moe_exact.rank_experts(LOG_PROBS.bfloat16()).shape == (3, 8)


def test_strided_operands_give_the_contiguous_operands_bits():
    """Transposed, sliced and permuted views: the same bits as their contiguous copies."""
    xt, wt = _r(16, 5).t(), _r(16, 32).t()
    bias = _r(64)[::2]
    assert torch.equal(cpu_exact.linear(xt, wt, bias), cpu_exact.linear(xt.contiguous(), wt.contiguous(),
                                                                         bias.contiguous()))
    xs = _r(3, 32)[:, ::2]
    weight = _r(16)
    assert torch.equal(cpu_exact.rms_norm(xs, weight, 1e-6), cpu_exact.rms_norm(xs.contiguous(), weight, 1e-6))
    gate, up = _r(16, 3).t(), _r(16, 3).t()
    for dtype in (torch.float32, torch.bfloat16):
        g, u = gate.to(dtype), up.to(dtype)
        assert torch.equal(cpu_exact.silu_mul(g, u), cpu_exact.silu_mul(g.contiguous(), u.contiguous()))
    logits = _r(11, 4).t()
    assert torch.equal(cpu_exact.log_softmax(logits), cpu_exact.log_softmax(logits.contiguous()))
    assert torch.equal(cpu_exact.token_logprobs(logits, TARGETS), cpu_exact.token_logprobs(logits.contiguous(),
                                                                                            TARGETS))
    assert torch.equal(cpu_exact.entropy(logits), cpu_exact.entropy(logits.contiguous()))
    q, k, v = _r(2, 4, 3, 8).transpose(1, 2), _r(2, 2, 5, 8).transpose(1, 2), _r(2, 2, 5, 8).transpose(1, 2)
    assert torch.equal(cpu_exact.attention(q, k, v, START, 0.3),
                       cpu_exact.attention(q.contiguous(), k.contiguous(), v.contiguous(), START, 0.3))
    assert torch.equal(cpu_exact.rope(q, COS, SIN), cpu_exact.rope(q.contiguous(), COS, SIN))


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_batch_of_rows_is_an_empty_result(mode):
    """In every guard mode (a mode's own arrangements: ``fixed-order``'s GEMM once failed on zero tiles), given
    explicitly: the run's ``VEXACT_CPU_EXACT_PATH`` would test one mode only."""
    ops = cpu_exact.ops_in_mode(mode)
    assert ops.linear(_r(0, 16), W).shape == (0, 32)
    assert ops.linear(_r(0, 16).bfloat16(), W.bfloat16()).shape == (0, 32)
    assert ops.linear(_r(3, 0, 16), W, B).shape == (3, 0, 32)
    assert ops.rms_norm(_r(0, 16), _r(16), 1e-6).shape == (0, 16)
    assert ops.silu_mul(_r(0, 16), _r(0, 16)).shape == (0, 16)
    assert ops.log_softmax(_r(0, 11)).shape == (0, 11)
    assert ops.token_logprobs(_r(0, 11), torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert ops.entropy(_r(0, 11)).shape == (0,)
    assert ops.attention(Q[:, :0], K, V, START, 0.3).shape == (2, 0, 4, 8)
    for dtype in (torch.float32, torch.bfloat16):  # and its gradients: none from no rows
        x, w = _r(0, 16).to(dtype).requires_grad_(), W.to(dtype, copy=True).requires_grad_()
        ops.linear(x, w).sum().backward()
        assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_no_rows_give_zero_weight_and_bias_gradients(mode, shape):
    """rms_norm's weight gradient and linear's bias gradient over zero rows are the empty sum, zeros (as native's),
    not an error: the halving tree once failed on width 0 (``fixed_order.tree_sum``; the compiled loop hands widths
    below 2 to it, so both loops modes met it)."""
    ops, native = cpu_exact.ops_in_mode(mode), get_ops("native", "cpu")
    assert torch.equal(fixed_order.tree_sum(_r(0, 3), dim=0), torch.zeros(3))
    for dtype in (torch.float32, torch.bfloat16):
        for op in (ops, native):  # the exact kernels give what native gives
            x = _r(*shape).to(dtype).requires_grad_()
            w, b = W.to(dtype, copy=True).requires_grad_(), B.to(dtype, copy=True).requires_grad_()
            scale = _r(16).to(dtype).requires_grad_()
            op.rms_norm(x, scale, 1e-6).sum().backward()
            op.linear(x, w, b).sum().backward()
            assert x.grad.shape == shape and torch.equal(x.grad, torch.zeros_like(x))
            assert scale.grad.dtype == dtype and torch.equal(scale.grad, torch.zeros_like(scale))
            assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("backend", ["native", "triton", *MODES])
def test_no_queries_are_an_empty_output_on_every_backend(backend):
    """Attention of T = 0 queries (``q_start`` 0 for both sequences, and 0 and 2) is [B, 0, Hq, hd] in q's dtype on
    every backend (the exact CPU one in each guard mode; it failed inside its tiles where no query reaches past the
    cache), and its gradients are zero: q's empty, the keys' and values' all zeros, as native's."""
    if backend == "triton":
        require_optional("triton", TRITON_PIP)
    ops = get_ops(backend, "cpu") if backend in ("native", "triton") else cpu_exact.ops_in_mode(backend)
    for start in (torch.tensor([0, 0]), START):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (Q[:, :0], K, V))
            with torch.no_grad():
                out = ops.attention(q, k, v, start, 0.3)
            assert out.shape == (2, 0, 4, 8) and out.dtype == dtype
            ops.attention(q, k, v, start, 0.3).sum().backward()
            assert q.grad.shape == q.shape and q.grad.dtype == dtype
            assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


@pytest.mark.parametrize("retain_graph", [False, True])
def test_a_second_backward_through_an_exact_kernel_is_one_clear_error(retain_graph):
    """The exact kernels free what their backward saved once it has run (retain_graph cannot keep it): a second
    backward says so, as torch's own ops do for a freed graph, instead of failing inside the VJP."""
    x = torch.randn(4, 8, requires_grad=True)
    out = cpu_exact.rms_norm(x, torch.ones(8), 1e-6)
    out.sum().backward(retain_graph=retain_graph)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()
