"""Public API behaviour: seeded sampling, bad input errors, packaging."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_prompts, tiny_model
from test_run_faults import _write_config
from test_sweep_faults import _cli_error, _sweep_file

from vexact import ModelConfig, Transformer, generate, token_logprobs
from vexact.engine import model as model_module
from vexact.engine.model import ModelTooLarge, parameter_count
from vexact_kernels import get_ops


@pytest.mark.slow
def test_kernels_folder_is_not_importable_as_kernels(tmp_path):
    """transformers imports a PyPI package called 'kernels' (5.25 and newer require it); ours must never answer to
    that name: no distribution of ours claims it, and ``import kernels`` finds the PyPI package or nothing.

    Run from an empty directory: the repo root itself is on sys.path under `python -m pytest`, where the folder hands
    the name over instead (tests/kernels/test_folder_name.py)."""
    probe = (
        "import importlib.util, importlib.metadata as m, pathlib, vexact_kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "ours = pathlib.Path(vexact_kernels.__file__).parent\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is None or pathlib.Path(spec.origin).parent != ours, spec.origin\n"
        "claims = m.packages_distributions().get('kernels', [])\n"
        "assert 'vexact' not in claims, claims\n"
        "if is_kernels_available():\n"
        "    import kernels\n"
        "    assert pathlib.Path(kernels.__file__).parent != ours and hasattr(kernels, 'get_kernel'), kernels\n"
        "else:\n"
        "    assert spec is None, spec.origin\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_same_seed_same_samples_different_seed_different_samples():
    model = tiny_model()
    prompts = random_prompts(8, 12)
    a = generate(model, prompts, max_new_tokens=10, seed=1)
    b = generate(model, prompts, max_new_tokens=10, seed=1)
    c = generate(model, prompts, max_new_tokens=10, seed=2)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.tokens != c.tokens


def test_sample_depends_on_prompt_index_not_neighbours():
    model = tiny_model()
    prompts = random_prompts(6, 12)
    full = generate(model, prompts, max_new_tokens=8, seed=4)
    # The same prompt list, different batch sizes: identical; the sequence alone in its own
    # call is sampled with index 0 -- same as prompts[0] of the full call.
    alone = generate(model, prompts[:1], max_new_tokens=8, seed=4)
    assert alone.tokens[0] == full.tokens[0]


def test_greedy_picks_argmax_and_logs_unscaled_logprob():
    model = tiny_model()
    prompts = random_prompts(3, 10)
    out = generate(model, prompts, max_new_tokens=5, temperature=0.0)
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        seq = torch.tensor([p + toks[:-1]])
        logits = model.logits(model(seq))[0, len(p) - 1 :]
        assert toks == logits.argmax(-1).tolist()
        assert torch.equal(lps, model.ops.token_logprobs(logits.float(), torch.tensor(toks)))


def test_eos_stops_a_sequence_and_is_included():
    model = tiny_model()
    prompts = random_prompts(10, 8)
    free = generate(model, prompts, max_new_tokens=12, seed=0)
    eos = free.tokens[0][3]
    out = generate(model, prompts, max_new_tokens=12, seed=0, eos_token_id=eos)
    assert out.tokens[0] == free.tokens[0][: free.tokens[0].index(eos) + 1]
    assert out.finished[0] and len(out.logprobs[0]) == len(out.tokens[0])


def test_responses_score_empty_response():
    model = tiny_model()
    lp = token_logprobs(model, [[1, 2], [3]], [[], [4, 5]])
    assert lp[0].numel() == 0 and lp[1].shape == (2,)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
        (dict(prompts=[[1, 500]]), "outside the vocabulary"),
        (dict(prompts=[[1, -1]]), "outside the vocabulary"),
        (dict(prompts=[[1.5]]), "list of ints"),
        (dict(prompts=torch.zeros(2, 3, dtype=torch.long)), "list of lists"),
        (dict(prompts=[[1] * 120], max_new_tokens=20), "exceeds max_seq_len"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1]], temperature=-1.0), "temperature"),
        (dict(prompts=[[1]], batch_size=0), "batch_size"),
        (dict(prompts=[[1]], eos_token_id=1000), "eos_token_id"),
        (dict(prompts=[[1]], eos_check_every=0), "eos_check_every"),
        (dict(prompts=[[1]], eos_check_every=2.0), "eos_check_every"),
    ],
)
def test_generate_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_model(), **kwargs)


@pytest.mark.parametrize("tokens,message", [
    (torch.zeros(1, 129, dtype=torch.long), r"129 tokens from position 0 exceed max_seq_len \(128\)"),
    (torch.zeros(5, dtype=torch.long), r"tokens must be a \[B, T\] tensor of token ids, got \[5\]"),
    ([[1, 2]], r"tokens must be a \[B, T\] tensor of token ids, got list"),
])
def test_forward_bad_tokens_is_one_clear_error(tokens, message):
    """The model's own forward, called as a user's training loop would: one ValueError naming the tokens, not an
    index error from inside the rotary table."""
    with pytest.raises(ValueError, match=message):
        tiny_model()(tokens)


def test_forward_q_start_outside_the_cache_or_without_one_is_one_clear_error():
    """``q_start`` without a cache gave a non-causal output (every query saw every key before its start: no error); a
    start past the cache or ``max_seq_len``, or a float one, an IndexError from deep inside."""
    model = tiny_model()
    tokens, later = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 9]])
    start = torch.tensor([5])
    with pytest.raises(ValueError, match=r"^Transformer.forward: q_start without a cache must be all 0 \(the tokens "):
        model(tokens, q_start=start)
    assert torch.equal(model(tokens, q_start=torch.tensor([0]))[:, 0], model(later)[:, 0])  # all 0: causal, allowed
    top = model.config.max_seq_len
    cases = [
        (dict(q_start=torch.tensor([top - 1]), cache=model.new_cache(1, top)),
         rf"puts 3 tokens at positions up to {top + 1} \(from {top - 1}\), outside the cache's {top} positions"),
        (dict(q_start=torch.tensor([1]), cache=model.new_cache(1, 2)), r"outside the cache's 2 positions"),
        (dict(q_start=torch.tensor([-1]), cache=model.new_cache(1, top)), r"\(from -1\)"),
        (dict(q_start=torch.tensor([0.0]), cache=model.new_cache(1, top)),
         r"q_start must be an integer tensor \[1\] \(one start position per row\), got torch.float32 \[1\]"),
        (dict(q_start=torch.tensor([0, 0]), cache=model.new_cache(2, top)), r"must be an integer tensor \[1\]"),
        (dict(q_start=torch.tensor([0, 0]), cache=model.new_cache(1, top)), r"must be an integer tensor \[1\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(tokens, **kwargs)
    with pytest.raises(ValueError, match=r"the cache holds 1 rows, the tokens 2"):
        model(torch.tensor([[1], [2]]), q_start=torch.tensor([0, 0]), cache=model.new_cache(1, top))


@pytest.mark.parametrize("device", ["mps", "xpu", "hpu"])
def test_a_device_vexact_does_not_compute_on_is_one_clear_error(device):
    """mps failed inside torch's allocator (NotImplementedError), xpu with an AssertionError."""
    with pytest.raises(ValueError, match=rf"^device '{device}' is not supported: the models compute on cpu or cuda"):
        Transformer(tiny_model().config, device=device)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        (dict(temperature=True), "temperature must be a finite number >= 0 (0 = greedy), got True"),
        (dict(temperature=1e-40), "temperature 1e-40 is below 1e-06: the scaled logits can overflow float32 (NaN "
                                  "log-probs); use 0 for greedy"),
        (dict(seed=1.5), "seed must be an int in [-2**63, 2**64), got 1.5"),
        (dict(seed=None), "seed must be an int in [-2**63, 2**64), got None"),
        (dict(seed=2**64), f"seed must be an int in [-2**63, 2**64), got {2**64}"),
        (dict(eos_token_id="1"), "eos_token_id must be a token id (an int) or None, got '1'"),
        (dict(eos_token_id=True), "eos_token_id must be a token id (an int) or None, got True"),
        (dict(max_new_tokens=True), "max_new_tokens must be a positive int, got True"),
        (dict(first_index=True), "first_index must be a non-negative int, got True"),
    ],
)
def test_generate_refuses_arguments_that_failed_deep_or_gave_garbage(kwargs, message):
    """Each was a TypeError from inside the sampler (seed 1.5, eos '1'), silent garbage (temperature inf: uniform
    log-probs; 1e-40: NaN log-probs; seed 2**64: the tokens of seed 0) or a bool read as an int."""
    with pytest.raises(ValueError) as err:
        generate(tiny_model(), [[1, 2]], **kwargs)
    assert str(err.value) == message


