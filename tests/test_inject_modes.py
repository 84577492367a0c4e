"""The injection modes as one table (vexact.rl.inject_modes): the config's choices and checks derive from it."""

from __future__ import annotations

import typing

import pytest

from vexact.rl.config import InjectSection, config_from_dict
from vexact.rl.inject_modes import INJECT_MODE_NAMES, INJECT_MODES, KNOB_MODES, SOURCE_KEYS
from vexact.rl.validate import ConfigError


def test_config_choices_are_the_table():
    mode_type = typing.get_type_hints(InjectSection)["mode"]
    assert typing.get_args(mode_type) == INJECT_MODE_NAMES
    assert set(KNOB_MODES) | set(SOURCE_KEYS) | {"none"} == set(INJECT_MODES)
    assert not set(KNOB_MODES) & set(SOURCE_KEYS)


@pytest.mark.parametrize("mode, value, says", [("logit_noise", -0.1, "sigma"), ("logprob_only", -1.0, "sigma"),
                                               ("logit_scale", -1.0, "> -1"), ("top_k", 2.5, "whole number")])
def test_each_mode_checks_its_value(mode, value, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"mode": mode, "value": value}})
    assert e.value.key == "inject.value" and says in str(e.value)
    assert INJECT_MODES[mode].value_problem(value) is not None


def test_a_knob_mode_needs_its_value_and_a_source_mode_refuses_one():
    with pytest.raises(ConfigError, match=KNOB_MODES["logit_noise"]):
        config_from_dict({"inject": {"mode": "logit_noise"}})
    with pytest.raises(ConfigError, match="inject.precision"):
        config_from_dict({"inject": {"mode": "precision", "value": 0.1}})
    with pytest.raises(ConfigError, match="no continuous knob"):
        config_from_dict({"inject": {"mode": "kernel", "target": {"value": 0.1}}})
    assert config_from_dict({"inject": {"mode": "top_k", "value": 3}}).inject.value == 3.0  # counter-case
