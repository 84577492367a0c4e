"""Large fp32 linear layers on torch's oneDNN linear op (``host_guard.onednn_rows``): probed like ``gemm_rows``, never
assumed.

- A class of at least ``ONEDNN_MIN_WEIGHT`` weight elements takes oneDNN where its probe passes, and the linear
  layer's invariance contract holds on it: a row's bits do not depend on the number of rows in the call (1 to 130,
  one tile to three), at 1 and 2 threads; its values agree with ``x @ w.T`` to fp32 accuracy.
- A smaller class, a bf16 class and a guard that probes nothing (``fixed-order``, ``unguarded``) never try oneDNN;
  nor does any class with ``VEXACT_CPU_ONEDNN=off``, whose large class keeps the contract on ``torch.bmm``.
- A oneDNN whose rows depend on the call's row count (a broken op swapped in) fails its probe: the class runs
  ``torch.bmm``'s path instead, with no warning (no result had oneDNN's bits), and the contract still holds; one that
  fails only at a thread count seen later warns (results from before differ from those after) and moves too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import num_threads

from vexact_kernels import cpu_exact, gemm_linear, host_guard
from vexact_kernels.host_guard import (
    BMM_PATH,
    MACHINE_THREADS,
    ONEDNN_ENV,
    ONEDNN_MIN_WEIGHT,
    ONEDNN_PATH,
    ONEDNN_ROWS,
    HostGuard,
)

pytestmark = pytest.mark.skipif(not host_guard.onednn_available(),
                                reason="this torch build or CPU has no oneDNN linear op (the class keeps torch.bmm)")

K, N = 512, 512  # K x N = ONEDNN_MIN_WEIGHT: the smallest class that tries oneDNN
ROW_COUNTS = (1, 3, 8, 64, 65, 130)


def _inputs(rows: int = max(ROW_COUNTS), k: int = K, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5


def _records(host: HostGuard, prop: str) -> list[dict]:
    return [p for p in host.report()["probes"] if p["property"] == prop]


def _rows_depend_on_row_count(host: HostGuard, x: torch.Tensor, w: torch.Tensor) -> list[int]:
    """The row counts m at which tiled_matmul(x[:m]) differs from the first m rows of tiled_matmul(x)."""
    full = gemm_linear.tiled_matmul(x, w, host)
    return [m for m in ROW_COUNTS if not torch.equal(gemm_linear.tiled_matmul(x[:m], w, host), full[:m])]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_fp32_class_runs_onednn_and_keeps_the_row_invariance_contract(threads):
    assert K * N >= ONEDNN_MIN_WEIGHT
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    x, w = _inputs()
    with num_threads(threads):
        assert _rows_depend_on_row_count(host, x, w) == []
        out = gemm_linear.tiled_matmul(x, w, host)
    (record,) = _records(host, ONEDNN_ROWS)
    assert record["path"] == ONEDNN_PATH and record["passed"] is True
    assert _records(host, "gemm_rows") == []  # the class never ran torch.bmm
    # the same products in another order: agrees with x @ w.T to fp32 accuracy (K = 512 terms of size ~1)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)


def test_smaller_bf16_and_unprobed_classes_never_try_onednn():
    x, w = _inputs(k=256, n=512)  # K x N = 2^17: below the size
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    gemm_linear.tiled_matmul(x, w, host)
    assert _records(host, ONEDNN_ROWS) == [] and _records(host, "gemm_rows")
    x, w = _inputs()
    gemm_linear.tiled_matmul(x.bfloat16(), w.bfloat16(), host)
    assert _records(host, ONEDNN_ROWS) == []
    for mode in ("fixed-order", "unguarded"):
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        gemm_linear.tiled_matmul(x[:8], w, host)
        assert _records(host, ONEDNN_ROWS) == [], mode


@pytest.mark.parametrize("threads", [1, 2])
def test_onednn_off_sends_a_large_fp32_class_to_torch_bmm_with_the_same_contract(monkeypatch, threads):
    """``VEXACT_CPU_ONEDNN=off`` (the guard's ``onednn`` choice): the class is probed and run on ``torch.bmm`` alone,
    its rows still independent of the row count; the report names the choice; a bad value is one clear error."""
    monkeypatch.setenv(ONEDNN_ENV, "off")
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    assert host.onednn is False and host.report()["onednn"] == "off"
    x, w = _inputs()
    with num_threads(threads):
        assert _rows_depend_on_row_count(host, x, w) == []
    assert _records(host, ONEDNN_ROWS) == []
    (record,) = _records(host, "gemm_rows")
    assert record["path"] == "blas"
    monkeypatch.setenv(ONEDNN_ENV, "auto")
    assert HostGuard(cpu_exact.ROW_BLOCKS, mode="auto").report()["onednn"] == "auto"
    monkeypatch.setenv(ONEDNN_ENV, "mkl")
    with pytest.raises(ValueError, match=f"^{ONEDNN_ENV}='mkl': expected one of auto, off$"):
        HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")


def test_a_onednn_whose_rows_depend_on_the_call_fails_its_probe_and_the_class_runs_torch_bmm(monkeypatch):
    def by_row_count(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # every output depends on how many rows the call has: what the probe exists to catch
        rows = a.reshape(-1, a.shape[-1]).shape[0]
        return torch.nn.functional.linear(a, weight) * (1 + rows * 2.0 ** -20)

    monkeypatch.setattr(host_guard, "onednn_linear", by_row_count)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    x, w = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: no result had oneDNN's bits
        assert _rows_depend_on_row_count(host, x, w) == []
    (record,) = _records(host, ONEDNN_ROWS)
    assert record["path"] == BMM_PATH and record["passed"] is False and "rows differ" in record["failure"]
    (bmm_record,) = _records(host, "gemm_rows")
    assert bmm_record["path"] == "blas"
    # the op's path counts the class's torch.bmm record, not the failed oneDNN one
    assert cpu_exact.host_report(host)["ops"]["linear"]["path"] == "fast"


def test_a_onednn_that_fails_at_a_thread_count_seen_later_warns_and_the_class_moves_to_torch_bmm(monkeypatch):
    real = host_guard.onednn_linear
    later = MACHINE_THREADS + 1  # a count the first probe (1 thread and the machine's) does not check

    def off_at_the_later_count(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = real(a, weight)
        return out * (1 + 2.0 ** -20) if torch.get_num_threads() == later else out

    monkeypatch.setattr(host_guard, "onednn_linear", off_at_the_later_count)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    x, w = _inputs()
    with num_threads(1):
        before = gemm_linear.tiled_matmul(x, w, host)  # probed at 1 and the machine's count: passes
    assert _records(host, ONEDNN_ROWS)[0]["path"] == ONEDNN_PATH
    with num_threads(later), pytest.warns(RuntimeWarning, match="oneDNN's .* now run torch.bmm's path"):
        after = gemm_linear.tiled_matmul(x, w, host)  # the later count: checked before use, fails
    (record,) = _records(host, ONEDNN_ROWS)
    assert record["path"] == BMM_PATH and f"{later} threads" in record["failure"]
    assert _records(host, "gemm_rows")[0]["path"] == "blas"
    # results from before the change were oneDNN's, after it MKL's: other bits, which the warning says
    assert not torch.equal(before, after)
