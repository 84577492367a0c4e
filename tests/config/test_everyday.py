"""Everyday use: dtype spellings, dotted keys of optional sections, verl's key names, the Triton-interpreter guard,
cleanup after an early Ctrl-C, file modes of checkpoints, hub ids, and --help/--version of every command."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from rich.console import Console
from test_trainer import EXPERIMENT, _short

from vexact.cli import build_parser, main
from vexact.engine.model import DTYPE_ALIASES, resolve_dtype
from vexact.real.check_report import check_verdict
from vexact.real.locate import parse_locate_path
from vexact.real.measure import parse_path
from vexact.real.pretrained import read_checkpoint_config
from vexact.real.tiny import make_tiny_checkpoint
from vexact.records import runlog
from vexact.records.runlog import discard_if_interrupted_early, save_checkpoint
from vexact.rl import triton_guard
from vexact.rl.config import (
    KEY_ALIASES,
    ConfigError,
    config_from_dict,
    config_hash,
    dotted_items,
    load_config,
    save_config,
)
from vexact.rl.tasks import make_task
from vexact.rl.trainer import Trainer
from vexact.sweeps.sweep import load_sweep_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _error(d: dict, overrides: list[str] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(d, overrides)
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- dtype spellings
def test_short_and_long_dtype_names_are_one_config(tmp_path):
    short = config_from_dict({"dtype": "bf16", "rollout": {"dtype": "fp32"},
                              "inject": {"mode": "kernel", "kernel_dtype": "bf16", "precision": "fp16"}})
    long = config_from_dict({"dtype": "bfloat16", "rollout": {"dtype": "float32"},
                             "inject": {"mode": "kernel", "kernel_dtype": "bfloat16", "precision": "float16"}})
    assert (short.dtype, short.rollout.dtype, short.inject.kernel_dtype, short.inject.precision) == (
        "bfloat16", "float32", "bfloat16", "float16")
    assert short == long and config_hash(short) == config_hash(long)
    save_config(short, tmp_path / "config.yaml")  # what --resume compares against: the long names
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["dtype"] == "bfloat16" and saved["rollout"]["dtype"] == "float32"
    assert load_config(tmp_path / "config.yaml") == short


def test_override_with_short_dtype_and_error_lists_both_spellings():
    assert config_from_dict({}, ["dtype=bf16"]).dtype == "bfloat16"
    err = _error({}, ["dtype=fp16"])  # the model computes in fp32 or bf16 only
    assert err.key == "dtype"
    assert "'float32', 'bfloat16' (also spelled 'fp32', 'bf16'), got 'fp16'" in str(err)


def test_engine_and_path_specs_take_both_spellings():
    for short, long in DTYPE_ALIASES.items():
        if long in ("float32", "bfloat16"):
            assert resolve_dtype(short) == resolve_dtype(long) == getattr(torch, long)
            assert parse_path(f"native:{short}") == parse_path(f"native:{long}")
            assert parse_locate_path(f"exact:{long}:train", "rollout").spec == parse_path(f"exact:{short}")
    with pytest.raises(ValueError, match=r"DTYPE in float32 \(fp32\), bfloat16 \(bf16\)"):
        parse_path("native:fp16")


def test_check_accepts_short_dtype_and_ends_with_a_verdict(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check", "--dtype", "bf16", "--backend", "exact", "--num-prompts", "3", "--max-new-tokens", "4",
                 "--hidden-size", "32", "--intermediate-size", "64", "--batch-sizes", "all,1",
                 "--micro-batch-sizes", "all", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["dtype"] == "bfloat16" and row["bitwise_equal"] == row["tokens"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASS: ") and "exact/bfloat16" in last and f"({row['tokens']} of" in last


def test_check_verdict_fails_naming_the_exact_path():
    ok = {"backend": "exact", "dtype": "float32", "tokens": 10, "bitwise_equal": 10, "sampling_batch_invariant": True}
    native = {**ok, "backend": "native", "bitwise_equal": 3}
    assert check_verdict([ok, native]).startswith("PASS: ")  # native makes no promise
    bad = {**ok, "dtype": "bfloat16", "bitwise_equal": 7}
    verdict = check_verdict([ok, bad, native])
    assert verdict.startswith("FAIL: ") and "exact/bfloat16 (3 of 10 tokens differ)" in verdict
    assert "native" not in verdict and "\n" not in verdict
    assert "sampling not batch-invariant" in check_verdict([{**ok, "sampling_batch_invariant": False}])


# --------------------------------------------------------------------------- dotted keys
def test_dotted_key_below_a_value_says_it_is_not_a_section():
    err = _error({"steps": 200}, ["steps.x=1"])
    assert str(err).startswith("config error at 'steps.x': 'steps' is not a section (it takes an integer >= 1)")
    assert "expected an integer" not in str(err)


def test_dotted_keys_create_an_optional_section():
    overrides = ["inject.mode=logit_noise", "inject.target.metric=mismatch/abs_dlogp_mean", "inject.target.value=1e-3"]
    target = config_from_dict({}, overrides).inject.target
    assert (target.metric, target.value) == ("mismatch/abs_dlogp_mean", 1e-3)
    # value alone: metric has a default (rollout_corr/k3_kl); an existing target is updated key by key
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.target.value=0.5"]).inject.target.metric == \
        "rollout_corr/k3_kl"
    base = {"inject": {"mode": "logit_noise", "target": {"metric": "mismatch/abs_dlogp_mean", "value": 0.1}}}
    assert config_from_dict(base, ["inject.target.value=0.2"]).inject.target.value == 0.2


def test_a_target_without_its_value_is_one_error():
    err = _error({}, ["inject.mode=logit_noise", "inject.target.metric=rollout_corr/k3_kl"])
    assert err.key == "inject.target.value" and "required key missing: 'inject.target' needs 'value'" in str(err)
    assert _error({"inject": {"mode": "logit_noise", "target": {}}}).key == "inject.target.value"
    assert config_from_dict({"inject": {"target": None}}).inject.target is None  # null: no target at all


def _sweep(tmp_path: Path, **spec) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": str(EXPERIMENT), "output_dir": str(tmp_path / "out"),
                                    **spec}))
    return path


def test_sweep_grid_over_a_target_value_and_a_verl_key(tmp_path):
    target = {"inject.mode": "logit_noise", "inject.target.metric": "rollout_corr/k3_kl"}
    spec = load_sweep_spec(_sweep(tmp_path, set=target,
                                  grid={"inject.target.value": [1e-3, 1e-2], "algorithm.clip_ratio_low": [0.1]}))
    assert [p.config.inject.target.value for p in spec.points] == [1e-3, 1e-2]
    assert all(p.config.algorithm.clip_low == 0.1 for p in spec.points)
    with pytest.raises(ConfigError, match="verl's and vexact's spelling"):
        load_sweep_spec(_sweep(tmp_path, set={"algorithm.clip_low": 0.2}, grid={"algorithm.clip_ratio_low": [0.1]}))


# --------------------------------------------------------------------------- verl spellings
def test_verl_spellings_are_stored_as_vexact_keys():
    cfg = config_from_dict({"rollout": {"n": 4, "response_length": 24},
                            "algorithm": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "entropy_coeff": 0.01,
                                          "loss_agg_mode": "seq-mean-token-mean", "adv_estimator": "rloo",
                                          "norm_adv_by_std_in_grpo": False, "kl_loss_coef": 0.05},
                            "optimizer": {"lr_warmup_steps": 3}})
    assert (cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens) == (4, 24)
    a = cfg.algorithm
    assert (a.clip_low, a.clip_high, a.entropy_coef, a.loss_agg, a.advantage, a.std_normalize, a.kl_coef) == (
        0.1, 0.3, 0.01, "seq_mean", "rloo", False, 0.05)
    assert cfg.optimizer.warmup_steps == 3
    saved = cfg.to_dict()
    assert "clip_ratio_low" not in saved["algorithm"] and saved["algorithm"]["loss_agg"] == "seq_mean"
    assert config_from_dict({}, ["algorithm.clip_ratio_high=0.4", "rollout.n=2"]).rollout.samples_per_prompt == 2
    keys = dotted_items(config_from_dict({}).to_dict())
    for alias, key in KEY_ALIASES.items():  # every alias names a real key and shadows none
        assert key in keys and alias not in keys


def test_both_spellings_of_one_key_are_an_error():
    err = _error({"algorithm": {"clip_ratio_low": 0.1, "clip_low": 0.2}})
    assert err.key == "algorithm.clip_ratio_low" and "keep only one" in str(err)
    err = _error({}, ["algorithm.clip_low=0.2", "algorithm.clip_ratio_low=0.1"])
    assert "--set algorithm.clip_low=0.2 and --set algorithm.clip_ratio_low=0.1 set the same key" in str(err)
    err = _error({"algorithm": {"clip_ratio_low": -1}})  # a bad value names the spelling the file used
    assert err.key == "algorithm.clip_low" and "(written as 'algorithm.clip_ratio_low')" in str(err)


# --------------------------------------------------------------------------- Triton in the interpreter
@pytest.fixture
def interpreted(monkeypatch):
    """As on a machine without CUDA (and with the triton extra), whatever this one has."""
    monkeypatch.setattr(triton_guard, "interpreting", lambda: True)
    monkeypatch.setattr(triton_guard, "triton_installed", lambda: True)  # the estimate needs no triton
    monkeypatch.delenv(triton_guard.ALLOW_ENV, raising=False)


def _task(cfg):
    return make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len, cfg.task.partial_credit)


def test_triton_run_too_long_for_the_interpreter_is_refused_before_any_file(tmp_path, interpreted):
    cfg = load_config(EXPERIMENT, ["backend=triton", f"output_dir={tmp_path / 'run'}",
                                   f"warm_start.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match=r"config error at 'backend': .* roughly \d+\.\d h \(warm start "
                                         r".*VEXACT_ALLOW_SLOW_TRITON=1") as info:
        Trainer(cfg, Console(quiet=True))
    assert "backend: exact" in str(info.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_triton_override_and_small_runs_warn_with_the_estimate(tmp_path, interpreted, monkeypatch):
    cfg = load_config(EXPERIMENT, ["backend=triton", f"warm_start.cache_dir={tmp_path}"])
    monkeypatch.setenv(triton_guard.ALLOW_ENV, "1")
    console = Console(record=True, width=300)
    cost = triton_guard.check_interpreted_triton(cfg, _task(cfg), console)
    assert cost.total > triton_guard.REFUSE_ABOVE_S and cost.warm_start > 0
    text = console.export_text()
    assert "warning: Triton kernels run in the Triton interpreter" in text and "roughly" in text
    monkeypatch.delenv(triton_guard.ALLOW_ENV)
    tiny = load_config(EXPERIMENT, ["backend=triton", "steps=1", "warm_start.steps=0", "model.hidden_size=16",
                                    "model.num_layers=1", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2",
                                    "task.eval_prompts=1", "distributed.leaves=1"])
    cost = triton_guard.check_interpreted_triton(tiny, _task(tiny), console)
    assert 0 < cost.total <= triton_guard.REFUSE_ABOVE_S and cost.warm_start == 0


def test_only_interpreted_triton_paths_are_counted(interpreted, monkeypatch):
    exact = load_config(EXPERIMENT)
    assert triton_guard.check_interpreted_triton(exact, _task(exact)) is None
    rollout_only = load_config(EXPERIMENT, ["rollout.backend=triton", "steps=1"])
    cost = triton_guard.estimate(rollout_only, _task(rollout_only))
    assert cost.warm_start == 0 and cost.rl > 0  # the warm start trains on the exact backend
    monkeypatch.setattr(triton_guard, "interpreting", lambda: False)  # a GPU compiles the kernels
    triton = load_config(EXPERIMENT, ["backend=triton"])
    assert triton_guard.check_interpreted_triton(triton, _task(triton)) is None


def test_cli_refuses_a_long_interpreted_triton_run(tmp_path, interpreted, capsys):
    assert main(["run", str(EXPERIMENT), "--set", "backend=triton", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "VEXACT_ALLOW_SLOW_TRITON" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- Ctrl-C before anything is finished
def test_interrupt_during_warm_start_removes_the_new_run_dir(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("vexact.rl.trainer.warm_start", interrupted)
    cfg = _short(tmp_path, "run")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, Console(quiet=True)).run()
    assert not (tmp_path / "run").exists()


def test_interrupt_in_the_first_step_removes_it_too_but_a_finished_step_is_kept(tmp_path, monkeypatch):
    real_step = Trainer.step
    calls = []

    def step(self, number):
        calls.append(number)
        if len(calls) > stop_after:
            raise KeyboardInterrupt
        return real_step(self, number)

    monkeypatch.setattr(Trainer, "step", step)
    stop_after = 0
    summary = Trainer(_short(tmp_path, "none", "warm_start.steps=0"), Console(quiet=True)).run()
    assert summary["status"] == "interrupted" and not (tmp_path / "none").exists()
    stop_after, calls[:] = 1, []
    summary = Trainer(_short(tmp_path, "one", "warm_start.steps=0"), Console(quiet=True)).run()
    assert summary["status"] == "interrupted" and summary["steps_completed"] == 1
    assert len(runlog.read_metrics(tmp_path / "one" / "metrics.jsonl")) == 1  # finished: kept for --resume


def test_discard_keeps_existing_dirs_and_anything_finished(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(KeyboardInterrupt), discard_if_interrupted_early(existing, log=lambda _: None):
        raise KeyboardInterrupt
    assert existing.is_dir()  # not created by this run
    for name, content in (("metrics.jsonl", '{"step": 0}\n'), ("notes.txt", "mine")):
        run = tmp_path / name
        with pytest.raises(KeyboardInterrupt), discard_if_interrupted_early(run, log=lambda _: None):
            run.mkdir()
            (run / "config.yaml").write_text("{}")
            (run / name).write_text(content)
            raise KeyboardInterrupt
        assert (run / name).read_text() == content
    fresh = tmp_path / "fresh"
    with discard_if_interrupted_early(fresh, log=lambda _: None):  # no interrupt: nothing is removed
        fresh.mkdir()
    assert fresh.is_dir()


# --------------------------------------------------------------------------- file modes
@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_checkpoint_files_get_the_umask_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        model = torch.nn.Linear(2, 2)
        directory = save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), {"next_step": 1})
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in directory.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask) and "checkpoint.safetensors" in modes


def test_warm_start_cache_and_run_checkpoints_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        Trainer(_short(tmp_path, "run", "steps=1", "warm_start.steps=2", f"warm_start.cache_dir={tmp_path / 'cache'}"),
                Console(quiet=True)).run()  # a cache of its own: the entry is written here, under this umask
    finally:
        os.umask(old)
    (cached,) = (tmp_path / "cache").glob("*.safetensors")
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("*/checkpoint.safetensors")
    assert cached.stat().st_mode & 0o777 == checkpoint.stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- hub ids
def test_a_hub_id_is_answered_with_how_to_get_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at its import
    with pytest.raises(ValueError) as info:
        read_checkpoint_config(Path("Qwen/Qwen2.5-0.5B"))
    message = str(info.value)
    assert message.startswith("checkpoint directory not found: Qwen/Qwen2.5-0.5B")
    assert "downloads nothing at run time" in message
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B" in message
    assert "--model models/Qwen2.5-0.5B" in message and "cache" not in message
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")  # what huggingface_hub writes with a download
    with pytest.raises(ValueError, match=f"a copy is in your Hugging Face cache: --model {snapshot}"):
        read_checkpoint_config(Path("Qwen/Qwen2.5-0.5B"))
    with pytest.raises(ValueError) as info:  # an absolute path is no hub id
        read_checkpoint_config(tmp_path / "missing")
    assert str(info.value) == f"checkpoint directory not found: {tmp_path / 'missing'}"


def test_measure_prints_the_chi2_footnote_with_long_dtype_names(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=2, tokenizer=False)
    assert main(["measure", "--model", str(model), "--random-prompts", "2", "--max-new-tokens", "4",
                 "--rollout", "native:bfloat16", "--train", "exact:float32", "--no-full-vocab"]) == 0
    out = capsys.readouterr().out
    assert "native:bf16" in out and "exact:fp32" in out  # the long names name the same paths
    assert "χ² token †" in out and "† χ² token: the token mean of ρ² − 1" in out and "slightly negative" in out


# --------------------------------------------------------------------------- help and version
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"vexact": parser, **{f"vexact {name}": p for name, p in sub.choices.items()}}


def test_every_subcommand_and_every_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest: bool(c.help) for c in sub._choices_actions} == dict.fromkeys(sub.choices, True)
    missing = [f"{name} {action.option_strings or action.dest}" for name, p in _subcommands().items()
               for action in p._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not (action.help or "").strip()]
    assert missing == []


def test_every_flag_with_a_default_shows_it():
    unshown = []
    for name, p in _subcommands().items():
        formatter = p._get_formatter()
        for action in p._actions:
            default = action.default
            if (not action.option_strings or default is None or isinstance(default, bool) or default == []
                    or default is argparse.SUPPRESS):
                continue
            if "default" not in formatter._get_help_string(action).lower():
                unshown.append(f"{name} {action.option_strings}")
    assert unshown == []
    check_help = _subcommands()["vexact check"].format_help()
    assert "(default: 24)" in check_help and "(default all,1,3" in check_help  # the shared check_paths default


def test_defaults_read_as_typed_and_help_says_each_thing_once(monkeypatch):
    """The help nits a newcomer found: a default shown as ``(None, 1, 3)`` in the CLI reference, "finished work is
    kept; finished output is kept", an unwrapped epilogue in ``compare --help``, and ``--only``'s help saying every
    KEY must match where a KEY given twice merges its values."""
    from tools.docs_gen import _default

    commands = _subcommands()
    check = commands["vexact check"]
    sizes = {a.dest: a for a in check._actions if a.dest in ("batch_sizes", "micro_batch_sizes")}
    assert [_default(a) for a in sizes.values()] == ["`all,1,3`", "`all,1,5`"]  # the CLI reference's cells
    assert check.parse_args([]).batch_sizes == (None, 1, 3)  # still parsed by the flag's type
    for name, p in commands.items():
        assert "finished output is kept" not in p.format_help() and p.epilog.count("is kept") == 1, name
    monkeypatch.setenv("COLUMNS", "100")
    text = commands["vexact compare"].format_help()
    epilog = text[text.index("exit codes:"):]
    assert len(epilog.splitlines()) > 1 and max(map(len, epilog.splitlines())) <= 100
    assert "  vexact compare dump.jsonl                    one file holding both sides" in text  # laid out by hand
    only = next(a for a in commands["vexact sweep"]._actions if a.dest == "only")
    assert "every KEY must match" not in only.help and "a KEY given twice keeps the values of both" in only.help


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vexact {importlib.metadata.version('vexact')}"
