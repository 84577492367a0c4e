"""The compiled loops' contract: the same bits as the torch-op compositions they replace (``compiled_loops``).

Each loop is checked bitwise (the bit patterns, so -0.0 against +0.0 counts) against its torch-op version on
random shapes, strides and special values, every op in both loops' modes on NaNs and infinities (the same bits but a
NaN's sign and payload, NaN in the same places), and a whole run is compared with and without the loops. Under CI
(``CI=true``) the loops must have built: CI must not pass by testing only the torch-op path."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import recorded_returns, running_in_ci
from test_data_parallel import _config_file, _result, _same, _vexact_run
from test_exact_price_bits import _bits, _rms_norm_vjp_reference

from vexact_kernels import compiled_loops, cpu_attention, cpu_elementwise, fixed_order

DTYPES = (torch.float32, torch.float64)


@pytest.fixture(scope="module")
def loops():
    found = compiled_loops.status()
    if found["path"] != "compiled":
        if running_in_ci():
            pytest.fail(f"the compiled loops did not load under CI: {found}", pytrace=False)
        pytest.skip(f"no compiled loops on this host: {found['reason']}")
    return compiled_loops.library()


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over many magnitudes (so the order of additions shows in the result), with signed zeros,
    infinities and subnormals sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * 10.0 ** torch.randint(-6, 7, shape, generator=gen)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-310], dtype=torch.float64)
    pick = torch.randint(0, 40, shape, generator=gen)
    x = torch.where(pick < len(special), special[pick.clamp(max=len(special) - 1)], x)
    return x.to(dtype)


CASES = [  # (shape, dim, a view to take: how the operand's strides differ from a fresh tensor's)
    ((2, 5, 3), 1, "plain"), ((3, 64), -1, "plain"), ((64,), 0, "plain"), ((1000,), 0, "plain"),
    ((4, 9, 33), 0, "plain"), ((2, 3, 4, 5), 2, "plain"), ((7, 2), 1, "plain"), ((3, 6, 5), -1, "transposed"),
    ((5, 4, 17), 1, "transposed"), ((6, 10, 12), 0, "sliced"), ((2, 3, 4, 64), -1, "permuted"),
    ((3, 8, 4, 5), 1, "permuted"), ((0, 5), 1, "plain"), ((4, 0, 3), 0, "plain"),
]


def _view(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transposed":
        return x.transpose(0, -1)
    if how == "transposed_last":  # a batch of transposed matrices (the attention backward's GEMM operands)
        return x.transpose(-1, -2)
    if how == "sliced":
        return x[:, 1:8, ::2]
    if how == "permuted":
        return x.permute(3, 1, 0, 2)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,how", CASES)
def test_tree_sum_is_the_torch_op_tree_bit_for_bit(loops, dtype, shape, dim, how):
    x = _view(_values(shape, dtype, seed=len(shape) * 100 + abs(dim)), how)
    if x.shape[dim % x.dim()] < 2:
        pytest.skip("a width of 1 is a select, not a sum (taken by the torch ops)")
    expected = fixed_order.tree_sum(x, dim)
    got = loops.tree_sum(x, dim)
    assert got.shape == expected.shape and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("width", [2, 3, 5, 8])
def test_tree_sum_into_adds_the_last_entry_to_zero_first(loops, width):
    """``tree_sum_into(x, 0, out, zero_last=True)`` is the tree of x with its last entry replaced by that entry +
    0.0 (a -0.0 becomes +0.0: what the unpadded last chunk of a weight gradient on views adds), written into out.
    Where every entry is -0.0 the tree's sum is -0.0 without the + 0.0 if the width is a power of two (no entry
    is unpaired, which would add + 0 itself), so there the check can fail."""
    x = _values((width, 6, 33), torch.float32, seed=width)
    x[:, 0, :5] = -0.0
    expected = fixed_order.tree_sum(torch.cat([x[:-1], x[-1:] + 0.0]), 0)
    out = torch.empty(6, 33)
    got = loops.tree_sum_into(x, 0, out, zero_last=True)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(_bits(out), _bits(expected))
    without = loops.tree_sum_into(x, 0)
    assert torch.equal(_bits(without), _bits(fixed_order.tree_sum(x, 0)))
    assert torch.equal(_bits(without), _bits(expected)) == (width & (width - 1) != 0)


def test_tree_sum_propagates_nan_where_the_torch_ops_do(loops):
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(1))
    x[3, 5] = float("nan")
    x[9, 36] = float("nan")
    expected, got = fixed_order.tree_sum(x), loops.tree_sum(x, -1)
    assert torch.equal(got.isnan(), expected.isnan()) and int(got.isnan().sum()) == 2
    keep = ~expected.isnan()
    assert torch.equal(_bits(got[keep]), _bits(expected[keep]))


def test_tree_sum_keeps_the_order_visible(loops):
    """The check above can fail: the sequential sum of the same values differs from the tree in fp32."""
    x = _values((200, 64), torch.float32, seed=2)
    tree, sequential = loops.tree_sum(x, -1), x.cumsum(-1)[:, -1]
    assert not torch.equal(_bits(tree), _bits(sequential))


def test_dispatch_takes_the_torch_ops_where_the_loops_do_not_apply(loops):
    """Width 1 (a select), bf16 (not compiled) and fp32 all give the torch-op tree's values through ``tree_sum``."""
    for x, dim in ((torch.randn(3, 1), -1), (torch.randn(4, 6, dtype=torch.bfloat16), -1), (torch.randn(5, 9), 0)):
        assert torch.equal(compiled_loops.tree_sum(x, dim), fixed_order.tree_sum(x, dim))


def test_bad_mode_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(compiled_loops.LOOPS_ENV, "fast")
    with pytest.raises(ValueError, match="VEXACT_CPU_LOOPS='fast'"):
        compiled_loops.mode_from_env()


@pytest.mark.slow
def test_a_whole_run_is_the_same_bits_with_and_without_the_loops(loops, tmp_path, monkeypatch):
    """Warm start, rollouts, scoring, the update and evaluation, once with the compiled loops and once with
    ``VEXACT_CPU_LOOPS=python``: metrics (timing aside) and every checkpoint tensor bitwise equal."""
    results = []
    for mode in ("auto", "python"):
        monkeypatch.setenv(compiled_loops.LOOPS_ENV, mode)
        (tmp_path / mode).mkdir()
        config = _config_file(tmp_path / mode, threads=1, **{"distributed.leaves": 1})
        _vexact_run(config, tmp_path / f"run-{mode}")
        results.append(_result(tmp_path / f"run-{mode}"))
    metrics, _ = results[0]
    assert all(row["actor/grad_norm"] > 0 for row in metrics if "actor/grad_norm" in row), "the policy must move"
    assert _same(*results), "the compiled loops changed a bit of the run"


