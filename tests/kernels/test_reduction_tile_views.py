"""A fp32 weight gradient's canonical GEMM tiles as one GEMM per (chunk, row tile) on views of its inputs
(``gemm_arrangements._transposed_matmul_tile_views``) give the canonical call's bits.

What changed: where the class runs the library GEMM, the canonical weight gradient (``_transposed_matmul_tiles``)
copied its inputs into laid-out operands on every call -- each token chunk of the gradient transposed and padded to
whole row tiles, and each chunk of the input transposed once per row tile -- for one ``bmm`` over every (chunk, row
tile) pair. Now each pair is its own GEMM of the same shape on views (a tile reaching past the inputs' rows or columns
on a zero-padded copy of its region), the tiles spread over the threads, checked at first use against the canonical
call (``_tile_views_agree``). Checked here, in mode ``canonical`` (what a host whose ``same_bits`` probes fail runs):

- the weight gradient equals, bit for bit, the canonical call's, at ragged token counts (not multiples of the
  chunk), one chunk and several, partial row tiles and K padded, at 1 and 2 threads, on this host and on the
  emulated rows-in-call host, and that the form ran (counted);
- through a linear layer's backward, fp32 and bf16 (a bf16 gradient of more than 1,024 tokens reduces its chunks in
  fp32), every output and gradient as the canonical call's;
- counter-test: tiles made one ulp off are caught by the first-use check, and the canonical call runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import form_and_canonical, num_threads
from test_arranged_weights import _steps, _with_threads
from test_host_guard import emulated_guard

from vexact_kernels import compiled_loops, cpu_exact, gemm_arrangements
from vexact_kernels.host_guard import HostGuard

HOSTS = ("this-host", "rows-in-call")
# (tokens, output rows N, input width K): ragged token counts over several 256-token chunks (3,968: the default
# model's training batch) and in one chunk (200); N in whole and partial 64-row tiles, in a small tile (20: one of 32
# rows) and over two of VIEW_SLAB_ROWS' slabs (4,100); K padded to a multiple of 16 (17, 40) or not
SHAPES = [(3968, 176, 64), (300, 130, 17), (200, 20, 64), (513, 64, 40), (1000, 1536, 32), (300, 4100, 16)]

pytestmark = pytest.mark.skipif(compiled_loops.library() is None,
                                reason="the form runs where the compiled loops are built")


def _host(name: str, monkeypatch: pytest.MonkeyPatch) -> HostGuard:
    if name == "this-host":
        return HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
    return emulated_guard(name, monkeypatch, mode="canonical")


def _tile_views(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> list[int]:
    """Let the tile views run where their check passes (``enabled``) or never (the canonical call); counts their
    calls. The checks start afresh (a verdict is kept per process)."""
    monkeypatch.setattr(gemm_arrangements, "_TILE_VIEWS_CHECKS", {})
    if not enabled:
        monkeypatch.setattr(gemm_arrangements, "_tile_views_agree", lambda *args: False)
    calls, checking = [], []
    real, real_check = gemm_arrangements._transposed_matmul_tile_views, gemm_arrangements._tile_views_agree

    def counted(*args, **kwargs):
        if not checking:  # the first-use check runs the form too: not counted
            calls.append(1)
        return real(*args, **kwargs)

    def check(*args):
        checking.append(1)
        try:
            return real_check(*args)
        finally:
            checking.pop()
    monkeypatch.setattr(gemm_arrangements, "_transposed_matmul_tile_views", counted)
    if enabled:
        monkeypatch.setattr(gemm_arrangements, "_tile_views_agree", check)
    return calls


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _weight_gradient(rows: int, n: int, k: int, host: HostGuard) -> torch.Tensor:
    return gemm_arrangements.transposed_matmul(_randn(rows, n, seed=rows + n), _randn(rows, k, seed=rows + k + 1),
                                               host, "linear")


@pytest.mark.parametrize("host_name", HOSTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_weight_gradient_on_tile_views_is_the_canonical_call(rows, n, k, threads, host_name, monkeypatch):
    with num_threads(threads):
        expected, out = form_and_canonical(monkeypatch, _tile_views,
                                           lambda patch: _weight_gradient(rows, n, k, _host(host_name, patch)))
    assert out.shape == (n, k) and torch.equal(out, expected)


@pytest.mark.parametrize("host_name", HOSTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_backward_on_tile_views_is_the_canonical_call(dtype, host_name, monkeypatch):
    """Through a linear layer's forward and backward (1,100 tokens: four 256-token chunks and a partial one; N = 200:
    four row tiles, the last partial), before and after an in-place update of its weight, at 1 and 2 threads: every
    output and gradient bit for bit as the canonical call's."""
    def steps() -> list[torch.Tensor]:
        ops = cpu_exact.with_host(_host(host_name, monkeypatch))
        return [t for threads in (1, 2) for t in _with_threads(threads, lambda: _steps(dtype, 1100, 96, 200, ops=ops))]
    with pytest.MonkeyPatch.context() as canonical:
        assert not (calls := _tile_views(canonical, enabled=False))
        expected = steps()
        assert not calls
    calls = _tile_views(monkeypatch, enabled=True)
    out = steps()
    assert len(calls) == 6  # three backward passes at each thread count
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


def test_tile_views_that_differ_keep_the_canonical_call(monkeypatch):
    """Counter-test: tiles made one ulp off are caught by the first-use check, and the canonical call runs (its bits);
    without the check they would have been used."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
    expected = _weight_gradient(1000, 200, 96, host)
    real = compiled_loops.library()

    class OneUlpOff:
        def __getattr__(self, name):
            return getattr(real, name)

        def reduction_tile_gemms(self, *args):
            out = real.reduction_tile_gemms(*args)
            return torch.nextafter(out, torch.full_like(out, float("inf")))
    monkeypatch.setattr(compiled_loops, "library", lambda: OneUlpOff())
    calls = _tile_views(monkeypatch, enabled=True)
    out = _weight_gradient(1000, 200, 96, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
    assert not calls and torch.equal(out, expected)
    monkeypatch.setattr(gemm_arrangements, "_tile_views_agree", lambda *args: True)
    wrong = _weight_gradient(1000, 200, 96, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
    assert calls == [1] and not torch.equal(wrong, expected)
