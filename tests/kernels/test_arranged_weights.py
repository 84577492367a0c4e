"""The canonical linear arrangement lays each weight out once per weight version, with the bits of laying it out per
call (``gemm_arrangements.arranged_weight``, ``laid_out_operand``).

What changed: the canonical tiles of ``tiled_matmul`` copied the weight on every call -- an input gradient's W.T
made contiguous, a padded or cast weight, and (bf16) the contiguous copy oneDNN's ``bmm`` makes of the shared,
transposed operand before its GEMM. Now each such copy is made once per weight version and kept; the bf16 tiles run
on the copy as ``bmm`` lays it out. Checked here, in mode ``canonical`` (what a host whose ``same_bits`` probes fail
runs), forward and backward, fp32 and bf16:

- the outputs and gradients equal, bit for bit, those of laying the weight out per call (nothing kept, ``bmm``
  making its own copy), before and after an in-place update of the weight;
- each weight is laid out once per version (counted), and an in-place update lays it out again;
- counter-test: an operand kept whatever the version (stale after the update) is caught;
- torch's bf16 ``bmm`` does copy the canonical operand where ``bmm_copies_operand`` says it does (the profiler sees
  the copy), and fp32's does not.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vexact_kernels import cpu_exact, gemm_arrangements
from vexact_kernels.host_guard import HostGuard

DTYPES = (torch.float32, torch.bfloat16)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _steps(dtype: torch.dtype, rows: int = 150, k: int = 64, n: int = 40) -> list[torch.Tensor]:
    """Two forward + backward passes of a canonical linear layer (N = 40: column padding), an in-place update of
    its weight, then a third: every output and gradient."""
    ops = cpu_exact.with_host(HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
    weight = _randn(n, k, dtype=dtype, seed=1, scale=0.1).requires_grad_()
    results = []
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                weight.mul_(1.5)  # in place: the version counter moves on
        x = _randn(rows, k, dtype=dtype, seed=10 + step).requires_grad_()
        y = ops.linear(x, weight)
        grads = torch.autograd.grad(y, [x, weight], _randn(rows, n, dtype=dtype, seed=20 + step))
        results += [y.detach(), *grads]
    return results


def _per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lay every operand out per call: nothing kept, and ``bmm`` making its own copy (the arrangement before)."""
    monkeypatch.setattr(gemm_arrangements, "ARRANGED_BYTES_MAX", 0)
    monkeypatch.setattr(gemm_arrangements, "bmm_copies_operand", lambda *args: False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kept_operands_give_the_bits_of_laying_out_per_call(dtype):
    kept = _steps(dtype)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _per_call(monkeypatch)
        fresh = _steps(dtype)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(kept, fresh))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_each_weight_is_laid_out_once_per_version(dtype, monkeypatch):
    made = []
    real = gemm_arrangements.arranged_weight

    def counting(weight, form, make):
        def counted():
            made.append(form[0])
            return make()
        return real(weight, form, counted)
    monkeypatch.setattr(gemm_arrangements, "arranged_weight", counting)
    _steps(dtype)
    # per version (once for the first, over two passes; once after the update): in fp32 the forward's padded
    # weight and the input gradient's W.T made contiguous; in bf16 the forward's W.T as bmm lays it out (the input
    # gradient's operand, so laid out, is W itself)
    expected = ["canonical", "canonical"] if dtype == torch.float32 else ["laid out"]
    assert made == expected * 2, made


def test_an_operand_kept_whatever_the_version_is_caught(monkeypatch):
    """Counter-test: keyed without the version counter, the update is missed and the third pass differs."""
    real = gemm_arrangements.arranged_weight
    stale = {}

    def ignore_version(weight, form, make):
        key = (id(weight if weight._base is None else weight._base), form, weight.stride())
        if key not in stale:
            stale[key] = real(weight, form, make)
        return stale[key]
    monkeypatch.setattr(gemm_arrangements, "arranged_weight", ignore_version)
    kept = _steps(torch.float32)
    monkeypatch.undo()
    with pytest.MonkeyPatch.context() as per_call:
        _per_call(per_call)
        fresh = _steps(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(kept[:6], fresh[:6]))
    assert not all(torch.equal(a, b) for a, b in zip(kept[6:], fresh[6:]))


def test_the_bound_keeps_nothing_beyond_it(monkeypatch):
    monkeypatch.setattr(gemm_arrangements, "ARRANGED_BYTES_MAX", 0)
    weight = _randn(40, 64, dtype=torch.float32, seed=1)
    operand = gemm_arrangements.canonical_operand(weight, torch.float32, 48)
    assert weight not in gemm_arrangements._ARRANGED
    assert torch.equal(operand[0, :, :40], weight.t()) and not operand[0, :, 40:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_bmm_copies_the_canonical_operand_where_the_rule_says(dtype):
    """What ``bmm_copies_operand`` claims of torch, seen by the profiler: one 64-row tile against the canonical
    operand (a weight [96, 128] seen transposed) copies a [1, 128, 96] operand in bf16 where the rule says so."""
    x = _randn(1, 64, 128, dtype=dtype, seed=3)
    operand = _randn(96, 128, dtype=dtype, seed=4).t().unsqueeze(0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.bmm(x, operand)
    copies = [e for e in prof.events() if e.name == "aten::copy_" and list(e.input_shapes[0]) == [1, 128, 96]]
    assert bool(copies) == gemm_arrangements.bmm_copies_operand(dtype, 64, 128, 96)
    if dtype == torch.float32:
        assert not copies
