"""Op-level invariance contracts of the exact CPU kernels (``vexact_kernels.cpu_exact``).

Each ``test_<op>_invariance`` checks what the op's docstring promises: a row's output is
bitwise identical (torch.equal) whether computed alone or in a batch of any size, at any
position in the batch, with 1, 2 or 3 torch threads. Shapes include last dims that are not
multiples of 32. Every contract test runs on both paths of the ops (fixture ``exact``): ``auto``,
the host guard's choice on this host, and ``fixed-order``, the by-construction fallback forced
(see ``test_host_guard.py`` for the guard itself). Correctness against the native (or fp64)
reference uses assert_close with stated tolerances; it is not what exactness means.
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from vexact_kernels import cpu_exact, native

THREADS = (1, 2, 3)
DTYPES = (torch.float32, torch.bfloat16)
# Correctness vs native (not exactness): fp32 kernels differ only in summation order.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

TORCH_GRAIN = 32768
"""torch's CPU parallel grain (``at::internal::GRAIN_SIZE``): a row wider than this has its reduction split over the
threads by a plain torch sum or mean (other bits at another thread count), a hazard every host reaches; below it a
plain-torch mutant of an exact kernel may give each row the same bits (on the AMD EPYC, torch's mean + rsqrt does:
its vector and scalar rsqrt agree)."""
WIDE_ROW = 40000  # a row past the grain, in few rows (the tests' time on CI's two cores)


# Both paths of every op: the guard's choice on this host (the fast library path wherever its probe
# passed) and the by-construction fallback forced everywhere -- so each is tested on every host.
PATHS = {"auto": cpu_exact, "fixed-order": cpu_exact.ops_in_mode("fixed-order")}


@pytest.fixture(params=list(PATHS))
def exact(request):
    return PATHS[request.param]


def _rows_invariant(op, x: torch.Tensor, *args) -> None:
    """op(x)[i] == op(x[i:i+1])[0] for every thread count, batch size and permutation."""
    reference = [op(x[i : i + 1], *args)[0] for i in range(x.shape[0])]
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    for threads in THREADS:
        with num_threads(threads):
            for rows in (1, 2, 5, x.shape[0]):
                out = op(x[:rows], *args)
                for i in range(rows):
                    assert torch.equal(out[i], reference[i]), f"row {i} of {rows} differs ({threads} threads)"
            shuffled = op(x[perm], *args)
            for j, i in enumerate(perm.tolist()):
                assert torch.equal(shuffled[j], reference[i]), f"row {i} moved to {j} differs ({threads} threads)"


@pytest.mark.parametrize("dtype", DTYPES)
# K of 2-5: MKL on the CI machine gives 4-row and 64-row tiles different bits there (the guard's probe catches it)
@pytest.mark.parametrize("k,n", [(64, 192), (100, 37), (1000, 37), (576, 1536), (33, 1000), (4, 16), (3, 5)])
def test_linear_invariance(dtype, k, n, exact):
    g = torch.Generator().manual_seed(k * n)
    x = torch.randn(130, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    _rows_invariant(exact.linear, x, w, b)
    if dtype == torch.float32:  # vs the fp64 result, within the probabilistic bound of an fp32 dot product's
        # rounding (Higham & Mary, lambda = 2): 2 sqrt(n) u sum |terms| per element, n = K + 1 additions (the bias
        # too), u = 2^-24 -- whatever order the GEMM accumulates in (MKL's blocked K; oneDNN's on large layers,
        # host_guard.onednn_rows, whose K = 576 error exceeded the fixed 4e-6 sqrt(K) this test had)
        reference = x.double() @ w.double().t() + b.double()
        bound = 2.0 ** -23 * (k + 1) ** 0.5 * (x.double().abs() @ w.double().abs().t() + b.double().abs())
        error = (exact.linear(x, w, b).double() - reference).abs()
        assert bool((error <= bound).all()), f"largest error / bound {float((error / bound).max()):.2f}"
    else:
        torch.testing.assert_close(exact.linear(x, w, b), native.linear(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 100, 576, 1000, WIDE_ROW])
def test_rms_norm_invariance(dtype, d, exact):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(8 if d > TORCH_GRAIN else 70, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    _rows_invariant(exact.rms_norm, x, w, 1e-6)
    torch.testing.assert_close(exact.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [14, 1000, 32003, 151936])
def test_log_softmax_invariance(dtype, v, exact):
    g = torch.Generator().manual_seed(v)
    rows = 6 if v > 100000 else 40
    x = (torch.randn(rows, v, generator=g) * 4).to(dtype)
    _rows_invariant(exact.log_softmax, x)
    torch.testing.assert_close(exact.log_softmax(x), native.log_softmax(x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1001, WIDE_ROW])
def test_token_logprobs_invariance(dtype, v, exact):
    g = torch.Generator().manual_seed(1)
    rows = 8 if v > TORCH_GRAIN else 50
    x = (torch.randn(rows, v, generator=g) * 4).to(dtype)
    t = torch.randint(0, v, (rows,), generator=g)
    # half the targets each row's likeliest token: its log-prob is minus the log-normalizer alone (0 - log sum exp),
    # where a few ulps of the sum show (beside a target's logit of a larger magnitude they mostly round away)
    t[::2] = x[::2].argmax(-1)
    # rows picked by index, each row's logits with its own target
    _rows_invariant(lambda picked: exact.token_logprobs(x[picked], t[picked]), torch.arange(rows))
    # bitwise the same as gathering from log_softmax: one definition of a token's log-prob
    assert torch.equal(exact.token_logprobs(x, t), exact.log_softmax(x).gather(-1, t[:, None])[:, 0])
    torch.testing.assert_close(exact.token_logprobs(x, t), native.token_logprobs(x, t), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [14, 1000, 32003, WIDE_ROW])
def test_entropy_invariance(dtype, v, exact):
    """A row's entropy alone == in a batch of any size, at any position, at any thread count (its docstring's
    contract); close to the fp64 value."""
    g = torch.Generator().manual_seed(v + 1)
    rows = 8 if v > TORCH_GRAIN else 40
    log_probs = native.log_softmax((torch.randn(rows, v, generator=g) * 4).to(dtype)).to(dtype)
    _rows_invariant(exact.entropy, log_probs)
    lp = log_probs.double()
    torch.testing.assert_close(exact.entropy(log_probs).double(), -(lp.exp() * lp).sum(-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_invariance(dtype, exact):
    """Each output row is ``weight[token]`` bit for bit, whatever the batch (a gather; its docstring's contract)."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(50, 24, generator=g).to(dtype)
    tokens = torch.randint(0, 50, (6, 9), generator=g)
    out = exact.embedding(tokens, weight)
    assert out.dtype == dtype and torch.equal(out, weight[tokens])
    for threads in THREADS:
        with num_threads(threads):
            assert torch.equal(exact.embedding(tokens[2:3, 4:5], weight)[0, 0], out[2, 4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [31, 500, 4099])
def test_silu_mul_invariance(dtype, width, exact):
    # torch's own silu changes value with tensor size (e.g. index 16 of 31 elements).
    g = torch.Generator().manual_seed(width)
    gate = (torch.randn(40, width, generator=g) * 4).to(dtype)
    up = torch.randn(40, width, generator=g).to(dtype)
    _rows_invariant(lambda pair: exact.silu_mul(pair[:, 0], pair[:, 1]), torch.stack([gate, up], dim=1))
    flat_alone = exact.silu_mul(gate[0, :16], up[0, :16])
    assert torch.equal(flat_alone, exact.silu_mul(gate[0], up[0])[:16])
    torch.testing.assert_close(exact.silu_mul(gate, up), native.silu_mul(gate, up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_invariance(dtype, exact):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 13, 4, 18, generator=g).to(dtype)
    cos, sin = torch.randn(2, 9, 13, 9, generator=g)
    full = exact.rope(x, cos, sin)
    for threads in THREADS:
        with num_threads(threads):
            assert torch.equal(exact.rope(x[3:4, 5:6], cos[3:4, 5:6], sin[3:4, 5:6]), full[3:4, 5:6])


def _ragged_attention_inputs(dtype, lengths, q_heads=4, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, longest = len(lengths), max(lengths)
    q = torch.randn(batch, longest, q_heads, head_dim, generator=g).to(dtype)
    # Garbage (finite) beyond each sequence's length must never matter.
    k = torch.randn(batch, longest + 20, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, longest + 20, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 4), (9, 3)])
def test_attention_invariance(dtype, q_heads, kv_heads, exact):
    """Decode at position t == prefill row t, and a chunk of rows from q_start > 0 those rows; a sequence alone == in
    a batch; cache garbage beyond a query's position and the thread count never matter."""
    lengths = [1, 7, 64, 65, 130, 3]
    q, k, v = _ragged_attention_inputs(dtype, lengths, q_heads, kv_heads)
    scale = 0.25
    zero = torch.zeros(len(lengths), dtype=torch.long)
    prefill = exact.attention(q, k, v, zero, scale)
    for threads in THREADS:
        with num_threads(threads):
            for b, n in enumerate(lengths):
                alone = exact.attention(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], zero[:1], scale)
                assert torch.equal(alone[0], prefill[b, :n]), f"seq {b} alone != batched ({threads} threads)"
            for t in (0, 1, 63, 64, 129):
                decode = exact.attention(q[:, t : t + 1], k, v, torch.full((len(lengths),), t), scale)
                assert torch.equal(decode[:, 0], prefill[:, t]), f"decode at {t} != prefill row ({threads} threads)"
    # ragged decode: every sequence at its own position in one call
    positions = torch.tensor([n - 1 for n in lengths])
    q_last = q[torch.arange(len(lengths)), positions][:, None]
    decode = exact.attention(q_last, k, v, positions, scale)
    for b, n in enumerate(lengths):
        assert torch.equal(decode[b, 0], prefill[b, n - 1])
    # chunked prefill: T > 1 queries from q_start > 0 (a chunk across a 64-key tile's edge, and ragged starts) are
    # the one-shot prefill's rows
    for start, stop in ((5, 12), (60, 70), (64, 130)):
        chunk = exact.attention(q[:, start:stop], k, v, torch.full((len(lengths),), start), scale)
        assert torch.equal(chunk, prefill[:, start:stop]), f"chunk {start}:{stop} != prefill rows"
    starts = torch.tensor([0, 5, 61, 64, 120, 2])
    rows = starts[:, None] + torch.arange(4)
    chunk = exact.attention(q[torch.arange(len(lengths))[:, None], rows], k, v, starts, scale)
    assert torch.equal(chunk, prefill[torch.arange(len(lengths))[:, None], rows]), "ragged chunks != prefill rows"
    # garbage after the query position
    k2, v2 = k.clone(), v.clone()
    k2[:, 40:], v2[:, 40:] = 1e3, -1e3
    assert torch.equal(exact.attention(q[:, :40], k2, v2, zero, scale), prefill[:, :40])
    torch.testing.assert_close(prefill, native.attention(q, k, v, zero, scale), **TOL[dtype])


@pytest.mark.parametrize("length", [6, 64, 70])
def test_attention_query_past_the_cache_end_sees_the_whole_cache(length, exact):
    """The contract (and the Triton and native kernels): a query past the cache's end sees the whole cache. The CPU
    kernel counted the zero keys it pads past the cache as visible, diluting the softmax (|diff| 0.28 at L = 6).
    Such a query is the query at the cache's last position, bit for bit, with and without a gradient, and a
    sequence past the end leaves its batch's other rows' bits as they are alone."""
    q, k, v = _ragged_attention_inputs(torch.float32, [3, 3], kv_heads=2)
    k, v = k[:, :length], v[:, :length]
    last = exact.attention(q[:, :1], k, v, torch.full((2,), length - 1), 0.3)
    for start in (length, length + 5, length + 200):
        past = torch.tensor([start, length - 1])
        out = exact.attention(q[:, :1], k, v, past, 0.3)
        assert torch.equal(out, last), start
        leaves = [t.clone().requires_grad_() for t in (q[:, :1], k, v)]
        assert torch.equal(exact.attention(*leaves, past, 0.3).detach(), last)
    span = exact.attention(q, k, v, torch.tensor([length - 2, 0]), 0.3)  # rows at L-2, L-1, L (past the end)
    for t in (1, 2):  # both see every key: each is its query decoded at the last position
        at_last = exact.attention(q[:1, t : t + 1], k[:1], v[:1], torch.tensor([length - 1]), 0.3)
        assert torch.equal(span[0, t], at_last[0, 0]), t
    alone = exact.attention(q[1:], k[1:], v[1:], torch.tensor([0]), 0.3)
    assert torch.equal(span[1], alone[0])
    reference = native.attention(q, k, v, torch.tensor([length - 2, 0]), 0.3)
    torch.testing.assert_close(span, reference, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["linear", "rms_norm", "silu_mul", "attention", "log_softmax", "token_logprobs"])
def test_forward_with_grad_equals_forward_without(op, dtype, exact):
    """Each op has a no-grad forward (rollout, scoring under no_grad) and a forward that also saves what
    its backward needs (training); the two implementations must give the same bits."""
    g = torch.Generator().manual_seed(9)
    if op == "attention":
        q, k, v = _ragged_attention_inputs(dtype, [12, 12])
        inputs, static = [q, k, v], (torch.tensor([0, 3]), 0.25)
    elif op == "linear":
        inputs, static = [torch.randn(20, 33, generator=g).to(dtype), torch.randn(17, 33, generator=g).to(dtype)], ()
    elif op == "rms_norm":
        inputs, static = [torch.randn(20, 33, generator=g).to(dtype), torch.randn(33, generator=g).to(dtype)], (1e-6,)
    elif op == "silu_mul":
        inputs, static = [torch.randn(20, 33, generator=g).to(dtype) * 4 for _ in range(2)], ()
    elif op == "log_softmax":
        inputs, static = [torch.randn(20, 33, generator=g).to(dtype) * 4], ()
    else:
        inputs, static = [torch.randn(20, 33, generator=g).to(dtype) * 4], (torch.randint(0, 33, (20,), generator=g),)
    fn = getattr(exact, op)
    with torch.no_grad():
        without_grad = fn(*inputs, *static)
    with_grad = fn(*[t.clone().requires_grad_() for t in inputs], *static)
    assert with_grad.requires_grad, "the forward that saves for backward was not the one run"
    assert torch.equal(with_grad.detach(), without_grad)


@given(rows=st.integers(1, 150), k=st.integers(1, 200), n=st.integers(1, 200), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_linear_invariance_randomized(rows, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    i = seed % rows
    full = cpu_exact.linear(x, w)
    assert torch.equal(full[i], cpu_exact.linear(x[i : i + 1], w)[0])


@given(batch=st.integers(1, 5), length=st.integers(1, 90), t=st.integers(0, 89), seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_attention_invariance_randomized(batch, length, t, seed):
    t = t % length
    q, k, v = _ragged_attention_inputs(torch.float32, [length] * batch, seed=seed)
    prefill = cpu_exact.attention(q, k, v, torch.zeros(batch, dtype=torch.long), 0.3)
    decode = cpu_exact.attention(q[:, t : t + 1], k, v, torch.full((batch,), t), 0.3)
    assert torch.equal(decode[:, 0], prefill[:, t])


@pytest.mark.parametrize("op", ["linear", "rms_norm", "silu_mul", "attention", "log_softmax", "token_logprobs"])
def test_backward_deterministic_and_close_to_native(op, exact):
    g = torch.Generator().manual_seed(3)
    if op == "linear":
        inputs, static = [torch.randn(20, 33, generator=g), torch.randn(17, 33, generator=g)], ()
    elif op == "rms_norm":
        inputs, static = [torch.randn(20, 33, generator=g), torch.randn(33, generator=g)], (1e-6,)
    elif op == "silu_mul":
        inputs, static = [torch.randn(20, 33, generator=g), torch.randn(20, 33, generator=g)], ()
    elif op == "attention":
        q, k, v = _ragged_attention_inputs(torch.float32, [10, 10])
        inputs, static = [q, k[:, :10], v[:, :10]], (torch.zeros(2, dtype=torch.long), 0.25)
    elif op == "log_softmax":
        inputs, static = [torch.randn(20, 33, generator=g)], ()
    else:
        inputs, static = [torch.randn(20, 33, generator=g)], (torch.randint(0, 33, (20,), generator=g),)
    upstream = None

    def grads(module):
        nonlocal upstream
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = getattr(module, op)(*leaves, *static)
        if upstream is None:
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        out.backward(upstream)
        return [t.grad for t in leaves]

    first, second, reference = grads(exact), grads(exact), grads(native)
    for a, b, ref in zip(first, second, reference):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_native_attention_with_query_groups_as_rows_is_the_repeated_cache_formulation(dtype, tol):
    """The GPU's native attention (each KV head's query group folded into the query rows, the cache read as it is)
    computes the CPU's formulation (the cache copied to every query head), forward and gradients, on ragged
    positions: allclose at ``tol`` (a different summation order, not the same bits)."""
    from vexact_kernels import native

    gen = torch.Generator().manual_seed(5)
    batch, new, q_heads, kv_heads, length, head_dim = 3, 4, 8, 2, 11, 16
    q_start = torch.tensor([0, 3, 7])
    inputs = [torch.randn(batch, new, q_heads, head_dim, generator=gen, dtype=dtype),
              torch.randn(batch, length, kv_heads, head_dim, generator=gen, dtype=dtype),
              torch.randn(batch, length, kv_heads, head_dim, generator=gen, dtype=dtype)]
    positions = q_start[:, None] + torch.arange(new)[None, :]
    mask = torch.arange(length)[None, None, :] <= positions[:, :, None]
    results = []
    for formulation in ("repeated", "groups_as_rows"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        if formulation == "repeated":
            out = native.attention(*leaves, q_start, 0.25)  # on the CPU: the cache repeated per query head
        else:
            out = native._attention_groups_as_rows(*leaves, mask, 0.25)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape)).sum().backward()
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for repeated, as_rows in zip(*results):
        torch.testing.assert_close(as_rows, repeated, rtol=tol, atol=tol)
