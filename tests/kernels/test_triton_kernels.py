"""Op-level contracts of the Triton kernels (``vexact_kernels.triton_exact``; attention's in ``triton_attention``).

Without a GPU these run in the Triton interpreter (slow), so shapes are tiny; the module's
interpreter tiles (64x64x32 matmul tiles, 16x16 attention tiles, 512-wide row chunks) are
small enough that the shapes below still cover several tiles/blocks and ragged edges. On a
GPU the same tests run on CUDA tensors with the (larger) GPU tiles.

Exactness and invariance are asserted with ``torch.equal`` (bitwise): a row's output must
not depend on the batch it is computed in, its position there, or (attention) on prefill
vs decode. Agreement with the plain-torch reference (``native``) is *correctness*, not
exactness, and uses ``assert_close`` with the tolerances stated in ``TOL``.
"""

from __future__ import annotations

import functools

import numpy
import pytest
import torch
from conftest import num_threads, require_optional

from vexact_kernels import TRITON_PIP, native

require_optional("triton", TRITON_PIP)  # the optional triton extra: the whole module needs it
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vexact_kernels import triton_common  # noqa: E402
from vexact_kernels import triton_exact as exact  # noqa: E402

pytestmark = pytest.mark.slow  # the Triton interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16)
# Correctness vs native. fp32: only the summation order differs. bf16: both sides round the
# result to bf16 (8 significant bits), so they may land one or two bf16 ulps apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# log-probs are fp32 outputs for both input dtypes; |logp| grows with V, hence the atol.
LOGPROB_TOL = dict(atol=1e-4, rtol=1e-5)
# Gradients (fp32): the backward passes are standard torch ops, close to native's own.
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal samples (drawn on the CPU, so the same everywhere) on DEVICE, in dtype."""
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _randint(g: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g).to(DEVICE)


def _rows_invariant(op, x: torch.Tensor, *args, batch_sizes=(1, 2, 5)) -> None:
    """op(x)[i] == op(x[i:i+1])[0] for several batch sizes (incl. all rows) and a permutation."""
    rows = x.shape[0]
    full = op(x, *args)
    for i in range(rows):
        assert torch.equal(op(x[i : i + 1], *args)[0], full[i]), f"row {i} alone != in a batch of {rows}"
    for size in batch_sizes:
        out = op(x[:size], *args)
        for i in range(size):
            assert torch.equal(out[i], full[i]), f"row {i} differs in a batch of {size}"
    perm = torch.randperm(rows, generator=_gen(0))
    shuffled = op(x[perm], *args)
    for j, i in enumerate(perm.tolist()):
        assert torch.equal(shuffled[j], full[i]), f"row {i} moved to position {j} differs"


def test_interpreter_mode_without_cuda():
    from triton.runtime.interpreter import InterpretedFunction

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels are compiled, not interpreted")
    assert triton_common.INTERPRETING
    assert isinstance(exact._linear_kernel, InterpretedFunction)


# --------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_native(dtype):
    g = _gen(1)
    x = _randn(g, 3, 50, 90, dtype=dtype)[:, ::2]  # non-contiguous view, [3, 25, 90]
    w = _randn(g, 70, 90, dtype=dtype)
    b = _randn(g, 70, dtype=dtype)
    torch.testing.assert_close(exact.linear(x, w, b), native.linear(x, w, b), **TOL[dtype])
    torch.testing.assert_close(exact.linear(x, w), native.linear(x, w), **TOL[dtype])
    # transposed (non-contiguous) weight view
    w_t = _randn(g, 90, 70, dtype=dtype).t()
    torch.testing.assert_close(exact.linear(x, w_t), native.linear(x, w_t), **TOL[dtype])


def test_bf16_results_round_to_nearest_even():
    # With K = 1 the fp32 result x * w is exact (8-bit x 8-bit mantissas), so the only error
    # is the final rounding to bf16, which must be torch's round-to-nearest-even bit for bit
    # (the interpreter's own fp32 -> bf16 cast truncates; the module rounds by hand there).
    g = _gen(10)
    x = _randn(g, 300, 1, dtype=torch.bfloat16)
    w = _randn(g, 50, 1, dtype=torch.bfloat16)
    assert torch.equal(exact.linear(x, w), (x.float() * w.float().t()).bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_and_elementwise_ops_match_native(dtype):
    g = _gen(2)
    x = _randn(g, 2, 9, 600, dtype=dtype, scale=3)
    w = _randn(g, 600, dtype=dtype)
    torch.testing.assert_close(exact.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL[dtype])
    up = _randn(g, 2, 9, 600, dtype=dtype)
    torch.testing.assert_close(exact.silu_mul(x, up), native.silu_mul(x, up), **TOL[dtype])
    torch.testing.assert_close(exact.log_softmax(x), native.log_softmax(x), **LOGPROB_TOL)
    targets = _randint(g, 600, 2, 9)
    torch.testing.assert_close(exact.token_logprobs(x, targets), native.token_logprobs(x, targets), **LOGPROB_TOL)
    q = _randn(g, 2, 7, 3, 16, dtype=dtype)
    cos, sin = _randn(g, 2, 2, 7, 8)
    torch.testing.assert_close(exact.rope(q, cos, sin), native.rope(q, cos, sin), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: padded to a 32-wide tile, masked
def test_attention_matches_native(dtype, head_dim):
    g = _gen(3)
    q = _randn(g, 2, 20, 4, head_dim, dtype=dtype)
    k = _randn(g, 2, 30, 2, head_dim, dtype=dtype)
    v = _randn(g, 2, 30, 2, head_dim, dtype=dtype)
    for q_start in ([0, 0], [10, 3]):  # prefill, and a chunk continuing at ragged offsets
        start = torch.tensor(q_start, device=DEVICE)
        out = exact.attention(q, k, v, start, 0.3)
        torch.testing.assert_close(out, native.attention(q, k, v, start, 0.3), **TOL[dtype])


# --------------------------------------------------------------------------- invariance
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(90, 70), (33, 96), (70, 45)])  # K, N not multiples of 32
def test_linear_invariance(dtype, k, n):
    g = _gen(k * n)
    x = _randn(g, 130, k, dtype=dtype)  # 130 rows: three 64-row tiles, ragged
    w = _randn(g, n, k, dtype=dtype)
    b = _randn(g, n, dtype=dtype)
    full = exact.linear(x, w, b)
    for i in (0, 1, 63, 64, 65, 100, 129):  # tile edges
        assert torch.equal(exact.linear(x[i : i + 1], w, b)[0], full[i]), f"row {i} alone differs"
    for rows in (1, 2, 5, 64, 65, 97):
        out = exact.linear(x[:rows], w, b)
        assert torch.equal(out, full[:rows]), f"a batch of {rows} rows differs"
    perm = torch.randperm(130, generator=_gen(0))
    assert torch.equal(exact.linear(x[perm], w, b), full[perm]), "rows at other positions differ"
    # leading dims [B, T, K] are just rows: a [1, 1, K] decode input equals its prefill row
    assert torch.equal(exact.linear(x[None, 5:6], w, b)[0, 0], full[5])


@pytest.fixture
def fresh_decode_checks(monkeypatch):
    """``linear``'s decode-tile checks and choices made afresh for one test (none kept from other tests)."""
    monkeypatch.setattr(exact, "_DECODE_TILE_CHECKS", {})
    monkeypatch.setattr(exact, "_DECODE_CHOICES", {})


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_decode_tiles_keep_the_canonical_bits(dtype, fresh_decode_checks):
    """A call of at most DECODE_ROWS_MAX rows runs a decode tile where its first-use check passed, and its rows are
    the canonical tiles' rows bit for bit; a call of more rows runs the canonical tiles."""
    k, n = 70, 45
    g = _gen(3)
    x = _randn(g, exact.DECODE_ROWS_MAX + 1, k, dtype=dtype)
    w = _randn(g, n, k, dtype=dtype)
    canonical = exact._MATMUL_TILES[dtype]
    reference = exact._linear_forward(x, w, None, canonical)
    chosen = exact.linear_tiles(1, k, n, dtype, x.device)
    if DEVICE == "cpu":  # the interpreter sums a block in one fixed tree whatever BLOCK_N: its decode tile agrees
        assert chosen in exact._DECODE_TILES[dtype] and chosen != canonical
    for rows in (1, 17, exact.DECODE_ROWS_MAX):
        assert torch.equal(exact.linear(x[:rows], w), reference[:rows]), f"{rows} rows in {chosen} differ"
    b = _randn(g, n, dtype=dtype)  # the kernel's variant with a bias: checked apart
    with_bias = exact._linear_forward(x, w, b, canonical)
    assert torch.equal(exact.linear(x[:17], w, b), with_bias[:17])
    assert exact._DECODE_CHOICES.keys() == {(k, n, dtype, str(x.device), False), (k, n, dtype, str(x.device), True)}
    assert exact.linear_tiles(exact.DECODE_ROWS_MAX + 1, k, n, dtype, x.device) == canonical


