"""Metric keys as data: modules name keys through ``vexact.metric_keys`` constants, and config keys that name a
metric take its full key (the old short spelling of ``inject.target.metric`` still works, with a warning)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from vexact import metric_keys
from vexact.rl.config import config_from_dict, load_config, save_config
from vexact.rl.config_spellings import DEPRECATED_VALUES
from vexact.rl.validate import ConfigError

ROOT = Path(__file__).resolve().parents[2]
_SOURCES = [p for folder in ("vexact", "benchmarks", "tools") for p in sorted((ROOT / folder).rglob("*.py"))
            if p.name != "metric_keys.py"]


def test_every_constant_is_a_registered_key():
    for name in metric_keys.CONSTANTS:
        entry = metric_keys.find(name)
        assert entry is not None and entry.name == name, name
    assert metric_keys.K3_KL == "rollout_corr/k3_kl"


def _bare_strings(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, key) of every string literal of the code that is exactly one of ``names`` -- inside an f-string's
    replacement fields too (``f"{m['reward/mean']:.3f}"``), which a tokenizer's STRING tokens do not show -- docstrings
    aside."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in docstrings)


def test_modules_name_registered_keys_through_the_constants():
    """No registered key (one without a placeholder) is a bare string in package or benchmark code: a module that
    writes or reads one by name uses its constant in ``vexact.metric_keys``."""
    names = {key.name for key in metric_keys.KEYS if "<" not in key.name}
    assert set(metric_keys.CONSTANTS) <= names
    bare = {str(p.relative_to(ROOT)): hits for p in _SOURCES if (hits := _bare_strings(p.read_text(), names))}
    assert bare == {}


def test_the_constants_are_every_upper_case_string_of_the_module():
    """``CONSTANTS`` and ``__all__`` are derived from the definitions (one list: the constants themselves)."""
    defined = {v for n, v in vars(metric_keys).items() if n.isupper() and not n.startswith("_") and isinstance(v, str)}
    assert set(metric_keys.CONSTANTS) == defined and len(metric_keys.CONSTANTS) == len(defined)
    assert {n for n in metric_keys.__all__ if isinstance(getattr(metric_keys, n), str)} == {
        n for n, v in vars(metric_keys).items() if isinstance(v, str) and v in defined and n.isupper()}


def test_the_bare_string_check_finds_one():
    """Counter-case: the check above does find a bare key (and not one inside a longer string or a docstring)."""
    code = ('"""rollout_corr/k3_kl"""\nx = m["rollout_corr/k3_kl"]\ny = "see rollout_corr/k3_kl"\nz = "actor/ppo_kl"\n'
            'w = f"{m[\'reward/mean\']:.3f}"\n')
    names = {key.name for key in metric_keys.KEYS if "<" not in key.name}
    assert _bare_strings(code, names) == [(2, "rollout_corr/k3_kl"), (4, "actor/ppo_kl"), (5, "reward/mean")]


def _target(metric: str) -> dict:
    return {"inject": {"mode": "logit_noise", "target": {"metric": metric, "value": 0.01}}}


@pytest.mark.parametrize("full", ["rollout_corr/k3_kl", "mismatch/abs_dlogp_mean"])
def test_target_metric_takes_the_full_key_without_a_warning(full):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_dict(_target(full)).inject.target.metric == full


@pytest.mark.parametrize("short, full", list(DEPRECATED_VALUES["inject.target.metric"].items()))
def test_the_short_name_still_works_warns_and_is_stored_as_the_full_key(short, full, tmp_path):
    with pytest.warns(FutureWarning, match=f"use the full metric key '{full}'"):
        cfg = config_from_dict(_target(short))
    assert cfg.inject.target.metric == full and cfg == config_from_dict(_target(full))
    with pytest.warns(FutureWarning, match=full):  # and through --set, as sweeps and the CLI give it
        assert config_from_dict({"inject": {"mode": "logit_noise"}}, [f"inject.target.metric={short}",
                                                                      "inject.target.value=0.01"]) == cfg
    save_config(cfg, tmp_path / "config.yaml")  # a run started with the short name resumes as the same config
    assert load_config(tmp_path / "config.yaml") == cfg
    assert f"metric: {full}" in (tmp_path / "config.yaml").read_text()


def test_one_scheme_for_every_config_key_that_names_a_metric():
    cfg = config_from_dict({"lr_schedule": {"kind": "mismatch_triggered",
                                            "mismatch_metric": "rollout_corr/log_ppl_abs_diff"},
                            "collapse": {"metric": "reward/mean"}})
    assert metric_keys.find(cfg.lr_schedule.mismatch_metric) and metric_keys.find(cfg.collapse.metric)
    with pytest.raises(ConfigError) as e:  # an unknown key is one error naming the field
        config_from_dict(_target("rollout_corr/k4_kl"))
    assert e.value.key == "inject.target.metric" and "'rollout_corr/k3_kl'" in str(e.value)


@pytest.mark.parametrize("metric", ["eval/reward_men", "live/nonfinite", "mismatch/full_vocab_top5_overlap_mean"])
def test_collapse_metric_that_no_run_writes_is_refused_naming_the_field(metric):
    """A typo (or a key only measure/compare/live write) was accepted, and the detector never judged: the key is
    never in a run's metrics.jsonl."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"collapse": {"metric": metric}})
    assert e.value.key == "collapse.metric" and f"{metric!r} is not a metric key vexact run writes" in str(e.value)
    # a family's instance (a placeholder entry) is a key a run writes
    config_from_dict({"collapse": {"metric": "rollout_corr/rollout_rs_token_k3_mean"}})