def test_generate_and_token_logprobs_name_a_model_that_is_not_a_transformer():
    message = ("model must be a vexact Transformer (vexact.from_pretrained loads a Hugging Face checkpoint as one), "
               "got dict")
    for call in (lambda: generate({}, [[1]]), lambda: token_logprobs({}, [[1]], [[2]])):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message


def test_a_cast_model_a_backend_name_as_ops_and_a_bad_init_are_one_error_naming_them():
    """Each failed deep inside: ``.half()`` in the embedding kernel, ``ops="native"`` as an AttributeError in the
    forward, a string init_seed in torch's generator, device cuda in the memory probe (an AssertionError)."""
    cases = [
        (lambda: generate(tiny_model().half(), [[1]]),
         "model parameters must all be float32 or all bfloat16 (Transformer(dtype=...)); embed_tokens.weight is "
         "torch.float16"),
        (lambda: token_logprobs(tiny_model(), [[1]], [[2]], ops="exact"),
         "ops must be kernel ops (vexact_kernels.get_ops('native'), say), got str 'exact'"),
        (lambda: generate(tiny_model(), [[1]], ops="native"),
         "ops must be kernel ops (vexact_kernels.get_ops('native'), say), got str 'native'"),
        (lambda: Transformer(tiny_model().config, init_seed="x"),
         "init_seed must be an int in [-2**63, 2**64) or None (no initialisation), got 'x'"),
        (lambda: ModelConfig.from_dict({"vocab_size": 3}),
         "ModelConfig keys missing: hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size"),
        (lambda: ModelConfig.from_dict([1]), "ModelConfig.from_dict needs a dict of its field names, got list"),
    ]
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        cases.append((lambda: Transformer(tiny_model().config, device="cuda"),
                      "device 'cuda' needs CUDA, but torch.cuda.is_available() is False on this machine (torch "
                      f"{torch.__version__}, {build})"))
    for call, message in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message
    mixed = tiny_model()
    mixed.norm.weight.data = mixed.norm.weight.data.bfloat16()
    with pytest.raises(ValueError, match=r"norm.weight is torch.bfloat16, embed_tokens.weight torch.float32$"):
        token_logprobs(mixed, [[1]], [[2]])
    assert torch.equal(token_logprobs(tiny_model(), [[1]], [[2]], ops=get_ops("native"))[0],
                       token_logprobs(tiny_model(), [[1]], [[2]], ops=get_ops("native"))[0])


