"""A linear layer's decisions are made once per call key and kept (``gemm_linear.TiledPlan``): no bit depends on
whether its plan was made or found.

What changed: ``tiled_matmul`` asked the guard its questions, chose the arrangement and the tile height, and looked up
the weight's operand on every call (a dozen µs of Python per call, on the default model more than its GEMM). Now the
decisions for one call key (x's shape and dtype, the weight's identity, layout and dtype, the guard's state, the op,
the thread count) are made once and a repeated call runs the GEMM; a new version of the weight keeps its plans and
lays out their operands again. Checked here:

- linear forward and backward through plans made afresh on every call (cold) and through plans made once and found
  (warm): every output and gradient bitwise equal, fp32 and bf16, 1 and 2 threads, on this host in ``auto`` and in
  ``canonical`` and on the emulated rows-in-call host (whose GEMM gives a row other bits in another call shape); the
  warm pass made no plan (so it did run on found plans);
- an in-place update of the weight (its version counter) keeps the plan and lays out (and packs) its operand
  again, with the fresh bits; counter-test: the plan run with what it held for the old version gives other bits;
- another thread count and a guard whose answer changed (a class failing at a thread count checked later:
  ``HostGuard.epoch``) each make a new plan, with the fresh bits;
- a weight's plans go with the weight.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
from conftest import num_threads
from test_host_guard import SOUND, _nudge, emulated_guard

from vexact_kernels import compiled_loops, cpu_exact, gemm_linear, gemm_packed, gemm_weight_gradient
from vexact_kernels.host_guard import MACHINE_THREADS, SINGLE_THREAD_PATH, HostGuard

DTYPES = (torch.float32, torch.bfloat16)
HOSTS = ("auto", "canonical", "rows-in-call")
# (rows, K, N): a decode step's rows (one tile of 8; 128), padded columns (N = 40, the default model's LM head's 22),
# several 64-row tiles, a training batch's 62 tiles
CALLS = [(8, 64, 176), (8, 64, 22), (128, 64, 64), (37, 48, 40), (300, 176, 64), (3968, 64, 64)]


def _host(name: str, monkeypatch: pytest.MonkeyPatch) -> HostGuard:
    if name == "rows-in-call":
        return emulated_guard(name, monkeypatch, mode="canonical")
    return HostGuard(cpu_exact.ROW_BLOCKS, mode=name)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _forget_plans() -> None:
    gemm_linear._PLANS.clear()
    gemm_linear._DTYPE_PLANS.clear()
    gemm_weight_gradient._VIEWS_PLANS.clear()


def _passes(ops, weights: list[torch.Tensor], dtype: torch.dtype, cold: bool, seed: int) -> list[torch.Tensor]:
    """Forward and backward of each call of ``CALLS`` on its weight: output, grad_x, grad_w. ``cold``: every plan
    forgotten before each forward and each backward (each ``tiled_matmul`` call then makes its own)."""
    results = []
    for (rows, k, n), weight in zip(CALLS, weights):
        x = _randn(rows, k, dtype=dtype, seed=seed + rows + k).requires_grad_()
        if cold:
            _forget_plans()
        y = ops.linear(x, weight)
        if cold:
            _forget_plans()
        results += [y.detach(), *torch.autograd.grad(y, [x, weight], _randn(rows, n, dtype=dtype, seed=seed + n))]
    return results


def _counting_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made = []
    real = gemm_linear._tiled_plan

    def counted(*args, **kwargs):
        plan = real(*args, **kwargs)
        made.append(plan.arrangement)
        return plan
    monkeypatch.setattr(gemm_linear, "_tiled_plan", counted)
    return made


@pytest.mark.parametrize("host_name", HOSTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_warm_plans_give_the_cold_bits(dtype, threads, host_name, monkeypatch):
    ops = cpu_exact.with_host(_host(host_name, monkeypatch))
    weights = [_randn(n, k, dtype=dtype, seed=n * k, scale=k**-0.5).requires_grad_() for _, k, n in CALLS]
    made = _counting_plans(monkeypatch)
    with num_threads(threads):
        cold = _passes(ops, weights, dtype, cold=True, seed=1)  # (also the guard's first questions: its probes)
        cold_again = _passes(ops, weights, dtype, cold=True, seed=2)
        assert len(made) == 4 * len(CALLS)  # each forward and input gradient, twice
        _forget_plans()
        _passes(ops, weights, dtype, cold=False, seed=3)  # makes the plans
        made.clear()
        warm = _passes(ops, weights, dtype, cold=False, seed=1)
        warm_again = _passes(ops, weights, dtype, cold=False, seed=2)
    assert made == [], "the warm passes must run on found plans"
    for name, a, b in zip(("output", "grad_x", "grad_w") * len(CALLS), cold + cold_again, warm + warm_again):
        assert a.dtype == b.dtype == dtype and torch.equal(_bits(a), _bits(b)), name


def _call(host: HostGuard, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gemm_linear.tiled_matmul(x, weight, host)


@pytest.mark.parametrize("calls", [1, gemm_packed.PACK_AFTER_CALLS + 2], ids=["unpacked", "packed"])
@pytest.mark.parametrize("host_name", ["auto", "canonical"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_an_in_place_update_keeps_the_plan_and_lays_out_its_operand_again(dtype, host_name, calls, monkeypatch):
    """A training step's new weight version: the plan stays (no decision reads the weight's values), the operand it
    held for the old version goes, and the output is the fresh plan's bit for bit. N = 40: the canonical operand is
    a padded copy of the weight (``arranged_weight``), which the plan keeps per version; ``packed``: enough calls on
    one version for a plan that packs its weight (``PACK_AFTER_CALLS``) to run on the packed copy, which the new
    version must pack again."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode=host_name)
    weight = _randn(40, 64, dtype=dtype, seed=5, scale=0.1)
    x = _randn(8, 64, dtype=dtype, seed=6)
    made = _counting_plans(monkeypatch)
    for _ in range(calls):
        _call(host, x, weight)
    assert len(made) == 1
    (kept,) = [kept for key, kept in gemm_linear._PLANS.items() if key == id(weight)]
    old_version = dict(kept.held)
    assert old_version, "the plan keeps what it laid out for this version"
    with torch.no_grad():
        weight.mul_(1.5)  # in place: the version counter moves on
    outs = [_call(host, x, weight) for _ in range(calls)]
    assert len(made) == 1, "the plan outlives the update"
    _forget_plans()
    fresh = _call(host, x, weight)
    assert all(torch.equal(_bits(out), _bits(fresh)) for out in outs)
    # counter-test: the same plan run with what it held for the old version multiplies the old weight
    (plan,) = kept.plans.values()
    kept.held.clear()
    kept.held.update(old_version)
    stale = plan.run(x, weight, host, compiled_loops.library())
    assert not torch.equal(_bits(stale), _bits(fresh))


