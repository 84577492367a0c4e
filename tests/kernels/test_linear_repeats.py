"""A decode loop's repeated linear calls run their remembered plan (``linear_repeats``), and a decode step's padded
inputs reuse a buffer per thread (``gemm_tiles.padded_rows_input``): no bit depends on either.

What changed: every ``cpu_exact.linear`` call checked its inputs, asked the dtype its GEMM runs in and looked its plan
up before the plan ran; now a call like the one before it (no gradient recorded, no bias, the same weight, x's shape
and dtype, the guard's state, thread count and switches) runs the plan at once. Checked here:

- many calls through remembered plans (past ``PACK_AFTER_CALLS``: the packed weight too) give the bits of the whole
  path, fp32 and bf16, 1 and 2 threads, in ``auto`` and ``canonical``, and the remembered path did run;
- every change the plan's choice or the input check rests on takes the whole path again, with its bits: a new
  version of the weight (counter-test: a remembered plan run on it regardless gives the old version's bits), its
  storage swapped under ``.data``, another x shape, dtype or thread count, another guard, a recorded gradient;
- bad input after a remembered call still gets the check's one clear error;
- a weight's remembered call goes with it;
- the buffer gives a fresh padded copy's values for a shorter call after a longer one, and none under grad mode; a
  thread keeps at most ``PADDED_INPUTS_MAX`` buffers.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import num_threads

from vexact_kernels import compiled_loops, cpu_exact, gemm_linear, gemm_packed, gemm_tiles, linear_repeats
from vexact_kernels.host_guard import HostGuard

DTYPES = (torch.float32, torch.bfloat16)
CALLS = gemm_packed.PACK_AFTER_CALLS + 4  # past the switch to a packed weight


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _whole_path(x: torch.Tensor, weight: torch.Tensor, host: HostGuard) -> torch.Tensor:
    """The output of ``linear``'s whole path (the dtype asked, the plan looked up), which no remembered call reaches."""
    with torch.no_grad():
        return cpu_exact._linear_forward(x, weight, None, host)


