"""Named model presets (``model.preset``): one table used by the config, ``vexact check``, locate and benchmarks."""

from __future__ import annotations

import pytest

from vexact.cli import _check_shape, build_parser
from vexact.engine.model import ModelConfig
from vexact.engine.presets import MODEL_PRESETS, PRESET_NAMES, UnknownPresetError, preset_config, preset_values
from vexact.real.check import CHECK_PRESET, CheckSettings
from vexact.real.locate import RANDOM_MODEL
from vexact.rl.config import MODEL_DEFAULTS, ConfigError, config_from_dict
from vexact.rl.warmstart import warm_start_key


def test_issue_names_are_presets():
    assert {"tiny", "testbed", "llama100m"} <= set(PRESET_NAMES)
    for name in PRESET_NAMES:  # every preset is a valid shape once given a vocabulary and a length
        preset_config(name, **{"vocab_size": 7, "max_seq_len": 16})


def test_config_preset_fills_and_explicit_keys_win():
    cfg = config_from_dict({"model": {"preset": "tiny", "num_layers": 3}})
    assert cfg.model.preset == "tiny"
    assert cfg.model.num_layers == 3  # explicit wins
    assert cfg.model.hidden_size == MODEL_PRESETS["tiny"]["hidden_size"] == 32
    over = config_from_dict({"model": {"preset": "tiny"}}, ["model.hidden_size=64"])
    assert over.model.hidden_size == 64  # --set is explicit too
    by_set = config_from_dict({}, ["model.preset=tiny"])
    assert by_set.model.intermediate_size == MODEL_PRESETS["tiny"]["intermediate_size"]


def test_unknown_preset_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"preset": "huge"}})
    assert e.value.key == "model.preset" and "tiny" in str(e.value) and "huge" in str(e.value)
    with pytest.raises(UnknownPresetError):
        preset_values("huge")


def test_default_model_is_the_testbed_preset_and_round_trips():
    cfg = config_from_dict({})
    assert cfg.model.preset is None
    assert {k: getattr(cfg.model, k) for k in MODEL_DEFAULTS} == preset_values("testbed")
    named = config_from_dict({"model": {"preset": "testbed"}})
    assert config_from_dict(named.to_dict()) == named  # a saved config (preset + every key) loads to itself
    # the preset only names values: the warm-start cache key is that of the same shape written out
    assert warm_start_key(named) == warm_start_key(cfg)
    assert warm_start_key(config_from_dict({"model": {"preset": "tiny"}})) != warm_start_key(cfg)


def test_check_locate_and_benchmarks_read_the_table():
    assert CHECK_PRESET in PRESET_NAMES
    small = MODEL_PRESETS[CHECK_PRESET]
    assert {k: getattr(CheckSettings(), k) for k in RANDOM_MODEL} == RANDOM_MODEL
    assert RANDOM_MODEL == {k: small[k] for k in RANDOM_MODEL}
    parser = build_parser()
    assert _check_shape(parser.parse_args(["check"]))["hidden_size"] == small["hidden_size"]
    shape = _check_shape(parser.parse_args(["check", "--preset", "tiny", "--num-layers", "3"]))
    assert shape["num_layers"] == 3 and shape["hidden_size"] == MODEL_PRESETS["tiny"]["hidden_size"]
    from benchmarks.common import shapes

    named = shapes()
    assert named["tiny"].model == preset_config("tiny")
    assert named["llama100m"].model == preset_config("llama100m")
    default = named["default"].model
    assert default == ModelConfig(**{**preset_values("testbed"), "vocab_size": default.vocab_size, "max_seq_len": 48})
