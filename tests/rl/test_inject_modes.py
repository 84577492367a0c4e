"""The injection modes as one registry (vexact.rl.inject_modes): the config's choices and checks derive from it."""

from __future__ import annotations

import typing

import pytest

from vexact.rl.config import InjectSection, config_from_dict
from vexact.rl.inject import calibrate
from vexact.rl.inject_modes import INJECT_MODES, register_inject_mode
from vexact.rl.validate import ConfigError


def test_config_choices_are_the_registry():
    mode_type = typing.get_type_hints(InjectSection)["mode"]
    assert mode_type.registry is INJECT_MODES
    knob = {n for n, m in INJECT_MODES.items() if m.knob is not None}
    source = {n for n, m in INJECT_MODES.items() if m.source_keys}
    assert knob | source | {"none"} == set(INJECT_MODES) and not knob & source
    assert all(m.knob is not None for _, m in INJECT_MODES.items() if m.calibratable)


@pytest.mark.parametrize("mode, value, says", [("logit_noise", -0.1, "sigma"), ("logprob_only", -1.0, "sigma"),
                                               ("logit_scale", -1.0, "> -1"), ("top_k", 2.5, "whole number"),
                                               ("top_p", 1.5, "0 < value <= 1")])
def test_each_mode_checks_its_value(mode, value, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"mode": mode, "value": value}})
    assert e.value.key == "inject.value" and says in str(e.value)


def test_a_knob_mode_needs_its_value_and_a_source_mode_refuses_one():
    with pytest.raises(ConfigError, match=INJECT_MODES["logit_noise"].knob):
        config_from_dict({"inject": {"mode": "logit_noise"}})
    with pytest.raises(ConfigError, match="inject.precision"):
        config_from_dict({"inject": {"mode": "precision", "value": 0.1}})
    with pytest.raises(ConfigError, match="no continuous knob"):
        config_from_dict({"inject": {"mode": "kernel", "target": {"value": 0.1}}})
    assert config_from_dict({"inject": {"mode": "top_k", "value": 3}}).inject.value == 3.0  # counter-case


@pytest.mark.parametrize("mode, sign, expect", [("logit_noise", 1.0, 0.4), ("logit_scale", -1.0, -0.4),
                                                ("top_p", 1.0, 0.6), ("top_k", 1.0, 4.0)])
def test_calibration_searches_the_knob_the_mode_names(mode, sign, expect):
    """A fake metric of the mode's magnitude (|knob| for signed/noise, 1 - p, fewer kept tokens): the search
    lands where the mode's knob_search says the metric hits the target."""
    metric = {"logit_noise": abs, "logit_scale": abs, "top_p": lambda p: 1.0 - p,
              "top_k": lambda k: (16 - k) / 30}[mode]
    target = {"top_k": 0.4}.get(mode, 0.4)
    result = calibrate(metric, mode, target, tolerance=1e-3, sign=sign, vocab_size=16)
    assert result.value == pytest.approx(expect, rel=1e-2)


def test_registration_refuses_a_taken_name_and_a_calibratable_mode_without_knob():
    with pytest.raises(ValueError, match="already registered"):
        register_inject_mode(INJECT_MODES["top_k"])

    class Broken(type(INJECT_MODES["none"])):
        name = "broken_calibratable"
        calibratable = True

    with pytest.raises(ValueError, match="no knob"):
        register_inject_mode(Broken())
    assert "broken_calibratable" not in INJECT_MODES


def test_the_triton_guard_asks_the_mode_which_backends_it_runs(monkeypatch):
    """kernel mode on triton is seen by the guard through the mode's ``backends``; on native it is not."""
    from rich.console import Console

    from vexact.rl import triton_guard
    from vexact.rl.tasks import make_task

    monkeypatch.setattr(triton_guard, "interpreting", lambda: True)
    monkeypatch.setattr(triton_guard, "triton_installed", lambda: True)  # the estimate needs no triton
    monkeypatch.setenv(triton_guard.ALLOW_ENV, "1")
    for backend, seen in (("triton", True), ("native", False)):
        cfg = config_from_dict({"steps": 1, "warm_start": {"steps": 0},
                                "inject": {"mode": "kernel", "kernel_backend": backend}})
        task = make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
        cost = triton_guard.check_interpreted_triton(cfg, task, Console(quiet=True))
        assert (cost is not None) == seen and (not seen or cost.rl > 0)
