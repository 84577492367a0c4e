"""Faster arrangements of the exact kernels' library calls: the same bits as the canonical ones, or those themselves.

Two arrangements of the exact CPU kernels run only where the guard's ``same_bits`` probe found that they give the
bits of the kernels' own (canonical) arrangement on this host:

- a linear layer's weight gradient (``gemm_weight_gradient.transposed_matmul``, a reduction over tokens in 256-token
  chunks): canonically transposed, zero-padded copies in 64-row tiles (``_transposed_matmul_tiles``); faster, the
  same chunk GEMMs on views of the inputs, the last chunk on its real rows (``_transposed_matmul_views``);
- a linear layer's row tiles (``gemm_linear.tiled_matmul``): canonically one ``bmm`` of 64-row tiles sharing the
  weight; faster, one GEMM over the stacked tiles (``_stacked_matmul``), which packs the weight once -- and, where the
  last tile is partial and the weight small, that GEMM over the whole tiles where the rows lie with the last tile in
  a GEMM of its own (``_split_mm``).

Either way the result must be the canonical one, bit for bit: that is what these tests check, with the real GEMM
and with a faster arrangement made wrong on purpose."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import linear_with_gradients, num_threads
from test_exact_price_bits import _same_bits

from vexact_kernels import cpu_exact, fixed_order, gemm_linear, gemm_tiles, gemm_weight_gradient, host_guard
from vexact_kernels.host_guard import CANONICAL_PATH, FASTER_PATH, MACHINE_THREADS, HostGuard


def _nudge(t: torch.Tensor) -> torch.Tensor:
    """One ulp up at every other element."""
    out = t.clone()
    flat = out.view(-1)
    flat[::2] = torch.nextafter(flat[::2], torch.full_like(flat[::2], float("inf")))
    return out


def _inputs(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)


# --------------------------------------------------------------------------- the guard's same_bits probe
def _probe(guard: HostGuard, faster) -> bool:
    canonical = torch.arange(12.0).view(3, 4) / 7
    return guard.arrangement_agrees("test", "3x4", lambda: canonical.clone(), lambda: faster(canonical), "linear")


def test_an_agreeing_arrangement_is_taken_and_recorded():
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    assert _probe(guard, lambda c: c.clone()) is True
    (probe,) = guard.report()["probes"]
    assert probe["property"] == "same_bits" and probe["path"] == FASTER_PATH and probe["passed"] is True
    assert probe["threads_checked"] == sorted({torch.get_num_threads(), MACHINE_THREADS})


def test_a_differing_arrangement_keeps_the_canonical_one_without_a_warning():
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the canonical arrangement is exact: nothing to warn about
        assert _probe(guard, _nudge) is False
    (probe,) = guard.report()["probes"]
    assert probe["path"] == CANONICAL_PATH and probe["passed"] is False and "differ" in probe["failure"]


def test_an_arrangement_wrong_only_at_more_threads_is_caught_at_first_use():
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    with num_threads(1):  # first use at 1 thread: the machine's count is probed too
        agrees = _probe(guard, lambda c: _nudge(c) if torch.get_num_threads() > 1 else c.clone())
    assert agrees is (MACHINE_THREADS == 1)


def test_a_thread_count_seen_later_is_checked_before_the_arrangement_is_used():
    beyond = MACHINE_THREADS + 1
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")

    def faster(c: torch.Tensor) -> torch.Tensor:
        return _nudge(c) if torch.get_num_threads() > MACHINE_THREADS else c.clone()

    with num_threads(1):
        assert _probe(guard, faster) is True
    with num_threads(beyond):
        assert _probe(guard, faster) is False
    (probe,) = guard.report()["probes"]
    assert probe["path"] == CANONICAL_PATH and probe["threads_checked"][-1] == beyond
    with num_threads(1):
        assert _probe(guard, faster) is False  # from now on one arrangement at every thread count


def test_fixed_order_mode_never_takes_a_faster_arrangement():
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="fixed-order")
    assert _probe(guard, lambda c: c.clone()) is False


# --------------------------------------------------------------------------- the weight gradient itself
CASES = [(3968, 176, 64), (3968, 64, 176), (300, 22, 64), (512, 64, 64), (256, 40, 48), (100, 40, 48),
         (70, 16, 16), (1, 32, 8)]


@pytest.mark.parametrize("rows,n,k", CASES)
def test_weight_gradient_is_the_canonical_arrangement_bit_for_bit(rows, n, k):
    a, b = _inputs(rows, n, k)
    expected = gemm_weight_gradient._transposed_matmul_tiles(a, b, cpu_exact.HOST, "linear")
    assert _same_bits(gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)
    # inputs as they come from autograd: a transposed view, and a view that starts off the 64-byte boundary
    a_t = a.t().contiguous().t()
    b_off = torch.cat([torch.zeros(1), b.view(-1)])[1:].view(rows, k)
    assert b_off.data_ptr() % gemm_tiles.ALIGNMENT != 0
    assert _same_bits(gemm_weight_gradient.transposed_matmul(a_t, b_off, cpu_exact.HOST, "linear"), expected)


def test_weight_gradient_with_special_values_is_the_canonical_arrangement():
    """Signed zeros (a masked token's gradient), infinities and NaN reach the weight gradient too. Column 0 of ``a`` is
    all -0.0 and column 5 of ``b`` positive, so every product for element (0, 5) is -0.0: the canonical result is
    +0.0 (its last chunk's zero padding adds +0.0; MKL's sums start from +0.0 anyway), and so must the views' be (an
    unpadded last chunk's sum gets + 0.0 for a BLAS that starts from the first product). 4 chunks: the tree adds no
    + 0.0 of its own; 100 rows: one chunk, no tree."""
    for rows in (856, 100):
        _check_special_values(rows)


def _check_special_values(rows: int) -> None:
    a, b = _inputs(rows, 48, 32, seed=1)
    a[:, 0] = -0.0
    b[:, 5] = b[:, 5].abs() + 1.0
    a[rows // 2, 3], b[rows // 2 + 1, 7], b[rows - 3, 9] = float("inf"), float("nan"), -float("inf")
    expected = gemm_weight_gradient._transposed_matmul_tiles(a, b, cpu_exact.HOST, "linear")
    assert str(expected[0, 5].item()) == "0.0"
    assert _same_bits(gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear"), expected)


def _views_probes(guard: HostGuard) -> list[tuple[str, str]]:
    return [(p["shape_class"], p["path"]) for p in guard.report()["probes"] if p["property"] == "same_bits"]


def test_a_views_arrangement_that_differs_is_not_used(monkeypatch):
    """A host whose GEMM gave the views other bits: the probes see it and the tiles run."""
    real_views = gemm_weight_gradient._transposed_matmul_views
    monkeypatch.setattr(gemm_weight_gradient, "_transposed_matmul_views",
                        lambda a, b, block, unpadded_tail: _nudge(real_views(a, b, block, unpadded_tail)))
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    a, b = _inputs(700, 64, 48)
    out = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
    assert _same_bits(out, gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear"))
    prefix = "weight gradient on views: block=256 N=64 K=48"
    assert _views_probes(guard) == [(f"{prefix} last chunk of 188 rows unpadded float32", CANONICAL_PATH),
                                    (f"{prefix} last chunk padded float32", CANONICAL_PATH)]


def test_a_last_chunk_whose_short_reduction_differs_is_padded(monkeypatch):
    """A host whose GEMM gives a 188-row reduction other bits than the zero-padded 256-row one (MKL on the AMD EPYC
    development machine does for lengths over 128): that length's probe fails and the last chunk is padded."""
    real_views = gemm_weight_gradient._transposed_matmul_views

    def short_tail_differs(a, b, block, unpadded_tail):
        out = real_views(a, b, block, unpadded_tail)
        return _nudge(out) if unpadded_tail and a.shape[0] % block == 188 else out

    monkeypatch.setattr(gemm_weight_gradient, "_transposed_matmul_views", short_tail_differs)
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    for rows in (700, 600):  # last chunks of 188 (probed: differs) and 88 rows (probed: agrees)
        a, b = _inputs(rows, 64, 48)
        out = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        assert _same_bits(out, gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear"))
    paths = dict(_views_probes(guard))
    prefix = "weight gradient on views: block=256 N=64 K=48"
    assert paths[f"{prefix} last chunk of 188 rows unpadded float32"] == CANONICAL_PATH
    assert paths[f"{prefix} last chunk padded float32"] == FASTER_PATH
    assert paths[f"{prefix} last chunk of 88 rows unpadded float32"] == FASTER_PATH


def test_a_class_of_few_outputs_is_probed_on_several_draws(monkeypatch):
    """A weight gradient of few outputs (N = 2, K = 17 over a 7-token chunk: 34) whose views round one output
    otherwise on about half the inputs -- but not on the probe's first draw, which alone would pass: the draws up to
    ``VIEW_PROBE_OUTPUTS`` outputs catch it, and the slabs' bits run. (MKL on the AMD EPYC host rounds three of
    these 34 outputs otherwise in the views for 3 inputs in 4; its seeded first draw was the fourth.)"""
    rows, n, k = 7, 2, 17
    real_views = gemm_weight_gradient._transposed_matmul_views
    first = real_views(*gemm_tiles.seeded_randn((rows, n), (rows, k)), 64, True)
    sign = 1.0 if first[1, 0] < 0 else -1.0  # the sign the first draw's output does not have

    def some_inputs_differ(a, b, block, unpadded_tail):
        out = real_views(a, b, block, unpadded_tail)
        if unpadded_tail and out[1, 0] * sign > 0:
            out[1, 0] = torch.nextafter(out[1, 0], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(gemm_weight_gradient, "_transposed_matmul_views", some_inputs_differ)
    assert gemm_tiles.VIEW_PROBE_OUTPUTS > n * k
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    gen = torch.Generator().manual_seed(5)
    for _ in range(8):  # inputs on both sides of the sign: each gives the slabs' bits
        a, b = torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)
        out = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        assert _same_bits(out, gemm_weight_gradient.canonical_transposed_matmul(a, b, guard, "linear"))
    paths = dict(_views_probes(guard))
    assert paths[f"weight gradient on views: block=64 N={n} K={k} last chunk of {rows} rows unpadded float32"] == (
        CANONICAL_PATH)


@pytest.mark.parametrize("rows,n,k", [(7, 2, 17), (5, 3, 5), (39, 4, 64), (100, 2, 17)])
def test_a_weight_gradient_of_few_outputs_is_the_canonical_arrangement(rows, n, k):
    """On this host's own GEMM: a MoE router's or a small head's weight gradient (few output rows) gives the canonical
    arrangement's bits on inputs the probe never saw -- what ``VIEW_PROBE_OUTPUTS``' draws are for (N = 2, K = 17, 7
    tokens took views that rounded otherwise before them, on the AMD EPYC host)."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    gen = torch.Generator().manual_seed(rows * n * k)
    for _ in range(16):
        a, b = torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)
        assert _same_bits(gemm_weight_gradient.transposed_matmul(a, b, guard, "linear"),
                          gemm_weight_gradient.canonical_transposed_matmul(a, b, guard, "linear"))


MODE_CASES = [(rows, k, n, dtype) for (rows, k, n) in [(7, 17, 2), (1, 3, 1), (5, 8, 15), (33, 64, 22), (65, 100, 40),
                                                        (129, 16, 177), (200, 176, 64), (312, 48, 300), (513, 17, 3)]
              for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("rows,k,n,dtype", MODE_CASES)
def test_auto_gives_canonicals_bits(rows, k, n, dtype):
    """The guard's promise for every ``same_bits`` arrangement, asked of the whole linear layer: whatever ``auto``
    takes (stacked tiles, views, a last tile apart, slabs spread) gives the bits of ``canonical``, which takes none --
    output and both gradients, on inputs no probe saw, at the run's thread count. (A fuzz of this found the weight
    gradient of few outputs, [7, 17] x [2, 17], that ``VIEW_PROBE_OUTPUTS`` is for.)"""
    gen = torch.Generator().manual_seed(rows * 1000 + k * 10 + n)
    x0 = torch.randn(rows, k, generator=gen).to(dtype)
    w0 = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    grad = torch.randn(rows, n, generator=gen).to(dtype)
    results = {mode: linear_with_gradients(cpu_exact.ops_in_mode(mode).linear,
                                           x0, w0, grad) for mode in ("auto", "canonical")}
    for name, a, b in zip(("output", "grad_x", "grad_w"), results["auto"], results["canonical"]):
        assert _same_bits(a, b), name


def test_a_weight_gradients_views_answer_is_asked_once_per_key(monkeypatch):
    """``transposed_matmul`` keeps the guard's answer for the views (``_views_arrangement``) per (guard state, rows,
    N, K, dtype, op, thread count): a repeated call asks once; another thread count, or a guard whose state changed,
    asks again; and the kept answer gives the bits the asked one gave."""
    asked = []
    real = gemm_weight_gradient._views_arrangement
    monkeypatch.setattr(gemm_weight_gradient, "_views_arrangement", lambda *args: asked.append(args) or real(*args))
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    a, b = _inputs(700, 64, 48)
    with num_threads(1):
        first = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        again = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        assert len(asked) == 1
        gemm_weight_gradient.transposed_matmul(a[:600], b[:600], guard, "linear")  # another key: its own question
        assert len(asked) == 2
    with num_threads(2):
        gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        assert len(asked) == 3
    guard.epoch = next(host_guard._EPOCHS)  # what a check that changes a class's path does
    with num_threads(1):
        after = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
        assert len(asked) == 4
    canonical = gemm_weight_gradient.canonical_transposed_matmul(a, b, guard, "linear")
    assert _same_bits(first, again) and _same_bits(first, after) and _same_bits(first, canonical)


def test_wide_weight_gradients_run_in_slabs_with_the_same_bits(monkeypatch):
    """N beyond ``VIEW_SLAB_ROWS`` (the LM head's vocabulary) is cut into slabs: the canonical bits still."""
    monkeypatch.setattr(gemm_tiles, "VIEW_SLAB_ROWS", 160)
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    a, b = _inputs(300, 500, 16)
    out = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
    assert _same_bits(out, gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear"))
    # the probe ran the slabs (whatever it found): the views were considered for N = 500
    assert [shape for shape, _ in _views_probes(guard)] == [
        "weight gradient on views: block=256 N=500 K=16 last chunk of 44 rows unpadded float32"]


def test_a_guard_over_another_gemm_keeps_the_tiles():
    """The views call torch.bmm itself: a guard over another GEMM (the fixed-order one here) never probes them."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", bmm=fixed_order.bmm)
    a, b = _inputs(300, 32, 16)
    out = gemm_weight_gradient.transposed_matmul(a, b, guard, "linear")
    assert _same_bits(out, gemm_weight_gradient._transposed_matmul_tiles(a, b, guard, "linear"))
    assert not [p for p in guard.report()["probes"] if p["property"] == "same_bits"]


@pytest.mark.parametrize("threads", (1, 2, 3, 4))
def test_weight_gradient_on_views_is_thread_invariant(threads):
    a, b = _inputs(1000, 176, 64, seed=2)
    with num_threads(1):
        reference = gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear")
    with num_threads(threads):
        assert _same_bits(gemm_weight_gradient.transposed_matmul(a, b, cpu_exact.HOST, "linear"), reference)


# --------------------------------------------------------------------------- a linear layer's tiles, stacked
def _tiles_reference(x: torch.Tensor, weight: torch.Tensor, guard: HostGuard) -> torch.Tensor:
    """``tiled_matmul``'s canonical arrangement, written out: zero-padded rows in tiles, one bmm sharing the
    (column-padded, transposed) weight."""
    rows, k = x.shape
    n = weight.shape[0]
    n_pad = -(-n // 16) * 16
    w = torch.cat([weight, weight.new_zeros(n_pad - n, k)]) if n_pad != n else weight.contiguous()
    operand = w.t().unsqueeze(0)
    block = gemm_tiles.row_block(rows, guard.tile_heights(torch.float32, operand, True, "linear"))
    blocks = -(-rows // block)
    padded = torch.cat([x, x.new_zeros(blocks * block - rows, k)])
    out = torch.bmm(padded.view(blocks, block, k), operand.expand(blocks, k, n_pad)).view(blocks * block, n_pad)
    return out[:rows, :n]


@pytest.fixture(scope="module")
def auto_guard() -> HostGuard:
    """A guard in mode ``auto`` (given, not the run's ``VEXACT_CPU_EXACT_PATH``): the tests comparing the library
    GEMM's arrangements with torch's own ``bmm`` are about the library path, which ``fixed-order`` never takes."""
    return HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")


STACKED_CASES = [(3968, 64, 176), (3968, 176, 64), (312, 576, 192), (100, 64, 22), (700, 48, 40), (129, 16, 16),
                 (64, 32, 32), (5, 8, 16)]


@pytest.mark.parametrize("rows,k,n", STACKED_CASES)
def test_linear_tiles_stacked_are_the_tiles_bit_for_bit(rows, k, n, auto_guard):
    gen = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, k), generator=gen)
    x[0] = -0.0
    x[1, 0], x[2, 1] = float("inf"), float("nan")
    weight = torch.randn(n, k, generator=gen)
    out = gemm_linear.tiled_matmul(x, weight, auto_guard)
    assert _same_bits(out.contiguous(), _tiles_reference(x, weight, auto_guard).contiguous())


def test_a_stacked_gemm_that_differs_keeps_the_tiles(monkeypatch):
    real_stacked = gemm_linear._stacked_matmul
    monkeypatch.setattr(gemm_linear, "_stacked_matmul",
                        lambda x, operand, rows, n: _nudge(real_stacked(x, operand, rows, n)))
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(300, 48, generator=gen), torch.randn(24, 48, generator=gen)
    out = gemm_linear.tiled_matmul(x, weight, guard)
    assert _same_bits(out.contiguous(), _tiles_reference(x, weight, guard).contiguous())
    assert _views_probes(guard) == [("linear tiles stacked in one GEMM: 5x64 rows K=48 N=32 row-major float32",
                                     CANONICAL_PATH)]


APART_CASES = [(928, 64, 64), (928, 176, 64), (129, 16, 16), (700, 48, 40), (3776 + 5, 64, 22)]


def _apart_probes(guard: HostGuard) -> list[tuple[str, str]]:
    return [(shape_class, path) for shape_class, path in _views_probes(guard) if "the last tile apart" in shape_class]


@pytest.mark.parametrize("rows,k,n", APART_CASES)
@pytest.mark.parametrize("given", [False, True], ids=["forward", "input-gradient"])
def test_a_partial_last_tile_apart_is_the_tiles_bit_for_bit(rows, k, n, given):
    """A stacked GEMM whose last tile is partial multiplies it apart (``_split_mm``: the whole tiles where x holds
    them, no copy) where the guard found the tiles' bits; either way the tiles' bits, for a forward's weight and for
    an input gradient's (the weight as given)."""
    gen = torch.Generator().manual_seed(rows + 7 * k + n)
    x = torch.randn(rows, k, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, k), generator=gen)
    x[0], x[-1, 0] = -0.0, float("inf")
    weight = torch.randn(k, n, generator=gen).t() if given else torch.randn(n, k, generator=gen)
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    out = gemm_linear.tiled_matmul(x, weight, guard)
    assert _same_bits(out.contiguous(), _tiles_reference(x, weight, guard).contiguous())
    stacked = [path for shape_class, path in _views_probes(guard) if "apart" not in shape_class]
    if stacked == [FASTER_PATH]:  # a stacked GEMM runs: its last tile apart was asked (the weight is small)
        assert len(_apart_probes(guard)) == 1


def test_a_last_tile_apart_that_differs_keeps_the_stacked_gemm(monkeypatch):
    real_split = gemm_linear._split_mm
    monkeypatch.setattr(gemm_linear, "_split_mm",
                        lambda x, operand, rows, n, block: _nudge(real_split(x, operand, rows, n, block)))
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(300, 48, generator=gen), torch.randn(24, 48, generator=gen)
    out = gemm_linear.tiled_matmul(x, weight, guard)
    assert _same_bits(out.contiguous(), _tiles_reference(x, weight, guard).contiguous())
    assert _apart_probes(guard) in ([], [("linear tiles stacked in one GEMM, the last tile apart: 5x64 rows K=48 "
                                          "N=32 row-major float32", CANONICAL_PATH)])  # [] where no stack runs


@pytest.mark.parametrize("mode,rows,n,k", [("auto", 256, 64, 64), ("auto", 300, 512, 256), ("canonical", 300, 64, 64)],
                         ids=["whole-tiles", "large-weight", "canonical"])
def test_whole_tiles_a_large_weight_or_canonical_mode_ask_nothing_apart(mode, rows, n, k):
    """No last tile apart where every tile is whole, where the weight is above ``APART_WEIGHT_BYTES_MAX`` (512 x 256
    fp32: 512 KiB) or in mode ``canonical`` (which takes no ``same_bits`` arrangement): the probe is never asked."""
    gen = torch.Generator().manual_seed(rows + n)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
    out = gemm_linear.tiled_matmul(x, weight, guard)
    assert _same_bits(out.contiguous(), _tiles_reference(x, weight, guard).contiguous())
    assert _apart_probes(guard) == []


@pytest.mark.parametrize("rows,k,n", STACKED_CASES)
def test_an_input_gradient_on_the_weight_as_given_is_the_tiles_bit_for_bit(rows, k, n, auto_guard):
    """grad_x = grad @ W: ``tiled_matmul(grad, W.t())``, whose canonical operand is a transposed copy of W; on the
    weight as it is (row-major, no copy) where the probe agrees. Either way the tiles' bits."""
    gen = torch.Generator().manual_seed(rows * k + n)
    grad = torch.randn(rows, k, generator=gen)
    grad[3] = -0.0
    w = torch.randn(k, n, generator=gen)  # W [K, N] as a layer stores it; the kernel gets its transpose
    out = gemm_linear.tiled_matmul(grad, w.t(), auto_guard)
    assert _same_bits(out.contiguous(), _tiles_reference(grad, w.t(), auto_guard).contiguous())
