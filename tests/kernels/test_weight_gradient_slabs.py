"""A weight gradient in slabs of output rows (``gemm_weight_gradient._reduction_slabs``): the canonical arrangement of a
reduction over the tokens whose chunk class runs the host's own GEMM, every GEMM on one thread.

Its definition. bf16 (one chunk, a class the kernels call with one thread by construction): the tokens zero-padded to
a multiple of 64, then for each ``SLAB_ROWS``-row slab of the output one GEMM on one thread, the gradient's columns
seen transposed by the padded input. fp32: the tokens in chunks of ``_reduction_block`` (a power of two from 64 up to
256; a last chunk of at most half a chunk zero-padded to its own such length, any other partial one to the chunk),
each chunk's product in slabs as above, the products added by the halving tree in chunk order. These tests write
that definition out and check the kernel against it bit for bit, at every thread count, with and without the
compiled loops, through a linear layer's backward; that a spread over the threads which rounds otherwise is caught;
and that a guard over another GEMM keeps the tiles."""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads
from test_host_guard import emulated_guard

from vexact_kernels import compiled_loops, cpu_exact, fixed_order, gemm_tiles, gemm_weight_gradient
from vexact_kernels.host_guard import HostGuard

SLAB = gemm_weight_gradient.SLAB_ROWS
CASES = [(312, 600, 48), (320, 600, 40), (100, 96, 24), (1000, 300, 16), (1024, 257, 32), (64, 20, 8),
         (312, 4500, 8)]  # (the last: more output rows than VIEW_SLAB_ROWS, which one chunk's GEMMs write whole)


def _inputs(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=gen).bfloat16(), torch.randn(rows, k, generator=gen).bfloat16()


def _admitted(a: torch.Tensor, b: torch.Tensor, host: HostGuard) -> bool:
    """Whether this host runs the reduction in slabs (a bf16 GEMM class on the host's GEMM with one thread)."""
    if gemm_weight_gradient.transposed_dtype(a, b, host, "linear") != torch.bfloat16:
        return False
    return gemm_weight_gradient._reduction_in_slabs(a.shape[0], b.shape[1], a.dtype, host, "linear")


