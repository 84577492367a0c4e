"""``vexact measure``: natural TIM between two paths on a local checkpoint (tiny random ones, no downloads).

What must hold: exact vs exact is bitwise zero (fp32 and bf16); a bf16 native rollout against an
fp32 exact trainer is *not* zero (so the zero can fail); transformers' own generate/forward (``hf``)
agrees with vexact fp32 to fp32 rounding (|Δlogp| <= HF_FP32_TOL) and samples from the untruncated
distribution even when the checkpoint's generation_config.json asks for top-p and penalties;
prompts come from text (with a tokenizer), token ids or ``--random-prompts``; bad input is one clear error.
"""

from __future__ import annotations

import json

import pytest
import torch

from vexact.cli import build_parser, main
from vexact.engine.model import DTYPE_ALIASES, resolve_dtype
from vexact.real.locate import parse_locate_path
from vexact.real.measure import MeasureSettings, parse_path, position_bins, run_measure
from vexact.real.tiny import make_tiny_checkpoint

HF_FP32_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """Tiny Llama with the character-level tokenizer, and a generation_config.json a real model might ship."""
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=2, tokenizer=True)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation.update(do_sample=True, top_p=0.3, top_k=5, repetition_penalty=1.5, temperature=0.6)
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.fixture(scope="module")
def qwen3_ids_dir(tmp_path_factory):
    """Tiny Qwen3 without a tokenizer: prompts are token ids."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3, tokenizer=False)


def _measure(directory, rollout, train, **kwargs):
    settings = MeasureSettings(model=directory, rollout=rollout, train=train,
                               **{"random_prompts": 6, "max_new_tokens": 10, **kwargs})
    return run_measure(settings).summary


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exact_vs_exact_is_bitwise_zero(qwen3_ids_dir, dtype):
    s = _measure(qwen3_ids_dir, f"exact:{dtype}", f"exact:{dtype}", batch_size=4, micro_batch_size=5)
    m = s["metrics"]
    assert s["tokens"] == 60 and s["bitwise_equal"] == 60
    assert m["mismatch/abs_dlogp_max"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0 and m["rollout_corr/kl"] == 0.0
    assert sum(row["tokens"] for row in s["by_probability"]) == 60
    assert sum(row["tokens"] for row in s["by_position"]) == 60
    assert all(row["abs_dlogp_max"] == 0.0 for row in s["by_position"])


def test_bf16_rollout_against_fp32_trainer_mismatches(qwen3_ids_dir):
    m = _measure(qwen3_ids_dir, "native:bf16", "exact:fp32")["metrics"]
    assert m["mismatch/bitwise_equal_frac"] < 0.5
    assert m["rollout_corr/k3_kl"] > 0 and m["mismatch/abs_dlogp_max"] > 1e-3


def test_hf_path_agrees_with_vexact_fp32_and_ignores_the_checkpoints_sampling_settings(llama_dir):
    # The checkpoint's generation_config.json asks for top-p 0.3, top-k 5 and a repetition penalty:
    # the hf path must switch them off (a guard raises if any logits processor changed the scores).
    s = _measure(llama_dir, "hf:fp32", "exact:fp32", ignore_eos=True, random_prompts=4)
    m = s["metrics"]
    assert s["tokens"] == 40
    assert 0 < m["mismatch/abs_dlogp_max"] <= HF_FP32_TOL
    assert m["mismatch/tokens_bucket/0-0.01"] > 0  # tokens top-k 5 / top-p 0.3 could never have sampled
    back = _measure(llama_dir, "exact:fp32", "hf:fp32", ignore_eos=True, random_prompts=4)
    assert 0 < back["metrics"]["mismatch/abs_dlogp_max"] <= HF_FP32_TOL


def test_greedy_hf_rollout_and_eos(llama_dir):
    s = _measure(llama_dir, "hf:fp32", "exact:fp32", temperature=0.0, random_prompts=3)
    assert s["eos_token_id"] == 1 and 0 < s["tokens"] <= 30
    assert s["metrics"]["mismatch/abs_dlogp_max"] <= HF_FP32_TOL


def test_cli_text_prompts_json_png(llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat sat\n\nHello, world!\n")
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    code = main(["measure", "--model", str(llama_dir), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--rollout", "exact:fp32", "--train", "exact:fp32", "--ignore-eos", "--json", str(out_json),
                 "--png", str(out_png), "--fail-on-mismatch"])
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["prompts"] == 2 and report["tokens"] == 12 and report["bitwise_equal"] == 12
    assert report["rollout"] == "exact:fp32" and report["architecture"] == "LlamaForCausalLM"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "vexact measure" in out and "k3 KL" in out and "'The cat sat'" in out


def test_cli_token_id_prompts_and_fail_on_mismatch(qwen3_ids_dir, tmp_path):
    prompts = tmp_path / "ids.txt"
    prompts.write_text("5 6 7\n100 3\n")
    args = ["measure", "--model", str(qwen3_ids_dir), "--prompts", str(prompts), "--max-new-tokens", "5",
            "--ignore-eos", "--fail-on-mismatch"]
    assert main([*args, "--rollout", "exact:fp32", "--train", "exact:fp32"]) == 0
    assert main([*args, "--rollout", "native:bf16", "--train", "exact:fp32"]) == 1


@pytest.mark.parametrize("args,message", [
    (["--rollout", "native:fp64"], "bad path spec 'native:fp64'"),
    (["--train", "vllm:bf16"], "bad path spec 'vllm:bf16'"),
    (["--model", "/nonexistent/ckpt"], "checkpoint directory not found"),
    (["--prompts", "/nonexistent/prompts.txt"], "--prompts file '/nonexistent/prompts.txt' does not exist"),
    # flags that would change nothing (each was ignored); None: a flag without a value, P: a prompts file
    (["--token-ids", None], "--token-ids: it reads a --prompts file as token ids, and the prompts here are random "
                            "(--random-prompts): it would change nothing"),
    (["--prompts", "P", "--max-prompt-len", "4"], "--max-prompt-len: it bounds the length of random prompts "
     "(--random-prompts), and the prompts here are given by --prompts: it would change nothing"),
    (["--prompts", "P", "--temperature", "0", "--seed", "0"], "--seed: nothing it seeds is random here (--prompts "
     "gives the prompts, --temperature 0 is greedy): it would change nothing"),  # given, even as the default
])
def test_cli_bad_input_is_one_clear_error(qwen3_ids_dir, tmp_path, capsys, args, message):
    base = {"--model": str(qwen3_ids_dir), "--random-prompts": "2"}
    if "--prompts" in args:
        base.pop("--random-prompts")
    (tmp_path / "ids.txt").write_text("5 6 7\n")
    merged = {**base, **{k: str(tmp_path / "ids.txt") if v == "P" else v for k, v in zip(args[::2], args[1::2])}}
    argv = ["measure", *[x for kv in merged.items() for x in kv if x is not None], "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["measure", "locate"])
def test_a_prompts_file_that_is_binary_or_a_directory_is_one_error_naming_the_flag(qwen3_ids_dir, tmp_path, capsys,
                                                                                   monkeypatch, command):
    """A binary --prompts file was "error: 'utf-8' codec can't decode byte ...", naming neither flag nor file; a
    directory was "prompts file not found". Now one line naming both (locate reads --prompts as measure does)."""
    binary, folder = tmp_path / "bin.yaml", tmp_path / "d"
    binary.write_bytes(bytes(range(128, 256)))
    folder.mkdir()
    monkeypatch.setenv("COLUMNS", "10000")  # the error line unwrapped
    model = ["--model", str(qwen3_ids_dir)] if command == "measure" else ["--random"]
    for path, problem in ((binary, "is not a UTF-8 text file"), (folder, "is a directory, not a file")):
        capsys.readouterr()
        assert main([command, *model, "--prompts", str(path), "--max-new-tokens", "2"]) == 2
        assert capsys.readouterr().err == f"error: --prompts file '{path}' {problem}\n"


def test_cli_seed_and_prompt_length_are_taken_where_they_count(qwen3_ids_dir, tmp_path, capsys):
    """--seed seeds sampling (with --prompts at temperature 1) and random prompts (at temperature 0), and
    --max-prompt-len bounds random prompts: none of them is refused there."""
    (tmp_path / "ids.txt").write_text("5 6 7\n")
    argv = ["measure", "--model", str(qwen3_ids_dir), "--max-new-tokens", "2", "--rollout", "exact:fp32", "--seed", "3"]
    assert main([*argv, "--prompts", str(tmp_path / "ids.txt"), "--token-ids"]) == 0
    assert main([*argv, "--random-prompts", "2", "--max-prompt-len", "3", "--temperature", "0"]) == 0
    capsys.readouterr()


def test_cli_rejects_text_for_a_checkpoint_without_tokenizer_and_unsupported_models(qwen3_ids_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello there\n")
    assert main(["measure", "--model", str(qwen3_ids_dir), "--prompts", str(text)]) == 2
    assert "has no tokenizer, so prompts are token ids" in " ".join(capsys.readouterr().err.split())
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                   "vocab_size": 64}))
    assert main(["measure", "--model", str(other), "--random-prompts", "2", "--rollout", "exact:fp32"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model_type='gpt2'" in err and "Qwen3ForCausalLM" in err


def test_parse_path_and_position_bins():
    assert parse_path("native:bf16").dtype == torch.bfloat16 and parse_path("hf:float32").name == "hf:fp32"
    for bad in ("native", "native:fp64", ":fp32", "exact:bf16:x"):
        with pytest.raises(ValueError, match="bad path spec"):
            parse_path(bad)
    assert position_bins(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert position_bins(1) == [(0, 1)]


FULL_VOCAB_KEYS = ("mismatch/full_vocab_positions", "mismatch/full_vocab_kl_mean", "mismatch/full_vocab_kl_max",
                   "mismatch/full_vocab_tv_mean", "mismatch/full_vocab_tv_max", "mismatch/full_vocab_argmax_flip_frac",
                   "mismatch/full_vocab_top5_overlap_mean")


def test_full_vocab_exact_paths_are_zero_and_bf16_is_not(qwen3_ids_dir):
    """Both exact paths run the same forward on the same model: identical distributions at all 60 positions. A bf16
    native path against the fp32 exact one differs everywhere a little, and never by more than a sliver of mass."""
    m = _measure(qwen3_ids_dir, "exact:bf16", "exact:bf16", micro_batch_size=4)["metrics"]
    assert [m[k] for k in FULL_VOCAB_KEYS] == [60, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    m = _measure(qwen3_ids_dir, "native:bf16", "exact:fp32")["metrics"]
    assert m["mismatch/full_vocab_positions"] == 60
    assert 0 < m["mismatch/full_vocab_kl_mean"] <= m["mismatch/full_vocab_kl_max"] < 0.05
    assert 0 < m["mismatch/full_vocab_tv_mean"] <= m["mismatch/full_vocab_tv_max"] < 0.2
    assert 0.5 <= m["mismatch/full_vocab_top5_overlap_mean"] <= 1.0


def test_full_vocab_hf_path_agrees_with_vexact_fp32_and_can_be_switched_off(llama_dir):
    m = _measure(llama_dir, "hf:fp32", "exact:fp32", ignore_eos=True, random_prompts=3)["metrics"]
    assert m["mismatch/full_vocab_positions"] == 30
    assert 0 <= m["mismatch/full_vocab_kl_max"] <= 1e-9 and m["mismatch/full_vocab_tv_max"] <= 1e-5
    assert m["mismatch/full_vocab_argmax_flip_frac"] == 0.0
    off = _measure(llama_dir, "exact:fp32", "exact:fp32", random_prompts=2, full_vocab=False)
    assert not any(key.startswith("mismatch/full_vocab") for key in off["metrics"])
    assert "full_vocab" not in off["seconds"]


def test_cli_measure_prints_and_writes_the_full_vocab_comparison(qwen3_ids_dir, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["measure", "--model", str(qwen3_ids_dir), "--random-prompts", "2", "--max-new-tokens", "3",
                 "--ignore-eos", "--rollout", "exact:fp32", "--train", "exact:fp32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [report["metrics"][k] for k in FULL_VOCAB_KEYS] == [6, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    printed = capsys.readouterr().out
    assert "full-vocabulary comparison" in printed and "top-5 overlap mean" in printed


def test_measure_random_prompts_and_the_old_spelling():
    import warnings


    parser = build_parser()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        assert parser.parse_args(["measure", "--model", "m", "--random-prompts", "4"]).random_prompts == 4
    with pytest.warns(FutureWarning, match="--random is deprecated; use --random-prompts"):
        assert parser.parse_args(["measure", "--model", "m", "--random", "3"]).random_prompts == 3
    with pytest.raises(SystemExit), pytest.warns(FutureWarning):  # one source of prompts: not both spellings
        parser.parse_args(["measure", "--model", "m", "--random", "3", "--random-prompts", "4"])


def test_engine_and_path_specs_take_both_spellings():
    for short, long in DTYPE_ALIASES.items():
        if long in ("float32", "bfloat16"):
            assert resolve_dtype(short) == resolve_dtype(long) == getattr(torch, long)
            assert parse_path(f"native:{short}") == parse_path(f"native:{long}")
            assert parse_locate_path(f"exact:{long}:train", "rollout").spec == parse_path(f"exact:{short}")
    with pytest.raises(ValueError, match=r"DTYPE in float32 \(fp32\), bfloat16 \(bf16\)"):
        parse_path("native:fp16")


def test_measure_prints_the_chi2_footnote_with_long_dtype_names(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=2, tokenizer=False)
    assert main(["measure", "--model", str(model), "--random-prompts", "2", "--max-new-tokens", "4",
                 "--rollout", "native:bfloat16", "--train", "exact:float32", "--no-full-vocab"]) == 0
    out = capsys.readouterr().out
    assert "native:bf16" in out and "exact:fp32" in out  # the long names name the same paths
    assert "χ² token †" in out and "† χ² token: the token mean of ρ² − 1" in out and "slightly negative" in out


def test_a_broken_correction_method_is_refused_before_the_work(qwen3_ids_dir, capsys, monkeypatch):
    """The report resolves every registered correction method's default plan (``mismatch/ratio_affected_frac/*``):
    a plugin method whose ``to_verl`` fails was found only then, after the checkpoint was loaded and both paths had
    run. Now measure refuses it first, with ``vexact run``'s check (``corrections.check_every_method``)."""
    from vexact.real import measure
    from vexact.rl.corrections import CorrectionMethod, register_correction_method
    from vexact.rl.registries import CORRECTION_METHODS

    def no_work(*args, **kwargs):
        raise AssertionError("measure loaded the checkpoint before refusing the method")

    monkeypatch.setattr(measure, "CheckpointLoader", no_work)
    register_correction_method(CorrectionMethod("outside_broken", "x", "x", lambda cfg: None))
    try:
        assert main(["measure", "--model", str(qwen3_ids_dir), "--random-prompts", "2", "--max-new-tokens", "2"]) == 2
    finally:
        CORRECTION_METHODS.remove("outside_broken")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: correction method 'outside_broken' (to_verl) returned None")
    assert "mismatch/ratio_affected_frac/outside_broken" in err, err
