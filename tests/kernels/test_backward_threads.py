"""The exact CPU kernels' backward contract: every gradient is the same bits at 1, 2, 3 and 4 torch threads.

What thread invariance means here: for each op of ``cpu_exact`` (and for fp32 and bf16 compute), the gradients of
a fixed loss with respect to every input are ``torch.equal`` whatever ``torch.set_num_threads`` was during forward
and backward. The shapes are large enough that the library would split work between threads (more than ATen's
grain of 32768 elements, GEMMs with hundreds of rows). The update (``vexact.rl.optim``: clipping and AdamW) is
checked the same way.

The linear and attention contracts also run on emulated hosts (``test_host_guard.EMULATED_HOSTS``: an Intel
Xeon whose bf16 GEMM splits a long reduction between threads when a call's tiles leave a thread idle; one whose
GEMM accumulates by the number of rows in the call), on any CPU.

Counter-tests show the checks can fail: a GEMM that is one ulp off whenever more than one thread runs breaks the
gradients of an unguarded kernel, and the guard catches it (fallback to the fixed-order GEMM, bits equal again).
"""

from __future__ import annotations

import pytest
import torch
from test_host_guard import EMULATED_HOSTS, SOUND, emulated_ops, intel_amx_like_bmm, thread_dependent_bmm

from vexact.rl.optim import ExactAdamW, clip_flat_gradient_
from vexact_kernels import cpu_exact
from vexact_kernels.host_guard import HostGuard

THREADS = (1, 2, 3, 4)
DTYPES = (torch.float32, torch.bfloat16)
HOSTS = ("this-host", *EMULATED_HOSTS)


def _ops(host: str, monkeypatch: pytest.MonkeyPatch):
    """The exact CPU ops on this machine's own libraries (the process's guard), or over an emulated host's
    primitives (a fresh guard, mode auto; ``emulated_guard``)."""
    if host == "this-host":
        return cpu_exact
    return emulated_ops(host, monkeypatch)


def _gradients(loss_of, inputs: list[torch.Tensor], threads: int) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = loss_of(*leaves)
        weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out).to(out.dtype)  # a non-trivial upstream grad
        wanted = [t for t in leaves if t.requires_grad]
        return list(torch.autograd.grad(out, wanted, weights))
    finally:
        torch.set_num_threads(before)


