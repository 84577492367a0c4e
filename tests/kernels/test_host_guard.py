"""The runtime guard of the exact CPU kernels (``vexact_kernels.host_guard``), made to fail on purpose.

The fast exact CPU paths rest on measured host properties: a BLAS GEMM gives a row the same bits in any
tile arrangement, and vectorised exp/log/cos give an element the same bits at any position. These tests
substitute primitives that break those properties -- as another CPU generation or BLAS might -- and show:

- the unguarded kernels then really are non-exact in the arrangement tested (so the checks can fail);
- the probe catches the broken property, warns once naming it, and reports the op's new path;
- the fixed-order fallback is still bitwise exact (rows alone == in a batch, decode == prefill,
  rollout log-probs == training log-probs), and the native backend mismatches in the same arrangement.

Exactness is asserted with torch.equal; accuracy of the fallback math against torch with stated tolerances.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from conftest import linear_with_gradients, num_threads, random_prompts, tiny_model

from vexact import generate, token_logprobs
from vexact_kernels import cpu_exact, fixed_order, gemm_linear, native
from vexact_kernels.host_guard import MACHINE_THREADS, MODE_ENV, PROBE_ROWS, HostGuard, mode_from_env


# --------------------------------------------------------------------------- broken primitives
# Each fake is a by-construction primitive (fixed_order) with one defect added, so what the probe sees
# is the defect alone, on any host: these tests must not depend on the host's own BLAS or libm.
def _nudge(t: torch.Tensor) -> torch.Tensor:
    """One ulp up: the smallest change a different reduction order or micro-kernel makes."""
    return torch.nextafter(t, torch.full_like(t, torch.inf))


def position_dependent_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM whose rows 2-3 of every 4 in a tile come out one ulp higher (a row's bits depend on where it
    sits, as with numpy/OpenBLAS on the AVX-512 host that broke CI; a decode step's rows sit at 0-1)."""
    out = fixed_order.bmm(a, b)
    moved = (torch.arange(a.shape[1]) // 2) % 2 == 1
    out[:, moved] = _nudge(out[:, moved])
    return out


def thread_dependent_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM one ulp higher whenever more than one torch thread runs (a thread-count-dependent BLAS)."""
    out = fixed_order.bmm(a, b)
    return _nudge(out) if torch.get_num_threads() > 1 else out


def position_dependent_exp(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """An exp one ulp higher at odd element positions (a vector body and a scalar tail that round apart)."""
    fixed_order.exp(x, out=out)
    out[1::2] = _nudge(out[1::2])
    return out


def position_dependent_sqrt(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A sqrt one ulp higher at odd element positions."""
    fixed_order.sqrt(x, out=out)
    out[1::2] = _nudge(out[1::2])
    return out


SOUND = dict(bmm=fixed_order.bmm, exp=fixed_order.exp, log=fixed_order.log, cos=fixed_order.cos,
             sqrt=fixed_order.sqrt)


SPLIT_K_FROM = 512


def intel_amx_like_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An emulated Intel Xeon (AMX-bf16) host's GEMM: fp32 operands as ``fixed_order.bmm``; bf16 operands with exact
    products, fp32 accumulation and one rounding to bf16 -- but at more than one thread, where the reduction is long
    (K >= ``SPLIT_K_FROM``) and the call's tiles do not divide evenly among the threads (three tiles at 2 threads),
    each tile's reduction is split between the threads (K's first third and the rest, added afterwards), as oneDNN's
    AMX kernels did there for a 768-token weight-gradient chunk in three row tiles. The guard's probe arrangements
    (1, 2, 4, ..., 48 tiles) never hit that case at 2 threads; a real call can."""
    if a.dtype != torch.bfloat16:
        return fixed_order.bmm(a, b)
    a, b = a.float(), b.float()
    threads, tiles, k = torch.get_num_threads(), a.shape[0], a.shape[2]
    if threads > 1 and k >= SPLIT_K_FROM and tiles > 1 and tiles % threads:
        cut = k // 3
        out = fixed_order.bmm(a[:, :, :cut], b[:, :cut]) + fixed_order.bmm(a[:, :, cut:], b[:, cut:])
    else:
        out = fixed_order.bmm(a, b)
    return out.to(torch.bfloat16)


_TORCH_BMM, _TORCH_MM = torch.bmm, torch.mm  # torch's own GEMMs, which the row-count host's wrap


def _rows_in_call_defect(out: torch.Tensor, rows: int) -> torch.Tensor:
    """``out`` one ulp higher, in place, where a GEMM call (or a batch entry) has more than ``PROBE_ROWS`` rows."""
    if rows > PROBE_ROWS:
        out.copy_(_nudge(out))
    return out


def rows_in_call_bmm(a: torch.Tensor, b: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch's bmm on an emulated host whose GEMM accumulates by the number of rows in the call (as an Intel Xeon's
    AMX-bf16 GEMM did: the guard's ``same_bits`` probe of linear tiles stacked in one GEMM failed there): rows of a
    batch entry of more than 64 rows come out one ulp higher. Tiles of at most 64 rows, the kernels' own, are
    torch's bits; so the ``gemm_rows`` probe passes and the faster arrangements' ``same_bits`` probes fail."""
    return _rows_in_call_defect(_TORCH_BMM(a, b, **kwargs), a.shape[1])


