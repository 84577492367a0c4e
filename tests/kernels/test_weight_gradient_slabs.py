"""A bf16 weight gradient in slabs of output rows (``gemm_arrangements._one_chunk_slabs``): the canonical arrangement of
a one-chunk reduction whose GEMMs run on one thread by construction, on the host's GEMM.

Its definition: the tokens zero-padded to a multiple of 64, then for each ``ONE_CHUNK_SLAB_ROWS``-row slab of the
output one GEMM on one thread, the gradient's columns seen transposed by the padded input. These tests write that
definition out and check the kernel against it bit for bit, at every thread count, with and without the compiled
loops, through a linear layer's backward; that a spread over the threads which rounds otherwise is caught; and that
a guard over another GEMM keeps the tiles."""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads
from test_host_guard import emulated_guard

from vexact_kernels import compiled_loops, cpu_exact, fixed_order, gemm_arrangements
from vexact_kernels.host_guard import HostGuard

SLAB = gemm_arrangements.ONE_CHUNK_SLAB_ROWS
CASES = [(312, 600, 48), (320, 600, 40), (100, 96, 24), (1000, 300, 16), (1024, 257, 32), (64, 20, 8)]


def _inputs(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=gen).bfloat16(), torch.randn(rows, k, generator=gen).bfloat16()


def _admitted(a: torch.Tensor, b: torch.Tensor, host: HostGuard) -> bool:
    """Whether this host runs the reduction in slabs (a bf16 GEMM class on the host's GEMM with one thread)."""
    if gemm_arrangements.transposed_dtype(a, b, host, "linear") != torch.bfloat16:
        return False
    return gemm_arrangements._one_chunk_in_slabs(a.shape[0], b.shape[1], a.dtype, host, "linear")


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
    assert torch.equal(gemm_arrangements.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
    # inputs as autograd gives them: a transposed view, and a view that starts off the 64-byte boundary
    b_off = torch.cat([b.new_zeros(1), b.reshape(-1)])[1:].view(rows, k)
    assert b_off.data_ptr() % gemm_arrangements.ALIGNMENT != 0
    out = gemm_arrangements.transposed_matmul(a.t().contiguous().t(), b_off, cpu_exact.HOST, "linear")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("threads", (1, 2, 3, 4))
def test_bf16_weight_gradient_in_slabs_is_thread_invariant(threads, monkeypatch):
    """The slabs shared out between the threads (``slab_mms``), each GEMM on one thread: the same bits at every
    thread count, and the same as the Python loop of the same calls (no compiled loops)."""
    a, b = _inputs(312, 1100, 40, seed=3)  # five slabs, the last partial
    if not _admitted(a, b, cpu_exact.HOST):
        pytest.skip("this host runs no bf16 weight gradient on its own GEMM with one thread")
    expected = _slabs_written_out(a, b)
    with num_threads(threads):
        assert torch.equal(gemm_arrangements.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
        monkeypatch.setattr(compiled_loops, "library", lambda: None)
        assert torch.equal(gemm_arrangements.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)


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


def test_a_spread_that_rounds_otherwise_runs_the_slabs_in_turn(monkeypatch):
    """Counter-test: a library whose GEMM inside a parallel region gives other bits (made so here: one bit flipped
    whenever several threads run) is caught by the first-use check, and the slabs run one after another."""
    real = compiled_loops.library()
    if real is None:
        pytest.skip("the compiled loops are not built here: the slabs always run in turn")

    class SpreadFlipsABit:
        def __getattr__(self, name):
            return getattr(real, name)

        def slab_mms(self, a, b, slab):
            out = real.slab_mms(a, b, slab)
            return (out.view(torch.int16) ^ 1).view(torch.bfloat16) if torch.get_num_threads() > 1 else out

    monkeypatch.setattr(compiled_loops, "library", lambda: SpreadFlipsABit())
    monkeypatch.setattr(gemm_arrangements, "_SPREAD_CHECKS", {})
    a, b = _inputs(312, 600, 48)
    if not _admitted(a, b, cpu_exact.HOST):
        pytest.skip("this host runs no bf16 weight gradient on its own GEMM with one thread")
    with num_threads(2):
        assert torch.equal(gemm_arrangements.transposed_matmul(a, b, cpu_exact.HOST, "linear"),
                           _slabs_written_out(a, b))
    assert list(gemm_arrangements._SPREAD_CHECKS.values()) == [False]


def test_a_guard_over_another_gemm_keeps_the_tiles():
    """The slabs call torch's GEMM themselves: a guard over another GEMM (the fixed-order one) runs the tiles."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", bmm=fixed_order.bmm)
    a, b = _inputs(312, 600, 48)
    assert not gemm_arrangements._one_chunk_in_slabs(312, 48, torch.bfloat16, guard, "linear")
    expected = gemm_arrangements._transposed_matmul_tiles(a, b, guard, "linear")
    assert torch.equal(gemm_arrangements.transposed_matmul(a, b, guard, "linear"), expected)


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
    assert not torch.equal(expected, gemm_arrangements._transposed_matmul_tiles(a, b, guard, "linear"))
    with num_threads(threads):
        assert torch.equal(gemm_arrangements.transposed_matmul(a, b, guard, "linear"), expected)
