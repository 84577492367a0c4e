"""The injection modes as one registry (vexact.rl.inject_modes): the config's choices and checks derive from it."""

from __future__ import annotations

import typing

import pytest

from vexact.rl.config import config_from_dict
from vexact.rl.config_schema import InjectSection
from vexact.rl.inject import calibrate
from vexact.rl.inject_modes import INJECT_MODES, register_inject_mode
from vexact.rl.tasks import task_of
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
                                               ("top_p", 1.5, "0 < p <= 1")])
def test_each_mode_checks_its_value(mode, value, says):
    key = f"inject.{INJECT_MODES[mode].knob_name}"
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"mode": mode, key.split(".")[1]: value}})
    assert e.value.key == key and says in str(e.value)
    with pytest.warns(FutureWarning, match=f"use '{key}'"), pytest.raises(ConfigError) as e:  # the old spelling
        config_from_dict({"inject": {"mode": mode, "value": value}})
    assert e.value.key == key and says in str(e.value)


KNOB_NAMES = {"logit_noise": "sigma", "logprob_only": "sigma", "logit_scale": "epsilon", "top_p": "top_p",
              "top_k": "top_k", "routing_flip": "flip_rate"}


def test_each_knob_mode_names_its_knob_and_inject_value_is_the_old_spelling(tmp_path):
    """The knob's key is the mode's own (one registry: each mode declares it); ``inject.value`` still reads, with a
    FutureWarning naming the mode's key, to the same config; both, or a key of another mode, is one error; the
    config stores the mode's key, so a saved config reloads without a warning."""
    import warnings

    from vexact.rl.config import load_config
    from vexact.rl.config_schema import knob_key, knob_keys

    assert {n: m.knob_name for n, m in INJECT_MODES.items() if m.knob is not None} == KNOB_NAMES
    assert knob_keys() == {"sigma": ("logit_noise", "logprob_only"), "epsilon": ("logit_scale",), "top_p": ("top_p",),
                           "top_k": ("top_k",), "flip_rate": ("routing_flip",)}
    assert knob_key("none") == knob_key("precision") == "value" and knob_key("logit_scale") == "epsilon"
    moe = {"num_experts": 4, "num_experts_per_tok": 2}
    for mode, name in KNOB_NAMES.items():
        base = {"model": moe} if mode == "routing_flip" else {}
        value = {"top_k": 3.0, "top_p": 0.9}.get(mode, 0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = config_from_dict({**base, "inject": {"mode": mode, name: value}})
            assert new == config_from_dict(base, [f"inject.mode={mode}", f"inject.{name}={value}"])
            saved = new.to_dict()
            assert saved["inject"][name] == value and "value" not in saved["inject"]
            assert config_from_dict(saved) == new  # a saved config.yaml: no warning
        assert new.inject.value == value
        with pytest.warns(FutureWarning, match=f"'inject.value' is deprecated for inject.mode '{mode}'; "
                                               f"use 'inject.{name}'"):
            assert config_from_dict({**base, "inject": {"mode": mode, "value": value}}) == new
        with pytest.raises(ConfigError, match=f"'inject.value'.*old spelling of inject.{name}.*keep only"):
            config_from_dict({**base, "inject": {"mode": mode, "value": value, name: value}})
        with pytest.raises(ConfigError, match=f"'inject.value'.*old spelling of inject.{name}"):
            config_from_dict(base, [f"inject.mode={mode}", f"inject.{name}={value}", f"inject.value={value}"])
    with pytest.raises(ConfigError, match=r"'inject.top_k': is the knob of mode top_k, not of inject.mode "
                                          r"'logit_noise' \(its knob is inject.sigma\)"):
        config_from_dict({"inject": {"mode": "logit_noise", "top_k": 3}})
    with pytest.raises(ConfigError, match=r"'inject.sigma': is the knob of mode logit_noise / logprob_only, not of "
                                          r"inject.mode 'precision' \(it has no knob\)"):
        config_from_dict({}, ["inject.mode=precision", "inject.sigma=0.1"])
    with pytest.raises(ConfigError, match=r"'inject.sigma'.*inject.mode 'none'"):
        config_from_dict({}, ["inject.sigma=0.1"])
    with pytest.raises(ConfigError, match="needs inject.epsilon"):
        config_from_dict({"inject": {"mode": "logit_scale"}})
    with warnings.catch_warnings():  # mode none and the path modes store no knob; a saved 0 reads silently
        warnings.simplefilter("error")
        assert "value" not in config_from_dict({}).to_dict()["inject"]
        assert config_from_dict({"inject": {"mode": "none", "value": 0.0}}) == config_from_dict({})
    path = tmp_path / "c.yaml"
    path.write_text("inject:\n  mode: logit_scale\n  epsilon: -0.2\n")
    assert load_config(path).inject.value == -0.2


def test_a_knob_of_the_wrong_type_is_named_as_given():
    """The knob is read into inject.value; an error about its value names the key the user wrote (and the --set or
    grid value that gave it), not inject.value."""
    with pytest.raises(ConfigError, match=r"^config error at 'inject.sigma': expected a number, got 'abc' \(from "
                                          r"--set inject.sigma=abc\)$"):
        config_from_dict({}, ["inject.mode=logit_noise", "inject.sigma=abc"])
    with pytest.raises(ConfigError, match=r"^config error at 'inject.top_k': expected a number, got 'many'$"):
        config_from_dict({"inject": {"mode": "top_k", "top_k": "many"}})
    with pytest.raises(ConfigError, match=r"^config error at 'inject.epsilon': expected a number, got \[1\] \(from "
                                          r"the grid's inject.epsilon\)$"):
        config_from_dict({}, ["inject.mode=logit_scale", "inject.epsilon=[1]"], ["set", "the grid's inject.epsilon"])
    # counter-case: the old spelling is named as written
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"^config error at 'inject.value': expected a "
                                                                       r"number, got 'abc' \(from --set "
                                                                       r"inject.value=abc\)$"):
        config_from_dict({}, ["inject.mode=logit_noise", "inject.value=abc"])


