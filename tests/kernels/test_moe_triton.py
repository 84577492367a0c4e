"""The MoE block on the Triton backend: the routing's exp on CUDA tensors, rollout == training, grouping invariance.

Without a GPU these run in the Triton interpreter on tiny shapes (the model's routing exp then stays the exact CPU
kernels', whose bits must not change); on a GPU the same tests run on CUDA tensors with the compiled kernels, where
the routing's exp is the elementwise Triton kernel ``triton_exact.exp``. Exactness is asserted bitwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, require_optional

from vexact_kernels import TRITON_PIP

require_optional("triton", TRITON_PIP)  # the optional triton extra: the whole module needs it

from test_moe import EOS, moe_model  # noqa: E402

from vexact import generate, token_logprobs  # noqa: E402
from vexact.engine.model import Routing  # noqa: E402
from vexact.engine.scoring import token_routing  # noqa: E402
from vexact_kernels import moe_exact  # noqa: E402
from vexact_kernels import triton_exact as exact  # noqa: E402

pytestmark = pytest.mark.slow  # the Triton interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the routing exp's GPU path)")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y.detach()) for x, y in zip(a, b))


# --- the exp kernel -----------------------------------------------------------------------------------------------


def test_triton_exp_is_elementwise_invariant_and_correct():
    x = (torch.randn(3, 7, 700, generator=torch.Generator().manual_seed(0)) * 6).to(DEVICE)
    full = exact.exp(x)
    assert torch.equal(exact.exp(x[2:3, 5:6, 13:14]), full[2:3, 5:6, 13:14])  # one element alone
    assert torch.equal(exact.exp(x[1]), full[1])  # a slice of the rows
    assert torch.equal(exact.exp(x.flip(-1)), full.flip(-1))  # every element at another position
    torch.testing.assert_close(full, x.exp(), atol=0, rtol=1e-5)  # correctness, not exactness: a few ulps
    with pytest.raises(ValueError, match="expected a float32 tensor"):
        exact.exp(x.double())


@CUDA_ONLY
def test_the_routing_exp_on_cuda_is_the_triton_kernel(monkeypatch):
    """On CUDA tensors the routing's exp must not reach the CPU kernels' host-guarded exp (whose probes measure the
    CPU's library, not the GPU): it is ``triton_exact.exp``, forward and backward."""

    def refuse(*args, **kwargs):
        raise AssertionError("the routing's exp went through cpu_exact.elementwise on a CUDA tensor")

    monkeypatch.setattr(moe_exact, "elementwise", refuse)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to("cuda")
    assert torch.equal(moe_exact.exp(x), exact.exp(x))
    leaf = x.clone().requires_grad_(True)
    out = moe_exact.exp(leaf)
    out.sum().backward()
    assert torch.equal(out.detach(), exact.exp(x)) and torch.equal(leaf.grad, exact.exp(x))


def test_the_routing_exp_on_cpu_is_the_exact_cpu_kernels():
    """CPU bits unchanged: on CPU tensors the routing's exp is still ``cpu_exact.elementwise`` (also when the
    model's backend is triton, interpreted)."""
    from vexact_kernels import cpu_exact

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(moe_exact.exp(x), cpu_exact.elementwise("exp", x, op=moe_exact.OP))


# --- the block and the model on the Triton backend ----------------------------------------------------------------


def _model(backend: str, dtype: torch.dtype, **overrides):
    return moe_model(backend, dtype, **overrides).to(DEVICE)


def _block(model, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer 0's MoE block output, chosen experts) for ``rows`` [N, D] as one batch."""
    record: list[torch.Tensor] = []
    positions = torch.zeros(1, rows.shape[0], dtype=torch.long, device=rows.device)
    out = model._moe(rows[None], model.layers[0].mlp, model.ops, Routing(record=record), 0, positions)
    return out[0], record[0][0]


@DTYPES
def test_triton_moe_tokens_output_does_not_depend_on_who_shares_its_experts(dtype):
    model = _model("triton", dtype)
    pool = torch.randn(120, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    _, chosen = _block(model, pool)
    checked = 0
    for token in range(4):
        first = int(chosen[token, 0])
        share = [i for i in range(len(pool)) if i != token and first in chosen[i].tolist()][:11]
        mine = set(chosen[token].tolist())
        apart = [i for i in range(len(pool)) if i != token and not mine & set(chosen[i].tolist())]
        if len(share) < 11 or not apart:
            continue
        out_crowded, chosen_crowded = _block(model, pool[[token, *share]])
        out_apart, chosen_apart = _block(model, pool[[token, *apart[:11]]])
        # not vacuous: the token's first expert runs on 12 rows in one grouping and on 1 in the other
        assert int((chosen_crowded == first).sum()) == 12 and int((chosen_apart == first).sum()) == 1
        assert torch.equal(out_crowded[0], out_apart[0])
        assert torch.equal(out_crowded[0], _block(model, pool[[token]])[0][0])  # and alone in the batch
        checked += 1
    assert checked >= 2, "the pool should hold enough tokens of each kind"


# In the interpreter (no GPU) a generation costs about a minute per dtype on a 2-core CPU: there the test runs fp32
# only, at fewer prompts, tokens and arrangements; bf16 and the full sizes run compiled on CUDA.
INTERPRETED_DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]
PROMPTS, NEW_TOKENS, ARRANGEMENTS = (4, 3, (None, 1)) if DEVICE == "cpu" else (6, 6, (None, 4, 1))


@pytest.mark.parametrize("backend", ["triton"] + (["exact"] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("dtype", INTERPRETED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_moe_rollout_logprobs_equal_training_logprobs(backend, dtype):
    model = _model(backend, dtype)
    prompts = random_prompts(PROMPTS, 12, seed=3)
    rollouts = [generate(model, prompts, max_new_tokens=NEW_TOKENS, seed=7, batch_size=bs, eos_token_id=EOS)
                for bs in ARRANGEMENTS]
    for rollout in rollouts[1:]:  # batch arrangement changes nothing: tokens, log-probs, routing
        assert rollout.tokens == rollouts[0].tokens
        assert _equal_lists(rollout.logprobs, rollouts[0].logprobs)
        assert _equal_lists(rollout.routing, rollouts[0].routing)
    for micro_batch_size in ARRANGEMENTS:
        with torch.no_grad():
            scored = token_logprobs(model, prompts, rollouts[0].tokens, micro_batch_size=micro_batch_size)
        assert _equal_lists(rollouts[0].logprobs, scored)
        routed = token_routing(model, prompts, rollouts[0].tokens, micro_batch_size=micro_batch_size)
        assert _equal_lists(rollouts[0].routing, routed)
    assert len(torch.cat(rollouts[0].routing).unique()) >= 3  # not vacuous: tokens go to several experts


@CUDA_ONLY
@DTYPES
def test_native_moe_runs_on_cuda_and_trains(dtype):
    """The native backend's MoE block runs on CUDA (its routing exp is the Triton kernel too) and its router
    gets gradients; its rollout-vs-training agreement is measured (not asserted) by benchmarks.gpu_triton."""
    model = _model("native", dtype)
    prompts = random_prompts(4, 10, seed=4)
    out = generate(model, prompts, max_new_tokens=4, seed=7)
    torch.cat(token_logprobs(model, prompts, out.tokens)).float().sum().backward()
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
