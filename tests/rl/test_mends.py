"""Issue P item 6: small mends (one definition per concept, settings that reach what they claim to set)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vexact.rl.config import AlgorithmSection, CorrectionSection
from vexact.rl.metrics import LOG_RATIO_BOUND, mismatch_metrics
from vexact.rl.objective import Anchors, Objective


def _chi2(bound: float) -> dict[str, float]:
    train, roll = [torch.tensor([0.0, -1.0], dtype=torch.float64)], [torch.tensor([-30.0, -1.0], dtype=torch.float64)]
    return mismatch_metrics(train, roll, log_ratio_bound=bound)


def test_log_ratio_bound_reaches_the_chi2_metrics():
    default = mismatch_metrics([torch.tensor([0.0, -1.0], dtype=torch.float64)],
                               [torch.tensor([-30.0, -1.0], dtype=torch.float64)])
    assert default == _chi2(LOG_RATIO_BOUND)  # the default is the config's default
    five = _chi2(5.0)
    assert five["rollout_corr/chi2_token"] == pytest.approx((math.exp(10.0) + 1.0) / 2 - 1.0, rel=1e-12)
    assert five["rollout_corr/chi2_seq"] == pytest.approx(math.exp(10.0) - 1.0, rel=1e-12)
    assert five["rollout_corr/chi2_token"] != default["rollout_corr/chi2_token"]  # counter-case: the bound bites


def _ppo_kl(bound: float) -> float:
    objective = Objective(AlgorithmSection(), CorrectionSection(log_ratio_bound=bound), 1.0, exact_training=False)
    logp = torch.tensor([-30.0, -1.0], requires_grad=True)
    old = torch.tensor([0.0, -1.0])
    batch = SimpleNamespace(responses=[[1, 2]], logprobs=[old])
    out = objective.loss_of(batch, [0], [logp], [torch.zeros(2)], torch.ones(1), Anchors([old], None, None), False)
    return out.stats["actor/ppo_kl"]


def test_log_ratio_bound_reaches_ppo_kl():
    assert _ppo_kl(LOG_RATIO_BOUND) == pytest.approx(20.0 / 2)
    assert _ppo_kl(5.0) == pytest.approx(5.0 / 2)


def test_lengths_are_config_errors_at_load_and_in_the_trainer():
    from vexact.rl.config import ConfigError, RunConfig, config_from_dict
    from vexact.rl.trainer import Trainer

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


def test_version_has_one_source():
    from setuptools.config.pyprojecttoml import read_configuration

    import vexact
    from vexact.cli import package_version

    root = Path(__file__).resolve().parents[2]
    project = read_configuration(root / "pyproject.toml")["project"]
    assert project["version"] == vexact.__version__ == package_version()
    assert 'dynamic = ["version"]' in (root / "pyproject.toml").read_text()  # no second literal version


def test_bench_choices_are_the_benchmark_modules():
    import inspect

    from vexact.cli import BENCHMARKS, _benchmarks_module, build_parser

    assert {"data_parallel", "compare"} <= set(BENCHMARKS)
    for name in BENCHMARKS:
        assert "prog" in inspect.signature(_benchmarks_module(name).main).parameters, name
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions if a.dest == "which")
    assert tuple(bench.choices) == tuple(BENCHMARKS)
    assert all(f"{name}:" in bench.help for name in BENCHMARKS)


def test_measure_random_prompts_and_the_old_spelling():
    import warnings

    from vexact.cli import build_parser

    parser = build_parser()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        assert parser.parse_args(["measure", "--model", "m", "--random-prompts", "4"]).random_prompts == 4
    with pytest.warns(FutureWarning, match="--random is deprecated; use --random-prompts"):
        assert parser.parse_args(["measure", "--model", "m", "--random", "3"]).random_prompts == 3
    with pytest.raises(SystemExit), pytest.warns(FutureWarning):  # one source of prompts: not both spellings
        parser.parse_args(["measure", "--model", "m", "--random", "3", "--random-prompts", "4"])


def test_check_and_check_paths_share_their_arrangements():
    import inspect

    from vexact.cli import build_parser
    from vexact.real.check import DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES, CheckSettings
    from vexact.testing import check_paths

    kw = {n: p.default for n, p in inspect.signature(check_paths).parameters.items()}
    assert kw["batch_sizes"] == DEFAULT_BATCH_SIZES == CheckSettings().batch_sizes
    assert kw["micro_batch_sizes"] == DEFAULT_MICRO_BATCH_SIZES == CheckSettings().micro_batch_sizes
    args = build_parser().parse_args(["check"])
    assert (args.batch_sizes, args.micro_batch_sizes) == (DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES)
