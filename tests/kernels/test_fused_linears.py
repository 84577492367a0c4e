"""Linear layers of one input in one GEMM (``cpu_exact.linears``, ``fused_linears``): each output is ``linear``'s.

A decode loop's q/k/v and gate/up projections run, after ``PACK_AFTER_CALLS`` calls, as one oneDNN linear on their
weights packed as one, where a first-use check found each weight's columns to keep the bits of its own packed call.
So:

- a decode loop past the switch gives each weight the bits of ``linear`` on it (a loop that never fuses), at 1 and
  2 threads, fp32 and bf16, in modes ``auto`` and ``canonical`` -- and where this host's check passed, it fused;
- a fused packing whose bits differ (a perturbed weight swapped in) fails the check and is never used;
- a new version of a weight (a training step's update) is packed again: the fused call follows the weight;
- with a gradient recorded, each linear runs as ``linear`` (the same gradients);
- a backend without ``linears`` (a wrapper of the contract's ops) sees one ``linear`` call per weight.
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads

from vexact_kernels import (
    contract,
    cpu_exact,
    fused_linears,
    gemm_laid_out,
    gemm_packed,
    gemm_tiles,
    host_guard,
    native,
)
from vexact_kernels.host_guard import HostGuard

pytestmark = pytest.mark.skipif(not host_guard.onednn_packing(),
                                reason="this torch build or CPU has no oneDNN linear op with weight packing")

K = 512
WIDTHS = (512, 512, 528)  # each K x N at least ONEDNN_MIN_WEIGHT (each packs alone); the last one's N_pad = N
CALLS = gemm_packed.PACK_AFTER_CALLS + 4


def _operands(dtype: torch.dtype, widths: tuple[int, ...] = WIDTHS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 1, K, generator=g).to(dtype)  # a decode step's [B, T, K]
    return x, [(torch.randn(n, K, generator=g) * K ** -0.5).to(dtype) for n in widths]


def _fused(weights: list[torch.Tensor]) -> bool:
    """Whether a group of these weights holds their packed concatenation."""
    return any(group.operands and len(group.weights) == len(weights)
               and all(r() is w for r, w in zip(group.weights, weights)) for group in fused_linears._GROUPS.values())


def _loop(x: torch.Tensor, weights: list[torch.Tensor], host: HostGuard) -> list[tuple[torch.Tensor, ...]]:
    with torch.no_grad():
        return [cpu_exact.linears(x, weights, host=host) for _ in range(CALLS)]


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    """Every test asks the first-use checks afresh."""
    monkeypatch.setattr(fused_linears, "_FUSED_CHECKS", {})
    monkeypatch.setattr(gemm_packed, "_PACKED_CHECKS", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["auto", "canonical"])
def test_linears_contract_past_the_switch_each_output_is_linears(dtype, threads, mode):
    """``linears``' invariance contract: a decode loop's every call gives each weight ``linear``'s bits (a loop that
    never fuses), before the switch and after it."""
    x, weights = _operands(dtype)
    with num_threads(threads):
        outs = _loop(x, weights, HostGuard(cpu_exact.ROW_BLOCKS, mode=mode))
        reference_weights = [w.clone() for w in weights]  # never fused: one linear each
        with torch.no_grad():
            reference_host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
            reference = [[cpu_exact.linear(x, w, host=reference_host) for w in reference_weights]
                         for _ in range(CALLS)]
    for step, (got, expected) in enumerate(zip(outs, reference)):
        assert len(got) == len(weights)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a.shape == b.shape == (8, 1, WIDTHS[i]) and a.dtype == dtype
            assert torch.equal(a, b), f"call {step}, weight {i}"
    if fused_linears._FUSED_CHECKS:  # this host's plans pack these weights alike: the check ran
        assert all(fused_linears._FUSED_CHECKS.values()), "the fused call's bits differ on this host"
        assert _fused(weights)


def test_the_group_packs_at_the_call_a_single_weight_packs_at():
    """The weights are packed as one at the call after ``PACK_AFTER_CALLS`` (the first call included), where each
    weight's own plan would pack: a benchmark that warms up past the switch times no packing."""
    x, weights = _operands(torch.bfloat16)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    with torch.no_grad():
        for _ in range(gemm_packed.PACK_AFTER_CALLS):
            cpu_exact.linears(x, weights, host=host)
        assert not _fused(weights)
        cpu_exact.linears(x, weights, host=host)
    checks = list(fused_linears._FUSED_CHECKS.values())  # [] where this host's plans do not pack these weights
    assert _fused(weights) == (checks != [] and all(checks))
    if any(gemm_packed._PACKED_CHECKS.values()):  # each weight's plan packs here: the group fused at this call
        assert checks and _fused(weights)