def test_a_thread_count_makes_a_new_plan(monkeypatch):
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(176, 64, dtype=torch.float32, seed=7)
    x = _randn(8, 64, dtype=torch.float32, seed=8)
    made = _counting_plans(monkeypatch)
    with num_threads(1):
        one = _call(host, x, weight)
        _call(host, x, weight)
        assert len(made) == 1
    with num_threads(2):
        two = _call(host, x, weight)
        assert len(made) == 2
        _call(host, x, weight)
        assert len(made) == 2
    assert torch.equal(one, two)


UNCHECKED_THREADS = 3  # a count neither the first probe (1 thread and the machine's) nor the test above checked


def _off_at_unchecked_threads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch's GEMM, one ulp off at ``UNCHECKED_THREADS`` threads."""
    out = torch.bmm(a, b)
    if torch.get_num_threads() == UNCHECKED_THREADS:
        out = torch.nextafter(out, torch.full_like(out, float("inf")))
    return out


def test_a_guard_whose_answer_changed_makes_new_plans(monkeypatch):
    """A class that fails its check at a thread count verified later takes another path at every count (here the
    library GEMM with 1 thread): the guard's epoch changes, and the plans made before it are not used again."""
    if MACHINE_THREADS == UNCHECKED_THREADS:
        pytest.skip(f"the first probe checks {UNCHECKED_THREADS} threads on this machine")
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", bmm=_off_at_unchecked_threads)
    weight = _randn(40, 64, dtype=torch.float32, seed=7)
    x = _randn(8, 64, dtype=torch.float32, seed=8)
    made = _counting_plans(monkeypatch)
    with num_threads(1):
        before = _call(host, x, weight)
        epoch = host.epoch
        _call(host, x, weight)
        assert len(made) == 1
    with num_threads(UNCHECKED_THREADS):
        _call(host, x, weight)
    assert host.epoch != epoch
    assert {p["path"] for p in host.report()["probes"] if p["property"] == "gemm_rows"} == {SINGLE_THREAD_PATH}
    with num_threads(1):
        after = _call(host, x, weight)
        assert len(made) == 3
    assert torch.equal(before, after)


def test_a_weights_plans_go_with_it():
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=torch.float32, seed=9).requires_grad_()
    key = id(weight)
    _call(host, _randn(8, 64, dtype=torch.float32, seed=10), weight)
    _call(host, _randn(8, 64, dtype=torch.float32, seed=10), weight[:32])  # a view: its base's plans
    assert gemm_linear._PLANS[key].owner() is weight and len(gemm_linear._PLANS[key].plans) == 2
    del weight
    gc.collect()
    assert key not in gemm_linear._PLANS


def test_tiled_rows_are_the_rows_padded_to_the_shortest_tile_whose_bits_the_host_keeps():
    """``tiled_rows`` (what ``vexact bench decode_profile --gemm`` times ``F.linear`` at): on a host whose GEMM gives
    tiles of under 32 rows other bits (``gemm_rows`` heights 32, 48 and 64), 3 rows
    are multiplied as 32; on a sound host as 4, the shortest tile; rows beyond the tallest tile fill whole tiles."""
    def short_tiles_round_otherwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = SOUND["bmm"](a, b)
        return _nudge(out) if a.shape[1] < 32 else out

    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 48, generator=g)
    short_tiles = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", **{**SOUND, "bmm": short_tiles_round_otherwise})
    sound = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", **SOUND)
    assert gemm_linear.tiled_rows(torch.randn(3, 48, generator=g), w, short_tiles) == 32
    assert short_tiles.report()["probes"][0]["tile_heights"] == [32, 48, 64]  # a restriction, not a failed probe
    assert gemm_linear.tiled_rows(torch.randn(3, 48, generator=g), w, sound) == 4
    assert gemm_linear.tiled_rows(torch.randn(70, 48, generator=g), w, sound) == 128


def test_a_weight_held_until_interpreter_exit_drops_its_plans_without_an_error():
    """A script that keeps a weight (and its plans, as one that inspects them does) in its own globals frees it at
    interpreter exit, after the module's globals are gone: the plans' callback must still find their dict (it printed
    "Exception ignored in ... _forget": AttributeError on None)."""
    script = ("import torch\nfrom vexact_kernels import cpu_exact, gemm_linear\nw = torch.randn(40, 48)\n"
              "with torch.no_grad():\n    cpu_exact.linear(torch.randn(3, 48), w)\n"
              "kept = gemm_linear._PLANS[id(w)]\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