def test_linear_decode_tile_that_sums_otherwise_is_refused(fresh_decode_checks, monkeypatch):
    """A decode tile whose K chunks differ (another BLOCK_K: another order of the same sums) fails its first-use
    check, and the call keeps the canonical tiles: the check can fail, and its failure is obeyed."""
    dtype, k, n = torch.float32, 70, 45
    block_m, block_n, block_k, warps, stages = exact._MATMUL_TILES[dtype]
    other_order = (block_m, block_n // 2, block_k // 2, warps, stages)
    monkeypatch.setattr(exact, "_decode_tiles", lambda dtype: (other_order,))
    device = torch.device(DEVICE)
    assert not exact.decode_tiles_agree(other_order, k, n, dtype, device)
    assert exact.linear_tiles(1, k, n, dtype, device) == exact._MATMUL_TILES[dtype]


@pytest.mark.parametrize("processors,width", [(2, 32), (3, 16), (100, 16)])
def test_linear_decode_tile_fills_the_device(fresh_decode_checks, monkeypatch, processors, width):
    """Of the agreeing decode tiles (widest first), the widest that gives each SM two programs, else the narrowest:
    N = 100 is 4 programs 32 wide and 7 programs 16 wide."""
    dtype, k, n = torch.float32, 40, 100
    block_m, _, block_k, warps, stages = exact._MATMUL_TILES[dtype]
    offered = tuple((block_m, w, block_k, warps, stages) for w in (32, 16))
    monkeypatch.setattr(exact, "_decode_tiles", lambda dtype: offered)
    monkeypatch.setattr(exact, "_processors", lambda device: processors)
    monkeypatch.setattr(exact, "decode_tiles_agree", lambda *args, **kwargs: True)  # the rule, whatever the device
    assert exact.linear_tiles(8, k, n, dtype, torch.device(DEVICE))[1] == width


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_invariance(dtype):
    g = _gen(4)
    x = _randn(g, 12, 600, dtype=dtype, scale=3)  # 600: two 512-chunks, ragged
    w = _randn(g, 600, dtype=dtype)
    _rows_invariant(exact.rms_norm, x, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_invariance(dtype):
    g = _gen(5)
    x = _randn(g, 10, 1100, dtype=dtype, scale=4)  # 1100: three 512-chunks, ragged
    _rows_invariant(exact.log_softmax, x)
    targets = _randint(g, 1100, 10)
    full = exact.token_logprobs(x, targets)
    for i in range(10):
        assert torch.equal(exact.token_logprobs(x[i : i + 1], targets[i : i + 1])[0], full[i])
    # one definition of a token's log-prob: bitwise the gather of log_softmax
    assert torch.equal(full, exact.log_softmax(x).gather(-1, targets[:, None])[:, 0])


# Both ragged: 1100 is three 512-wide interpreter chunks (two 1024-wide on a GPU); 40000 is wider than torch's CPU
# grain (32768 elements), where ``native.entropy`` (the op before) split a row's sum between 2 threads when the row
# was alone but not in a batch -- so the contract tests fail on it on a CPU too.
ENTROPY_VOCABS = (1100, 40000)


def _log_probs(seed: int, rows: int, v: int, dtype: torch.dtype) -> torch.Tensor:
    """A log_softmax output [rows, v] in dtype (bf16: rounded log-probs; the fp32 reference reads the same values)."""
    return native.log_softmax(_randn(_gen(seed), rows, v, scale=4)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_invariance(dtype):
    """Its docstring's contract: a row's entropy alone == in a batch of any size, at any position, at 1 and 2
    threads, from a [B, T, V] or a non-contiguous view -- bit for bit."""
    for v in ENTROPY_VOCABS:
        log_probs = _log_probs(8, 12, v, dtype)
        full = exact.entropy(log_probs)
        assert full.dtype == torch.float32 and full.shape == (12,)
        for threads in (1, 2):
            with num_threads(threads):
                _rows_invariant(exact.entropy, log_probs)
                assert torch.equal(exact.entropy(log_probs), full), f"V={v}: {threads} threads differ"
        assert torch.equal(exact.entropy(log_probs.view(3, 4, v)), full.view(3, 4))
        assert torch.equal(exact.entropy(log_probs.t().contiguous().t()), full)  # strides (1, 12)
        assert exact.entropy(log_probs[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_matches_native(dtype):
    """Correctness, not exactness: close to ``native.entropy`` of the same values in fp32 (bf16 log-probs upcast
    exactly), within TOL[float32] for both dtypes -- all terms p log p have one sign, so only the summation order (and
    on a GPU tl.exp's last bits) differ. The result is fp32 for both (as ``cpu_exact.entropy``'s)."""
    for v in ENTROPY_VOCABS:
        log_probs = _log_probs(9, 6, v, dtype)
        out = exact.entropy(log_probs)
        assert out.dtype == torch.float32
        # (it failed once, by 1.3e-4 at V = 1100, and never again in dozens of reruns: should it recur, the message
        # says which side moved -- the kernel against itself and against fp64, or the native reference)
        reference = native.entropy(log_probs.float())
        torch.testing.assert_close(out, reference, **TOL[torch.float32], msg=functools.partial(
            _entropy_diagnosis, out=out, reference=reference, log_probs=log_probs))


def _entropy_diagnosis(default: str, out: torch.Tensor, reference: torch.Tensor, log_probs: torch.Tensor) -> str:
    """``test_entropy_matches_native``'s failure message: assert_close's own, then which side moved (computed only
    on failure)."""
    fp64 = native.entropy(log_probs.double())
    return (f"{default}\nV={log_probs.shape[-1]}: the kernel twice bitwise equal: "
            f"{torch.equal(out, exact.entropy(log_probs))}; max |kernel - fp64| {(out.double() - fp64).abs().max():.3g}"
            f", max |native - fp64| {(reference.double() - fp64).abs().max():.3g}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_backward(dtype):
    """The backward contract: the module's own elementwise VJP -g p (1 + log p) (not autograd through torch's sum),
    close to autograd of the native formula in fp64 (TOL of the gradient's dtype); a row's gradient alone == in the
    batch, at 1 and 2 threads, bit for bit; and for fp32 log-probs the very bits autograd of ``native.entropy`` gives
    (the gradient did not change with the forward)."""
    log_probs = _log_probs(10, 8, 1100, dtype)
    upstream = torch.randn(8, generator=_gen(11)).to(DEVICE)

    def grad_of(op, lp, g):
        x = lp.detach().clone().requires_grad_()
        out = op(x)
        return torch.autograd.grad(out, x, g.to(out.dtype))[0], out.grad_fn

    grad, grad_fn = grad_of(exact.entropy, log_probs, upstream)
    assert type(grad_fn).__name__ == "_ExactForwardOwnBackwardBackward"
    assert grad.dtype == dtype and grad.shape == log_probs.shape
    reference, _ = grad_of(native.entropy, log_probs.double(), upstream)
    torch.testing.assert_close(grad.double(), reference, **TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(grad, grad_of(native.entropy, log_probs, upstream)[0])
    for threads in (1, 2):
        with num_threads(threads):
            for i in range(8):
                assert torch.equal(grad_of(exact.entropy, log_probs[i : i + 1], upstream[i : i + 1])[0][0], grad[i])
            assert torch.equal(grad_of(exact.entropy, log_probs, upstream)[0], grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_invariance(dtype):
    """Each output row is ``weight[token]`` bit for bit, whatever the batch (a gather; its docstring's contract)."""
    g = _gen(7)
    weight = _randn(g, 50, 24, dtype=dtype)
    tokens = _randint(g, 50, 12)
    assert torch.equal(exact.embedding(tokens, weight), weight[tokens])
    _rows_invariant(lambda t: exact.embedding(t, weight), tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_invariance(dtype):
    """An element's bits alone == in a larger tensor: the slices taken here sit past the first interpreter block
    (4,096 elements; ``_ELEMENTWISE_BLOCK``), at another offset within theirs."""
    g = _gen(6)
    gate, up = _randn(g, 2, 6, 700, dtype=dtype, scale=4)  # 8,400 elements: three blocks
    full = exact.silu_mul(gate, up)
    assert torch.equal(exact.silu_mul(gate[1:, 2:3], up[1:, 2:3]), full[1:, 2:3])
    if dtype == torch.float32:  # (the routing's exp takes fp32 only)
        logits = gate.float() - 8
        assert torch.equal(exact.exp(logits[1, 4:6]), exact.exp(logits)[1, 4:6])
    x = _randn(g, 3, 9, 4, 16, dtype=dtype)
    cos, sin = _randn(g, 2, 3, 9, 8)
    full = exact.rope(x, cos, sin)
    assert torch.equal(exact.rope(x[2:3, 5:6], cos[2:3, 5:6], sin[2:3, 5:6]), full[2:3, 5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_equals_decode(dtype):
    """Ragged prefill == step-by-step decode against a filling cache, bit for bit (GQA 4:2).

    Lengths straddle the 16-wide interpreter blocks (1, 15, 16, 17, 33, 40), so prefill rows
    see several key blocks and query blocks, including fully masked ones."""
    lengths = [1, 15, 16, 17, 33, 40]
    batch, longest, q_heads, kv_heads, head_dim, scale = len(lengths), max(lengths), 4, 2, 16, 0.25
    g = _gen(7)
    q = _randn(g, batch, longest, q_heads, head_dim, dtype=dtype)
    k = _randn(g, batch, longest, kv_heads, head_dim, dtype=dtype)
    v = _randn(g, batch, longest, kv_heads, head_dim, dtype=dtype)
    zero = torch.zeros(batch, dtype=torch.long, device=DEVICE)

    # Padded batch prefill; positions past a sequence's length hold garbage (other tokens).
    prefill = exact.attention(q, k, v, zero, scale)
    torch.testing.assert_close(prefill, native.attention(q, k, v, zero, scale), **TOL[dtype])
    # Each sequence alone, with exactly its own length == its rows of the padded batch.
    for b, n in enumerate(lengths):
        alone = exact.attention(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], zero[:1], scale)
        assert torch.equal(alone[0], prefill[b, :n]), f"sequence {b} alone != batched"

    # Decode: a preallocated cache (longer than needed) full of finite garbage, filled one
    # position per step; every sequence decodes at its own position in one batched call.
    k_cache = _randn(g, batch, longest + 9, kv_heads, head_dim, dtype=dtype) * 50
    v_cache = _randn(g, batch, longest + 9, kv_heads, head_dim, dtype=dtype) * 50
    for t in range(longest):
        k_cache[:, t], v_cache[:, t] = k[:, t], v[:, t]
        active = [b for b, n in enumerate(lengths) if t < n]
        position = torch.full((len(active),), t, device=DEVICE)
        step = exact.attention(q[active, t : t + 1], k_cache[active], v_cache[active], position, scale)
        for j, b in enumerate(active):
            assert torch.equal(step[j, 0], prefill[b, t]), f"decode of sequence {b} at {t} != prefill row"

    # Ragged decode: each sequence at its own last position, in one call.
    last = torch.tensor(lengths, device=DEVICE) - 1
    ragged = exact.attention(q[torch.arange(batch, device=DEVICE), last][:, None], k_cache, v_cache, last, scale)
    for b, n in enumerate(lengths):
        assert torch.equal(ragged[b, 0], prefill[b, n - 1])

    # Chunked prefill (second chunk continues at position 20) == one-shot prefill.
    second = exact.attention(q[:, 20:], k, v, torch.full((batch,), 20, device=DEVICE), scale)
    assert torch.equal(second, prefill[:, 20:])

    # Garbage (large, finite) after each query's position never reaches its output.
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, 20:], v_bad[:, 20:] = 1e3, -1e3
    assert torch.equal(exact.attention(q[:, :20], k_bad, v_bad, zero, scale), prefill[:, :20])


# --------------------------------------------------------------------------- host independence
def _nudge_odd_rows(out):
    """One ulp up for entries at odd positions along the first axis: a result whose bits depend
    on where a row sits in the block, as with a BLAS that handles rows by position."""
    out = numpy.array(out, copy=True)
    if out.ndim >= 1 and out.dtype.kind == "f":
        out[1::2] = numpy.nextafter(out[1::2], numpy.inf)
    return out


@pytest.fixture
def position_dependent_numpy(monkeypatch):
    """Patch numpy.matmul and numpy.sum -- the interpreter's tl.dot and tl.sum -- with versions
    whose rows' bits depend on their position in the block; return the calls made to them."""
    calls = []
    real_matmul, real_sum = numpy.matmul, numpy.sum

    def matmul(*args, **kwargs):
        calls.append("matmul")
        return _nudge_odd_rows(real_matmul(*args, **kwargs))

    def sum_(*args, **kwargs):
        calls.append("sum")
        return _nudge_odd_rows(real_sum(*args, **kwargs))

    monkeypatch.setattr(numpy, "matmul", matmul)
    monkeypatch.setattr(numpy, "sum", sum_)
    return calls


def test_fake_host_numpy_would_break_plain_tl_dot_and_tl_sum(position_dependent_numpy):
    """The fake reaches the interpreter, and it breaks row invariance of plain tl.dot / tl.sum:
    so the test below can fail."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels are compiled, not interpreted")

    @triton.jit
    def dot_and_sum(a_ptr, b_ptr, dot_ptr, sum_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tile = i[:, None] * N + i[None, :]
        a = tl.load(a_ptr + tile)
        tl.store(dot_ptr + tile, tl.dot(a, tl.load(b_ptr + tile), input_precision="ieee"))
        tl.store(sum_ptr + i, tl.sum(a, axis=1))

    g = _gen(11)
    a = _randn(g, 16, 16)
    a[1] = a[0]  # the same row at positions 0 and 1
    b = _randn(g, 16, 16)
    dot, sums = torch.empty(16, 16), torch.empty(16)
    dot_and_sum[(1,)](a, b, dot, sums, N=16)
    assert {"matmul", "sum"} <= set(position_dependent_numpy), "numpy.matmul / numpy.sum patched, but not reached"
    assert not torch.equal(dot[0], dot[1]), "the fake np.matmul does not make rows position-dependent"
    assert sums[0] != sums[1], "the fake np.sum does not make rows position-dependent"


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreter_does_not_depend_on_host_blas(position_dependent_numpy, dtype):
    """Interpreted, block products and sums are fixed trees of elementwise fp32 operations, not
    np.matmul / np.sum: rows stay invariant even with a host whose BLAS and numpy reductions
    give a row bits that depend on its position in the block."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels are compiled, not interpreted")
    g = _gen(12)
    x = _randn(g, 66, 40, dtype=dtype)  # two 64-row tiles
    w = _randn(g, 20, 40, dtype=dtype)
    full = exact.linear(x, w)
    for i in (0, 1, 63, 64, 65):
        assert torch.equal(exact.linear(x[i : i + 1], w)[0], full[i]), f"row {i} alone differs"
    perm = torch.randperm(66, generator=_gen(0))
    assert torch.equal(exact.linear(x[perm], w), full[perm]), "rows at other positions differ"

    q = _randn(g, 1, 20, 2, 16, dtype=dtype)  # 20 queries: two 16-query blocks
    k, v = _randn(g, 2, 1, 20, 1, 16, dtype=dtype)
    prefill = exact.attention(q, k, v, torch.zeros(1, dtype=torch.long, device=DEVICE), 0.25)
    for t in (1, 5, 16, 19):
        step = exact.attention(q[:, t : t + 1], k, v, torch.full((1,), t, device=DEVICE), 0.25)
        assert torch.equal(step[0, 0], prefill[0, t]), f"decode at {t} != prefill row"

    rows = _randn(g, 5, 600, dtype=dtype, scale=3)
    _rows_invariant(exact.rms_norm, rows, rows[0], 1e-6, batch_sizes=(2,))
    _rows_invariant(exact.log_softmax, rows, batch_sizes=(2,))
    assert position_dependent_numpy == [], "the kernels still reduce with np.matmul / np.sum"


def test_interpreted_dot_rounds_each_product_to_fp32():
    """Interpreted fp32 products are fp32 (numpy fp32 * fp32), each rounded, then added: with
    K = 2 a linear output is exactly fl(fl(x0 * w0) + fl(x1 * w1)), not the fp64 dot rounded
    once (which differs for some elements). A GPU fuses multiply-adds, hence interpreter only."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels are compiled, not interpreted")
    g = _gen(13)
    x, w = _randn(g, 64, 2), _randn(g, 16, 2)
    out = exact.linear(x, w)
    assert torch.equal(out, x[:, :1] * w[:, 0] + x[:, 1:] * w[:, 1])
    assert not torch.equal(out, (x.double() @ w.double().t()).float())


# --------------------------------------------------------------------------- backward
def _backward_case(op: str):
    g = _gen(8)
    if op == "linear":
        return [_randn(g, 2, 10, 33), _randn(g, 17, 33), _randn(g, 17)], ()
    if op == "rms_norm":
        return [_randn(g, 20, 33), _randn(g, 33)], (1e-6,)
    if op == "silu_mul":
        return [_randn(g, 20, 33), _randn(g, 20, 33)], ()
    if op == "rope":
        return [_randn(g, 2, 5, 3, 16), _randn(g, 2, 5, 8), _randn(g, 2, 5, 8)], ()
    if op == "attention":
        q, k, v = _randn(g, 2, 10, 4, 16), *_randn(g, 2, 2, 12, 2, 16)
        return [q, k, v], (torch.tensor([0, 2], device=DEVICE), 0.25)
    if op == "log_softmax":
        return [_randn(g, 20, 33)], ()
    return [_randn(g, 20, 33)], (_randint(g, 33, 20),)


@pytest.mark.parametrize("op", ["linear", "rms_norm", "silu_mul", "rope", "attention", "log_softmax", "token_logprobs"])
def test_backward_deterministic_and_close_to_native(op):
    inputs, static = _backward_case(op)
    upstream = None

    def grads(module):
        nonlocal upstream
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = getattr(module, op)(*leaves, *static)
        if upstream is None:
            upstream = torch.randn(out.shape, generator=_gen(9)).to(DEVICE)
        out.backward(upstream)
        return out.detach(), [t.grad for t in leaves]

    out_a, first = grads(exact)
    out_b, second = grads(exact)
    out_ref, reference = grads(native)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(out_a, out_ref, **TOL[torch.float32])
    assert torch.equal(out_a, getattr(exact, op)(*inputs, *static)), "autograd path != no-grad forward"
    for a, b, ref in zip(first, second, reference):
        assert torch.equal(a, b), "gradients differ run to run"
        torch.testing.assert_close(a, ref, **GRAD_TOL)