def _slabs_written_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition: tokens zero-padded to a multiple of 64; per slab, a's columns (a zero-padded copy where the
    tokens were padded, else a's own view) seen transposed, times b padded, one ``torch.mm`` with one thread."""
    rows, n = a.shape
    length = -(-rows // 64) * 64
    b_pad = torch.cat([b, b.new_zeros(length - rows, b.shape[1])]) if length > rows else b.contiguous()
    slabs = []
    with num_threads(1):
        for first in range(0, n, SLAB):
            region = a[:, first : first + SLAB]
            left = torch.cat([region, region.new_zeros(length - rows, region.shape[1])]) if length > rows else region
            slabs.append(torch.mm(left.t(), b_pad))
    return torch.cat(slabs)


@pytest.mark.parametrize("loops", ("compiled", "python"))
@pytest.mark.parametrize("rows,n,k", CASES)
def test_bf16_weight_gradient_is_its_slabs_bit_for_bit(rows, n, k, loops, monkeypatch):
    if loops == "python":  # the same calls on the same operands, in a Python loop
        monkeypatch.setattr(compiled_loops, "library", lambda: None)
    a, b = _inputs(rows, n, k)
    if not _admitted(a, b, cpu_exact.HOST):
        pytest.skip("this host runs no bf16 weight gradient on its own GEMM with one thread")
    expected = _slabs_written_out(a, b)
    assert expected.dtype == torch.bfloat16 and expected.shape == (n, k)
    assert torch.equal(gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
    # inputs as autograd gives them: a transposed view, and a view that starts off the 64-byte boundary
    b_off = torch.cat([b.new_zeros(1), b.reshape(-1)])[1:].view(rows, k)
    assert b_off.data_ptr() % gemm_tiles.ALIGNMENT != 0
    out = gemm_weight_gradient.transposed_matmul(a.t().contiguous().t(), b_off, cpu_exact.HOST, "linear")
    assert torch.equal(out, expected)


def test_linear_backward_of_bf16_is_its_slabs():
    """Through ``cpu_exact.linear``'s autograd: the weight gradient is the slabs of (grad, x)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 104, 64, generator=gen).bfloat16()
    weight = torch.randn(520, 64, generator=gen).bfloat16().requires_grad_(True)
    grad = torch.randn(3, 104, 520, generator=gen).bfloat16()
    if not _admitted(grad.view(-1, 520), x.view(-1, 64), cpu_exact.HOST):
        pytest.skip("this host runs no bf16 weight gradient on its own GEMM with one thread")
    cpu_exact.linear(x, weight).backward(grad)
    assert torch.equal(weight.grad, _slabs_written_out(grad.view(-1, 520), x.view(-1, 64)))


def test_a_guard_over_another_gemm_keeps_the_tiles():
    """The slabs call torch's GEMM themselves: a guard over another GEMM (the fixed-order one) runs the tiles."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", bmm=fixed_order.bmm)
    a, b = _inputs(312, 600, 48)
    assert not gemm_weight_gradient._reduction_in_slabs(312, 48, torch.bfloat16, guard, "linear")
    expected = gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear")
    assert torch.equal(gemm_weight_gradient.transposed_matmul(a, b, guard, "linear"), expected)


@pytest.mark.parametrize("threads", (1, 2))
def test_on_a_host_whose_gemm_rounds_by_rows_in_the_call_the_slabs_stay_thread_invariant(threads, monkeypatch):
    """The emulated rows-in-call host (its GEMM gives rows of a call of more than 64 rows other bits, as an Intel
    Xeon's AMX GEMM did): a 256-row slab's rows are not the 64-row tiles' there, but they are the definition's, at
    every thread count. The compiled loops call the library's GEMM directly, past the emulation, so they are off."""
    monkeypatch.setattr(compiled_loops, "library", lambda: None)
    guard = emulated_guard("rows-in-call", monkeypatch)
    a, b = _inputs(312, 600, 48)
    if not _admitted(a, b, guard):
        pytest.skip("this host runs no bf16 weight gradient on its own GEMM with one thread")
    expected = _slabs_written_out(a, b)
    assert not torch.equal(expected, gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear"))
    with num_threads(threads):
        assert torch.equal(gemm_weight_gradient.transposed_matmul(a, b, guard, "linear"), expected)


# --------------------------------------------------------------------------- fp32: several chunks, each in slabs
# (tokens, N, K): one chunk (100: padded to 128), whole chunks only (512), a short last chunk (312: 56 tokens padded to
# 64), a partial last chunk padded to the whole chunk (700: 188 tokens), the default model's update (3,776 tokens),
# N over several slabs and past ``VIEW_SLAB_ROWS`` (4,100: two chunks; 4,200: one, whose GEMMs write the result
# whole), K not a multiple of 16
FP32_CASES = [(100, 300, 24), (512, 576, 40), (312, 600, 17), (700, 260, 32), (3776, 176, 64), (300, 4100, 16),
              (200, 4200, 8)]


def _fp32_inputs(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)


def _fp32_admitted(rows: int, k: int, host: HostGuard) -> bool:
    return gemm_weight_gradient._reduction_in_slabs(rows, k, torch.float32, host, "linear")


def _chunk_written_out(a: torch.Tensor, b: torch.Tensor, length: int) -> torch.Tensor:
    """One chunk: a [M, N] and b [M, K] zero-padded to ``length`` tokens; per slab one ``torch.mm``, one thread."""
    rows = a.shape[0]
    a_pad = torch.cat([a, a.new_zeros(length - rows, a.shape[1])])
    b_pad = torch.cat([b, b.new_zeros(length - rows, b.shape[1])])
    with num_threads(1):
        return torch.cat([torch.mm(a_pad[:, first : first + SLAB].t(), b_pad)
                          for first in range(0, a.shape[1], SLAB)])


def _fp32_slabs_written_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = a.shape[0]
    block = 64
    while block < min(rows, 256):
        block *= 2
    starts = list(range(0, rows, block))
    tail = rows - starts[-1]
    lengths = [block] * len(starts)
    if len(starts) > 1 and tail <= block // 2:  # a short last chunk: its own power of two from 64
        lengths[-1] = 64
        while lengths[-1] < tail:
            lengths[-1] *= 2
    parts = [_chunk_written_out(a[s : s + block], b[s : s + block], length) for s, length in zip(starts, lengths)]
    return parts[0] if len(parts) == 1 else fixed_order.tree_sum(torch.stack(parts), dim=0)


@pytest.mark.parametrize("loops", ("compiled", "python"))
@pytest.mark.parametrize("rows,n,k", FP32_CASES)
def test_fp32_weight_gradient_is_its_chunks_in_slabs_bit_for_bit(rows, n, k, loops, monkeypatch):
    """The canonical arrangement against the definition written out; and ``transposed_matmul`` (in mode ``auto`` the
    views where they agree, which ``same_bits`` checks against this definition) gives the same bits."""
    if loops == "python":
        monkeypatch.setattr(compiled_loops, "library", lambda: None)
    a, b = _fp32_inputs(rows, n, k)
    if not _fp32_admitted(rows, k, cpu_exact.HOST):
        pytest.skip("this host runs no fp32 weight gradient on its own GEMM")
    expected = _fp32_slabs_written_out(a, b)
    assert expected.shape == (n, k)
    assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
    assert torch.equal(gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)


def _case(dtype: torch.dtype, seed: int, n: int = 1100, k: int = 40, fp32_rows: int = 700) -> tuple:
    """(a, b, whether this host runs them in slabs, the definition written out) for a layer of ``n`` outputs and ``k``
    inputs: bf16's one chunk of 312 tokens; fp32's ``fp32_rows`` tokens (by default three chunks of 700, the last
    partial; five slabs, the last partial)."""
    if dtype == torch.bfloat16:
        a, b = _inputs(312, n, k, seed=seed)
        return a, b, _admitted(a, b, cpu_exact.HOST), _slabs_written_out
    a, b = _fp32_inputs(fp32_rows, n, k, seed=seed)
    return a, b, _fp32_admitted(fp32_rows, k, cpu_exact.HOST), _fp32_slabs_written_out


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("threads", (1, 2, 3, 4))
def test_weight_gradient_in_slabs_is_thread_invariant(threads, dtype, monkeypatch):
    """Every (chunk, slab) pair shared out between the threads (``reduction_slab_mms``), each GEMM on one thread: the
    same bits at every thread count, and the same as the Python loop of the same calls (no compiled loops)."""
    a, b, admitted, written_out = _case(dtype, seed=3)
    if not admitted:
        pytest.skip("this host runs no weight gradient of this dtype on its own GEMM")
    expected = written_out(a, b)
    with num_threads(threads):
        assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
        monkeypatch.setattr(compiled_loops, "library", lambda: None)
        assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)


@pytest.mark.parametrize("mode", ("auto", "canonical"))
@pytest.mark.parametrize("rows,n,k", [(6, 8, 24), (7, 64, 24), (65, 8, 24), (300, 8, 24), (33, 200, 17), (40, 3, 5)])
def test_a_weight_gradient_of_one_pair_is_thread_invariant(rows, n, k, mode):
    """A reduction of one (chunk, slab) pair (one chunk of at most 256 outputs), whose one task runs its GEMM on the
    library's own threads where no column blocks do: at 1, 2 and 3 threads the same bits, on inputs no check saw.
    (MKL on the AMD EPYC host rounds the [8, 64] x [64, 24] product otherwise at 3 threads; the check that allowed it
    had multiplied two chunks -- two tasks, each on one thread -- and a one-row partial chunk, which sums alike in any
    order.)"""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
    gen = torch.Generator().manual_seed(rows + n + k)
    for _ in range(4):
        a, b = torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)
        results = []
        for threads in (1, 2, 3):
            with num_threads(threads):
                results.append(gemm_weight_gradient.transposed_matmul(a, b, guard, "linear"))
        assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_linear_backward_in_canonical_mode_is_the_chunks_in_slabs(dtype):
    """Through ``cpu_exact.linear``'s autograd in mode ``canonical`` (no ``same_bits`` arrangement: what a host whose
    probes fail runs): the weight gradient is the definition's, over 1,100 tokens -- in bf16 more than one chunk
    holds, so its chunks reduce in fp32."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 550, 48, generator=gen).to(dtype)
    weight = torch.randn(300, 48, generator=gen).to(dtype).requires_grad_(True)
    grad = torch.randn(2, 550, 300, generator=gen).to(dtype)
    if not _fp32_admitted(1100, 48, guard):
        pytest.skip("this host runs no fp32 weight gradient on its own GEMM")
    cpu_exact.linear(x, weight, host=guard).backward(grad)
    expected = _fp32_slabs_written_out(grad.view(-1, 300).float(), x.view(-1, 48).float()).to(dtype)
    assert torch.equal(weight.grad, expected)


def test_fp32_short_last_chunk_on_another_gemm_keeps_its_tiles(monkeypatch):
    """A short last chunk whose own class does not run the host's GEMM (made so here) is that chunk's tiles, added
    by the same tree to the whole chunks' slabs."""
    host = cpu_exact.HOST
    a, b = _fp32_inputs(312, 600, 17)
    if not _fp32_admitted(312, 17, host):
        pytest.skip("this host runs no fp32 weight gradient on its own GEMM")
    real = gemm_weight_gradient._chunk_in_slabs
    monkeypatch.setattr(gemm_weight_gradient, "_chunk_in_slabs",
                        lambda length, *args: length != 64 and real(length, *args))
    whole = _chunk_written_out(a[:256], b[:256], 256)
    tail = gemm_weight_gradient._transposed_matmul_tiles(a[256:], b[256:], host, "linear")
    expected = fixed_order.tree_sum(torch.stack([whole, tail]), dim=0)
    assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, host, "linear"), expected)


