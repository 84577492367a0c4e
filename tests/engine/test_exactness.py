"""The exactness guarantee, end to end: rollout log-probs == training log-probs, bit for bit.

With backend "exact", every generated token's log-prob recorded while sampling (KV-cache
decode) is torch.equal to the one recomputed by the teacher-forced training forward -- for
fp32 and bf16, ragged prompts of 1..40 tokens, 1..64 sequences, generation batch sizes 1, 3
and all, scoring micro-batches 1, 5 and all, 1, 2 and 3 torch threads, responses of 1..64
tokens. The counter-check runs the same pipeline on the native backend and must find
mismatches -- proof that these assertions can fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads, random_prompts, tiny_model

from vexact import ModelConfig, Transformer, generate, token_logprobs
from vexact.engine.generation import decode_one_token, prefill
from vexact.engine.inputs import pad_right
from vexact_kernels import TRITON_PIP

EOS = 3


def _model_with_varied_lengths(backend: str, dtype: torch.dtype):
    """Tiny model whose EOS logit varies strongly with context, so responses end anywhere in 1..64."""
    model = tiny_model(backend, dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        direction = torch.randn(model.config.hidden_size, generator=g)
        model.lm_head.weight[EOS] = (direction * 0.15).to(dtype)
    return model


def _compare(rollout, scored) -> tuple[int, int, float]:
    total = sum(len(lp) for lp in rollout.logprobs)
    equal = sum(int((a == b).sum()) for a, b in zip(rollout.logprobs, scored))
    worst = max((float((a - b.detach()).abs().max()) for a, b in zip(rollout.logprobs, scored) if len(a)), default=0.0)
    return total, equal, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rollout_logprobs_equal_training_logprobs(dtype, threads):
    model = _model_with_varied_lengths("exact", dtype)
    prompts = random_prompts(64, 40, seed=threads)
    with num_threads(threads):
        rollouts = [generate(model, prompts, max_new_tokens=64, seed=7, batch_size=bs, eos_token_id=EOS)
                    for bs in (None, 3, 1)]
        lengths = [len(t) for t in rollouts[0].tokens]
        assert min(lengths) <= 5 and max(lengths) == 64, f"response lengths should span 1..64, got {sorted(lengths)}"
        for rollout in rollouts[1:]:  # batch size changes nothing, bitwise
            assert rollout.tokens == rollouts[0].tokens
            assert all(torch.equal(a, b) for a, b in zip(rollout.logprobs, rollouts[0].logprobs))
        for micro_batch_size in (None, 5, 1):
            scored = token_logprobs(model, prompts, rollouts[0].tokens, micro_batch_size=micro_batch_size)
            for i, (a, b) in enumerate(zip(rollouts[0].logprobs, scored)):
                assert torch.equal(a, b.detach()), f"sequence {i}: rollout != training log-probs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_logprobs_equal_training_logprobs_at_hidden_512(dtype):
    """Layers of K = 512 on the host's own GEMM: a decode step's few rows and a training batch's many take the
    library's different kernels where it has them (oneDNN's bf16 GEMM on an Intel Xeon with AMX: below 33 rows in a
    call, which broke this equality until the guard's probe tried one short tile alone)."""
    config = ModelConfig(vocab_size=512, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=4,
                         intermediate_size=512, max_seq_len=64)
    model = Transformer(config, backend="exact", dtype=dtype, init_seed=3)
    prompts = random_prompts(3, 12, seed=4, vocab=config.vocab_size)
    with num_threads(2):
        out = generate(model, prompts, max_new_tokens=20, seed=2)
        scored = token_logprobs(model, prompts, out.tokens)
    for i, (a, b) in enumerate(zip(out.logprobs, scored)):
        assert torch.equal(a, b.detach()), f"sequence {i}: rollout != training log-probs"


@pytest.mark.parametrize("num_seqs,temperature", [(1, 1.0), (2, 0.7), (17, 0.0), (64, 1.3)])
def test_exactness_across_sequence_counts_and_temperatures(num_seqs, temperature):
    model = tiny_model("exact", torch.float32)
    prompts = random_prompts(num_seqs, 40, seed=num_seqs)
    out = generate(model, prompts, max_new_tokens=9, temperature=temperature, seed=1, batch_size=3)
    scored = token_logprobs(model, prompts, out.tokens, temperature=temperature, micro_batch_size=5)
    total, equal, _ = _compare(out, scored)
    assert total == num_seqs * 9 and equal == total


