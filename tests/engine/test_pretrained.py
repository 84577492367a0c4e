"""Loading Hugging Face checkpoints: parity with transformers, exactness, and clear refusals.

Every checkpoint is a tiny random-init model written by the test (no downloads): one per supported
architecture variant (``TINY_VARIANTS``) -- Llama with tied embeddings, Llama with Llama-3 RoPE
scaling and an untied head, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm, head_dim != hidden/heads).
Norm weights and biases are randomised, so a mis-mapped tensor shows up in the logits.
``python -m vexact.real.measure --parity-tiny --seed 1`` prints the measured numbers quoted below.

Tolerances (logits up to ~7 in magnitude, sequences up to 40 tokens; measured values on the CI machine):
- fp32: max |vexact logit - transformers logit| <= FP32_TOL = 5e-5 (measured <= 1.1e-5, exact and native).
- bf16: the two implementations round at different places, so bf16 is judged against the fp32
  reference: vexact-bf16's mean |error| <= BF16_MEAN_RATIO (1.25) x transformers-bf16's own mean
  |error| (measured ratio <= 0.95), and max |vexact bf16 - transformers bf16| <= BF16_TOL = 0.4
  (measured <= 0.23).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vexact import from_pretrained, generate, token_logprobs
from vexact.engine.model import rope_inv_freq
from vexact.real.hf_config import SUPPORTED_ARCHITECTURES, model_config_from_hf
from vexact.real.pretrained import load_tokenizer
from vexact.real.tiny import (
    PARITY_PROMPTS,
    TINY_VARIANTS,
    make_tiny_checkpoint,
    make_tiny_hf_model,
    parity_with_transformers,
)

FP32_TOL = 5e-5
BF16_TOL = 0.4
BF16_MEAN_RATIO = 1.25

VARIANTS = TINY_VARIANTS
PROMPTS = PARITY_PROMPTS


pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # see conftest.py
              pytest.mark.slow]  # real-model loading: Hugging Face checkpoints against transformers


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (checkpoint directory, the transformers model it was saved from)."""
    out = {}
    for name, (arch, kwargs) in VARIANTS.items():
        directory = tmp_path_factory.mktemp(name)
        make_tiny_checkpoint(directory, arch, seed=1, tokenizer=False, **kwargs)
        out[name] = (directory, make_tiny_hf_model(arch, seed=1, **kwargs))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(checkpoints, variant):
    """fp32 within FP32_TOL on both backends; bf16 as close to the fp32 reference as transformers' own bf16."""
    directory, hf_model = checkpoints[variant]
    r = parity_with_transformers(hf_model, PROMPTS)
    assert r["fp32_max_abs_exact"] <= FP32_TOL and r["fp32_max_abs_native"] <= FP32_TOL, r
    assert r["bf16_mean_abs_err_vexact"] <= BF16_MEAN_RATIO * r["bf16_mean_abs_err_transformers"], r
    assert r["bf16_max_abs_vs_transformers"] <= BF16_TOL, r
    # Loading from the model object (as parity_with_transformers does) gives the very weights of its files.
    from_files, from_object = from_pretrained(directory).state_dict(), from_pretrained(hf_model).state_dict()
    assert from_files.keys() == from_object.keys()
    assert all(torch.equal(from_files[k], from_object[k]) for k in from_files)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_transformers_generate(checkpoints, variant):
    directory, hf_model = checkpoints[variant]
    prompts = PROMPTS[1:3]
    ours = generate(from_pretrained(directory), prompts, max_new_tokens=16, temperature=0.0)
    for prompt, tokens in zip(prompts, ours.tokens):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, top_k=None,
                                          eos_token_id=None, pad_token_id=0)
        assert tokens == reference[0, len(prompt):].tolist()
    assert ours.tokens[0] != ours.tokens[1]  # the prompts led somewhere different


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_exactness_holds_for_loaded_checkpoints(checkpoints, variant, dtype):
    """Generation in batches of 3 (KV cache), scoring all at once: every log-prob bitwise equal."""
    model = from_pretrained(checkpoints[variant][0], backend="exact", dtype=dtype)
    prompts = [[(7 * i + j) % 128 for j in range(1 + (5 * i) % 23)] for i in range(8)]
    rollout = generate(model, prompts, max_new_tokens=10, seed=3, batch_size=3)
    scored = token_logprobs(model, prompts, rollout.tokens)
    assert sum(map(len, rollout.tokens)) == 80
    for a, b in zip(rollout.logprobs, scored):
        assert torch.equal(a, b)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_model = make_tiny_hf_model("llama", rope_scaling=True)
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf_model.config.to_dict()))
    ours = rope_inv_freq(from_pretrained(hf_model).config)
    plain = rope_inv_freq(from_pretrained(make_tiny_hf_model("llama")).config)
    torch.testing.assert_close(ours.float(), reference, rtol=1e-6, atol=0)
    assert not torch.allclose(plain.float(), reference)  # the scaling changes something