# Each op's outputs and gradients on inputs sprinkled with NaNs of both signs, infinities, overflowing and subnormal
# values, saved to argv[1]: run once per loops mode, each in its own process (the mode is read once per process).
_SPECIALS_RUN = """
import sys, torch
from vexact_kernels import cpu_exact as E
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
nan = float("nan")
specials = torch.tensor([nan, -nan, float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-40,
                         88.0, -104.0, 2e19])
def values(*shape, dtype, p=0.1):
    x = torch.randn(*shape, generator=gen)
    pick = torch.randint(0, len(specials), shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < p, specials[pick], x).to(dtype)
def grads(name, op, inputs, *rest):
    inputs = [t.clone().requires_grad_() for t in inputs]
    y = op(*inputs, *rest)
    y.backward(values(*y.shape, dtype=y.dtype, p=0.005))
    out[name] = y.detach()
    out.update({f"{name} grad {i}": t.grad for i, t in enumerate(inputs)})
out = {}
for dtype in (torch.float32, torch.bfloat16):
    d = str(dtype)
    x, w, b = values(70, 24, dtype=dtype, p=0.02), values(20, 24, dtype=dtype, p=0), values(20, dtype=dtype, p=0)
    x[0, :2], x[1, :2] = torch.tensor([nan, -nan]), torch.tensor([-nan, nan])  # rows with NaNs of both signs
    grads(f"{d} linear", E.linear, [x, w, b])
    grads(f"{d} rms_norm", E.rms_norm, [x, values(24, dtype=dtype, p=0)], 1e-6)
    out[f"{d} rms_norm eps 0"] = E.rms_norm(x, values(24, dtype=dtype, p=0), 0.0)
    logits = values(40, 33, dtype=dtype, p=0.015) * 5
    logits[3], logits[4, :30] = -float("inf"), -float("inf")  # a row all masked, a row masked but three
    logits[5, 1], logits[6, 0] = -nan, nan
    grads(f"{d} log_softmax", E.log_softmax, [logits])
    grads(f"{d} token_logprobs", E.token_logprobs, [logits], torch.randint(0, 33, (40,), generator=gen))
    grads(f"{d} entropy", E.entropy, [E.log_softmax(logits)])
    grads(f"{d} silu_mul", E.silu_mul, [values(8, 40, dtype=dtype, p=0.3), values(8, 40, dtype=dtype)])
    q, k, v = values(2, 3, 4, 8, dtype=dtype, p=0.02), values(2, 6, 2, 8, dtype=dtype, p=0.02), values(
        2, 6, 2, 8, dtype=dtype, p=0.02)
    q[1], k[1], v[1] = q[1].clamp(-3e38, 3e38), k[1].nan_to_num(0.0), v[1].nan_to_num(0.0)  # infinite scores only
    q[0, 0, 0, 0], q[0, 1, 1, 1] = -nan, nan
    grads(f"{d} attention", E.attention, [q, k, v], torch.tensor([3, 1]), 0.35)
    grads(f"{d} rope", E.rope, [values(2, 3, 2, 8, dtype=dtype, p=0.25)], torch.randn(2, 3, 4, generator=gen),
          torch.randn(2, 3, 4, generator=gen))
torch.save(out, sys.argv[1])
"""