def test_numpy_token_ids_are_the_list_of_ints_they_hold():
    """A 1-D integer array, or a list of numpy integers, was 'must be a list of ints' (a 1-D tensor was taken)."""
    import numpy as np

    model = tiny_model()
    want = generate(model, [[1, 2], [3]], max_new_tokens=3)
    for prompts in ([np.array([1, 2]), np.array([3], dtype=np.int32)], [list(np.array([1, 2])), [np.int64(3)]]):
        got = generate(model, prompts, max_new_tokens=3)
        assert got.tokens == want.tokens and all(torch.equal(a, b) for a, b in zip(got.logprobs, want.logprobs))
    for call, name, shape in ((lambda: generate(model, np.array([[1, 2]]), max_new_tokens=2), "prompts", "(1, 2)"),
                              (lambda: token_logprobs(model, [[1]], np.array([[2]])), "responses", "(1, 1)")):
        with pytest.raises(ValueError) as err:  # (was: "must be a non-empty list", of a non-empty array)
            call()
        assert str(err.value) == f"{name} must be a list of lists of ints, got a numpy array of shape {shape}"
    with pytest.raises(ValueError, match=r"^prompts\[0\] must be a list of ints, got a float \(1.5\)$"):
        generate(model, [np.array([1.5])])


def test_seeds_in_range_keep_their_samples():
    """A negative seed (torch.manual_seed's range) is still a seed of its own, and 0 still gives seed 0's bits."""
    model = tiny_model()
    zero, again, negative = (generate(model, [[1, 2]], max_new_tokens=6, seed=s) for s in (0, 0, -5))
    assert zero.tokens == again.tokens and torch.equal(zero.logprobs[0], again.logprobs[0])
    assert zero.tokens != negative.tokens


