"""Run config: defaults, YAML round trip, --set overrides, and one clear ConfigError per kind of mistake."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from test_sweep_faults import _cli_error
from test_trainer import EXPERIMENT

from vexact.engine.inputs import MIN_TEMPERATURE
from vexact.rl.config import ConfigError, config_from_dict, config_hash, dotted_items, load_config, save_config
from vexact.rl.config_schema import MIN_ADAM_EPS, AlgorithmSection, OptimizerSection, RunConfig
from vexact.rl.config_spellings import KEY_ALIASES
from vexact.rl.trainer import Trainer
from vexact.sweeps.sweep import load_sweep_spec

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def config_error(d: dict, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(d, overrides)
    return str(info.value)


# --- valid configs ---------------------------------------------------------------------------------------------


def test_defaults_are_valid(tmp_path):
    cfg = config_from_dict({})
    assert cfg == RunConfig()
    assert cfg.name == "run" and cfg.steps == 100 and cfg.output_dir is None
    assert cfg.model.num_kv_heads == 2 and cfg.task.name == "reverse"
    assert cfg.optimizer.betas == (0.9, 0.99) and cfg.algorithm.old_logprobs == "rollout"
    assert cfg.rollout.backend is None and cfg.optimizer.grad_clip == 1.0
    # "{}", and a section left empty in YAML ("model:"), both mean defaults; an empty file is refused (below).
    (tmp_path / "braces.yaml").write_text("{}  # every default\n")
    assert load_config(tmp_path / "braces.yaml") == cfg
    (tmp_path / "name_only.yaml").write_text("name: tiny\nmodel:\n")
    assert load_config(tmp_path / "name_only.yaml") == dataclasses.replace(cfg, name="tiny")


def test_yaml_round_trip(tmp_path):
    cfg = config_from_dict({
        "name": "rt", "threads": 2, "dtype": "bfloat16", "output_dir": str(tmp_path / "out"),
        "rollout": {"backend": "native", "batch_size": 8, "temperature": 0.7},
        "optimizer": {"lr": 1e-5, "betas": [0.8, 0.95], "grad_clip": None},
        "algorithm": {"old_logprobs": "recompute", "mini_batches": 4, "micro_batch_size": 16},
    })
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    saved = yaml.safe_load(path.read_text())
    # Fully resolved: every section and field is written, defaults included.
    assert list(saved) == [f.name for f in dataclasses.fields(RunConfig)]
    assert saved["model"]["hidden_size"] == 64 and saved["optimizer"]["betas"] == [0.8, 0.95]
    assert load_config(path) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg


def test_float_fields_accept_ints_and_yaml11_exponents(tmp_path):
    # PyYAML reads 3e-3 and 1e-6 as strings (YAML 1.1); float fields must still take them.
    path = tmp_path / "c.yaml"
    path.write_text("warm_start:\n  lr: 3e-3\nmodel:\n  rope_theta: 500000\n  rms_norm_eps: 1e-6\n"
                    "optimizer:\n  lr: 1.0e-4\n")
    cfg = load_config(path)
    assert cfg.warm_start.lr == 3e-3 and cfg.optimizer.lr == 1e-4 and cfg.model.rms_norm_eps == 1e-6
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)


def test_shipped_experiments_load():
    """Every shipped run config validates, and so does every point of every shipped sweep."""
    from vexact.sweeps.bias_meter import load_meter_spec
    from vexact.sweeps.sweep import load_sweep_spec

    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        if "sweep" in path.stem:
            assert all(isinstance(p.config, RunConfig) for p in load_sweep_spec(path).points)
        elif "meter" in path.stem:  # vexact meter's files
            load_meter_spec(path)
        else:
            assert isinstance(load_config(path), RunConfig)
    demo = Path(__file__).resolve().parents[2] / "vexact" / "sweeps" / "demo_sweep.yaml"
    assert len(load_sweep_spec(demo).points) == 6


def test_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"name": "base", "rollout": {"batch_size": 32}})
    cfg = load_config(path, [
        "optimizer.lr=1e-4",  # YAML 1.1 string -> float
        "rollout.batch_size=null",
        "algorithm.old_logprobs=recompute",
        "optimizer.betas=[0.8, 0.9]",
        "model.num_layers=3",  # section absent from the file
        "name=renamed",
        "output_dir=runs/x=1",  # only the first '=' splits
    ])
    assert cfg.optimizer.lr == 1e-4 and cfg.rollout.batch_size is None
    assert cfg.algorithm.old_logprobs == "recompute" and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.model.num_layers == 3 and cfg.name == "renamed" and cfg.output_dir == "runs/x=1"
    # Later overrides win; the input dict is not mutated.
    raw = {"steps": 5}
    assert config_from_dict(raw, ["steps=6", "steps=7"]).steps == 7
    assert raw == {"steps": 5}


def test_config_hash_is_stable_and_sensitive():
    a = config_from_dict({})
    assert config_hash(a.optimizer) == config_hash(a.to_dict()["optimizer"]) == config_hash(OptimizerSection())
    assert config_hash({"x": 1, "y": 2}) == config_hash({"y": 2, "x": 1})
    assert len(config_hash(a)) == 64
    assert config_hash(a.model) != config_hash(config_from_dict({"model": {"num_layers": 3}}).model)


# --- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,key,expected", [
    # unknown keys
    ({"stpes": 3}, "stpes", "unknown key (known keys: name, seed, steps"),
    ({"rollout": {"temprature": 1.0}}, "rollout.temprature", "unknown key (known keys: prompts_per_step"),
    # wrong types
    ({"steps": 1.5}, "steps", "expected an integer >= 1, got 1.5"),
    ({"seed": True}, "seed", "expected an integer >= -9223372036854775808 and <= 18446744073709551615, got true"),
    ({"model": {"qk_norm": 1}}, "model.qk_norm", "expected a boolean, got 1"),
    ({"logging": {"live": "yes"}}, "logging.live", "expected a boolean, got 'yes'"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr", "expected a number > 0, got 'fast'"),
    ({"optimizer": {"lr": False}}, "optimizer.lr", "expected a number > 0, got false"),
    ({"name": 3}, "name", "expected a string, got 3"),
    ({"model": 5}, "model", "expected a mapping"),
    ({"algorithm": {"old_logprobs": "bypass"}}, "algorithm.old_logprobs",
     "expected one of 'rollout', 'recompute', got 'bypass'"),
    ({"backend": "cuda"}, "backend", "expected one of 'exact', 'native', 'triton', got 'cuda'"),
    ({"rollout": {"dtype": "float16"}}, "rollout.dtype", "expected one of 'float32', 'bfloat16' or null"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas", "expected a list of 2 numbers"),
    ({"optimizer": {"betas": 0.9}}, "optimizer.betas", "expected a list of 2 numbers"),
    ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas[1]", "expected a number"),
    # constraints
    ({"optimizer": {"lr": -1}}, "optimizer.lr", "expected a number > 0, got -1"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]", "expected a number >= 0 and < 1, got 1.0"),
    ({"optimizer": {"grad_clip": 0}}, "optimizer.grad_clip", "expected a number > 0 or null, got 0"),
    ({"rollout": {"temperature": float("nan")}}, "rollout.temperature", "got nan"),
    ({"threads": 0}, "threads", "expected an integer >= 1 and <= 4096 or null, got 0"),
    ({"warm_start": {"steps": -1}}, "warm_start.steps", "expected an integer >= 0, got -1"),
    # both seeds: torch.manual_seed's range (beyond it the model init failed, naming no key)
    ({"seed": 2**64}, "seed", "<= 18446744073709551615, got 18446744073709551616"),
    ({"warm_start": {"seed": -(2**63) - 1}}, "warm_start.seed", "expected an integer >= -9223372036854775808"),
    ({"task": {"eval_prompts": 0}}, "task.eval_prompts", ">= 1"),
    # cross-field checks
    ({"model": {"num_heads": 4, "num_kv_heads": 3}}, "model.num_heads", "divisible by num_kv_heads"),
    ({"model": {"hidden_size": 66}}, "model.hidden_size", "divisible by num_heads"),
    ({"model": {"hidden_size": 20}}, "model.hidden_size", "must be even"),
    ({"task": {"min_len": 6, "max_len": 5}}, "task.max_len", "max_len >= min_len"),
    ({"algorithm": {"mini_batches": 3}}, "algorithm.mini_batches", "divisible by mini_batches"),
])
def test_errors_name_the_key(d, key, expected):
    message = config_error(d)
    assert message.startswith(f"config error at '{key}': ")
    assert expected in message
    assert "\n" not in message


def test_both_seeds_take_one_range_negatives_too():
    """A negative run seed always ran (it seeds the policy when warm_start.seed is None), so warm_start.seed takes
    negatives too: one range for both (warm_start.seed -1 was refused, seed -1 accepted)."""
    assert config_from_dict({"seed": -1}).policy_seed == -1
    assert config_from_dict({"seed": 3, "warm_start": {"seed": -1}}).policy_seed == -1


def test_cross_field_check_sees_overrides():
    assert config_from_dict({"algorithm": {"mini_batches": 4}}).algorithm == AlgorithmSection(mini_batches=4)
    overrides = ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=1"]
    message = config_error({"algorithm": {"mini_batches": 4}}, overrides)
    assert "'algorithm.mini_batches'" in message


@pytest.mark.parametrize("override,key,expected", [
    ("rollout.foo=1", "rollout.foo", "unknown key"),
    ("foo=1", "foo", "unknown key"),
    ("optimizer.lr.x=1", "optimizer.lr.x", "'optimizer.lr' is not a section"),
    ("optimizer.lr=-1", "optimizer.lr", "expected a number > 0, got -1 (from --set optimizer.lr=-1)"),
    ("rollout.batch_size=1.5", "rollout.batch_size", "expected an integer >= 1 or null"),
    ("optimizer.betas=[1, 2]", "optimizer.betas[0]", "(from --set optimizer.betas=[1, 2])"),
    ("optimizer.lr=[1", "optimizer.lr", "cannot parse value '[1' as YAML"),
    # YAML's infinities and NaN: no setting means infinity (null turns a knob off), so none is taken as given
    ("optimizer.lr=.inf", "optimizer.lr", "expected a finite number > 0, got inf (from --set optimizer.lr=.inf)"),
    ("optimizer.grad_clip=.inf", "optimizer.grad_clip", "expected a finite number > 0, got inf (from --set "
                                                        "optimizer.grad_clip=.inf)"),
    ("optimizer.betas=[0.9, .nan]", "optimizer.betas[1]", "expected a finite number >= 0 and < 1, got nan"),
    ("collapse.min_peak=-.inf", "collapse.min_peak", "expected a finite number >= 0, got -inf"),
    ("warm_start.lr=.nan", "warm_start.lr", "expected a finite number > 0, got nan (from --set warm_start.lr=.nan)"),
    # an integer beyond float's range (it was an OverflowError traceback)
    ("optimizer.lr=1" + "0" * 400, "optimizer.lr", "expected a finite number > 0, got 1000"),
    ("correction.log_ratio_bound=-1" + "0" * 400, "correction.log_ratio_bound", "expected a finite number"),
    # torch.set_num_threads overflowed after the run had started, naming no key
    ("threads=2147483648", "threads", "expected an integer >= 1 and <= 4096 or null, got 2147483648"),
    # 0 in float32: NaN weights at the first update of a parameter with a zero gradient
    ("optimizer.eps=1e-46", "optimizer.eps", f"expected a number >= {MIN_ADAM_EPS}, got '1e-46'"),
])
def test_override_errors(override, key, expected):
    message = config_error({}, [override])
    assert message.startswith(f"config error at '{key}': ")
    assert expected in message


@pytest.mark.parametrize("override", ["optimizer.lr", "=1", "a..b=1", ""])
def test_malformed_override(override):
    message = config_error({}, [override])
    assert "malformed override" in message and repr(override) in message


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- name: a\n- name: b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml' must contain a mapping of config keys at top level, got list"):
        load_config(not_mapping)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("optimizer: [1\nsteps: 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in config file '.*bad\.yaml'.*line 2"):
        load_config(bad_yaml)
    twice = tmp_path / "twice.yaml"
    twice.write_text("seed: 1\nsteps: 5\nseed: 2\n")  # PyYAML alone would keep seed 2 silently
    with pytest.raises(ConfigError, match=r"twice\.yaml': found duplicate key 'seed' \(line 3, column 1\)"):
        load_config(twice)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00seed")
    with pytest.raises(ConfigError, match=r"binary\.yaml' is not a UTF-8 text file"):
        load_config(binary)
    with pytest.raises(ConfigError, match="expected a mapping of config keys, got list"):
        config_from_dict([1, 2])


def test_the_public_names_import_from_vexact_rl_config():
    """``vexact.rl.config`` is where users import the run config from: every name of its ``__all__`` is there, the
    object its defining module holds (the sections live in ``config_schema``, the other spellings in
    ``config_spellings``), and every section class is one of them."""
    from vexact.rl import config, config_schema, config_spellings

    defined = {**vars(config_schema), **vars(config_spellings), **vars(config)}
    assert [name for name in config.__all__ if getattr(config, name, "missing") is not defined.get(name)] == []
    assert config.RunConfig is config_schema.RunConfig and config.KEY_ALIASES is config_spellings.KEY_ALIASES
    sections = {name for name, value in vars(config_schema).items() if isinstance(value, type)
                and dataclasses.is_dataclass(value) and value.__module__ == config_schema.__name__}
    assert "TargetSection" in sections and sections <= set(config.__all__), sections - set(config.__all__)


def test_config_error_is_value_error():
    # Callers that catch ValueError (the CLI) keep working.
    assert issubclass(ConfigError, ValueError)
    err = ConfigError("expected a number > 0, got -1", "optimizer.lr")
    assert err.key == "optimizer.lr" and err.problem == "expected a number > 0, got -1"


def test_lengths_are_config_errors_at_load_and_in_the_trainer():
    from vexact.rl.config import ConfigError, config_from_dict
    from vexact.rl.config_schema import RunConfig

    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"max_seq_len": 10}})
    assert e.value.key == "model.max_seq_len" and "too short" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"rollout": {"max_new_tokens": 3}})
    assert e.value.key == "rollout.max_new_tokens"
    cfg = RunConfig()  # built in Python: never validated by load_config
    cfg.model.max_seq_len = 10
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    assert e.value.key == "model.max_seq_len"
    config_from_dict({})  # counter-case: the defaults fit


def _error(d: dict, overrides: list[str] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(d, overrides)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
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


def test_the_configs_dtypes_are_the_models():
    """``DType`` spells the model's dtypes as a Literal (the config's schema needs one): it must stay the model's
    table (``engine.model.DTYPE_NAMES``, from the exact kernels' ``FLOAT_DTYPES``), in its order."""
    import typing

    from vexact.engine.model import DTYPE_NAMES
    from vexact.rl.config_schema import DType

    assert typing.get_args(DType) == DTYPE_NAMES == ("float32", "bfloat16")


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_override_with_short_dtype_and_error_lists_both_spellings():
    assert config_from_dict({}, ["dtype=bf16"]).dtype == "bfloat16"
    err = _error({}, ["dtype=fp16"])  # the model computes in fp32 or bf16 only
    assert err.key == "dtype"
    assert "'float32', 'bfloat16' (also spelled 'fp32', 'bf16'), got 'fp16'" in str(err)


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_dotted_key_below_a_value_says_it_is_not_a_section():
    err = _error({"steps": 200}, ["steps.x=1"])
    assert str(err).startswith("config error at 'steps.x': 'steps' is not a section (it takes an integer >= 1)")
    assert "expected an integer" not in str(err)


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_dotted_keys_create_an_optional_section():
    overrides = ["inject.mode=logit_noise", "inject.target.metric=mismatch/abs_dlogp_mean", "inject.target.value=1e-3"]
    target = config_from_dict({}, overrides).inject.target
    assert (target.metric, target.value) == ("mismatch/abs_dlogp_mean", 1e-3)
    # value alone: metric has a default (rollout_corr/k3_kl); an existing target is updated key by key
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.target.value=0.5"]).inject.target.metric == \
        "rollout_corr/k3_kl"
    base = {"inject": {"mode": "logit_noise", "target": {"metric": "mismatch/abs_dlogp_mean", "value": 0.1}}}
    assert config_from_dict(base, ["inject.target.value=0.2"]).inject.target.value == 0.2


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
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


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_sweep_grid_over_a_target_value_and_a_verl_key(tmp_path):
    target = {"inject.mode": "logit_noise", "inject.target.metric": "rollout_corr/k3_kl"}
    spec = load_sweep_spec(_sweep(tmp_path, set=target,
                                  grid={"inject.target.value": [1e-3, 1e-2], "algorithm.clip_ratio_low": [0.1]}))
    assert [p.config.inject.target.value for p in spec.points] == [1e-3, 1e-2]
    assert all(p.config.algorithm.clip_low == 0.1 for p in spec.points)
    with pytest.raises(ConfigError, match="verl's and vexact's spelling"):
        load_sweep_spec(_sweep(tmp_path, set={"algorithm.clip_low": 0.2}, grid={"algorithm.clip_ratio_low": [0.1]}))


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
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


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_both_spellings_of_one_key_are_an_error():
    err = _error({"algorithm": {"clip_ratio_low": 0.1, "clip_low": 0.2}})
    assert err.key == "algorithm.clip_ratio_low" and "keep only one" in str(err)
    err = _error({}, ["algorithm.clip_low=0.2", "algorithm.clip_ratio_low=0.1"])
    assert "--set algorithm.clip_low=0.2 and --set algorithm.clip_ratio_low=0.1 set the same key" in str(err)
    err = _error({"algorithm": {"clip_ratio_low": -1}})  # a bad value names the spelling the file used
    assert err.key == "algorithm.clip_low" and "(written as 'algorithm.clip_ratio_low')" in str(err)


@pytest.mark.parametrize("overrides,key,words", [
    (["inject.value=0.5"], "inject.value", ["would inject nothing", "no inject.mode", "logit_noise"]),
    (["inject.mode=logit_noise"], "inject.mode", ["needs inject.sigma", "sigma", "inject.target"]),
    (["inject.mode=logit_scale"], "inject.mode", ["needs inject.epsilon", "epsilon"]),
    (["inject.mode=top_k"], "inject.mode", ["needs inject.top_k"]),
    (["inject.mode=precision", "inject.value=0.3"], "inject.value", ["not used by mode 'precision'",
                                                                      "inject.precision"]),
])
def test_an_injection_that_would_do_nothing_is_refused(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, overrides)
    assert err.value.key == key and all(w in str(err.value) for w in words), str(err.value)
    assert f"(from --set {overrides[-1] if key == 'inject.value' else overrides[0]})" in str(err.value)


def test_what_injection_configs_may_still_say():
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.sigma=0"]).inject.value == 0.0  # a baseline
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.target.value=0.01"]).inject.target.value == 0.01
    assert config_from_dict({}, ["inject.mode=precision"]).inject.mode == "precision"  # no knob needed
    assert config_from_dict({"inject": {"mode": "none", "value": 0.0}}).inject.mode == "none"  # as saved
    saved = config_from_dict({}, ["inject.mode=top_p", "inject.top_p=0.9"]).to_dict()
    assert config_from_dict(saved).inject.value == 0.9  # a saved config.yaml loads as it was


@pytest.mark.parametrize("name,problem", [("../elsewhere", "leaves the runs directory"), ("a/b", "a path separator"),
                                          ("/tmp/abs", "an absolute path"), ("a\\b", "a backslash"),
                                          ("..", "leaves the runs directory"), ("", "an empty name")])
def test_run_names_that_leave_the_runs_directory_are_refused(name, problem):
    with pytest.raises(ConfigError, match=f"config error at 'name': expected a plain folder name .*: .*{problem}"):
        config_from_dict({"name": name})


def test_a_name_is_a_label_when_output_dir_is_set_but_never_leaves_with_dot_dot(tmp_path):
    assert config_from_dict({"name": "sweep/point", "output_dir": str(tmp_path)}).name == "sweep/point"
    with pytest.raises(ConfigError, match="config error at 'name': expected a relative label"):
        config_from_dict({"name": "../x", "output_dir": str(tmp_path)})


def test_a_run_name_with_dot_dot_is_one_cli_error_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("name: ../outside\nsteps: 1\n")
    line = _cli_error(capsys, monkeypatch, "run", str(config))
    assert "config error at 'name'" in line and "'../outside'" in line
    assert not (tmp_path / "outside").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("raw,key,says", [
    ({"algorithm": {"clip_low": 1.0}}, "algorithm.clip_low", "expected a number >= 0 and < 1, got 1.0"),
    ({"algorithm": {"clip_ratio_low": 1.5}}, "algorithm.clip_low", "< 1, got 1.5 (written as"),
    ({"algorithm": {"clip_high": -0.1}}, "algorithm.clip_high", "expected a number >= 0"),
    ({"rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt", "'grpo' compares the samples"),
    ({"rollout": {"samples_per_prompt": 1}, "algorithm": {"advantage": "rloo"}}, "rollout.samples_per_prompt",
     "a group of 1 sample has advantage 0"),
    ({"rollout": {"samples_per_prompt": 1, "prompts_per_step": 1}, "algorithm": {"advantage": "reinforce"},
      "distributed": {"leaves": 1}}, "rollout.prompts_per_step", "a batch of 1 sample has advantage 0"),
    ({"rollout": {"temperature": 0}}, "rollout.temperature", "expected a number >= 1e-06, got 0"),
    # below the sampler's MIN_TEMPERATURE: refused here, not in the first rollout after the run directory was made
    ({"rollout": {"temperature": 1e-7}}, "rollout.temperature", "expected a number >= 1e-06, got 1e-07"),
    ({"steps": 10, "inject": {"mode": "logit_noise", "sigma": 0.5, "onset_step": 10}}, "inject.onset_step",
     "would inject nothing"),
    ({"steps": 10, "inject": {"mode": "precision", "onset_step": 12}}, "inject.onset_step", "would inject nothing"),
])
def test_settings_that_can_never_learn_or_inject_are_refused_naming_the_key(raw, key, says):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(f"config error at '{key}': ") and says in str(err.value)


def test_the_meaningful_neighbours_are_accepted():
    config_from_dict({"rollout": {"samples_per_prompt": 1}, "algorithm": {"advantage": "reinforce"}})
    config_from_dict({"algorithm": {"clip_low": 0.0, "clip_high": 0.0}})
    config_from_dict({"rollout": {"temperature": MIN_TEMPERATURE}})
    config_from_dict({"optimizer": {"eps": MIN_ADAM_EPS}})
    config_from_dict({"steps": 10, "inject": {"mode": "logit_noise", "sigma": 0.0, "onset_step": 50}})  # a baseline
    config_from_dict({"steps": 10, "inject": {"mode": "logit_noise", "sigma": 0.5, "onset_step": 9}})


@pytest.mark.parametrize("raw,message", [
    ({"rollout": {"cuda_graphs": True}}, "it needs device cuda"),  # the default device is the CPU
    ({"device": "cuda", "rollout": {"cuda_graphs": True, "engine": "vllm"}}, "rollout.engine is 'vllm'"),
    ({"device": "cuda", "model": {"num_experts": 4}, "rollout": {"cuda_graphs": True}},
     "an MoE model's decode step records its routing on the host"),
])
def test_rollout_cuda_graphs_where_it_cannot_run_is_one_config_error_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=message) as refused:
        config_from_dict({"steps": 10, **raw})
    assert refused.value.key == "rollout.cuda_graphs"
    cfg = config_from_dict({"steps": 10, "device": "cuda", "rollout": {"cuda_graphs": True}})
    assert cfg.rollout.cuda_graphs is True and config_from_dict({"steps": 10}).rollout.cuda_graphs is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (device auto resolves to the CPU)")
def test_rollout_cuda_graphs_with_device_auto_on_a_machine_without_a_gpu_is_refused_when_the_run_starts(tmp_path):
    cfg = config_from_dict({"steps": 10, "device": "auto", "output_dir": str(tmp_path / "run"),
                            "rollout": {"cuda_graphs": True}})
    with pytest.raises(ConfigError, match="resolved to cpu here, and it needs a CUDA device") as refused:
        Trainer(cfg)
    assert refused.value.key == "rollout.cuda_graphs"