def test_a_top_k_that_keeps_the_whole_vocabulary_is_refused_naming_its_size():
    """top_k >= the vocabulary size cuts nothing: the run injected nothing and said nothing."""
    vocab_size = task_of(config_from_dict({})).tokenizer.vocab_size
    for k in (vocab_size, 10 * vocab_size):
        with pytest.raises(ConfigError) as e:
            config_from_dict({"inject": {"mode": "top_k", "top_k": k}})
        assert e.value.key == "inject.top_k" and f"keeps the whole vocabulary of {vocab_size} tokens" in str(e.value)
        assert f"give 0 < top_k < {vocab_size} (0 = off)" in str(e.value)
    # the neighbours: off, the largest k that cuts, a vocabulary tail that makes k cut, a ramp (its k starts above
    # the final one on purpose) and calibration (inject.target searches k itself)
    for inject, task in [({"top_k": 0}, {}), ({"top_k": vocab_size - 1}, {}),
                         ({"top_k": vocab_size}, {"distractors": 8}), ({"top_k": 8, "ramp_steps": 10}, {}),
                         ({"top_k": 10 * vocab_size, "target": {"value": 0.01}}, {})]:
        config_from_dict({"inject": {"mode": "top_k", **inject}, "task": task})


def test_a_knob_mode_needs_its_value_and_a_source_mode_refuses_one():
    with pytest.raises(ConfigError, match=INJECT_MODES["logit_noise"].knob):
        config_from_dict({"inject": {"mode": "logit_noise"}})
    with pytest.raises(ConfigError, match="inject.precision"):
        config_from_dict({"inject": {"mode": "precision", "value": 0.1}})
    with pytest.raises(ConfigError, match="no continuous knob"):
        config_from_dict({"inject": {"mode": "kernel", "target": {"value": 0.1}}})
    assert config_from_dict({"inject": {"mode": "top_k", "top_k": 3}}).inject.value == 3.0  # counter-case


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