def _same_but_nan_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The loops' modes' contract: NaN in the same places, every other value's bits equal (a NaN's sign and payload
    may differ)."""
    nan = a.isnan()
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(nan, b.isnan())
            and torch.equal(_bits(a.masked_fill(nan, 0.0)), _bits(b.masked_fill(nan, 0.0))))


def test_the_loops_modes_give_the_same_bits_but_a_nans_sign_on_special_values(loops, tmp_path):
    """Every op's outputs and gradients with the compiled loops and with ``VEXACT_CPU_LOOPS=python``, each mode in its
    own process, on NaNs of both signs, infinities, overflows and subnormals: NaN in the same places and every other
    value bit for bit (zeros' signs and infinities included). Only a NaN's sign and payload may differ (which NaN an
    IEEE operation passes on, or the default NaN an invalid one makes, is the instruction's choice: aten's vectorised
    kernels and a compiled loop may pick differently), as ``BIT_NEUTRAL_SETTINGS`` and the docs state."""
    results = {}
    for mode in ("compiled", "python"):
        env = {**os.environ, compiled_loops.LOOPS_ENV: mode}
        done = subprocess.run([sys.executable, "-c", _SPECIALS_RUN, str(tmp_path / mode)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results[mode] = torch.load(tmp_path / mode)
    compiled, python = results["compiled"], results["python"]
    assert compiled.keys() == python.keys() and len(compiled) == 46
    assert sum(int(t.isnan().any()) for t in compiled.values()) >= 20, "the inputs must make NaNs to compare"
    assert sum(int(t.isinf().any()) for t in compiled.values()) >= 10, "and infinities"
    different = [name for name in compiled if not _same_but_nan_bits(compiled[name], python[name])]
    assert not different, f"the loops' modes differ beyond a NaN's sign and payload: {different}"
    # counter-test of the comparison: one value a bit off, or one NaN more, is a difference
    out = compiled["torch.float32 rms_norm"]
    finite = out.isfinite().flatten().nonzero()[0, 0]
    nudged = out.flatten().clone()
    nudged.view(torch.int32)[finite] += 1
    assert not _same_but_nan_bits(out, nudged.view(out.shape))
    assert not _same_but_nan_bits(out, out.flatten().clone().index_fill_(0, finite, float("nan")).view(out.shape))
    assert _same_but_nan_bits(out, out.neg().neg()), "a NaN's sign flipped (and back) is still the same"


ATTENTION_CASES = {  # (batch, q_len, q_heads, kv_heads, head_dim, cache_len, q_start per sequence)
    "decode": (5, 1, 4, 2, 16, 48, [3, 17, 40, 0, 47]),
    "prefill_ragged": (3, 9, 4, 2, 16, 40, [0, 5, 31]),
    "prefill_uniform_two_key_tiles": (2, 70, 4, 2, 16, 70, [0, 0]),
    "many_row_tiles_three_key_tiles": (2, 40, 8, 2, 16, 170, [100, 130]),
    "no_grouping_wide_heads": (3, 2, 2, 2, 64, 20, [4, 0, 18]),
}


def _python_attention_steps(monkeypatch: pytest.MonkeyPatch, cpu_exact: object) -> None:
    """From now on the exact attention's forward takes its steps in Python (its plan says the guard's calls are not
    torch's own), whatever the guard answers."""
    plan = cpu_attention._attention_plan
    monkeypatch.setattr(cpu_attention, "_attention_plan", lambda host, head_dim: plan(host, head_dim)._replace(
        library=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_forward_in_one_call_is_the_python_steps_bit_for_bit(loops, case, dtype, monkeypatch):
    """A forward without a gradient (``cpu_attention.attention_exact``) in one compiled call (``attention_forward``)
    against its steps in Python, where the guard runs torch's own GEMM and exp: the output bitwise (decode, ragged and
    uniform prefills, several row and key tiles, fp32 and bf16 queries and caches); and the compiled call did run."""
    from vexact_kernels import cpu_exact

    batch, q_len, q_heads, kv_heads, head_dim, cache_len, starts = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 1)
    q = (torch.randn(batch, q_len, q_heads, head_dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    q_start, scale = torch.tensor(starts), head_dim ** -0.5
    if not cpu_attention._library_attention(cpu_exact.HOST, head_dim):
        pytest.skip("this host's guard runs an attention GEMM class or exp on its fixed-order path")
    with torch.no_grad():
        calls = recorded_returns(monkeypatch, loops, "attention_forward")
        got = cpu_attention.attention_exact(q, k, v, q_start, scale, cpu_exact.HOST)
        _python_attention_steps(monkeypatch, cpu_exact)
        expected = cpu_attention.attention_exact(q, k, v, q_start, scale, cpu_exact.HOST)
    assert len(calls) == 1 and calls[0] is got
    assert got.shape == expected.shape == q.shape and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_forward_with_a_gradient_in_one_call_is_the_python_steps_bit_for_bit(loops, case, dtype,
                                                                                        monkeypatch):
    """A forward that keeps what its backward needs (``cpu_attention._ExactAttention``) in one compiled call
    (``attention_forward_saving``) against its steps in Python: the output and the three gradients bitwise (so the
    kept output rows and normalised probabilities are the Python steps' too), and the compiled call did run."""
    from vexact_kernels import cpu_exact

    batch, q_len, q_heads, kv_heads, head_dim, cache_len, starts = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 2)
    q = (torch.randn(batch, q_len, q_heads, head_dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    grad = torch.randn(batch, q_len, q_heads, head_dim, generator=gen).to(dtype)
    q_start, scale = torch.tensor(starts), head_dim ** -0.5
    if not cpu_attention._library_attention(cpu_exact.HOST, head_dim):
        pytest.skip("this host's guard runs an attention GEMM class or exp on its fixed-order path")
    results = []
    calls = recorded_returns(monkeypatch, loops, "attention_forward_saving")
    for compiled in (True, False):
        if not compiled:
            _python_attention_steps(monkeypatch, cpu_exact)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = cpu_exact.attention(*leaves, q_start, scale, host=cpu_exact.HOST)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    assert len(calls) == 1 and calls[0][0] is results[0][0]
    for name, got, expected in zip(("output", "grad_q", "grad_k", "grad_v"), *results):
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(_bits(got), _bits(expected)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_layout_loops_are_the_torch_ops_bit_for_bit(loops, case, dtype, monkeypatch):
    """``_AttentionTiles``' four layouts through the loops against their torch ops, bitwise, on values over many
    magnitudes and special values: queries to rows times the scale (the head size's, and a scale no power of two
    rounds exactly; from a fresh and a transposed tensor), a gradient to rows (from a fresh and a transposed tensor),
    rows to the output (a padded GEMM output's sliced view, with and without the scale) and keys to the cache's layout
    (fewer keys than the cache holds and more)."""
    from vexact_kernels import cpu_exact

    batch, q_len, q_heads, kv_heads, head_dim, cache_len, starts = ATTENTION_CASES[case]
    q = torch.zeros(batch, q_len, q_heads, head_dim, dtype=dtype)
    k = torch.zeros(batch, cache_len, kv_heads, head_dim, dtype=dtype)
    tiles = cpu_attention._AttentionTiles(q, k, k, torch.tensor(starts), head_dim ** -0.5, cpu_exact.HOST)
    grad = _values((batch, q_heads, q_len, head_dim), torch.float64, len(case)).clamp(-1e30, 1e30).to(dtype)
    padded_rows = _values((batch * kv_heads, tiles.row_len + 3, 2 * head_dim), torch.float64, len(case) + 1).float()
    rows = padded_rows[:, : tiles.rows, :head_dim]
    short = _values((batch * kv_heads, max(1, cache_len - 5), head_dim), torch.float64, len(case) + 2).float()
    long = _values((batch * kv_heads, cache_len + 7, head_dim), torch.float64, len(case) + 3).float()
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(cpu_attention, "_layout_loops", lambda x: None)
        odd_scale = cpu_attention._AttentionTiles(q, k, k, torch.tensor(starts), 0.1, cpu_exact.HOST)
        queries = grad.transpose(1, 2)
        results.append((tiles._query_rows(queries), odd_scale._query_rows(queries.contiguous()),
                        tiles.from_output(grad.transpose(1, 2)), tiles.from_output(grad.transpose(1, 2).contiguous()),
                        tiles.to_output(rows, dtype), tiles.to_output(rows, dtype, scale=tiles.scale),
                        tiles.to_cache(short, dtype), tiles.to_cache(long, dtype)))
    names = ("query rows of a transposed tensor", "query rows, a scale no power of two",
             "rows of a transposed gradient", "rows of a gradient", "output", "scaled output", "cache of fewer keys",
             "cache of more keys")
    for name, got, expected in zip(names, *results):
        assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous(), name
        assert torch.equal(_bits(got), _bits(expected)), name


@pytest.mark.parametrize("normalized", [False, True], ids=["unnormalised", "normalised"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_softmax_loops_are_the_torch_ops_bit_for_bit(loops, case, normalized):
    """``_attention_probs`` with and without the loops: the probability tiles, both row sums and the masked
    probabilities (divided by their row sums: ``normalized``), bitwise (decode, ragged and uniform prefills, several
    row and key tiles)."""
    from vexact_kernels import cpu_exact

    batch, q_len, q_heads, kv_heads, head_dim, cache_len, starts = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen) * 3
    k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen)
    tiles = cpu_attention._AttentionTiles(q, k, v, torch.tensor(starts), head_dim ** -0.5, cpu_exact.HOST)
    expected = cpu_attention._attention_probs(tiles, None, normalized)
    got = cpu_attention._attention_probs(tiles, loops, normalized)
    for name, a, b in zip(("tiles", "row sums (padded)", "probabilities", "row sums"), got, expected):
        assert a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), name
    unnormalised = cpu_attention._attention_probs(tiles, loops)[2]
    assert normalized != torch.equal(got[2], unnormalised)  # counter-check: the division did (or did not) happen


@pytest.mark.parametrize("how", ["plain", "sliced rows"])
@pytest.mark.parametrize("rows,keys,head_dim", [(7, 5, 16), (64, 130, 64), (3, 1, 2), (40, 33, 3)])
def test_attention_grad_scores_loop_is_the_torch_ops_bit_for_bit(loops, rows, keys, head_dim, how, monkeypatch):
    """The attention backward's dS = P * (dP - rowsum(dO * O)) with and without the loop, on special values and on
    row views of larger buffers (what the backward passes: the real rows of padded tiles)."""

    extra = 5 if how == "sliced rows" else 0
    d_p = _values((3, rows + extra, keys + extra), torch.float32, seed=rows)[:, :rows, :keys]
    d_out = _values((3, rows + extra, head_dim), torch.float32, seed=keys)[:, :rows]
    out_rows = _values((3, rows + extra, head_dim), torch.float32, seed=head_dim)[:, :rows]
    p = _values((3, rows, keys), torch.float32, seed=rows + keys).abs()
    got = cpu_attention._attention_grad_scores(d_p.clone(), d_out, out_rows, p)
    monkeypatch.setattr(compiled_loops, "library", lambda: None)
    expected = cpu_attention._attention_grad_scores(d_p.clone(), d_out, out_rows, p)
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("cache_len,key_len,how", [(48, 64, "plain"), (70, 64, "plain"), (64, 128, "sliced"),
                                                    (20, 64, "permuted")])
def test_key_rows_loop_is_the_torch_op_copy(loops, dtype, cache_len, key_len, how, monkeypatch):
    """``_AttentionTiles._key_rows`` with and without the loops: a cache (contiguous, a slice of a longer one, a
    permuted view) as fp32 rows [B*Hkv, key_len, hd], the cache converted where it reaches (exact), zeros after,
    bitwise, special values included."""
    from vexact_kernels import cpu_exact

    batch, kv_heads, head_dim = 3, 2, 16
    if how == "sliced":
        cache = _values((batch, cache_len + 9, kv_heads, head_dim), torch.float64, seed=cache_len).to(dtype)[:, 5:-4]
    elif how == "permuted":
        cache = _values((batch, kv_heads, cache_len, head_dim), torch.float64, seed=cache_len).to(dtype)
        cache = cache.permute(0, 2, 1, 3)
    else:
        cache = _values((batch, cache_len, kv_heads, head_dim), torch.float64, seed=cache_len).to(dtype)
    q = torch.zeros(batch, 1, kv_heads, head_dim, dtype=dtype)
    tiles = cpu_attention._AttentionTiles(q, cache, cache, torch.tensor([key_len - 1] * batch), 0.25, cpu_exact.HOST)
    assert tiles.key_len == key_len
    got = tiles._key_rows(cache)
    monkeypatch.setattr(cpu_exact.compiled_loops, "library", lambda: None)
    expected = tiles._key_rows(cache)
    assert got.shape == expected.shape == (batch * kv_heads, key_len, head_dim) and got.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("rows,n,k,block,unpadded", [(640, 64, 176, 256, True), (640, 64, 176, 256, False),
                                                     (512, 33, 40, 256, False), (100, 70, 16, 64, True),
                                                     (300, 9000, 16, 256, False), (300, 9000, 16, 256, True),
                                                     (64, 9000, 16, 64, False), (40, 5000, 16, 64, True),
                                                     (1100, 20, 16, 256, True), (7, 5, 3, 64, False)])
def test_weight_gradient_on_views_loop_is_the_torch_ops_bit_for_bit(loops, rows, n, k, block, unpadded, monkeypatch):
    """``_transposed_matmul_views`` with and without the loops (whole chunks, a last chunk padded or on its real rows,
    several slabs of output rows -- with one chunk, with a tree, with an unpadded tail's + 0.0 in the tree's first
    pass --, no whole chunk, an odd number of chunks), bitwise, on values over many magnitudes and special values."""
    from vexact_kernels import gemm_weight_gradient

    a = _values((rows, n), torch.float64, seed=rows + n).clamp(-1e15, 1e15).float()
    b = _values((rows, k), torch.float64, seed=rows + k).clamp(-1e15, 1e15).float()
    unpadded = unpadded and rows % block > 0
    got = gemm_weight_gradient._transposed_matmul_views(a, b, block, unpadded_tail=unpadded)
    monkeypatch.setattr(compiled_loops, "library", lambda: None)
    expected = gemm_weight_gradient._transposed_matmul_views(a, b, block, unpadded_tail=unpadded)
    assert got.shape == expected.shape == (n, k)
    assert torch.equal(_bits(got), _bits(expected))


LAYOUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
PAD_CASES = [  # (source shape, a view to take, padded shape)
    ((5, 7), "plain", (8, 16)), ((5, 7), "transposed", (16, 5)), ((3, 4, 5), "plain", (3, 8, 16)),
    ((6, 10, 12), "sliced", (8, 8, 16)), ((2, 3, 4, 64), "permuted", (64, 3, 2, 4)), ((1, 1), "plain", (4, 16)),
    ((0, 3), "plain", (4, 16)), ((4, 3), "plain", (4, 3)), ((3, 5, 7), "transposed_last", (4, 8, 16)),
    ((64, 56, 32), "transposed_last", (64, 32, 64)), ((2, 3, 40, 33), "transposed_last", (2, 4, 48, 48)),
]


@pytest.mark.parametrize("dtype", LAYOUT_DTYPES)
@pytest.mark.parametrize("shape,how,padded", PAD_CASES)
def test_padded_copy_is_the_torch_op_padding(loops, dtype, shape, how, padded):
    x = _view(_values(shape, torch.float64, seed=sum(shape)).to(dtype), how)
    expected = torch.constant_pad_nd(x, [p for size, full in zip(reversed(x.shape), reversed(padded))
                                         for p in (0, full - size)])
    got = loops.padded_copy(x, padded)
    assert got.is_contiguous() and got.shape == expected.shape and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("dtype", LAYOUT_DTYPES)
@pytest.mark.parametrize("rows,cols,block,width,how", [(230, 64, 256, 64, "plain"), (256, 22, 64, 32, "plain"),
                                                        (70, 40, 64, 48, "transposed"), (5, 3, 4, 16, "sliced")])
def test_chunks_transposed_is_the_torch_op_layout(loops, dtype, rows, cols, block, width, how):
    """out[c, i, j] = src[c * block + j, i], zero elsewhere: the layout of padding the rows to whole chunks, then
    each chunk's transpose (the torch-op composition ``gemm_weight_gradient._chunks_transposed`` replaces)."""
    if how == "transposed":
        src = _values((cols, rows), torch.float64, seed=rows).to(dtype).t()
    elif how == "sliced":
        src = _values((rows * 2, cols + 3), torch.float64, seed=rows).to(dtype)[::2, 1 : cols + 1]
    else:
        src = _values((rows, cols), torch.float64, seed=rows).to(dtype)
    chunks = -(-rows // block)
    padded = torch.constant_pad_nd(src, [0, width - cols, 0, chunks * block - rows])
    expected = padded.view(chunks, block, width).transpose(1, 2).contiguous()
    got = loops.chunks_transposed(src, block, chunks, width)
    assert got.is_contiguous() and got.shape == expected.shape
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_attention_softmax_loops_keep_special_scores_as_the_torch_ops(loops, special):
    """A query holding NaN or an infinity (its scores NaN or infinite, a row max NaN or infinite): the loops' row
    max (four running maxima and a NaN flag) and what follows give the torch ops' bits, NaN for NaN (a NaN's sign
    and payload aside: inf - inf in a compiled loop and in aten's kernel need not set the same bits)."""
    from vexact_kernels import cpu_exact

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 40, 4, 16, generator=gen) * 3
    q[1, 37, 0, :] = special  # a whole query vector (its scores NaN or infinite), in the last row tile
    k = torch.randn(2, 170, 2, 16, generator=gen) * 3
    k[0, 50, 0, 0] = special  # one key's score special (an infinity's sign: the query's) among finite ones
    v = torch.randn(2, 170, 2, 16, generator=gen)
    tiles = cpu_attention._AttentionTiles(q, k, v, torch.tensor([100, 130]), 0.25, cpu_exact.HOST)
    expected = cpu_attention._attention_probs(tiles, None)
    got = cpu_attention._attention_probs(tiles, loops)
    assert expected[2].isnan().any()  # the case reaches the special rows
    for name, a, b in zip(("tiles", "row sums (padded)", "probabilities", "row sums"), got, expected):
        assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(_bits(a.nan_to_num(0.0)), _bits(b.nan_to_num(0.0))), name


OPERAND_CASES = {  # (source [B, M, K] as laid out, padded shape, row tile height, a caller's zero-padded full tensor)
    "transposed_several_tiles": (lambda x: x.transpose(1, 2), (3, 128, 48), 64, False),  # attention's p.T
    # one tile: the clone of a dense transposed operand viewed as it is (kept strided)
    "transposed_one_tile": (lambda x: x[:, :, :64].contiguous().transpose(1, 2), (3, 64, 48), 64, False),
    "transposed_one_batch": (lambda x: x.transpose(1, 2)[:1], (1, 128, 48), 64, False),  # viewable: kept strided
    "transposed_sliced": (lambda x: x.transpose(1, 2)[:, :, :32], (3, 128, 32), 64, False),  # not dense: contiguous
    "contiguous": (lambda x: x.contiguous(), (3, 48, 128), 16, False),  # taken as it is
    "padded": (lambda x: x.transpose(1, 2)[:, :100, :40], (3, 128, 48), 64, False),
    "full": (lambda x: x.contiguous()[:, :40], (3, 48, 128), 16, True),
}


@pytest.mark.parametrize("case", OPERAND_CASES)
def test_batched_matmul_operands_are_the_copies_they_replace(loops, case, monkeypatch):
    """``batched_matmul``'s left operand in row tiles and its right operand once per row tile: the same values, shape
    and strides as the compositions they replace (``padded_operand(...).reshape(...)``, an expanded reshape), with
    the compiled loops and without -- the same GEMM call."""
    from vexact_kernels import gemm_batched, gemm_tiles

    layout, shape, block, with_full = OPERAND_CASES[case]
    source = _values((3, 48, 128), torch.float32, seed=len(case))
    a = layout(source)
    full = None
    if with_full:
        full = torch.zeros(shape)
        full[tuple(slice(0, n) for n in a.shape)] = a
    tiles = (shape[0] * shape[1] // block, block, shape[2])
    expected = gemm_tiles.padded_operand(a, shape, full).reshape(tiles)
    b = _values((shape[0], shape[2], 40), torch.float32, seed=7).transpose(1, 2).contiguous().transpose(1, 2)
    repeats = shape[1] // block
    expected_b = b.unsqueeze(1).expand(b.shape[0], repeats, *b.shape[1:]).reshape(-1, *b.shape[1:])
    for library in (loops, None):
        monkeypatch.setattr(compiled_loops, "library", lambda library=library: library)
        got, got_b = gemm_batched._row_tiles(a, shape, full, block), gemm_batched._repeated(b, repeats)
        for name, new, old in (("left", got, expected), ("right", got_b, expected_b)):
            assert new.shape == old.shape and new.stride() == old.stride(), name
            assert torch.equal(_bits(new), _bits(old)), name


def _rms_norm_torch_ops(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """cpu_exact's RMSNorm forward as torch ops (its torch-op path, with the host's guarded sqrt): (output, fp32
    1/rms [..., 1])."""
    from vexact_kernels.cpu_exact import elementwise

    xf = x.float()
    mean_sq = fixed_order.tree_sum(xf * xf).div_(x.shape[-1])
    inv_rms = elementwise("sqrt", mean_sq.add_(eps), op="rms_norm").reciprocal_().unsqueeze(-1)
    return torch.mul(xf, inv_rms).mul_(weight.float()).to(x.dtype), inv_rms


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", [(3, 17, 64), (1, 176), (230, 64), (2, 5, 4, 16), (4, 1)])
def test_rms_norm_loops_are_the_torch_ops_bit_for_bit(loops, dtype, shape):
    """Forward (output, 1/rms) and VJP (grad_x, grad_weight) of ``cpu_exact`` with the loops against the torch-op
    formulas, bitwise, on values over many magnitudes."""
    from vexact_kernels import cpu_exact

    x = (_values(shape, torch.float64, seed=shape[-1]).clamp(-1e15, 1e15) + 0.5).to(dtype)
    weight = torch.randn(shape[-1], generator=torch.Generator().manual_seed(3)).to(dtype)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    out, xf, inv_rms = cpu_exact._rms_norm_parts(x, weight, 1e-6, cpu_exact.HOST)
    expected_out, expected_inv = _rms_norm_torch_ops(x, weight, 1e-6)
    assert torch.equal(_bits(out), _bits(expected_out)) and torch.equal(_bits(inv_rms), _bits(expected_inv))
    grad_x, grad_w = cpu_exact._rms_norm_vjp((xf, inv_rms, weight, dtype), grad, (True, True))
    expected_x, expected_w = _rms_norm_vjp_reference((xf, inv_rms, weight, dtype), grad, (True, True))
    assert torch.equal(_bits(grad_x), _bits(expected_x)) and torch.equal(_bits(grad_w), _bits(expected_w))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", [(3, 17, 176), (1, 5), (230, 64), (2, 5, 4, 16), (7,)])
def test_silu_mul_loops_are_the_torch_ops_bit_for_bit(loops, dtype, shape, monkeypatch):
    """SwiGLU forward (output, saved 1 + exp(-gate) and silu) and VJP (both gradients) with the loops against the
    torch ops (``_silu_mul_loops`` answering None), bitwise, on values over many magnitudes and special values
    (bf16: the forward's loop where the guard chose the library exp; the backward's loop)."""
    from vexact_kernels import cpu_exact

    if dtype == torch.bfloat16:
        assert cpu_exact._silu_mul_loops(torch.ones(1, dtype=dtype), torch.ones(1, dtype=dtype), cpu_exact.HOST) \
            is (loops if cpu_exact._library_math(cpu_exact.HOST, "silu_mul", "exp") else None)
    gate = _values(shape, torch.float64, seed=sum(shape)).clamp(-1e30, 1e30).to(dtype)
    up = _values(shape, torch.float64, seed=sum(shape) + 1).clamp(-1e30, 1e30).to(dtype)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(cpu_exact, "_silu_mul_loops", lambda gate, up, host: None)
            monkeypatch.setattr(cpu_exact, "_silu_mul_vjp_loops", lambda grad, gate, up: None)
        out, saved = cpu_exact._silu_mul_with_saved(gate, up, cpu_exact.HOST)
        grads = cpu_exact._silu_mul_vjp(saved, grad, (True, True))
        plain = cpu_exact._silu_mul_exact(gate, up, cpu_exact.HOST)
        results.append((out, saved[2], saved[3], *grads, plain))
    names = ("output", "1 + exp(-gate)", "silu", "grad_gate", "grad_up", "output without grad")
    for name, a, b in zip(names, *results):
        assert torch.equal(_bits(a), _bits(b)), name
    assert torch.equal(_bits(results[0][0]), _bits(results[0][-1]))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape,table,how", [
    ((4, 5, 3, 8), (4, 5), "plain"), ((8, 1, 9, 64), (8, 1), "plain"), ((3, 7, 2, 16), (1, 7), "plain"),
    ((3, 7, 2, 16), (1, 1), "plain"), ((2, 6, 4, 32), (2, 6), "sliced"), ((2, 6, 4, 32), (2, 6), "transposed"),
    ((0, 3, 2, 8), (0, 3), "plain"),
])
def test_rope_loops_are_the_torch_ops_bit_for_bit(loops, dtype, shape, table, how):
    """The rotary embedding's forward (with and without a gradient) and its VJP through the loops against
    ``native.rope``'s torch ops and autograd's backward of them, bitwise, on values over many magnitudes and special
    values; x as a fresh tensor, a view with gaps between rows (a linear layer's sliced output) and one with no unit
    stride (copied first); cos and sin broadcast over B or T."""
    from vexact_kernels import cpu_exact, native

    assert cpu_exact._rope_loops(torch.ones(1, 1, 1, 2, dtype=dtype), torch.ones(1, 1, 1), torch.ones(1, 1, 1)) \
        is loops
    seed = sum(shape) + len(how)
    if how == "sliced":  # rows of a wider tensor: x's rows are hd apart in a row of 2 * hd
        x = _values((*shape[:3], 2 * shape[3]), torch.float64, seed)[..., : shape[3]]
    elif how == "transposed":
        x = _values((*shape[:2], shape[3], shape[2]), torch.float64, seed).transpose(-1, -2)
    else:
        x = _values(shape, torch.float64, seed)
    x = x.clamp(-1e30, 1e30).to(dtype)
    cos, sin = (_values((*table, shape[3] // 2), torch.float64, seed + i).clamp(-1e30, 1e30).float() for i in (1, 2))
    grad = _values(shape, torch.float64, seed + 3).clamp(-1e30, 1e30).to(dtype)
    results = []
    for rope in (cpu_exact.rope, native.rope):
        leaf = x.detach().requires_grad_()
        out = rope(leaf, cos, sin)
        (grad_x,) = torch.autograd.grad(out, leaf, grad)
        with torch.no_grad():
            results.append((out, rope(x, cos, sin), grad_x))
    assert results[0][0].grad_fn is not None and type(results[0][0].grad_fn) is not type(results[1][0].grad_fn)
    for name, a, b in zip(("output", "output without grad", "grad_x"), *results):
        assert a.dtype == dtype and a.is_contiguous()
        assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("budget", (1 << 16, 8, 1))
@pytest.mark.parametrize("count,vocab,width", [(300, 22, 64), (50, 1000, 16), (1, 5, 3), (0, 7, 4), (40, 3, 1)])
def test_embedding_backward_loop_is_the_torch_ops_bit_for_bit(loops, count, vocab, width, budget, dtype,
                                                              monkeypatch):
    """The embedding VJP (``_sum_rows_by_token``) with the loop against the torch ops, bitwise: skewed token counts,
    chunk budgets that group tokens of different counts together (zero padding turns -0.0 into +0.0, so the chunk
    width must be the torch ops' own), gradients with signed zeros and special values; in fp32 and rounded to bf16
    (the loop rounds only the occurring tokens' rows, the torch ops the whole fp32 result)."""
    from vexact_kernels import cpu_exact

    gen = torch.Generator().manual_seed(count + vocab)
    tokens = (torch.rand(count, generator=gen) ** 3 * vocab).long()  # a few tokens often, most rarely
    rows = _values((count, width), torch.float64, seed=count + width).clamp(-1e30, 1e30).float()
    if count:
        rows[tokens == tokens[0]] = -0.0  # one token's gradient is all -0.0
    monkeypatch.setattr(cpu_exact, "EMBEDDING_PAD_BUDGET", budget)
    compiled = cpu_exact._sum_rows_by_token(tokens, rows, vocab, dtype)
    monkeypatch.setattr(cpu_exact.compiled_loops, "library", lambda: None)
    expected = cpu_exact._sum_rows_by_token(tokens, rows, vocab, dtype)
    assert compiled.dtype == expected.dtype == dtype and compiled.shape == (vocab, width)
    assert torch.equal(_bits(compiled), _bits(expected))


def test_embedding_backward_loop_rejects_a_token_outside_the_vocabulary(loops):
    with pytest.raises(RuntimeError, match="token 9 outside"):
        loops.sum_rows_by_token(torch.tensor([1, 9]), torch.zeros(2, 4), 5, 1 << 16)


LINEAR_CASES = [  # (rows, in features, out features): one chunk / several, padded columns, a row tile per call
    (230, 64, 176), (230, 176, 64), (37, 64, 22), (600, 48, 40), (3, 16, 16), (1000, 64, 200),
]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows,k,n", LINEAR_CASES)
def test_linear_through_the_compiled_gemm_steps_is_the_torch_op_path(loops, dtype, rows, k, n, monkeypatch):
    """``linear`` forward and backward where the guard's verdict is torch's GEMM (the compiled ``tiled_matmul`` and
    ``transposed_matmul`` run the steps around it) against the same verdicts with the compiled loops off (every step
    in torch ops): output and both gradients bitwise. (Not against a guard over a wrapper of the GEMM: that one takes
    another canonical arrangement of the weight gradient -- the tiles, not the slabs -- whose bits equal the slabs'
    only where the host's GEMM gives a dot product the same bits in either operand layout: not torch's own bf16 GEMM
    on a CPU without oneDNN's bf16 kernels, an AVX2-only AMD EPYC.)"""
    from conftest import linear_with_gradients, num_threads

    from vexact_kernels import cpu_exact
    from vexact_kernels.host_guard import HostGuard

    gen = torch.Generator().manual_seed(rows + k + n)
    x0 = torch.randn(rows, k, generator=gen).to(dtype)
    w0 = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    grad = torch.randn(rows, n, generator=gen).to(dtype)

    def through(host: HostGuard) -> tuple:
        with num_threads(1):
            return linear_with_gradients(functools.partial(cpu_exact.linear, host=host), x0, w0, grad)

    # both in mode auto, given (the run's VEXACT_CPU_EXACT_PATH=fixed-order would take no library GEMM at all)
    library_guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    compiled = through(library_guard)
    operand = torch.empty(16 * -(-n // 16), k).t().unsqueeze(0)  # the forward's class: the path the guard took
    assert library_guard.library_gemm(torch.float32, operand, True, "linear") is not None
    monkeypatch.setattr(cpu_exact.compiled_loops, "library", lambda: None)
    torch_ops = through(HostGuard(cpu_exact.ROW_BLOCKS, mode="auto"))
    for name, a, b in zip(("output", "grad_x", "grad_w"), compiled, torch_ops):
        assert torch.equal(_bits(a), _bits(b)), name


def _without_a_compiler(tmp_path, code: list[str], mode: str) -> subprocess.CompletedProcess:
    """``python`` with an empty PATH (no C++ compiler, no ninja) and an empty extension cache."""
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
           compiled_loops.LOOPS_ENV: mode}
    return subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_no_compiler_falls_back_to_the_torch_ops_with_one_warning(tmp_path):
    code = ("import torch, warnings; from vexact_kernels import cpu_exact, compiled_loops\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    cpu_exact.rms_norm(torch.randn(4, 8), torch.randn(8), 1e-6)\n"
            "    cpu_exact.rms_norm(torch.randn(4, 8), torch.randn(8), 1e-6)\n"
            "warned = sum('compiled loops did not build' in str(w.message) for w in caught)\n"
            "print(compiled_loops.status()['path'], warned)")
    done = _without_a_compiler(tmp_path, ["-c", code], "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["torch", "ops", "1"]


@pytest.mark.slow
def test_compiled_mode_without_a_compiler_is_one_clear_error(tmp_path):
    done = _without_a_compiler(tmp_path, ["-m", "vexact_kernels.build_loops"], "compiled")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "VEXACT_CPU_LOOPS=compiled, but the compiled loops did not build" in done.stderr
    assert "no C++ compiler on PATH" in done.stderr


def test_compiled_mode_whose_build_failed_fails_again_and_the_cli_says_so_in_one_line(monkeypatch, capsys):
    """The first call raised; the state it left said mode python, so every later call in the process quietly ran the
    torch ops (and ``status`` named a setting the user never made). The CLI gave a traceback and exit 1 (a mismatch's
    code), where a machine that cannot build is exit 3."""
    from vexact.cli import EXIT_ENVIRONMENT, main

    def no_build(name, directory):
        raise RuntimeError("no C++ compiler on PATH (looked for c++ and g++)")

    monkeypatch.setenv(compiled_loops.LOOPS_ENV, "compiled")
    monkeypatch.setattr(compiled_loops, "_state", {})
    monkeypatch.setattr(compiled_loops, "_import_built", lambda name, directory: None)
    monkeypatch.setattr(compiled_loops, "_build", no_build)
    for _ in range(2):
        with pytest.raises(compiled_loops.LoopsBuildError, match="compiled, but the compiled loops did not build"):
            compiled_loops.library()
    code = main(["check", "--preset", "tiny", "--backend", "exact", "--wide-hidden", "0", "--num-prompts", "2",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == EXIT_ENVIRONMENT and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("error: VEXACT_CPU_LOOPS=compiled, but the compiled loops did not build (RuntimeError: no "
                          "C++ compiler"), err


def test_a_build_folder_that_cannot_be_written_is_named_with_its_fix_not_a_compiler(monkeypatch, tmp_path, capsys):
    """An extension cache that cannot be created (here under a regular file; a read-only HOME alike) failed the build
    with an OSError the CLI answered with "install a C++ compiler". Mode compiled now names the folder and says to set
    TORCH_EXTENSIONS_DIR (the CLI suggests no compiler); mode auto still falls back to the torch ops, saying why."""
    from vexact.cli import EXIT_ENVIRONMENT, main

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file" / "x"))
    monkeypatch.setattr(compiled_loops, "_import_built", lambda name, directory: None)
    monkeypatch.setenv(compiled_loops.LOOPS_ENV, "compiled")
    monkeypatch.setattr(compiled_loops, "_state", {})
    for _ in range(2):  # the same error on every call
        with pytest.raises(compiled_loops.LoopsBuildError) as raised:
            compiled_loops.library()
        assert f"cannot write their build folder {tmp_path / 'file' / 'x'}" in str(raised.value)
        assert "set TORCH_EXTENSIONS_DIR to a writable folder" in str(raised.value) and not raised.value.compiler
    code = main(["check", "--preset", "tiny", "--backend", "exact", "--wide-hidden", "0", "--num-prompts", "2",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == EXIT_ENVIRONMENT and err.count("\n") == 1 and "TORCH_EXTENSIONS_DIR" in err, err
    assert "compiler" not in err, err
    monkeypatch.setenv(compiled_loops.LOOPS_ENV, "auto")
    monkeypatch.setattr(compiled_loops, "_state", {})
    with pytest.warns(RuntimeWarning, match="cannot write their build folder .*using the torch-op versions"):
        assert compiled_loops.library() is None
    assert compiled_loops.status()["path"] == "torch ops"


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ("exp", "log", "cos", "sqrt"))
def test_chunked_library_math_is_the_python_chunk_loop_bit_for_bit(loops, name, dtype, threads, monkeypatch):
    """``cpu_elementwise.unary`` on the library function, compiled (one call, its chunks spread over threads) against
    its Python chunk loop (the loops answering None), bitwise, at 1 and 2 threads: sizes around the vector multiple
    and the chunk (one, several and a partial last chunk), a non-contiguous operand, and in place on scratch."""
    from vexact_kernels import cpu_exact
    from vexact_kernels.host_guard import HostGuard

    library = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")  # given: fixed-order mode takes no library function
    sizes = [(0,), (1,), (63,), (64,), (3, 65), (cpu_elementwise.CHUNK,), (cpu_elementwise.CHUNK + 1,), (5, 30011)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, shape in enumerate(sizes):
            x = _values(shape, torch.float64, seed=i).abs().clamp(max=80.0).to(dtype)  # exp finite, log defined
            views = [x] + ([x.view(shape[0], -1).t()] if x.dim() == 2 else [])
            for view in views:
                for inplace in (False, True):
                    got = cpu_elementwise.unary(name, view.clone() if inplace else view, library, "test", inplace)
                    with monkeypatch.context() as patched:
                        patched.setattr(compiled_loops, "library", lambda: None)
                        expected = cpu_elementwise.unary(name, view.clone() if inplace else view, library, "test",
                                                    inplace)
                    assert got.shape == expected.shape == view.shape
                    assert torch.equal(_bits(got), _bits(expected)), (name, shape, inplace)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_log_probs_through_the_compiled_chunk_loop_are_the_python_loops(loops, dtype, threads, monkeypatch):
    """The heads' ops whose chunked exp and log now run in one compiled call (``log_softmax``, ``token_logprobs``,
    ``entropy``), on a vocabulary of several chunks, against the Python chunk loop: bitwise, fp32 and bf16 logits,
    at 1 and 2 threads."""
    from vexact_kernels import cpu_exact

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3, 20000, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 20000, (6, 3), generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for compiled in (True, False):
            with monkeypatch.context() as patched:
                if not compiled:
                    patched.setattr(cpu_exact.compiled_loops, "library", lambda: None)
                log_probs = cpu_exact.log_softmax(logits)
                results.append((log_probs, cpu_exact.token_logprobs(logits, targets), cpu_exact.entropy(log_probs)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", [(128, 22), (3, 5, 100), (2, 33000), (4, 70), (0, 9)])
def test_token_logprobs_with_grad_loops_are_the_torch_ops_bit_for_bit(loops, shape, dtype, threads, monkeypatch):
    """``token_logprobs`` with a gradient (a training step's): the compiled forward that keeps each row's max and log
    normalizer, and the compiled VJP, against the torch ops (the loops answering None), output and logits gradient
    bitwise, at 1 and 2 threads: special values, a transposed operand, a vocabulary of several chunks, a total not a
    multiple of the vector width; a target outside the vocabulary is refused."""
    from vexact_kernels import cpu_exact

    gen = torch.Generator().manual_seed(sum(shape) + 1)
    logits = _values(shape, torch.float64, seed=len(shape) + 1).clamp(-1e30, 1e30).to(dtype)
    logits[..., :1] = 3.0  # every row has a finite maximum
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    upstream = torch.randn(shape[:-1], generator=gen)
    if cpu_exact._token_logprobs_loops(logits.float(), targets, cpu_exact.HOST) is None:
        pytest.skip("this host's guard keeps exp or log off the library function: the loops are not taken")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for operand in (logits, logits.transpose(0, 1).contiguous().transpose(0, 1)):
            results = []
            for compiled in (True, False):
                with monkeypatch.context() as patched:
                    if not compiled:
                        patched.setattr(compiled_loops, "library", lambda: None)
                    leaf = operand.detach().requires_grad_(True)
                    out = cpu_exact.token_logprobs(leaf, targets)
                    (out * upstream).sum().backward()
                    results.append((out.detach(), leaf.grad))
            (got, got_grad), (expected, expected_grad) = results
            assert got.shape == targets.shape and got_grad.shape == operand.shape and got_grad.dtype == dtype
            assert torch.equal(_bits(got), _bits(expected))
            assert torch.equal(_bits(got_grad), _bits(expected_grad))
        if targets.numel():
            row = torch.zeros(shape[:-1])
            with pytest.raises(RuntimeError, match="outside"):
                loops.token_logprobs_backward(logits.float(), row, row, targets + shape[-1], row, 32704, 64)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", [(128, 22), (3, 5, 100), (2, 33000), (4, 70), (0, 9)])
def test_token_logprobs_loop_is_the_torch_ops_bit_for_bit(loops, shape, dtype, threads, monkeypatch):
    """``token_logprobs`` without grad (a decode step's) in one compiled call against the torch ops and the Python
    chunk loop (the loops answering None), bitwise, at 1 and 2 threads: special values (infinities, signed zeros,
    subnormals), a transposed operand, a vocabulary of several chunks; a target outside the vocabulary is refused."""
    from vexact_kernels import cpu_exact

    gen = torch.Generator().manual_seed(sum(shape))
    logits = _values(shape, torch.float64, seed=len(shape)).clamp(-1e30, 1e30).to(dtype)
    logits[..., :1] = 3.0  # every row has a finite maximum (an all -inf row is NaN either way)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for operand in (logits, logits.transpose(0, 1).contiguous().transpose(0, 1)):
            got = cpu_exact.token_logprobs(operand, targets)
            with monkeypatch.context() as patched:
                patched.setattr(compiled_loops, "library", lambda: None)
                expected = cpu_exact.token_logprobs(operand, targets)
            assert got.shape == expected.shape == targets.shape
            assert torch.equal(_bits(got), _bits(expected))
        if targets.numel():
            with pytest.raises(RuntimeError, match="outside"):
                loops.token_logprobs_forward(logits.float(), targets + shape[-1], 32704, 64)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("shape", [(3, 17, 176), (5, 30011), (7,), (0, 4)])
def test_silu_mul_forward_with_its_exp_in_the_loop_is_the_split_calls(loops, shape, threads, monkeypatch):
    """The SwiGLU forward with the negation and chunked exp inside the compiled call against the negation, the Python
    chunk loop and ``silu_mul_forward`` (``_library_math`` answering None): output, saved 1 + exp(-gate) and silu,
    bitwise, at 1 and 2 threads (several chunks spread over threads), on special values."""
    from vexact_kernels import cpu_exact

    gate = _values(shape, torch.float64, seed=sum(shape) + 7).clamp(-1e30, 1e30).float()
    up = _values(shape, torch.float64, seed=sum(shape) + 8).clamp(-1e30, 1e30).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_exact._silu_mul_compiled(gate, up, cpu_exact.HOST, loops)
        with monkeypatch.context() as patched:
            patched.setattr(cpu_exact, "_library_math", lambda *args: None)
            expected = cpu_exact._silu_mul_compiled(gate, up, cpu_exact.HOST, loops)
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("output", "1 + exp(-gate)", "silu"), got, expected):
        assert a.shape == b.shape == gate.shape and torch.equal(_bits(a), _bits(b)), name


def test_a_build_killed_midway_does_not_make_later_builds_wait_forever(tmp_path, monkeypatch):
    """torch's builder guards a build with a plain ``O_EXCL`` file, ``<build dir>/lock``; a build killed by
    ``kill -9`` left it there and every later process waited for it forever (in mode ``auto``: every vexact command).
    The build is simulated (torch's real ``load``, its compile and import replaced); torch's wait on its lock file
    raises after a few polls here instead of spinning forever."""
    import types

    from torch.utils import cpp_extension, file_baton

    def wait_a_little(baton):
        for _ in range(5):
            if not os.path.exists(baton.lock_file_path):
                return
            time.sleep(0.01)
        raise TimeoutError(f"would wait forever for {baton.lock_file_path}")

    built = types.ModuleType("simulated_loops")
    monkeypatch.setattr(file_baton.FileBaton, "wait", wait_a_little)
    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", lambda **kw: None)
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda name, directory, python_module: built)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(compiled_loops.LOOPS_ENV, "compiled")
    monkeypatch.setattr(compiled_loops, "_state", {})
    directory = compiled_loops._build_directory(compiled_loops._build_name())
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # the killed build's
    assert compiled_loops.library() is built
    assert (directory / "complete").exists() and not (directory / "lock").exists()