def _recorded_slab_calls(monkeypatch: pytest.MonkeyPatch, real, flips=lambda column_blocks: False) -> list[int]:
    """The compiled loops (``real``) with ``reduction_slab_mms``' column blocks recorded per call, and the first-use
    checks of the spread forgotten; a call where ``flips(column_blocks)`` returns one bit flipped (a library whose GEMM
    rounds otherwise there: in a parallel region, or on a block of columns)."""
    calls = []

    class Recorded:
        def __getattr__(self, name):
            return getattr(real, name)

        def reduction_slab_mms(self, *args, column_blocks=1, **kwargs):
            calls.append(column_blocks)
            parts = real.reduction_slab_mms(*args, column_blocks=column_blocks, **kwargs)
            if flips(column_blocks):
                as_int = torch.int16 if parts.dtype == torch.bfloat16 else torch.int32
                parts.view(as_int).bitwise_xor_(1)  # in place: a caller's ``out`` gets the flip too
            return parts

    monkeypatch.setattr(compiled_loops, "library", lambda: Recorded())
    monkeypatch.setattr(gemm_weight_gradient, "_SPREAD_CHECKS", {})
    return calls


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_a_spread_that_rounds_otherwise_runs_the_slabs_in_turn(dtype, monkeypatch):
    """Counter-test: a library whose GEMM inside a parallel region gives other bits (made so here: one bit flipped
    whenever several threads run the (chunk, slab) pairs) is caught by the first-use check, and the pairs run one
    after another."""
    real = compiled_loops.library()
    if real is None:
        pytest.skip("the compiled loops are not built here: the slabs always run in turn")
    _recorded_slab_calls(monkeypatch, real, flips=lambda column_blocks: torch.get_num_threads() > 1)
    a, b, admitted, written_out = _case(dtype, seed=7)
    if not admitted:
        pytest.skip("this host runs no weight gradient of this dtype on its own GEMM")
    with num_threads(2):
        assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"),
                           written_out(a, b))
    checks = list(gemm_weight_gradient._SPREAD_CHECKS.values())  # (the column blocks first where the pairs are few)
    assert checks and not any(checks)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("threads", (2, 3))