def _with(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _same_at_every_thread_count(loss_of, inputs: list[torch.Tensor]) -> None:
    reference = _gradients(loss_of, inputs, 1)
    assert all(g.abs().sum() > 0 for g in reference), "every gradient must be non-zero for the check to mean much"
    for threads in THREADS[1:]:
        grads = _gradients(loss_of, inputs, threads)
        for i, (a, b) in enumerate(zip(reference, grads)):
            assert torch.equal(a, b), f"gradient {i} differs at {threads} threads vs 1"


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_backward_contract(dtype, bias, host, monkeypatch):
    """grad_x, grad_weight (a reduction over 700 tokens: three 256-token chunks in fp32; one 768-token chunk on a
    bf16 GEMM the guard admits, in three row tiles) and grad_bias."""
    ops = _ops(host, monkeypatch)
    inputs = [_randn(2, 350, 96, dtype=dtype), _randn(176, 96, dtype=dtype, seed=1, scale=0.1)]
    if bias:
        inputs.append(_randn(176, dtype=dtype, seed=2))
    _same_at_every_thread_count(lambda x, w, *b: ops.linear(x, w, *b), inputs)


def test_the_emulated_intel_host_splits_where_the_probe_arrangements_did_not_look():
    """The emulated host's defect is real and hidden: at 2 threads its bf16 GEMM gives other bits for three 64-row
    tiles of a 768-long reduction (a weight gradient's chunk for 176 output rows), and the same bits as at 1 thread
    for the tile counts the guard's probe used before it also ran three of the tallest tiles (1, 2, 4, 8, 16, 48)."""
    from vexact_kernels.host_guard import order_revealing

    gen = torch.Generator().manual_seed(7)
    rows, cols = order_revealing(torch.randn(192, 768, generator=gen), torch.randn(96, 768, generator=gen), 7)
    rows, cols = rows.bfloat16(), cols.bfloat16()

    def differing(tiles: int) -> int:
        a = rows[: tiles * (192 // 3)].reshape(tiles, -1, 768) if tiles <= 3 else rows[:64].reshape(tiles, -1, 768)
        b = cols.t().expand(tiles, 768, 96)
        at_one, at_two = (_with(threads, lambda: intel_amx_like_bmm(a, b)) for threads in (1, 2))
        return int((at_one != at_two).sum())

    assert differing(3) > 0
    assert [differing(tiles) for tiles in (1, 2, 4, 8, 16)] == [0] * 5


def test_the_probe_alone_also_catches_the_emulated_intel_host(monkeypatch):
    """Without the one-thread rule for bf16 weight gradients, the probe's three tallest tiles catch the emulated
    host at 2 threads: the class takes ``blas-1-thread`` and the contract holds (two defences, each sufficient)."""
    from vexact_kernels import gemm_weight_gradient

    monkeypatch.setattr(gemm_weight_gradient, "one_thread_reduction", lambda dtype: False)
    ops = _ops("intel-amx", monkeypatch)
    inputs = [_randn(2, 350, 96, dtype=torch.bfloat16), _randn(176, 96, dtype=torch.bfloat16, seed=1, scale=0.1)]
    _same_at_every_thread_count(ops.linear, inputs)
    (chunk,) = [p for p in ops.host.report()["probes"] if p["shape_class"].startswith("K=768")]
    assert chunk["path"] == "blas-1-thread" and "3 tiles of 64 rows" in chunk["note"], chunk


def test_a_bf16_weight_gradient_runs_its_gemm_with_one_thread_by_construction(monkeypatch):
    """On the emulated host the bf16 weight gradient's chunk class takes ``blas-1-thread`` by construction (probed at
    1 thread only), whatever the probes at other thread counts would find."""
    ops = _ops("intel-amx", monkeypatch)
    inputs = [_randn(2, 350, 96, dtype=torch.bfloat16), _randn(176, 96, dtype=torch.bfloat16, seed=1, scale=0.1)]
    _gradients(ops.linear, inputs, 2)
    reductions = [p for p in ops.host.report()["probes"] if p["shape_class"].endswith("one-thread")]
    assert [(p["shape_class"], p["path"], p["threads_checked"]) for p in reductions] == \
        [("K=768 N=96 transposed per-tile bfloat16 one-thread", "blas-1-thread", [1])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_backward_contract(dtype):
    inputs = [_randn(600, 96, dtype=dtype), 1.0 + _randn(96, dtype=dtype, seed=1, scale=0.1)]
    _same_at_every_thread_count(lambda x, w: cpu_exact.rms_norm(x, w, 1e-6), inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_backward_contract(dtype):
    inputs = [_randn(500, 176, dtype=dtype, scale=3.0), _randn(500, 176, dtype=dtype, seed=1)]
    _same_at_every_thread_count(cpu_exact.silu_mul, inputs)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_contract(dtype, host, monkeypatch):
    """Prefill of 4 sequences x 90 positions, 4 query / 2 KV heads: reductions over queries and 2 key tiles."""
    ops = _ops(host, monkeypatch)
    q, k, v = _randn(4, 90, 4, 16, dtype=dtype), _randn(4, 90, 2, 16, dtype=dtype, seed=1), \
        _randn(4, 90, 2, 16, dtype=dtype, seed=2)
    q_start = torch.zeros(4, dtype=torch.long)
    _same_at_every_thread_count(lambda q, k, v: ops.attention(q, k, v, q_start, 0.25), [q, k, v])


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_backward_contract(dtype):
    _same_at_every_thread_count(cpu_exact.log_softmax, [_randn(2000, 50, dtype=dtype, scale=3.0)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_backward_contract(dtype):
    targets = torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(3))
    _same_at_every_thread_count(lambda logits: cpu_exact.token_logprobs(logits, targets),
                                [_randn(2000, 50, dtype=dtype, scale=3.0)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_contract(dtype):
    """3000 tokens over a 40-token vocabulary, skewed so some tokens repeat hundreds of times."""
    gen = torch.Generator().manual_seed(4)
    tokens = (torch.rand(3000, generator=gen) ** 3 * 40).long()
    _same_at_every_thread_count(lambda w: cpu_exact.embedding(tokens, w) * 1.5,
                                [_randn(40, 96, dtype=dtype)])


def test_embedding_backward_sums_each_tokens_rows_in_position_order():
    """grad_weight[v] is the halving tree of v's gradient rows (position order); the chunking by count is invisible."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.tensor([3, 1, 3, 3, 0, 1, 3, 3, 3])
    rows = torch.randn(9, 8, generator=gen) * 10.0 ** torch.randint(-3, 4, (9, 1), generator=gen)
    out = cpu_exact._sum_rows_by_token(tokens, rows, 5)
    r = rows
    # token 3's rows x = (r0, r2, r3, r6, r7, r8), a halving tree padded to 8: ((x0+x4) + (x2+0)) + ((x1+x5) + (x3+0))
    assert torch.equal(out[3], ((r[0] + r[7]) + (r[3] + 0.0)) + ((r[2] + r[8]) + (r[6] + 0.0)))
    assert torch.equal(out[1], r[1] + r[5]) and torch.equal(out[0], r[4] + 0.0)
    assert torch.equal(out[2], torch.zeros(8)) and torch.equal(out[4], torch.zeros(8))
    # a tiny chunk budget (one token per chunk) gives the same bits
    budget = cpu_exact.EMBEDDING_PAD_BUDGET
    try:
        cpu_exact.EMBEDDING_PAD_BUDGET = 1
        assert torch.equal(cpu_exact._sum_rows_by_token(tokens, rows, 5), out)
    finally:
        cpu_exact.EMBEDDING_PAD_BUDGET = budget


def test_backward_matches_native_within_tolerance():
    """Correctness against torch's own autograd (fp32, relative tolerance 1e-5 of each gradient's scale)."""
    from vexact_kernels import native

    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(300, 64, generator=gen), torch.randn(176, 64, generator=gen) * 0.1
    q, k, v = (torch.randn(2, 40, h, 16, generator=gen) for h in (4, 2, 2))
    tokens = torch.randint(0, 22, (300,), generator=gen)
    table = torch.randn(22, 64, generator=gen)
    cases = [(lambda x, w, ops: ops.linear(x, w), [x, w]),
             (lambda x, w, ops: ops.rms_norm(x, w[0], 1e-6), [x, w]),
             (lambda x, w, ops: ops.silu_mul(x, x * 0.5 + 1.0), [x, w]),
             (lambda q, k, v, ops: ops.attention(q, k, v, torch.zeros(2, dtype=torch.long), 0.25), [q, k, v]),
             (lambda x, ops: ops.log_softmax(x), [x]),
             (lambda x, ops: ops.token_logprobs(x, tokens % 64), [x]),
             (lambda t, ops: ops.embedding(tokens, t), [table]),
             (lambda x, ops: ops.entropy(ops.log_softmax(x)), [x])]
    for fn, inputs in cases:
        grads = []
        for ops in (cpu_exact, native):
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            out = fn(*leaves, ops)
            weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
            grads.append(torch.autograd.grad(out, leaves, weights, allow_unused=True))
        for a, b in zip(*grads):
            if a is None and b is None:
                continue
            scale = b.abs().max().clamp_min(1e-12)
            assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(scale)), (fn, float((a - b).abs().max() / scale))


def test_guard_catches_a_thread_dependent_gemm_in_the_backward():
    """A GEMM one ulp off at more than one thread: unguarded, the gradients differ between 1 and 2 threads; guarded,
    the probe catches it (every GEMM class then calls the library with 1 thread: blas-1-thread) and the gradients
    are equal again."""
    inputs = [_randn(300, 64, dtype=torch.float32), _randn(80, 64, dtype=torch.float32, seed=1)]
    broken = dict(SOUND, bmm=thread_dependent_bmm)

    def linear_with(host: HostGuard):
        return lambda x, w: cpu_exact.linear(x, w, host=host)

    unguarded = HostGuard(cpu_exact.ROW_BLOCKS, mode="unguarded", **broken)
    a, b = (_gradients(linear_with(unguarded), inputs, t) for t in (1, 2))
    assert not all(torch.equal(x, y) for x, y in zip(a, b)), "the broken GEMM must break the unguarded backward"

    guarded = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto", **broken)
    a, b = (_gradients(linear_with(guarded), inputs, t) for t in (2, 1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert {p["path"] for p in guarded.report()["probes"]} == {"blas-1-thread"}


def test_update_is_thread_invariant():
    """Clipping (tree-summed norm) and ExactAdamW on a 200k-parameter tensor: same bits at 1-4 threads."""
    def update(threads: int) -> tuple[float, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            param = torch.nn.Parameter(_randn(200_000, dtype=torch.float32))
            optimizer = ExactAdamW([param], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
            norms = []
            for step in range(3):
                grad = _randn(200_000, dtype=torch.float32, seed=10 + step, scale=3.0)
                norms.append(clip_flat_gradient_(grad, 1.0))
                param.grad = grad
                optimizer.step()
            return norms, param.detach().clone()
        finally:
            torch.set_num_threads(before)

    ref_norms, ref_param = update(1)
    for threads in THREADS[1:]:
        norms, param = update(threads)
        assert norms == ref_norms and torch.equal(param, ref_param), f"{threads} threads"


def test_exact_adamw_matches_torch_adamw():
    """ExactAdamW is AdamW: within 1e-6 relative of torch's over 5 steps (only the rounding of fused ops differs)."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(5)]
    params = []
    for cls in (ExactAdamW, torch.optim.AdamW):
        param = torch.nn.Parameter(start.clone())
        optimizer = cls([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
        for g in grads:
            param.grad = g.clone()
            optimizer.step()
        params.append(param.detach())
    assert torch.allclose(params[0], params[1], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- a whole run
RUN_CASES = {
    # test_data_parallel's TINY: logit noise, token TIS, an entropy bonus, 2 mini-batches x 2 PPO epochs, fp32
    "noise_tis_minibatches": {},
    # the same in bf16 with micro-batches and a KL term to the reference policy
    "bf16_kl_micro_batches": {"dtype": "bfloat16", "algorithm.micro_batch_size": 4, "algorithm.kl_coef": 0.05},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", RUN_CASES)
def test_a_whole_run_is_the_same_bits_at_1_and_2_threads(tmp_path, case):
    """Warm start (each run trains its own), rollouts, scoring, the update and evaluation at ``threads: 1`` and
    ``threads: 2``: metrics.jsonl (timing aside) and every checkpoint tensor bitwise equal -- and the policy moved."""
    from test_data_parallel import _config_file, _result, _same, _vexact_run

    results = []
    for threads in (1, 2):
        (tmp_path / f"t{threads}").mkdir()
        config = _config_file(tmp_path / f"t{threads}", threads=threads, **{"distributed.leaves": 1, **RUN_CASES[case]})
        _vexact_run(config, tmp_path / f"run{threads}")
        results.append(_result(tmp_path / f"run{threads}"))
    metrics, _ = results[0]
    assert all(row["actor/grad_norm"] > 0 for row in metrics if "actor/grad_norm" in row), "the policy must move"
    assert _same(*results), f"{case}: threads 1 and 2 differ"


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_backward_contract(dtype):
    """The entropy of 2000 rows of a 50-token vocabulary (100k elements: split between threads by the library)."""
    _same_at_every_thread_count(lambda logits: cpu_exact.entropy(cpu_exact.log_softmax(logits)),
                                [_randn(2000, 50, dtype=dtype, scale=3.0)])