def test_a_fused_packing_whose_bits_differ_is_never_used(monkeypatch):
    true_packed = host_guard.onednn_packed

    def perturbed(weight: torch.Tensor) -> torch.Tensor:  # another weight's packing: what the check exists to catch
        return true_packed(weight * (1 + 2.0 ** -10))

    monkeypatch.setattr(fused_linears, "onednn_packed", perturbed)
    x, weights = _operands(torch.float32)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    outs = _loop(x, weights, host)
    with torch.no_grad():
        expected = [cpu_exact.linear(x, w, host=host) for w in weights]
    assert all(torch.equal(a, b) for out in outs for a, b in zip(out, expected))
    assert not _fused(weights)
    assert list(fused_linears._FUSED_CHECKS.values()) in ([], [False])  # [] where the weights' plans do not pack


def test_a_new_weight_version_is_packed_again():
    x, weights = _operands(torch.bfloat16)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    _loop(x, weights, host)
    with torch.no_grad():
        weights[1].mul_(0.5)  # a training step's in-place update: a new version
    after = _loop(x, weights, host)
    with torch.no_grad():
        expected = [cpu_exact.linear(x, w.clone(), host=HostGuard(cpu_exact.ROW_BLOCKS, mode="auto"))
                    for w in weights]
    assert all(torch.equal(a, b) for out in after for a, b in zip(out, expected))
    if fused_linears._FUSED_CHECKS:
        assert _fused(weights)


def test_with_a_gradient_each_linear_runs_as_linear():
    x, weights = _operands(torch.float32, (64, 48))
    leaves = [t.detach().requires_grad_() for t in (x, *weights)]
    out = cpu_exact.linears(leaves[0], leaves[1:])
    grads = torch.autograd.grad(sum(o.square().sum() for o in out), leaves)
    reference_leaves = [t.detach().requires_grad_() for t in (x, *weights)]
    reference = [cpu_exact.linear(reference_leaves[0], w) for w in reference_leaves[1:]]
    reference_grads = torch.autograd.grad(sum(o.square().sum() for o in reference), reference_leaves)
    assert all(torch.equal(a, b) for a, b in zip(out, reference))
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))


def test_a_backend_without_linears_sees_a_linear_call_per_weight():
    calls = []

    class Recording:  # a wrapper that offers only the contract's ops
        def linear(self, x, weight, bias=None):
            calls.append(weight)
            return native.linear(x, weight, bias)

    x, weights = _operands(torch.float32, (64, 48, 32))
    out = contract.linears(Recording(), x, weights)
    assert calls == weights
    assert all(torch.equal(a, native.linear(x, w)) for a, w in zip(out, weights))
    assert contract.FUSED_OP_NAMES == ("linears",)
    assert "Invariance contract:" in cpu_exact.linears.__doc__
    assert hasattr(cpu_exact.ops_in_mode("auto"), "linears")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("calls", [*gemm_packed.PACKED_CALLS, "laid out"])
@pytest.mark.parametrize("rows,blocks", [(8, 1), (5, 1), (16, 2), (7, 3)])
def test_the_compiled_fused_call_is_the_python_steps(dtype, calls, rows, blocks):
    """``compiled_loops``' ``packed_linears`` and ``bmm_linears`` (the fused call in one call: on the weights packed
    as one, or laid out as one for the canonical call of the tiles) against the steps they replace: x's rows padded to
    the tiles (the kept buffer, or x itself where it fills them), the GEMM, each weight's columns cut out -- bit for
    bit, contiguous, in x's leading shape."""
    from vexact_kernels import compiled_loops

    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("no compiled loops on this host")
    if calls != "laid out" and not host_guard.onednn_packing(dtype):
        pytest.skip("this CPU has no oneDNN bf16 kernels: no bf16 weight is ever packed here")
    block = 8
    _, weights = _operands(dtype, (40, 24, 64))
    x = torch.randn(rows, 1, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    pads = tuple(gemm_tiles.ceil_to(w.shape[0], gemm_tiles.COL_BLOCK) for w in weights)
    if calls == "laid out":
        plans = tuple(gemm_packed.LaidOutLinear("one call", dtype, block, blocks, w.shape[0], pad, True)
                      for w, pad in zip(weights, pads))
    else:
        plans = tuple(gemm_packed.PackedLinear("stacked", dtype, block, blocks, w.shape[0], pad, calls)
                      for w, pad in zip(weights, pads))
    operands = [torch.nn.functional.pad(w, (0, 0, 0, pad - w.shape[0])) for w, pad in zip(weights, pads)]
    operand = fused_linears.prepared(plans[0], torch.cat(operands))
    with torch.no_grad():
        got = fused_linears._fused_call(x, operand, plans, loops)
        expected = fused_linears._fused_call(x, operand, plans, None)
        reference = [native.linear(x, w) for w in weights]
    for a, b, r in zip(got, expected, reference):
        assert a.shape == b.shape == r.shape and a.is_contiguous() and b.is_contiguous()
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-2)  # the right columns (bf16 rounding)