def test_token_logprobs_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        token_logprobs(model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="micro_batch_size"):
        token_logprobs(model, [[1]], [[3]], micro_batch_size=-2)
    with pytest.raises(ValueError, match=r"responses\[0\] has token id 97"):
        token_logprobs(model, [[1]], [[97]])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_heads=4, num_kv_heads=3), "divisible by num_kv_heads"),
        (dict(hidden_size=66, num_heads=4), "divisible by num_heads"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(vocab_size=2.5), "vocab_size"),
    ],
)
def test_model_config_errors(overrides, message):
    base = dict(vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **overrides})


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(head_dim=8.0), "ModelConfig.head_dim must be a positive even integer, got 8.0"),
        (dict(head_dim="8"), "ModelConfig.head_dim must be a positive even integer, got '8'"),
        (dict(rope_theta=float("inf")), "ModelConfig.rope_theta must be a finite positive number, got inf"),
        (dict(rope_theta="1e4"), "ModelConfig.rope_theta must be a finite positive number, got '1e4'"),
        (dict(rms_norm_eps=float("inf")), "ModelConfig.rms_norm_eps must be a finite positive number, got inf"),
        (dict(tie_embeddings="no"), "ModelConfig.tie_embeddings must be True or False, got 'no'"),
        (dict(qk_norm=1), "ModelConfig.qk_norm must be True or False, got 1"),
        (dict(rope_scaling={**_LLAMA3, "factor": -1}),
         "ModelConfig.rope_scaling: factor must be a finite positive number, got -1"),
        (dict(rope_scaling={**_LLAMA3, "factor": "8"}),
         "ModelConfig.rope_scaling: factor must be a finite positive number, got '8'"),
        (dict(rope_scaling={**_LLAMA3, "original_max_position_embeddings": 0}),
         "ModelConfig.rope_scaling: original_max_position_embeddings must be a finite positive number, got 0"),
        (dict(rope_scaling={**_LLAMA3, "high_freq_factor": 1.0}),
         "ModelConfig.rope_scaling: llama3 scaling needs high_freq_factor != low_freq_factor, got both 1.0"),
        (dict(num_experts=2, mlp_only_layers=0), "ModelConfig.mlp_only_layers must be a list of layer indices, got 0"),
        (dict(num_experts=2, num_layers=2, mlp_only_layers=(True,)),
         "ModelConfig.mlp_only_layers must hold layer indices in [0, 2), got True"),
    ],
)
def test_model_config_refuses_values_that_would_build_a_wrong_model(overrides, message):
    """Values that used to pass and then failed deep inside torch (head_dim 8.0), or built a model that computes
    garbage without an error (an infinite epsilon or theta, a negative Llama-3 factor, "no" read as True)."""
    base = dict(vocab_size=10, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32)
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**base, **overrides})
    assert str(err.value) == message


def test_unknown_backend_and_dtype():
    cfg = ModelConfig(vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32)
    with pytest.raises(ValueError, match="unknown backend 'cuda-fast'"):
        Transformer(cfg, backend="cuda-fast")
    with pytest.raises(ValueError, match="unsupported dtype"):
        Transformer(cfg, dtype=torch.float16)
    with pytest.raises(ValueError, match="unknown backend"):
        get_ops("fast")
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="unknown backend"):
        model.backend = "nope"
    assert model.backend == "exact"
    for call in (lambda: Transformer(cfg, device="gpu"), lambda: get_ops("exact", "gpu")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == "device must be a torch.device or a name such as cpu, cuda, cuda:1, got 'gpu'"


@pytest.mark.parametrize("sizes", [{"hidden_size": 10**6, "num_heads": 4}, {"num_layers": 10**5},
                                   {"vocab_size": 10**9}])
def test_absurd_model_sizes_are_refused_before_allocating(sizes, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(model_module, "available_memory", lambda: 16 << 30)  # a laptop's 16 GiB, on any machine

    config = ModelConfig(**{"vocab_size": 97, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                            "intermediate_size": 176, **sizes})
    monkeypatch.setattr(torch.nn.Embedding, "__init__", no_allocation)
    with pytest.raises(ModelTooLarge) as err:
        Transformer(config)
    message = str(err.value)
    for name, value in sizes.items():
        assert f"ModelConfig.{name}={value:,}" in message
    assert f"{parameter_count(config):,} parameters" in message and "of memory available" in message


def test_a_model_that_does_not_fit_the_available_memory_is_one_error_naming_the_sizes(tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.setattr(model_module, "available_memory", lambda: 64 << 10)  # a machine with 64 KiB free
    with pytest.raises(ModelTooLarge, match=r"need about \d+ KiB, but this machine has 64 KiB of memory available"):
        Transformer(ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=176))
    line = _cli_error(capsys, monkeypatch, "run", str(_write_config(tmp_path, "big")))
    assert "model.hidden_size=64" in line and "the vocabulary of task reverse=" in line
    assert "AdamW moments need about" in line
    assert not (tmp_path / "big").exists()  # refused before anything was written
    line = _cli_error(capsys, monkeypatch, "sweep", str(_sweep_file(tmp_path, "sbig", grid={"seed": [0]})))
    assert "model.hidden_size=64" in line and not (tmp_path / "sbig").exists()