def test_sharded_and_pytorch_bin_checkpoints_load_identically(checkpoints, tmp_path):
    directory, hf_model = checkpoints["qwen2"]
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    legacy = tmp_path / "bin"
    legacy.mkdir()
    (legacy / "config.json").write_text((directory / "config.json").read_text())
    torch.save(load_file(directory / "model.safetensors"), legacy / "pytorch_model.bin")
    expected = from_pretrained(directory).state_dict()
    for other in (sharded, legacy):
        loaded = from_pretrained(other).state_dict()
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_config_translation():
    hf_model = make_tiny_hf_model("mistral")
    v5 = hf_model.config.to_dict()
    assert "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"} | {"rope_theta": v5["rope_parameters"]["rope_theta"]}
    assert model_config_from_hf(v5) == model_config_from_hf(v4)
    assert model_config_from_hf(v5).rope_theta == 1e6
    # Sliding-window attention equals full attention up to the window: sequences are capped there.
    assert model_config_from_hf(v5 | {"sliding_window": 32}).max_seq_len == 32
    assert model_config_from_hf(v5 | {"sliding_window": None}).max_seq_len == 128
    qwen = make_tiny_hf_model("qwen3").config.to_dict()
    c = model_config_from_hf(qwen)
    assert c.qk_norm and not c.qkv_bias and c.head_dim == 32 and c.hidden_size == 64
    sliding = qwen | {"use_sliding_window": True, "sliding_window": 16}
    assert model_config_from_hf(sliding | {"layer_types": ["full_attention", "sliding_attention"]}).max_seq_len == 16
    assert model_config_from_hf(sliding | {"layer_types": ["full_attention"] * 2}).max_seq_len == 128
    assert model_config_from_hf({k: v for k, v in sliding.items() if k != "layer_types"}).max_seq_len == 16
    assert model_config_from_hf(make_tiny_hf_model("qwen2").config.to_dict()).qkv_bias
    assert model_config_from_hf(v5, max_seq_len=64).max_seq_len == 64
    for bad in ("64", 0, True):  # the caller's argument is named, not the config file ("malformed config.json")
        with pytest.raises(ValueError) as refused:
            model_config_from_hf(v5, max_seq_len=bad)
        assert str(refused.value) == f"max_seq_len must be a positive int or None, got {bad!r}"


def _expect_error(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_unsupported_architectures_are_refused_with_what_is_supported(checkpoints, tmp_path):
    base = json.loads((checkpoints["llama-tied"][0] / "config.json").read_text())
    message = _expect_error("unsupported architecture", model_config_from_hf, base | {"model_type": "gemma2",
                                                                                      "architectures": ["G"]})
    assert "'gemma2'" in message and all(arch in message for arch in SUPPORTED_ARCHITECTURES.values())
    _expect_error(r"\['LlamaForSequenceClassification'\]", model_config_from_hf,
                  base | {"architectures": ["LlamaForSequenceClassification"]})
    _expect_error("hidden_act is 'gelu'", model_config_from_hf, base | {"hidden_act": "gelu"})
    _expect_error("RoPE type is 'yarn'", model_config_from_hf,
                  base | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    _expect_error("attention_bias", model_config_from_hf, base | {"attention_bias": True})
    _expect_error("quantization_config", model_config_from_hf, base | {"quantization_config": {"quant_method": "gptq"}})
    _expect_error("got int", from_pretrained, 3)
    # A transformers model of another family, as an object.
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert "LlamaForCausalLM" in _expect_error("GPT2LMHeadModel", from_pretrained, gpt2)


def test_bad_checkpoint_directories_are_one_clear_error(checkpoints, tmp_path):
    source = checkpoints["llama3-rope-untied"][0]
    _expect_error("checkpoint directory not found", from_pretrained, tmp_path / "nope")
    _expect_error("no config.json", from_pretrained, tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    _expect_error("no weights in", from_pretrained, broken)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    _expect_error(r"missing 1 tensor\(s\): layers.1.mlp.up_proj.weight", from_pretrained, broken)
    config = json.loads((source / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    save_file(load_file(source / "model.safetensors") | {"model.extra.weight": torch.zeros(2)},
              broken / "model.safetensors")
    _expect_error(r"unexpected 1 tensor\(s\): extra.weight", from_pretrained, broken)
    (broken / "config.json").write_text(json.dumps(config | {"intermediate_size": 100}))
    save_file(load_file(source / "model.safetensors"), broken / "model.safetensors")
    _expect_error("has shape", from_pretrained, broken)
    (broken / "config.json").write_text("{not json")
    _expect_error("not valid JSON", from_pretrained, broken)


def test_tokenizer_is_loaded_from_the_checkpoint_when_present(tmp_path):
    with_tok = make_tiny_checkpoint(tmp_path / "tok", "qwen3", tokenizer=True)
    tokenizer = load_tokenizer(with_tok)
    ids = tokenizer("Hi there")["input_ids"]
    assert tokenizer.decode(ids) == "Hi there" and max(ids) < from_pretrained(with_tok).config.vocab_size
    assert load_tokenizer(make_tiny_checkpoint(tmp_path / "bare", "qwen3", tokenizer=False)) is None