def _canonical_tiles_fuse(k: int, widths: tuple[int, ...], rows: int, threads: int, kind: str, seed: int) -> None:
    """A bf16 decode loop of ``rows`` rows (two 64-row tiles) in mode ``canonical`` on weights [N, k] of ``widths``:
    every call gives each weight ``linear``'s bits (a loop that never fuses), and where this host's checks of the
    fused call of ``kind`` (``PackedLinear``, ``LaidOutLinear``) passed, the group holds its operand of that kind."""
    if not gemm_laid_out.operand_per_tile(torch.bfloat16, k, max(widths)):
        pytest.skip("torch's bf16 bmm does not run oneDNN here: no laid-out class")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=g).bfloat16()
    weights = [(torch.randn(n, k, generator=g) * k ** -0.5).bfloat16() for n in widths]
    with num_threads(threads):
        outs = _loop(x, weights, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
        with torch.no_grad():
            reference_host = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
            expected = [cpu_exact.linear(x, w.clone(), host=reference_host) for w in weights]
    assert all(torch.equal(a, b) for out in outs for a, b in zip(out, expected))
    checks = [ok for key, ok in fused_linears._FUSED_CHECKS.items() if key[1][0] == kind]
    if checks and all(checks):
        assert any(form[0] == kind for group in fused_linears._GROUPS.values() for form in group.operands)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_group_where_only_some_weights_pack_fuses_packed_in_canonical(threads):
    """Two bf16 tiles in mode ``canonical``: q (512 x 512) packs alone, k and v (128 x 512) are too small to pack alone
    over several tiles (llama100m's q beside its k/v). Past the switch the group runs their canonical call packed as
    one, one oneDNN call per tile (the three together are large enough)."""
    _canonical_tiles_fuse(K, (512, 128, 128), 100, threads, "PackedLinear", seed=10)


@pytest.mark.parametrize("threads", [1, 2])
def test_weights_too_small_to_pack_fuse_laid_out_in_canonical(threads):
    """Two bf16 tiles in mode ``canonical`` on weights too small to pack even together (the default model's q/k/v,
    64 -> 64, 32, 32, 128 rows): each weight's canonical call of the tiles is one ``bmm`` (``TiledPlan.laid_out``);
    past the switch, one on the weights laid out as one."""
    _canonical_tiles_fuse(64, (64, 32, 32), 128, threads, "LaidOutLinear", seed=9)


def test_an_moe_rollout_with_fused_experts_equals_the_training_logprobs():
    """An MoE model's experts fuse their gate and up at each row count their tokens come in (the routing varies the
    rows from step to step); the rollout's log-probs, fused, equal the training path's, whose GEMMs never fuse
    (a gradient recorded) -- and the experts did fuse."""
    from vexact import ModelConfig, Transformer, generate, token_logprobs

    config = ModelConfig(vocab_size=512, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=4,
                         intermediate_size=512, max_seq_len=96, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=512)
    model = Transformer(config, backend="exact", dtype=torch.bfloat16, init_seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 9, 12, 7)]
    out = generate(model, prompts, max_new_tokens=48, seed=2)
    scored = token_logprobs(model, prompts, out.tokens, routing=out.routing)
    assert all(torch.equal(a, b.detach()) for a, b in zip(out.logprobs, scored))
    experts = [[e.gate_proj.weight, e.up_proj.weight] for e in model.layers[0].mlp.experts]
    if fused_linears._FUSED_CHECKS and all(fused_linears._FUSED_CHECKS.values()):
        assert any(_fused(pair) for pair in experts)