def rows_in_call_mm(a: torch.Tensor, b: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch's mm on the same emulated host: a call of more than 64 rows one ulp higher."""
    return _rows_in_call_defect(_TORCH_MM(a, b, **kwargs), a.shape[0])


@dataclass(frozen=True)
class EmulatedHost:
    """An emulated host: the guard's primitives (``HostGuard(**primitives)``), and torch's own GEMMs replaced
    (``torch_gemms``: name -> function) where the host's library GEMM is what is emulated -- the kernels call
    torch's GEMM themselves there (``HostGuard.library_gemm``), so the guard's bmm is torch's (replaced) one."""

    primitives: dict = field(default_factory=dict)
    torch_gemms: dict = field(default_factory=dict)


EMULATED_HOSTS = {"intel-amx": EmulatedHost(dict(SOUND, bmm=intel_amx_like_bmm)),
                  "rows-in-call": EmulatedHost(torch_gemms={"bmm": rows_in_call_bmm, "mm": rows_in_call_mm})}
"""Hosts the exactness tests also run on, on any CPU (``emulated_guard``)."""


def emulated_guard(name: str, monkeypatch: pytest.MonkeyPatch, mode: str = "auto") -> HostGuard:
    """A guard over the emulated host ``name``; its torch GEMMs replaced for the rest of the test (``monkeypatch``)."""
    host = EMULATED_HOSTS[name]
    for function, replacement in host.torch_gemms.items():
        monkeypatch.setattr(torch, function, replacement)
    library = {"bmm": torch.bmm} if "bmm" in host.torch_gemms else {}
    return HostGuard(cpu_exact.ROW_BLOCKS, mode=mode, **{**host.primitives, **library})


def emulated_ops(name: str, monkeypatch: pytest.MonkeyPatch, mode: str = "auto"):
    """``cpu_exact``'s ops over ``emulated_guard(name, monkeypatch, mode)``, as ``cpu_exact.ops_in_mode`` over this
    host's own."""
    return cpu_exact.with_host(emulated_guard(name, monkeypatch, mode))


def _guard(mode: str = "auto", **broken) -> HostGuard:
    """A guard over sound by-construction primitives, with the ``broken`` ones swapped in (mode given
    explicitly: these tests must not follow VEXACT_CPU_EXACT_PATH)."""
    return HostGuard(cpu_exact.ROW_BLOCKS, mode=mode, **{**SOUND, **broken})


def _rows_alone_vs_batch(linear, x: torch.Tensor, w: torch.Tensor) -> int:
    """How many rows of linear(x) differ from the same row computed alone."""
    full = linear(x, w)
    return sum(not torch.equal(linear(x[i : i + 1], w)[0], full[i]) for i in range(x.shape[0]))


def _linear_inputs(rows: int = 21, k: int = 48, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)


# --------------------------------------------------------------------------- the probes
def test_probe_catches_position_dependent_gemm():
    x, w = _linear_inputs()
    unguarded = cpu_exact.with_host(_guard(bmm=position_dependent_bmm, mode="unguarded"))
    assert _rows_alone_vs_batch(unguarded.linear, x, w) > 0, "the broken GEMM must break the unguarded kernel"

    guard = _guard(bmm=position_dependent_bmm)
    ops = cpu_exact.with_host(guard)
    with pytest.warns(RuntimeWarning, match="host property 'gemm_rows' failed for K=48 N=48"):
        full = ops.linear(x, w)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    torch.testing.assert_close(full, native.linear(x, w), atol=1e-5, rtol=1e-5)  # correct, not just invariant
    (probe,) = guard.report()["probes"]
    assert probe["path"] == "fixed-order" and probe["passed"] is False and "rows" in probe["failure"]
    assert cpu_exact.host_report(guard)["ops"]["linear"]["path"] == "fixed-order"


def test_probe_passes_a_correct_gemm_and_keeps_the_fast_path():
    # A GEMM that is invariant by construction must pass every arrangement of the probe.
    guard = _guard()
    x, w = _linear_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_exact.with_host(guard).linear(x, w)
    (probe,) = guard.report()["probes"]
    assert probe["passed"] is True and probe["path"] == "blas" and probe["ops"] == ["linear"]


def test_probe_catches_thread_dependent_gemm_at_first_use():
    """A GEMM that is right at 1 thread and wrong at more: the class keeps the library GEMM, always called with 1
    thread (``blas-1-thread``), so its rows are the 1-thread reference's at any thread count."""
    x, w = _linear_inputs()
    guard = _guard(bmm=thread_dependent_bmm)
    with num_threads(2), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to announce: the path is exact and fast
        at_two = cpu_exact.with_host(guard).linear(x, w)
    with num_threads(1):
        at_one = cpu_exact.with_host(guard).linear(x, w)
    assert torch.equal(at_one, at_two)
    (probe,) = guard.report()["probes"]
    assert probe["path"] == "blas-1-thread" and probe["passed"] is True and "2 threads vs 1" in probe["note"]
    unguarded = cpu_exact.with_host(_guard(mode="unguarded", bmm=thread_dependent_bmm))
    with num_threads(2):  # the counter-case: the same GEMM unguarded at 2 threads gives other bits
        assert not torch.equal(unguarded.linear(x, w), at_one)


def test_a_gemm_wrong_at_one_thread_too_still_falls_back_to_fixed_order():
    """The single-thread path is only for a GEMM whose every arrangement is right at 1 thread."""
    def thread_and_position_dependent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = position_dependent_bmm(a, b)
        return _nudge(out) if torch.get_num_threads() > 1 else out

    x, w = _linear_inputs()
    guard = _guard(bmm=thread_and_position_dependent)
    with num_threads(2), pytest.warns(RuntimeWarning, match="fixed-order"):
        cpu_exact.with_host(guard).linear(x, w)
    assert guard.report()["probes"][0]["path"] == "fixed-order"


def test_the_machines_thread_count_is_probed_at_first_use():
    """First use at 1 thread: the probe also runs the arrangements at the machine's thread count, so a GEMM that is
    right at 1 thread and wrong at more is caught before any result exists (threads then change no bit)."""
    x, w = _linear_inputs()
    guard = _guard(bmm=thread_dependent_bmm)
    with num_threads(1):
        at_one = cpu_exact.with_host(guard).linear(x, w)
    (probe,) = guard.report()["probes"]
    assert probe["path"] == "blas-1-thread" and probe["threads_checked"] == [1, MACHINE_THREADS]
    assert f"{MACHINE_THREADS} threads vs 1" in probe["note"]
    with num_threads(2):
        assert torch.equal(cpu_exact.with_host(guard).linear(x, w), at_one)


def test_a_thread_count_seen_later_is_verified_before_use():
    """A count beyond the machine's (set by hand) is verified at its first use; a failure there that 1 thread does
    not show switches the class to the single-thread library path, whose rows are those computed before."""
    x, w = _linear_inputs()
    beyond = MACHINE_THREADS + 1

    def broken_beyond_the_machine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = fixed_order.bmm(a, b)
        return _nudge(out) if torch.get_num_threads() > MACHINE_THREADS else out

    guard = _guard(bmm=broken_beyond_the_machine)
    ops = cpu_exact.with_host(guard)
    with num_threads(1):
        ops.linear(x, w)  # at 1 thread and at the machine's count the broken GEMM is still right: the probe passes
    assert guard.report()["probes"][0]["path"] == "blas"
    with num_threads(1):
        before = ops.linear(x, w)
    with num_threads(beyond):
        at_more = ops.linear(x, w)
    (probe,) = guard.report()["probes"]
    assert probe["path"] == "blas-1-thread" and probe["threads_checked"] == [1, MACHINE_THREADS, beyond]
    assert torch.equal(at_more, before)
    with num_threads(1):
        assert torch.equal(ops.linear(x, w), at_more)  # from now on one path for every thread count


def test_a_later_thread_count_checks_the_reference_computed_again_against_the_first():
    """The guard holds each class's 1-thread reference as a digest, not a tensor (a vocabulary-wide class's is tens
    of MB, held for the process); a thread count seen later computes the reference again. A GEMM whose 1-thread bits
    moved since first use (every arrangement moved with them, so they all agree with the new reference) fails there:
    the moved reference is not taken as the reference."""
    x, w = _linear_inputs()
    moved = []

    def moves_after_first_use(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = fixed_order.bmm(a, b)
        return _nudge(out) if moved else out

    guard = _guard(bmm=moves_after_first_use)
    ops = cpu_exact.with_host(guard)
    with num_threads(1):
        ops.linear(x, w)
    assert guard.report()["probes"][0]["path"] == "blas"
    assert all(record.reference is None for record in guard._records.values())  # no probe output held
    moved.append(True)
    with num_threads(MACHINE_THREADS + 1), pytest.warns(RuntimeWarning, match="reference computed again differs"):
        ops.linear(x, w)
    (probe,) = guard.report()["probes"]
    assert probe["path"] == "fixed-order" and probe["passed"] is False


def test_probe_catches_position_dependent_exp():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 301, generator=g) * 4
    unguarded = cpu_exact.with_host(_guard(exp=position_dependent_exp, mode="unguarded"))
    full = unguarded.log_softmax(logits)
    assert any(not torch.equal(unguarded.log_softmax(logits[i : i + 1])[0], full[i]) for i in range(9))

    guard = _guard(exp=position_dependent_exp)
    ops = cpu_exact.with_host(guard)
    with pytest.warns(RuntimeWarning, match="elementwise_exp"):
        full = ops.log_softmax(logits)
    for i in range(9):
        assert torch.equal(ops.log_softmax(logits[i : i + 1])[0], full[i])
    torch.testing.assert_close(full, native.log_softmax(logits), atol=1e-5, rtol=1e-5)
    assert cpu_exact.host_report(guard)["ops"]["log_softmax"]["path"] == "mixed"  # exp fixed-order, log fast


def test_probe_catches_position_dependent_sqrt():
    """RMSNorm's sqrt is a library function (not the IEEE operation on every host): a position-dependent one breaks
    the unguarded kernel's row independence; the guard catches it and falls back to ``fixed_order.sqrt``."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(33, 64, generator=g) * 3, torch.randn(64, generator=g)
    unguarded = cpu_exact.with_host(_guard(sqrt=position_dependent_sqrt, mode="unguarded"))
    full = unguarded.rms_norm(x, w, 1e-6)
    assert any(not torch.equal(unguarded.rms_norm(x[i : i + 1], w, 1e-6)[0], full[i]) for i in range(33))

    guard = _guard(sqrt=position_dependent_sqrt)
    ops = cpu_exact.with_host(guard)
    with pytest.warns(RuntimeWarning, match="elementwise_sqrt"):
        full = ops.rms_norm(x, w, 1e-6)
    for i in range(33):
        assert torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-6)[0], full[i])
    torch.testing.assert_close(full, native.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert cpu_exact.host_report(guard)["ops"]["rms_norm"]["path"] == "fixed-order"


def test_fixed_order_sqrt_is_correctly_rounded_in_fp32():
    """fp32: every root the correctly rounded one (numpy's sqrt is the IEEE operation); fp64: within an ulp. Over
    80 decades, subnormals and the special values. (torch's own CPU sqrt is not correctly rounded everywhere.)"""
    g = torch.Generator().manual_seed(8)
    for dtype, bits, ulps in ((torch.float32, torch.int32, 0), (torch.float64, torch.int64, 1)):
        x = (torch.rand(300000, generator=g, dtype=torch.float64)
             * 10.0 ** torch.randint(-40, 39, (300000,), generator=g).double()).to(dtype)
        special = [0.0, -0.0, torch.inf, 1.0, 2.0, 4.0, 1e-45 if dtype == torch.float32 else 5e-324, 3e38]
        x = torch.cat([x, torch.tensor(special, dtype=dtype)])
        got, ieee = fixed_order.sqrt(x), torch.from_numpy(np.sqrt(x.numpy()))
        assert int((got.view(bits) - ieee.view(bits)).abs().max()) <= ulps
        assert torch.equal(torch.signbit(got), torch.signbit(ieee))
    assert torch.isnan(fixed_order.sqrt(torch.tensor([-1.0, torch.nan]))).all()


def test_probe_catches_a_broken_attention_gemm_and_decode_still_equals_prefill():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, h, 16, generator=g) for h in (4, 2, 2))
    start = torch.tensor([0, 0])
    unguarded = cpu_exact.with_host(_guard(bmm=position_dependent_bmm, mode="unguarded"))
    guard = _guard(bmm=position_dependent_bmm)
    guarded = cpu_exact.with_host(guard)

    def decode_differs(ops) -> int:
        prefill = ops.attention(q, k, v, start, 0.25)
        return sum(not torch.equal(ops.attention(q[:, t : t + 1], k, v, torch.tensor([t, t]), 0.25)[:, 0],
                                   prefill[:, t]) for t in (0, 1, 5, 63, 64, 69))

    assert decode_differs(unguarded) > 0
    with pytest.warns(RuntimeWarning, match="gemm_rows"):
        assert decode_differs(guarded) == 0
    assert {p["path"] for p in guard.report()["probes"] if p["property"] == "gemm_rows"} == {"fixed-order"}


# --------------------------------------------------------------------------- end to end
def _mismatched_tokens(model, prompts, threads_rollout: int = 1, threads_scoring: int = 2, ops=None) -> int:
    with num_threads(threads_rollout):
        rollouts = [generate(model, prompts, max_new_tokens=12, seed=7, batch_size=bs, ops=ops) for bs in (None, 3)]
    mismatched = 0
    with num_threads(threads_scoring):
        for rollout in rollouts:
            for micro_batch_size in (None, 4):
                with torch.no_grad():
                    scored = token_logprobs(model, prompts, rollout.tokens, micro_batch_size=micro_batch_size,
                                            ops=ops)
                mismatched += sum(int((a != b).sum()) for a, b in zip(rollout.logprobs, scored))
    return mismatched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_equals_training_on_a_broken_host(dtype):
    """Every GEMM, exp and sqrt broken at once: the guarded model stays exact; unguarded and native do not."""
    prompts = random_prompts(10, 30, seed=2)
    broken = dict(bmm=position_dependent_bmm, exp=position_dependent_exp, sqrt=position_dependent_sqrt)
    model = tiny_model("exact", dtype)
    assert _mismatched_tokens(model, prompts, ops=cpu_exact.with_host(_guard(mode="unguarded", **broken))) > 0

    guard = _guard(**broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one per shape class; checked in the tests above
        assert _mismatched_tokens(model, prompts, ops=cpu_exact.with_host(guard)) == 0
    paths = {p["property"]: p["path"] for p in guard.report()["probes"]}
    assert paths == {"gemm_rows": "fixed-order", "elementwise_exp": "fixed-order", "elementwise_log": "vectorised",
                     "elementwise_sqrt": "fixed-order"}

    assert _mismatched_tokens(tiny_model("native", dtype), prompts) > 0  # the arrangement can detect TIM


@pytest.mark.parametrize("host", list(EMULATED_HOSTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_equals_training_on_each_emulated_host(dtype, host, monkeypatch):
    """Rollout at 1 and 2 threads, scoring at 2 and 1, on an emulated host's primitives (guard in auto): exact."""
    model = tiny_model("exact", dtype)
    ops = emulated_ops(host, monkeypatch)
    for rollout_threads, scoring_threads in ((1, 2), (2, 1)):
        assert _mismatched_tokens(model, random_prompts(10, 30, seed=8), threads_rollout=rollout_threads,
                                  threads_scoring=scoring_threads, ops=ops) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gemm_accumulating_by_rows_in_the_call_keeps_the_canonical_tiles(dtype, monkeypatch):
    """The rows-in-call host (as the Intel AMX Xeon): its ``same_bits`` probe of a linear layer's tiles stacked in one
    GEMM fails, so the guard (mode auto) keeps the canonical tiles -- whose rows are this host's canonical bits (mode
    ``canonical`` before the defect is emulated), alone or in a batch; trusted (``unguarded``), the stacked GEMM
    gives other bits (the defect is real)."""
    x, w = (t.to(dtype) for t in _linear_inputs(rows=150, k=64, n=48))  # three 64-row tiles
    reference = cpu_exact.ops_in_mode("canonical").linear(x, w)
    guard = emulated_guard("rows-in-call", monkeypatch)
    ops = cpu_exact.with_host(guard)
    assert torch.equal(ops.linear(x, w), reference)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    stacked = [p for p in guard.report()["probes"] if p["shape_class"].startswith("linear tiles stacked")
               and p["shape_class"].split(": ")[1].startswith("3x64")]
    assert stacked and all(p["path"] == "canonical" and p["passed"] is False for p in stacked), stacked
    trusted = emulated_ops("rows-in-call", monkeypatch, mode="unguarded")
    assert not torch.equal(trusted.linear(x, w), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fixed_order_mode_is_exact_end_to_end(dtype):
    """``VEXACT_CPU_EXACT_PATH=fixed-order``: no host property relied on at all, still bit for bit."""
    guard = _guard(mode="fixed-order")
    model = tiny_model("exact", dtype)
    assert _mismatched_tokens(model, random_prompts(10, 30, seed=3), threads_rollout=2, threads_scoring=1,
                              ops=cpu_exact.with_host(guard)) == 0
    assert guard.report()["probes"] and all(p["passed"] is None for p in guard.report()["probes"])


# --------------------------------------------------------------------------- the fallback math
def test_fixed_order_ops_match_native():
    ops = cpu_exact.with_host(_guard(mode="fixed-order"))
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(37, 90, generator=g), torch.randn(70, 90, generator=g), torch.randn(70, generator=g)
    torch.testing.assert_close(ops.linear(x, w, b), native.linear(x, w, b), atol=1e-5, rtol=1e-5)
    logits = torch.randn(5, 1000, generator=g) * 4
    torch.testing.assert_close(ops.log_softmax(logits), native.log_softmax(logits), atol=1e-5, rtol=1e-5)
    gate, up = torch.randn(2, 300, generator=g) * 4
    torch.testing.assert_close(ops.silu_mul(gate, up), native.silu_mul(gate, up), atol=1e-6, rtol=1e-6)


def test_fixed_order_math_accuracy_and_special_values():
    g = torch.Generator().manual_seed(7)
    x32 = torch.rand(200000, generator=g) * 190 - 100  # exp: 2 ulps relative, 2 subnormal ulps absolute
    torch.testing.assert_close(fixed_order.exp(x32), torch.exp(x32), rtol=2.4e-7, atol=3e-45)
    pos32 = torch.exp(torch.rand(200000, generator=g) * 160 - 80)  # log: 4e-7 absolute
    torch.testing.assert_close(fixed_order.log(pos32), torch.log(pos32), rtol=0, atol=4e-7)
    u64 = torch.rand(200000, generator=g, dtype=torch.float64)
    torch.testing.assert_close(fixed_order.log(u64), torch.log(u64), rtol=1e-15, atol=1e-15)
    angle = 2 * torch.pi * u64
    torch.testing.assert_close(fixed_order.cos(angle), torch.cos(angle), rtol=0, atol=1e-15)
    special = torch.tensor([0.0, -0.0, -torch.inf, torch.inf, torch.nan, 100.0, -120.0])
    torch.testing.assert_close(fixed_order.exp(special), torch.exp(special), equal_nan=True, rtol=0, atol=0)
    special = torch.tensor([0.0, 1.0, torch.inf, -1.0, torch.nan])
    torch.testing.assert_close(fixed_order.log(special), torch.log(special), equal_nan=True, rtol=0, atol=0)


def test_fixed_order_bmm_blocking_does_not_change_bits(monkeypatch):
    """Whole tiles, row blocks or column blocks per product block: one tree per element, the same bits."""
    g = torch.Generator().manual_seed(9)
    a, w = torch.randn(3, 8, 100, generator=g), torch.randn(37, 100, generator=g)
    per_tile = torch.randn(3, 100, 37, generator=g)
    for b in (w.t().expand(3, 100, 37), per_tile):
        reference = fixed_order.bmm(a, b)
        for block in (100 * 37 * 8 * 2, 100 * 37 + 1, 300):  # whole tiles, row blocks, column blocks
            monkeypatch.setattr(fixed_order, "PRODUCT_BLOCK", block)
            assert torch.equal(fixed_order.bmm(a, b), reference)
        monkeypatch.undo()


def test_fixed_order_bmm_is_invariant_by_construction():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(64, 200, generator=g), torch.randn(200, 33, generator=g)
    reference = fixed_order.bmm(a.view(1, 64, 200), b.expand(1, 200, 33))[0]
    for height in (1, 4, 64):
        tiles = a.view(-1, height, 200)
        assert torch.equal(fixed_order.bmm(tiles, b.expand(tiles.shape[0], 200, 33)).reshape(64, 33), reference)
    assert torch.equal(fixed_order.bmm(a.flip(0).view(1, 64, 200), b.expand(1, 200, 33))[0].flip(0), reference)


# --------------------------------------------------------------------------- configuration
def test_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "fixed-order")
    assert mode_from_env() == "fixed-order"
    monkeypatch.setenv(MODE_ENV, "canonical")
    assert mode_from_env() == "canonical"
    monkeypatch.setenv(MODE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{MODE_ENV}='fast': expected one of auto, canonical, fixed-order$"):
        mode_from_env()
    monkeypatch.setenv(MODE_ENV, "unguarded")  # tests only: not a user's choice
    with pytest.raises(ValueError, match="expected one of auto, canonical, fixed-order"):
        mode_from_env()
    with pytest.raises(ValueError, match="unknown function 'tanh'"):
        _guard(mode="auto").elementwise("tanh", torch.float32, op="x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_canonical_mode_probes_the_library_but_takes_no_same_bits_arrangement(dtype):
    """``VEXACT_CPU_EXACT_PATH=canonical``: the library properties are probed as in auto, every ``same_bits``
    arrangement is declined (what a host whose same_bits probes fail gets), and the bits are auto's: a forward and
    backward of a linear layer large enough for the faster arrangements, and rollout == training end to end."""
    results, reports = {}, {}
    for mode in ("auto", "canonical"):
        guard = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        ops = cpu_exact.with_host(guard)
        g = torch.Generator().manual_seed(12)
        x = torch.randn(300, 96, generator=g).to(dtype)
        w = (torch.randn(176, 96, generator=g) * 0.1).to(dtype)
        grad_output = torch.linspace(-1, 1, 300 * 176).view(300, 176).to(dtype)
        results[mode] = linear_with_gradients(ops.linear, x, w, grad_output)
        reports[mode] = guard.report()["probes"]
        assert _mismatched_tokens(tiny_model("exact", dtype), random_prompts(6, 20, seed=9), ops=ops) == 0
    assert all(torch.equal(a, b) for a, b in zip(results["auto"], results["canonical"]))
    canonical = reports["canonical"]
    assert all(p["path"] == "canonical" and p["passed"] is None for p in canonical if p["property"] == "same_bits")
    assert any(p["property"] == "same_bits" for p in canonical), "the shapes must reach a same_bits arrangement"
    assert all(p["passed"] is not None for p in canonical if p["property"] != "same_bits"), "probed as in auto"


# --------------------------------------------------------------------------- bf16 GEMM classes
# A bf16 GEMM class runs the host's GEMM in bf16 (exact products, fp32 accumulation, one rounding) where its probe
# finds it invariant; elsewhere it computes in fp32 from upcast operands (``fp32-upcast``), never the host's bf16
# GEMM. The fakes below are fp32-accumulating bf16 GEMMs (``fixed_order.bmm`` of the upcast operands, rounded once)
# with one defect each, and record which dtypes reached them.
def _bf16_gemm(seen: list | None = None, defect=None):
    """A bmm that is ``fixed_order.bmm`` for fp32 operands and, for bf16 ones, the same in fp32 rounded once to bf16
    (``defect(a, b)`` instead where given); ``seen`` collects the operand dtype of every call."""
    def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if seen is not None:
            seen.append(a.dtype)
        if a.dtype != torch.bfloat16:
            return fixed_order.bmm(a, b)
        out = defect(a, b) if defect is not None else fixed_order.bmm(a.float(), b.float())
        return out.to(torch.bfloat16)
    return bmm


def _height_dependent_accumulation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation whose order depends on the tile height: tiles of fewer than 64 rows add K's first third and
    the rest separately, as a micro-kernel for short tiles with another K blocking would. Rounded to bf16, this changes
    about 1 in 10^4 outputs of random data -- and most of the probe's order-revealing ones."""
    a, b = a.float(), b.float()
    if a.shape[1] == 64:
        return fixed_order.bmm(a, b)
    cut = a.shape[2] // 3
    return fixed_order.bmm(a[:, :, :cut], b[:, :cut]) + fixed_order.bmm(a[:, :, cut:], b[:, cut:])


def _few_rows_call_accumulation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation whose order depends on the rows in the whole call: a call of at most 32 rows (one short tile
    alone) adds K's first third and the rest separately, any call of more rows in one order -- as oneDNN's bf16 GEMM on
    an Intel Xeon with AMX does (another kernel below 33 rows), which short tiles side by side in one call never
    show."""
    a, b = a.float(), b.float()
    if a.shape[0] * a.shape[1] > 32:
        return fixed_order.bmm(a, b)
    cut = a.shape[2] // 3
    return fixed_order.bmm(a[:, :, :cut], b[:, :cut]) + fixed_order.bmm(a[:, :, cut:], b[:, cut:])


def _position_dependent_accumulation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation whose order depends on a row's position in its tile: rows 2-3 of every 4 add K's first
    third and the rest separately. Rounded to bf16, this changes about 1 in 10^4 outputs of random data."""
    a, b = a.float(), b.float()
    out = fixed_order.bmm(a, b)
    cut = a.shape[2] // 3
    moved = (torch.arange(a.shape[1]) // 2) % 2 == 1
    rows = a[:, moved]
    out[:, moved] = fixed_order.bmm(rows[:, :, :cut], b[:, :cut]) + fixed_order.bmm(rows[:, :, cut:], b[:, cut:])
    return out


def _thread_dependent_accumulation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Right at 1 thread; at more, K's first third and the rest are added separately (as a BLAS that splits a
    reduction between threads): rounded to bf16, a change in few outputs of random data."""
    a, b = a.float(), b.float()
    if torch.get_num_threads() == 1:
        return fixed_order.bmm(a, b)
    cut = a.shape[2] // 3
    return fixed_order.bmm(a[:, :, :cut], b[:, :cut]) + fixed_order.bmm(a[:, :, cut:], b[:, cut:])


def _bf16_paths(guard: HostGuard) -> set[str]:
    return {c["path"] for c in cpu_exact.host_report(guard)["library_dtype_gemm"]}


def _order_revealing_linear_inputs(rows: int = 64, k: int = 48, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    from vexact_kernels.host_guard import order_revealing

    g = torch.Generator().manual_seed(11)
    x, w = order_revealing(torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), 11)
    return x.bfloat16(), w.bfloat16()


def test_bf16_gemm_invariant_host_runs_the_bf16_gemm_and_rollout_equals_training():
    seen: list = []
    guard = _guard(bmm=_bf16_gemm(seen))
    model = tiny_model("exact", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing failed: nothing to announce
        assert _mismatched_tokens(model, random_prompts(10, 30, seed=4), ops=cpu_exact.with_host(guard)) == 0
    assert torch.bfloat16 in seen  # the host's bf16 GEMM ran
    assert _bf16_paths(guard) == {"blas"}
    assert all(p["passed"] for p in guard.report()["probes"] if p.get("fallback") == "fp32-upcast")


def test_bf16_gemm_with_a_position_dependent_accumulation_order_falls_back_to_fp32_and_stays_exact():
    x, w = _order_revealing_linear_inputs()
    unguarded = cpu_exact.with_host(_guard(mode="unguarded", bmm=_bf16_gemm(defect=_position_dependent_accumulation)))
    revealed = _rows_alone_vs_batch(unguarded.linear, x, w)
    assert revealed > 0, "the defect must break the unguarded bf16 kernel"
    # on plain random data the same defect shows in hardly any bf16 output: why the probe reveals the order
    plain_x, plain_w = (t.bfloat16() for t in _linear_inputs(rows=64))
    assert _rows_alone_vs_batch(unguarded.linear, plain_x, plain_w) < revealed

    seen: list = []
    guard = _guard(bmm=_bf16_gemm(seen, defect=_position_dependent_accumulation))
    ops = cpu_exact.with_host(guard)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 from upcast operands is as exact: no warning
        full = ops.linear(x, w)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    assert torch.equal(full, cpu_exact.with_host(_guard(mode="fixed-order")).linear(x, w))  # today's fp32 path
    (bf16_class,) = [p for p in guard.report()["probes"] if p.get("fallback") == "fp32-upcast"]
    assert bf16_class["path"] == "fp32-upcast" and bf16_class["passed"] is False
    assert "rows" in bf16_class["failure"] and "computes in fp32" in bf16_class["note"]
    assert cpu_exact.host_report(guard)["ops"]["linear"]["path"] == "fast"  # the fp32 class's own path
    probes_seen = len(seen)
    ops.linear(x, w)
    assert torch.bfloat16 not in seen[probes_seen:]  # after the probe, the bf16 GEMM never runs

    model = tiny_model("exact", torch.bfloat16)
    guard = _guard(bmm=_bf16_gemm(defect=_position_dependent_accumulation))
    assert _mismatched_tokens(model, random_prompts(10, 30, seed=5), ops=cpu_exact.with_host(guard)) == 0
    assert _bf16_paths(guard) == {"fp32-upcast"}


def test_bf16_gemm_whose_short_tiles_accumulate_otherwise_keeps_the_tall_tiles():
    """A bf16 GEMM right in 64-row tiles only: as for fp32, the class keeps the tile heights whose rows equal the
    reference's (here 64 alone) and runs the host's bf16 GEMM in those."""
    x, w = _order_revealing_linear_inputs()
    guard = _guard(bmm=_bf16_gemm(defect=_height_dependent_accumulation))
    ops = cpu_exact.with_host(guard)
    ops.linear(x, w)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    (bf16_class,) = [p for p in guard.report()["probes"] if p.get("fallback") == "fp32-upcast"]
    assert bf16_class["path"] == "blas" and bf16_class["tile_heights"] == [64]


def test_bf16_gemm_whose_few_row_calls_accumulate_otherwise_keeps_the_tall_tiles():
    """A bf16 GEMM whose call of at most 32 rows takes another kernel: short tiles side by side in one call (64 rows)
    give the reference's bits, one short tile alone does not. The probe tries each height alone too (the call a decode
    step makes), so the class keeps the tiles above 32 rows (48 and 64), and a decode-sized batch gets the rows a
    training batch gets -- multiplied as one 48-row tile."""
    x, w = _order_revealing_linear_inputs()
    guard = _guard(bmm=_bf16_gemm(defect=_few_rows_call_accumulation))
    ops = cpu_exact.with_host(guard)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    (bf16_class,) = [p for p in guard.report()["probes"] if p.get("fallback") == "fp32-upcast"]
    assert bf16_class["path"] == "blas" and bf16_class["tile_heights"] == [48, 64]
    assert gemm_linear.tiled_rows(x[:8], w, guard) == 48


def _second_tile_of_48_accumulates_otherwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation whose order differs in every 48-row tile after a call's first (a kernel that blocks a call's
    rows by 64 and so splits the second 48-row tile): one 48-row tile alone is right, 48-row tiles side by side are
    not."""
    a, b = a.float(), b.float()
    out = fixed_order.bmm(a, b)
    if a.shape[1] == 48 and a.shape[0] > 1:
        cut = a.shape[2] // 3
        out[1:] = fixed_order.bmm(a[1:, :, :cut], b[1:, :cut]) + fixed_order.bmm(a[1:, :, cut:], b[1:, cut:])
    return out


def test_a_tile_height_that_does_not_divide_the_probe_rows_is_probed_side_by_side_too():
    """48 does not divide the probe's 64 rows: its side-by-side arrangement is two overlapping tiles (rows 0-47 and
    16-63), each compared with the reference's rows. A GEMM that gets only the second tile wrong loses height 48 (and
    keeps the others); the kernels then pad 33-48 rows to 64."""
    x, w = _order_revealing_linear_inputs()
    guard = _guard(bmm=_bf16_gemm(defect=_second_tile_of_48_accumulates_otherwise))
    ops = cpu_exact.with_host(guard)
    assert _rows_alone_vs_batch(ops.linear, x, w) == 0
    (bf16_class,) = [p for p in guard.report()["probes"] if p.get("fallback") == "fp32-upcast"]
    assert bf16_class["path"] == "blas" and bf16_class["tile_heights"] == [4, 8, 16, 32, 64]
    assert gemm_linear.tiled_rows(x[:40], w, guard) == 64


@pytest.mark.parametrize("row_blocks", [(8, 4, 64), (4, 40, 64), (4, 4, 64)])
def test_tile_heights_must_ascend_and_divide_the_probe_crowd(row_blocks: tuple[int, ...]):
    """Tile heights the probe cannot place: unsorted, repeated, or not dividing its 192-row crowd (40) -- one error."""
    with pytest.raises(ValueError, match="ascending tile heights"):
        HostGuard(row_blocks, mode="auto")


def test_bf16_gemm_right_only_at_one_thread_runs_at_one_thread_and_stays_exact():
    guard = _guard(bmm=_bf16_gemm(defect=_thread_dependent_accumulation))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _mismatched_tokens(tiny_model("exact", torch.bfloat16), random_prompts(10, 30, seed=6),
                                  ops=cpu_exact.with_host(guard)) == 0
    assert _bf16_paths(guard) == {"blas-1-thread"}


def test_fixed_order_mode_never_runs_the_bf16_gemm():
    seen: list = []
    guard = _guard(mode="fixed-order", bmm=_bf16_gemm(seen))
    x, w = _order_revealing_linear_inputs()
    x.requires_grad_(), w.requires_grad_()
    cpu_exact.with_host(guard).linear(x, w).sum().backward()
    assert not seen and _bf16_paths(guard) == {"fp32-upcast"}  # fixed_order.bmm itself, in fp32


def test_bf16_linear_with_a_bias_computes_in_fp32():
    """A bias is added in fp32 before the one rounding; a bf16 GEMM's output is rounded already."""
    seen: list = []
    guard = _guard(bmm=_bf16_gemm(seen))
    x, w = _order_revealing_linear_inputs()
    bias = torch.randn(w.shape[0]).bfloat16()
    cpu_exact.with_host(guard).linear(x, w, bias)
    assert torch.bfloat16 not in seen


def test_bf16_gradients_are_thread_invariant_on_the_bf16_gemm():
    """Forward, input and weight gradients on the host's own bf16 GEMM (torch's): the same bits at 1 and 2 threads;
    the weight gradient of one 256-token chunk too."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    ops = cpu_exact.with_host(guard)
    results = []
    for threads in (1, 2):
        x, w = (t.detach().requires_grad_() for t in _order_revealing_linear_inputs(rows=200, k=64, n=48))
        with num_threads(threads):
            out = ops.linear(x, w)
            out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert _bf16_paths(guard) <= {"blas", "blas-1-thread", "fp32-upcast"}


@pytest.mark.parametrize("rows, chunk, gemm_dtype", [(300, 512, torch.bfloat16), (700, 768, torch.bfloat16),
                                                     (1100, 256, torch.float32)])
def test_a_bf16_weight_gradient_is_one_chunk_up_to_library_reduce_max(rows, chunk, gemm_dtype):
    """A bf16 weight gradient of up to ``LIBRARY_REDUCE_MAX`` tokens reduces them in one chunk on the host's bf16 GEMM
    (its length padded to a multiple of 256: one rounding, as native bf16); beyond, 256-token chunks in fp32, whose
    partial sums a bf16 GEMM could not return. (``test_linear_backward_contract`` checks the thread invariance of a
    700-token bf16 weight gradient on torch's own GEMM.)"""
    from vexact_kernels.gemm_tiles import LIBRARY_REDUCE_MAX

    calls: list = []

    def recording(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.dtype, a.shape[-1]))
        return _bf16_gemm()(a, b)

    guard = _guard(bmm=recording)
    x, w = (t.detach().requires_grad_() for t in _order_revealing_linear_inputs(rows=rows, k=48, n=40))
    out = cpu_exact.with_host(guard).linear(x, w)
    grad = torch.ones_like(out)
    calls.clear()
    out.backward(grad)
    reductions = {(dtype, k) for dtype, k in calls if k in (256, 512, 768, 1024)}  # the weight gradient's K: tokens
    assert reductions == {(gemm_dtype, chunk)}, reductions
    assert (rows <= LIBRARY_REDUCE_MAX) == (gemm_dtype == torch.bfloat16)
    assert w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad).all()