def test_top_k_calibration_measures_k_1():
    """The bisection over k never measured its lower end, k = 1, where the metric is largest: a target only k = 1
    reaches came back as k = 2, 8x off."""
    result = calibrate(lambda k: 1 / k**3, "top_k", 1.0, tolerance=0.05, vocab_size=256)
    assert (result.value, result.achieved, result.reached) == (1.0, 1.0, True)
    missed = calibrate(lambda s: min(s, 0.5) * 0.01, "logit_noise", 1.0, tolerance=0.05)  # a metric that levels off
    assert not missed.reached and len(missed.evaluations) == 40


def test_registration_refuses_a_taken_name_and_a_calibratable_mode_without_knob():
    with pytest.raises(ValueError, match="already registered"):
        register_inject_mode(INJECT_MODES["top_k"])

    class Broken(type(INJECT_MODES["none"])):
        name = "broken_calibratable"
        calibratable = True

    with pytest.raises(ValueError, match="no knob"):
        register_inject_mode(Broken())
    assert "broken_calibratable" not in INJECT_MODES
    for name in ("value", "flip_kind", "not a name"):  # the knob's key: a new identifier, no setting's name

        class BadName(type(INJECT_MODES["routing_flip"])):
            knob_name = name

        BadName.name = "bad_knob_name"
        with pytest.raises(ValueError, match=f"knob_name {name!r}"):
            register_inject_mode(BadName())
    assert "bad_knob_name" not in INJECT_MODES


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


def test_a_run_s_own_config_saved_before_the_renames_resumes_silently(tmp_path):
    """A config.yaml saved before the knobs were named (``inject.value``) and before ``correction.bypass_mode`` was
    read into ``algorithm.old_logprobs`` is the run's record: resume and reports read it (``saved=True``) as the same
    config, without the FutureWarning meant for the files users write (which still get it)."""
    import warnings

    import yaml

    from vexact.rl.config import load_config

    old = config_from_dict({"inject": {"mode": "logit_noise", "sigma": 0.5}}).to_dict()
    old["inject"]["value"] = old["inject"].pop("sigma")
    old["correction"]["bypass_mode"] = None
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path, saved=True)
    assert cfg.inject.value == 0.5 and cfg.to_dict()["inject"]["sigma"] == 0.5
    with pytest.warns(FutureWarning, match="use 'inject.sigma'"):
        assert load_config(path) == cfg


def test_quiet_reads_the_named_keys_old_spellings_without_their_warning():
    """Which deprecated spellings warn is a value passed in (``config_from_dict(quiet=...)``), never a warnings filter
    set around the call: a sweep's points read ``inject.value`` quietly and still warn for a renamed key; a record
    vexact wrote (``DEPRECATED_SPELLINGS``) reads every old spelling quietly; the global filters are untouched."""
    import warnings

    from vexact.rl.config_spellings import DEPRECATED_SPELLINGS, RENAMED_KEYS

    raw = {"inject": {"mode": "logit_scale", "value": -0.1}, "correction": {"bypass_mode": True}}
    assert "correction.bypass_mode" in RENAMED_KEYS and "inject.value" in DEPRECATED_SPELLINGS
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loud = config_from_dict(raw)
        assert sorted(str(w.message).split(" ")[2] for w in said) == ["'correction.bypass_mode'", "'inject.value'"]
        said.clear()
        assert config_from_dict(raw, quiet={"inject.value"}) == loud
        assert [str(w.message).split(" ")[2] for w in said] == ["'correction.bypass_mode'"]
        said.clear()
        assert config_from_dict(raw, quiet=DEPRECATED_SPELLINGS) == loud
        assert said == []
    assert warnings.filters == filters