def _served(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per ``linear_repeats.run`` call: whether it ran a remembered plan."""
    served = []
    real = linear_repeats.run

    def counted(*args):
        out = real(*args)
        served.append(out is not None)
        return out
    monkeypatch.setattr(linear_repeats, "run", counted)
    return served


@pytest.mark.parametrize("host_mode", ["auto", "canonical"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_remembered_calls_give_the_bits_of_the_whole_path(dtype, threads, host_mode, monkeypatch):
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode=host_mode)
    ops = cpu_exact.with_host(host)
    # a decode step's [B, 1, K] rows against a layer (N = 576) and a padded N (40); the LM head's 2-D [B, K]; layers
    # of 2^18 weight elements and more (which may switch to a packed weight: its plan takes x whole, ``any_rows``),
    # one with a padded N
    cases = [((8, 1, 64), 576), ((8, 1, 64), 40), ((5, 64), 200), ((8, 1, 512), 512), ((5, 1, 512), 520)]
    weights = [_randn(n, shape[-1], dtype=dtype, seed=n, scale=0.1) for shape, n in cases]
    served = _served(monkeypatch)
    with num_threads(threads), torch.no_grad():
        for call in range(CALLS):
            for (shape, _), weight in zip(cases, weights):
                x = _randn(*shape, dtype=dtype, seed=call)
                out = ops.linear(x, weight)
                assert out.shape == (*shape[:-1], weight.shape[0])
                assert torch.equal(_bits(out), _bits(_whole_path(x, weight, host)))
    assert served[: len(cases)] == [False] * len(cases), "the first calls take the whole path"
    assert all(served[len(cases) :]), "every later call runs its remembered plan"


def _remembered_once(host: HostGuard, weight: torch.Tensor, x: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(CALLS):
            cpu_exact.linear(x, weight, host=host)


def _changes() -> dict:
    """Each change: (x, weight) -> the (x, weight) of the next call, made under no_grad where it writes."""

    def update(x, w):
        w.mul_(1.5)  # in place: the version counter moves on
        return x, w

    def swap_storage(x, w):
        w.data = w.data.clone() * 2.0  # under .data: no version counter moves
        return x, w

    return {"weight updated in place": update, "storage swapped under .data": swap_storage,
            "another x shape": lambda x, w: (torch.cat([x, x]), w), "another x dtype": lambda x, w: (x.double(), w)}


@pytest.mark.parametrize("change", list(_changes()))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_change_takes_the_whole_path_again(dtype, change, monkeypatch):
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=dtype, seed=3, scale=0.1)
    x = _randn(8, 1, 64, dtype=dtype, seed=4)
    _remembered_once(host, weight, x)
    served = _served(monkeypatch)
    with torch.no_grad():
        x, weight = _changes()[change](x, weight)
    if x.dtype == torch.float64:  # not a dtype the op takes: the check's one error, not a remembered plan's
        with pytest.raises(TypeError, match="cpu_exact.linear: x has dtype"):
            cpu_exact.linear(x, weight, host=host)
        assert served == [False]
        return
    with torch.no_grad():
        out = cpu_exact.linear(x, weight, host=host)
    assert served == [False]
    assert torch.equal(_bits(out), _bits(_whole_path(x, weight, host)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_stale_plan_would_give_the_old_versions_bits(dtype):
    """Counter-test of the version check: the plan remembered for the old version (which holds its packed or laid-out
    operand), run on the new version regardless, multiplies the old weight."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=dtype, seed=5, scale=0.1)
    x = _randn(8, 64, dtype=dtype, seed=6)
    _remembered_once(host, weight, x)
    plan = linear_repeats._REMEMBERED[(id(weight), id(host), x.shape)].plan
    with torch.no_grad():
        weight.mul_(1.5)
        stale = plan.run(x, weight, host, compiled_loops.library())
        fresh = cpu_exact.linear(x, weight, host=host)
    assert not torch.equal(_bits(stale), _bits(fresh))
    assert torch.equal(_bits(fresh), _bits(_whole_path(x, weight, host)))


@pytest.mark.parametrize("host_mode", ["auto", "canonical"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_repeated_calls_of_no_rows_are_empty_results(dtype, host_mode):
    """An x of no rows is never remembered (a plan of 0 tiles failed in its GEMM: the second call of a [0, 512] x on a
    512 x 512 fp32 weight, oneDNN's class, raised an IndexError), nor planned; every call, ``linears`` too, is empty."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode=host_mode)
    ops = cpu_exact.with_host(host)
    weights = [_randn(512, 512, dtype=dtype, seed=seed, scale=0.1) for seed in (13, 14)]
    with torch.no_grad():
        for _ in range(CALLS):
            for shape in ((0, 512), (2, 0, 512)):
                x = _randn(*shape, dtype=dtype, seed=15)
                assert ops.linear(x, weights[0]).shape == (*shape[:-1], 512)
                assert [out.shape for out in ops.linears(x, weights)] == [(*shape[:-1], 512)] * 2
    assert not any(key[0] == id(weights[0]) for key in linear_repeats._REMEMBERED)
    no_rows = x.reshape(0, 512)
    assert gemm_linear.kept_plan(no_rows, weights[0], host, linear_repeats.OP, compiled_loops.library()) is None


def test_another_thread_count_guard_or_a_recorded_gradient_takes_the_whole_path(monkeypatch):
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=torch.float32, seed=7, scale=0.1)
    x = _randn(8, 64, dtype=torch.float32, seed=8)
    with num_threads(1):
        _remembered_once(host, weight, x)
    served = _served(monkeypatch)
    with num_threads(2), torch.no_grad():
        cpu_exact.linear(x, weight, host=host)
    with num_threads(1), torch.no_grad():
        cpu_exact.linear(x, weight, host=HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
    with num_threads(1):
        graded = cpu_exact.linear(x, weight.requires_grad_(), host=host)
    assert served == [False, False, False]
    assert graded.requires_grad, "a recorded gradient: the whole path, through the op's autograd function"


def test_bad_input_after_a_remembered_call_gets_the_checks_error():
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=torch.float32, seed=9)
    _remembered_once(host, weight, _randn(8, 64, dtype=torch.float32, seed=10))
    with pytest.raises(ValueError, match="weight must be \\[N, K\\], K = x's last dimension"):
        cpu_exact.linear(_randn(8, 63, dtype=torch.float32, seed=10), weight, host=host)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cpu_exact.linear([[0.0] * 64] * 8, weight, host=host)


def test_a_weights_remembered_call_goes_with_it():
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    weight = _randn(40, 64, dtype=torch.float32, seed=11)
    x = _randn(8, 64, dtype=torch.float32, seed=12)
    key = (id(weight), id(host), x.shape)
    _remembered_once(host, weight, x)
    assert key in linear_repeats._REMEMBERED
    del weight
    gc.collect()
    assert key not in linear_repeats._REMEMBERED


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_padded_rows_give_a_fresh_padded_copys_values(dtype):
    long, short = _randn(30, 64, dtype=dtype, seed=13), _randn(8, 64, dtype=dtype, seed=14)
    short[0, 0] = -0.0
    with torch.no_grad():
        first = gemm_tiles.padded_rows_input(long, 48).clone()
        again = gemm_tiles.padded_rows_input(short, 48)  # the same buffer: rows 8..29 written before
    assert torch.equal(_bits(first), _bits(gemm_tiles.zero_padded(long, (48, 64))))
    assert torch.equal(_bits(again), _bits(gemm_tiles.zero_padded(short, (48, 64))))
    assert again.is_contiguous() and again.data_ptr() % gemm_tiles.ALIGNMENT == 0
    with torch.enable_grad():  # a GEMM recorded for autograd keeps its input: a fresh copy, not the buffer
        fresh = gemm_tiles.padded_rows_input(short, 48)
    assert fresh.data_ptr() != again.data_ptr() and torch.equal(_bits(fresh), _bits(again))


def test_padded_rows_keep_at_most_their_bound_of_buffers():
    buffers = gemm_tiles._PADDED_INPUTS.buffers
    buffers.clear()
    with torch.no_grad():
        for rows_padded in range(2, 2 + gemm_tiles.PADDED_INPUTS_MAX + 5):
            x = _randn(1, 8, dtype=torch.float32, seed=rows_padded)
            padded = gemm_tiles.padded_rows_input(x, rows_padded)
            assert torch.equal(_bits(padded), _bits(gemm_tiles.zero_padded(x, (rows_padded, 8))))
    assert len(buffers) == gemm_tiles.PADDED_INPUTS_MAX
    assert (2, 8, torch.float32) not in buffers, "the oldest buffer went first"
