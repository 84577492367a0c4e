"""oneDNN's GEMM on a weight packed once (``gemm_packed.PACK_AFTER_CALLS``): a form of the same calls, checked.

A plan that runs torch's oneDNN linear -- an fp32 class on ``onednn_rows`` (its canonical tiles), a bf16 class's
``stacked`` arrangement (whose ``torch.mm`` is oneDNN's), or a bf16 class's canonical call (whose ``bmm`` is oneDNN's:
the ``laid out`` plan, in mode ``canonical``; packed, one call per tile) -- switches, after ``PACK_AFTER_CALLS`` calls
of one weight version (or at once where the version is packed already), to the same op on the weight packed once in
oneDNN's layout, where a first-use check found the packed call's bits equal to the call it replaces. So:

- a decode loop longer than that gives every call the bits of its first call, and of a guard that never packs, at 1
  and 2 threads, fp32 and bf16, in modes ``auto`` and ``canonical`` -- and (where this host packs) it did pack;
- a packing whose bits differ (a perturbed weight swapped in) fails the check and is never used;
- end to end, a model with layers above the size generates past the switch and its rollout log-probs equal the
  training path's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads, random_prompts, recorded_returns

from vexact import ModelConfig, Transformer, generate, token_logprobs
from vexact_kernels import (
    compiled_loops,
    cpu_exact,
    fused_linears,
    gemm_laid_out,
    gemm_linear,
    gemm_packed,
    host_guard,
)
from vexact_kernels.host_guard import HostGuard

pytestmark = pytest.mark.skipif(not host_guard.onednn_packing(),
                                reason="this torch build or CPU has no oneDNN linear op with weight packing")

K, N = 512, 512  # K x N = ONEDNN_MIN_WEIGHT: the smallest class that may pack
CALLS = gemm_packed.PACK_AFTER_CALLS + 4


def _operands(dtype: torch.dtype, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(rows, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)


def _packed_kept(w: torch.Tensor) -> bool:
    """Whether a packed copy of ``w`` is laid out (``arranged_weight``'s form ``onednn packed``)."""
    return any(key[0][0] == "onednn packed" for key in gemm_laid_out._ARRANGED.get(w, {}))


def _decode_loop(x: torch.Tensor, w: torch.Tensor, host: HostGuard) -> list[torch.Tensor]:
    with torch.no_grad():  # a rollout's calls: the plan holds its operands
        return [gemm_linear.tiled_matmul(x, w, host) for _ in range(CALLS)]


def _loops_packed_and_never_packed(x: torch.Tensor, w: torch.Tensor, threads: int, monkeypatch, mode: str = "auto"
                                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A decode loop on ``w`` as a guard in ``mode`` runs it, and one on a copy of ``w`` with packing off: (its
    outputs, the reference outputs, the copy)."""
    with num_threads(threads):
        outs = _decode_loop(x, w, HostGuard(cpu_exact.ROW_BLOCKS, mode=mode))
        with monkeypatch.context() as never_packs:
            never_packs.setattr(gemm_packed, "packable", lambda *shape: False)
            w_unpacked = w.clone()
            reference = _decode_loop(x, w_unpacked, HostGuard(cpu_exact.ROW_BLOCKS, mode=mode))
    return outs, reference, w_unpacked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["auto", "canonical"])
@pytest.mark.parametrize("rows", [8, 100], ids=["one-tile", "two-tiles"])
def test_a_decode_loop_past_the_switch_keeps_its_first_calls_bits(dtype, threads, mode, rows, monkeypatch):
    """In ``canonical`` a bf16 class runs its canonical call (``operand_per_tile``, ``laid out``), which packs too
    (one oneDNN call per tile, ``each tile``); in ``auto`` its ``stacked`` arrangement (where the probe passed)."""
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    x, w = _operands(dtype, rows)
    outs, reference, w_unpacked = _loops_packed_and_never_packed(x, w, threads, monkeypatch, mode)
    assert all(torch.equal(out, reference[0]) for out in outs + reference)
    assert not _packed_kept(w_unpacked)
    with torch.no_grad(), num_threads(threads):  # the weight's other uses while its packed copy is kept
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        wider = gemm_linear.tiled_matmul(torch.cat([x, x]), w, host)  # another call shape: a new plan
        input_grad = gemm_linear.tiled_matmul(x, w.t(), host)  # an input gradient's operand: W, laid out
        reference_grad = gemm_linear.tiled_matmul(x, w_unpacked.t(), host)
    assert torch.equal(wider[: x.shape[0]], reference[0]) and torch.equal(input_grad, reference_grad)
    checked = [key for key in gemm_packed._PACKED_CHECKS if key[5] == dtype]
    if checked:  # this host runs the class on oneDNN (fp32: onednn_rows; bf16: the stacked arrangement)
        assert all(gemm_packed._PACKED_CHECKS[key] for key in checked), "packed bits differ on this host"
        assert _packed_kept(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["auto", "canonical"])
def test_a_training_call_on_a_weight_packed_by_its_rollout_runs_packed_at_once(dtype, mode, monkeypatch):
    """A call of another shape on a weight version a decode loop packed (the RL step's scoring and update after its
    rollout: 320 rows, five tiles) takes the packed run from its first call, not after ``PACK_AFTER_CALLS`` -- with
    the bits of a guard that never packs."""
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    asked = []
    real_run = gemm_packed._packed_run

    def recorded(weight, plan):
        asked.append(plan.blocks * plan.block)
        return real_run(weight, plan)

    monkeypatch.setattr(gemm_packed, "_packed_run", recorded)
    x, w = _operands(dtype)
    training_rows = torch.randn(320, K, generator=torch.Generator().manual_seed(7)).to(dtype)
    outs, reference, w_unpacked = _loops_packed_and_never_packed(x, w, 1, monkeypatch, mode)
    with num_threads(1), torch.no_grad():
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        packed_first = gemm_linear.tiled_matmul(training_rows, w, host)
        unpacked_first = gemm_linear.tiled_matmul(training_rows, w_unpacked, host)
    assert all(torch.equal(out, reference[0]) for out in outs)
    assert torch.equal(packed_first, unpacked_first)
    if _packed_kept(w) and any(key[1] > 1 and ok for key, ok in gemm_packed._PACKED_CHECKS.items()):
        assert asked[-1] == 320, asked  # the training call's plan asked for its packed run at its first call


@pytest.mark.parametrize("threads", [1, 2])
def test_a_small_bf16_class_packs_where_its_gemm_is_onednn_already(threads, monkeypatch):
    """Below ``ONEDNN_MIN_WEIGHT`` a bf16 class packs only where torch's mm of its padded rows runs oneDNN's GEMM
    already (``onednn_bf16_bmm``; llama100m's k/v projections): a decode loop past the switch keeps its first call's
    bits, those of a guard that never packs, and (where the rule holds and the check passed) it packed."""
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(8, 576, generator=g).bfloat16(), (torch.randn(192, 576, generator=g) * 0.04).bfloat16()
    assert 576 * 192 < host_guard.ONEDNN_MIN_WEIGHT
    outs, reference, w_unpacked = _loops_packed_and_never_packed(x, w, threads, monkeypatch)
    assert all(torch.equal(out, reference[0]) for out in outs + reference)
    rows = gemm_linear.tiled_rows(x, w, HostGuard(cpu_exact.ROW_BLOCKS, mode="auto"))
    checked = [key for key in gemm_packed._PACKED_CHECKS if key[5] == torch.bfloat16]
    if gemm_laid_out.onednn_bf16_bmm(torch.bfloat16, rows * 576 * 192) and checked:
        assert _packed_kept(w) == all(gemm_packed._PACKED_CHECKS[key] for key in checked)
    else:
        assert not _packed_kept(w)


@pytest.mark.parametrize("rows", [8, 100], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("mode", ["auto", "canonical"])
def test_no_bf16_weight_is_packed_on_a_cpu_without_onednn_bf16(mode, rows, monkeypatch):
    """On a CPU without oneDNN's bf16 kernels (an AVX2-only AMD EPYC: ``onednn_bf16`` false, where packing a bf16
    weight raises) no bf16 class is packable and a decode loop past the switch runs unpacked, with the bits of a
    guard that never packs, its weights fused or not; fp32 classes still may pack. Emulated on every host (the
    packing op raises for bf16, as there, so a bf16 packing tried anyway fails this test)."""
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    monkeypatch.setattr(host_guard, "onednn_bf16", lambda: False)
    true_packed = host_guard.onednn_packed

    def packed_as_that_cpu(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                               "avx512bw, avx512vl and avx512dq")
        return true_packed(weight)

    for module in (gemm_packed, fused_linears):
        monkeypatch.setattr(module, "onednn_packed", packed_as_that_cpu)
    assert not gemm_packed.packable(K, N, torch.bfloat16, rows) and not host_guard.onednn_packing(torch.bfloat16)
    assert gemm_packed.packable(K, N, torch.float32) == host_guard.onednn_packing()
    x, w = _operands(torch.bfloat16, rows)
    outs, reference, _ = _loops_packed_and_never_packed(x, w, 1, monkeypatch, mode)
    assert all(torch.equal(out, reference[0]) for out in outs + reference)
    assert not _packed_kept(w)
    weights = [w, w.clone() * 0.5]
    with torch.no_grad():
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        fused = [cpu_exact.linears(x, weights, host=host) for _ in range(CALLS)]
        alone = [cpu_exact.linear(x, weight, host=HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)) for weight in weights]
    assert all(torch.equal(a, b) for out in fused for a, b in zip(out, alone))


def test_a_packing_whose_bits_differ_is_never_used(monkeypatch):
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    true_packed = host_guard.onednn_packed

    def perturbed(weight: torch.Tensor) -> torch.Tensor:  # another weight's packing: what the check exists to catch
        return true_packed(weight * (1 + 2.0 ** -10))

    monkeypatch.setattr(gemm_packed, "onednn_packed", perturbed)
    x, w = _operands(torch.float32)
    outs = _decode_loop(x, w, HostGuard(cpu_exact.ROW_BLOCKS, mode="auto"))
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert not _packed_kept(w)
    assert list(gemm_packed._PACKED_CHECKS.values()) in ([], [False])  # [] where the class is not on oneDNN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["auto", "canonical"])
def test_rollout_past_the_switch_equals_training_logprobs(dtype, mode, monkeypatch):
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    config = ModelConfig(vocab_size=512, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=4,
                         intermediate_size=512, max_seq_len=64)  # q, o, gate, up, down and the head: 2^18 weights
    model = Transformer(config, backend="exact", dtype=dtype, init_seed=3)
    ops = cpu_exact.ops_in_mode(mode)
    prompts = random_prompts(3, 12, seed=4, vocab=config.vocab_size)
    out = generate(model, prompts, max_new_tokens=gemm_packed.PACK_AFTER_CALLS + 6, seed=2, ops=ops)
    scored = token_logprobs(model, prompts, out.tokens, ops=ops)
    for i, (a, b) in enumerate(zip(out.logprobs, scored)):
        assert torch.equal(a, b.detach()), f"sequence {i}: rollout != training log-probs"
    if any(gemm_packed._PACKED_CHECKS.values()):  # this host packs these classes: the rollout ran packed
        assert any(_packed_kept(p) for p in model.parameters())


def test_no_weight_is_packed_beyond_the_bound(monkeypatch):
    """A packed weight counts against ``ARRANGED_BYTES_MAX`` as every laid-out operand does: with no room under it,
    a decode loop past the switch packs nothing (no copy kept, none held by its plan) and keeps its first call's
    bits."""
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    monkeypatch.setattr(gemm_laid_out, "ARRANGED_BYTES_MAX", 0)
    x, w = _operands(torch.float32)
    runs = []
    real_run = gemm_packed._packed_run

    def recorded(*args, **kwargs):  # what each plan got when it asked for its packed run
        runs.append(real_run(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(gemm_packed, "_packed_run", recorded)
    outs = _decode_loop(x, w, HostGuard(cpu_exact.ROW_BLOCKS, mode="auto"))
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert not _packed_kept(w)
    assert runs in ([], [None])  # [] where this host runs the class on no oneDNN linear


@pytest.fixture
def loops():
    """The compiled loops (``packed_linear``), or a skip where they are not built."""
    library = compiled_loops.library()
    if library is None:
        pytest.skip("no compiled loops on this host")
    return library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("calls", gemm_packed.PACKED_CALLS)
@pytest.mark.parametrize("rows,blocks,n", [(8, 1, N), (8, 1, N - 24), (5, 2, N), (8, 3, N - 7), (40, 3, N)])
def test_the_compiled_packed_call_is_the_python_steps(loops, dtype, calls, rows, blocks, n):
    """``compiled_loops``' ``packed_linear`` (a decode step's packed GEMM in one call) against the steps it replaces:
    x's rows copied into the zero-padded buffer, oneDNN's linear on the packed weight over the rows, the tiles or each
    tile (``PACKED_CALLS``), the output's first rows and ``n`` columns -- bit for bit, with the buffer left as the
    steps leave it."""
    if not host_guard.onednn_packing(dtype):
        pytest.skip("this CPU has no oneDNN bf16 kernels: no bf16 weight is ever packed here")
    x, w = _operands(dtype, rows)
    packed = host_guard.onednn_packed(w)
    padded = 48
    buffer = torch.full((padded, K), float("nan"), dtype=dtype)
    buffer[rows:] = 0  # the kept buffer's rows past x's are zero (``kept_buffer``'s job)
    expected_input = torch.cat([x, torch.zeros(padded - rows, K, dtype=dtype)])
    expected = gemm_packed.packed_calls(expected_input, packed, blocks, calls)[:rows, :n]
    plan = gemm_packed.PackedLinear("stacked", dtype, padded // blocks, blocks, n, N, calls)
    with torch.no_grad():
        got = loops.packed_linear(x, buffer, packed, *plan.loop_arguments()[:1], n, plan.loop_arguments()[1])
    assert got.shape == (rows, n) and torch.equal(got, expected)
    assert torch.equal(buffer, expected_input)


def test_a_decode_loops_packed_calls_run_compiled(loops, monkeypatch):
    """Past the switch, a decode loop's packed calls are the compiled call (where the loops are built), with the bits
    of a guard that never packs."""
    calls = recorded_returns(monkeypatch, loops, "packed_linear")
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})
    x, w = _operands(torch.float32, rows=5)  # padded to a taller tile: the kept buffer's case
    outs, reference, _ = _loops_packed_and_never_packed(x, w, 1, monkeypatch)
    assert all(torch.equal(out, reference[0]) for out in outs + reference)
    padded = gemm_linear.tiled_rows(x, w, HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")) > x.shape[0]
    if _packed_kept(w) and padded:  # this host packs the class: the calls past the switch were compiled
        assert len(calls) >= CALLS - gemm_packed.PACK_AFTER_CALLS, len(calls)