def test_training_forward_is_batch_invariant():
    """A sequence's logits are the same alone, or padded into any batch at any position."""
    model = tiny_model("exact", torch.float32)
    seqs = random_prompts(9, 60, seed=3)
    alone = [model.logits(model(torch.tensor([s]))[0]) for s in seqs]
    for order in (list(range(9)), list(reversed(range(9)))):
        batch = [seqs[i] for i in order]
        padded = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
        for row, s in enumerate(batch):
            padded[row, : len(s)] = torch.tensor(s)
        logits = model.logits(model(padded))
        for row, i in enumerate(order):
            assert torch.equal(logits[row, : len(seqs[i])], alone[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_equals_prefill_row(dtype):
    model = tiny_model("exact", dtype)
    seq = torch.tensor(random_prompts(1, 100, seed=4, min_len=100))
    prefill = model(seq)
    cache = model.new_cache(1, 128)
    model(seq[:, :30], cache=cache)  # prefill part, then decode the rest one token at a time
    for t in range(30, 100):
        step = model(seq[:, t : t + 1], q_start=torch.tensor([t]), cache=cache)
        assert torch.equal(step[0, 0], prefill[0, t]), f"decode step {t} != prefill row {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generation_steps_equal_training_logits(dtype):
    """``prefill`` and ``decode_one_token``, the named steps ``generate`` loops over, give each row the logits
    the training forward gives at that position, bit for bit, for ragged right-padded prompts."""
    model = tiny_model("exact", dtype)
    prompts = random_prompts(5, 20, seed=6)
    continuation = random_prompts(5, 6, seed=7, min_len=6)
    lengths = torch.tensor([len(p) for p in prompts])
    cache = model.new_cache(len(prompts), 64)
    logits = prefill(model, pad_right(prompts, model.device), lengths, cache, model.ops)
    for t in range(7):
        for b, (p, c) in enumerate(zip(prompts, continuation)):
            seq = p + c[:t]
            trained = model.logits(model(torch.tensor([seq]))[0, -1])
            assert torch.equal(logits[b], trained), f"step {t}, row {b}: generation step != training logits"
        if t < 6:
            token = torch.tensor([c[t] for c in continuation])
            logits = decode_one_token(model, token, lengths + t, cache, model.ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_backend_mismatches(dtype, record_property):
    """Counter-check: the same pipeline on native torch ops does find mismatched tokens."""
    model = _model_with_varied_lengths("native", dtype)
    prompts = random_prompts(64, 40, seed=0)
    out = generate(model, prompts, max_new_tokens=64, seed=7, batch_size=3, eos_token_id=EOS)
    scored = token_logprobs(model, prompts, out.tokens, micro_batch_size=5)
    total, equal, worst = _compare(out, scored)
    record_property("native_mismatched_tokens", total - equal)
    record_property("native_max_abs_dlogp", worst)
    print(f"native {dtype}: {total - equal}/{total} tokens mismatched, max |dlogp| {worst:.3g}")
    assert total - equal > 0 and worst > 0


def test_backend_switch_on_live_model():
    model = tiny_model("exact", torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = random_prompts(5, 10)
    exact_out = generate(model, prompts, max_new_tokens=6, seed=2)
    model.backend = "native"
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    native_scored = token_logprobs(model, prompts, exact_out.tokens)
    model.backend = "exact"
    exact_scored = token_logprobs(model, prompts, exact_out.tokens)
    assert all(torch.equal(a, b) for a, b in zip(exact_out.logprobs, exact_scored))
    torch.testing.assert_close(torch.cat(native_scored), torch.cat(exact_scored), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [dict(qkv_bias=True), dict(qk_norm=True), dict(tie_embeddings=True),
                                     dict(num_kv_heads=1, num_heads=4), dict(head_dim=24)])
def test_exactness_for_architecture_variants(variant):
    model = tiny_model("exact", torch.float32, **variant)
    if variant.get("qkv_bias"):
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    prompts = random_prompts(7, 30, seed=9)
    out = generate(model, prompts, max_new_tokens=12, seed=3, batch_size=2)
    scored = token_logprobs(model, prompts, out.tokens, micro_batch_size=3)
    total, equal, _ = _compare(out, scored)
    assert equal == total == 7 * 12


def test_training_path_is_differentiable_and_deterministic():
    model = tiny_model("exact", torch.float32)
    prompts = random_prompts(6, 20, seed=11)
    out = generate(model, prompts, max_new_tokens=8, seed=0)

    def grads():
        model.zero_grad()
        lp = token_logprobs(model, prompts, out.tokens, micro_batch_size=4)
        torch.cat(lp).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.isfinite(g).all() for g in first) and any(g.abs().sum() > 0 for g in first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.needs_package("triton", TRITON_PIP)
def test_triton_backend_end_to_end(dtype):
    """The Triton kernels (interpreted on CPU, compiled on a GPU) proven rollout == training on a
    tiny model, not only op by op."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("triton", dtype).to(device)
    # ragged, few and short: the interpreter runs every kernel instance in Python (69 s in bf16 at 4 x 12 + 6 tokens)
    prompts = random_prompts(3, 8, seed=2)
    out = generate(model, prompts, max_new_tokens=4, seed=3, batch_size=None)
    out_one = generate(model, prompts, max_new_tokens=4, seed=3, batch_size=1)
    assert out_one.tokens == out.tokens
    assert all(torch.equal(a, b) for a, b in zip(out.logprobs, out_one.logprobs))
    for micro_batch_size in (None, 1):
        scored = token_logprobs(model, prompts, out.tokens, micro_batch_size=micro_batch_size)
        assert all(torch.equal(a, b) for a, b in zip(out.logprobs, scored))