def test_too_few_pairs_share_their_columns_between_the_threads(threads, dtype, monkeypatch):
    """A reduction of fewer (chunk, slab) pairs than ``SLAB_PAIRS_PER_THREAD`` per thread splits each pair's GEMM into
    as many blocks of its output columns as threads (recorded), with the definition's bits; a library whose
    column blocks round otherwise (made so: one bit flipped) keeps the whole pairs, shared out, and the same bits."""
    real = compiled_loops.library()
    if real is None:
        pytest.skip("the compiled loops are not built here: the slabs always run in turn")
    # a layer of 200 outputs, one slab -- bf16's one chunk of 312 tokens, fp32's chunks of 256 and 44: too few
    # (chunk, slab) pairs for two threads
    a, b, admitted, written_out = _case(dtype, seed=5, n=200, k=48, fp32_rows=300)
    if not admitted:
        pytest.skip("this host runs no weight gradient of this dtype on its own GEMM")
    expected = written_out(a, b)
    with num_threads(threads):
        calls = _recorded_slab_calls(monkeypatch, real)
        assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
        assert calls[-1] == threads  # the reduction's own call, after its first-use check
        assert list(gemm_weight_gradient._SPREAD_CHECKS.values()) == [True]
        calls = _recorded_slab_calls(monkeypatch, real, flips=lambda column_blocks: column_blocks > 1)
        assert torch.equal(gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
        assert calls[-1] == 1
        assert list(gemm_weight_gradient._SPREAD_CHECKS.values()) == [False, True]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_a_weight_gradient_over_no_tokens_is_zero(dtype):
    """An empty reduction (a layer that saw no token) is zeros of the weight's shape, on every path."""
    a, b = torch.zeros(0, 300, dtype=dtype), torch.zeros(0, 40, dtype=dtype)
    for reduce in (gemm_weight_gradient.transposed_matmul, gemm_weight_gradient.canonical_transposed_matmul):
        out = reduce(a, b, cpu_exact.HOST, "linear")
        assert out.shape == (300, 40) and out.dtype == dtype and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("threads", (1, 2))
def test_a_one_column_gradient_of_any_column_stride_is_its_slabs(threads, dtype):
    """A weight of one output row (a MoE shared expert's gate, [1, hidden]): its output gradient [M, 1] comes as a
    transposed view (column stride M), which torch calls contiguous. The slabs take it -- in the compiled loops too,
    whose spread is checked at 2 threads -- and give the definition's bits, as for the same values laid out plainly.
    (On the Intel Xeon host the first such call failed in ``reduction_slab_mms``'s layout check.)"""
    rows, k = (312, 40) if dtype == torch.bfloat16 else (700, 40)
    gen = torch.Generator().manual_seed(8)
    a_row, b = torch.randn(1, rows, generator=gen).to(dtype), torch.randn(rows, k, generator=gen).to(dtype)
    a = a_row.t()  # [M, 1], strides (1, M)
    assert a.is_contiguous() and a.stride(1) == rows
    admitted = (_admitted(a.contiguous(), b, cpu_exact.HOST) if dtype == torch.bfloat16
                else _fp32_admitted(rows, k, cpu_exact.HOST))
    if not admitted:
        pytest.skip("this host runs no weight gradient of this dtype on its own GEMM")
    written_out = _slabs_written_out if dtype == torch.bfloat16 else _fp32_slabs_written_out
    expected = written_out(a_row.t().clone(), b)
    with num_threads(threads):
        got = gemm_weight_gradient.canonical_transposed_matmul(a, b, cpu_exact.HOST, "linear")
        assert torch.equal(got, expected)
        again = gemm_weight_gradient.canonical_transposed_matmul(a.clone(), b, cpu_exact.HOST, "linear")
        assert torch.equal(again, got)


@pytest.mark.parametrize("mode", ("auto", "canonical"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (200, 312))  # one chunk; in fp32 two (a short last one)
def test_a_weight_gradient_is_a_tensor_of_its_own(mode, dtype, rows, monkeypatch):
    """A weight gradient is returned as a tensor that holds its storage alone, never a view of a larger buffer (the
    one-chunk slabs returned their [1, N, K] buffer's first entry): autograd adds a tied weight's two gradients in
    place only into such a tensor (``test_a_tied_weight_s_two_gradients_add_in_place``). So too where the chunks'
    partial products do not fit at once (``VIEW_PARTIALS_MAX``: llama100m's head at a longer sequence), with the same
    bits."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
    gen = torch.Generator().manual_seed(rows)
    a, b = torch.randn(rows, 600, generator=gen).to(dtype), torch.randn(rows, 48, generator=gen).to(dtype)
    compute = gemm_weight_gradient.transposed_dtype(a, b, host, "linear")
    grads = []
    for partials_max in (gemm_tiles.VIEW_PARTIALS_MAX, 1):
        monkeypatch.setattr(gemm_tiles, "VIEW_PARTIALS_MAX", partials_max)
        grad = gemm_weight_gradient.transposed_matmul(a.to(compute), b.to(compute), host, "linear")
        assert grad.shape == (600, 48)
        assert grad._base is None
        assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
        grads.append(grad)
    assert torch.equal(grads[0], grads[1])


def _tied_step(ops, weight: torch.Tensor, tokens: torch.Tensor) -> list[tuple[str, list]]:
    """An embedding and an LM head sharing ``weight`` (a tied model): forward, backward; the ops autograd ran that
    add two tensors of the weight's shape, as (name, input shapes)."""
    hidden = ops.embedding(tokens, weight)
    logits = ops.linear(hidden, weight)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        logits.float().square().sum().backward()
    shape = list(weight.shape)
    return [(e.name, e.input_shapes[:2]) for e in prof.events()
            if e.name in ("aten::add", "aten::add_") and e.input_shapes[:2] == [shape, shape]]


@pytest.mark.parametrize("mode", ("auto", "canonical"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_tied_weight_s_two_gradients_add_in_place(mode, dtype, monkeypatch):
    """A tied weight (llama100m's embedding and LM head) gets two gradients, which autograd adds: in place (``add_``)
    where one holds its storage alone (``test_a_weight_gradient_is_a_tensor_of_its_own``), else out of place into a
    fresh vocabulary x width buffer on every step -- at llama100m's 49,152 x 576, 113 MB of fresh pages per step,
    which made ``canonical`` fp32 training 1.14-1.20x ``auto`` on the AMD EPYC. Counter-test: a weight gradient
    returned as a view of a larger buffer (the old one-chunk slabs) makes the add out of place."""
    ops = cpu_exact.ops_in_mode(mode)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(600, 48, generator=gen).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, 600, (2, 100), generator=gen)
    assert _tied_step(ops, weight, tokens) == [("aten::add_", [[600, 48], [600, 48]])]

    real = gemm_weight_gradient.transposed_matmul

    def as_a_view(*args, **kwargs):
        grad = real(*args, **kwargs)
        return torch.stack([grad, grad])[0]
    monkeypatch.setattr(gemm_weight_gradient, "transposed_matmul", as_a_view)
    weight.grad = None
    assert _tied_step(ops, weight, tokens) == [("aten::add", [[600, 48], [600, 48]])]
