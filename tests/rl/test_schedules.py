"""LR schedules on synthetic traces: warmup, cosine, step, and the length- and mismatch-triggered decays."""

from __future__ import annotations

import math

import pytest
import torch

from vexact.registry import PluginCodeError
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.config_schema import CollapseSection, LRScheduleSection, OptimizerSection
from vexact.rl.schedules import LR_SCHEDULES, LRSchedule, ScheduleKind, register_lr_schedule


def _schedule(kind: str, lr: float = 1.0, warmup: int = 0, steps: int = 100, length_window: int = 10,
              length_ratio: float = 1.5, **kw) -> LRSchedule:
    """The surge knobs live in the collapse section (one rule for the LR trigger and the detector)."""
    surge = CollapseSection(length_surge_window=length_window, length_surge_ratio=length_ratio)
    return LRSchedule(OptimizerSection(lr=lr, warmup_steps=warmup), LRScheduleSection(kind=kind, **kw), steps, surge)


def _feed(schedule: LRSchedule, key: str, trace: list[float]) -> list[float]:
    """Run the trainer's protocol over a trace: lr(step) for the update, then observe(step). Returns the LRs."""
    lrs = []
    for step, value in enumerate(trace):
        lrs.append(schedule.lr(step))
        schedule.observe(step, {key: value})
    return lrs


def test_constant_with_linear_warmup():
    s = _schedule("constant", lr=0.1, warmup=4)
    assert [s.lr(t) for t in range(6)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_cosine_goes_from_base_to_floor_over_total_steps():
    s = _schedule("cosine", lr=1.0, warmup=0, steps=100, min_lr_ratio=0.1)
    assert s.lr(0) == 1.0
    assert s.lr(50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.lr(100) == pytest.approx(0.1) and s.lr(500) == pytest.approx(0.1)
    lrs = [s.lr(t) for t in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_step_decay_to_floor():
    s = _schedule("step", lr=1.0, step_size=10, gamma=0.5, min_lr_ratio=0.2)
    assert [s.lr(t) for t in (0, 9, 10, 19, 20, 30, 90)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.2, 0.2])


def test_length_trigger_fires_on_the_surge_and_halves_on_algorithm_1_clock():
    # flat length 10 for 20 steps, then 30: the first trailing window of 5 above 2 x 10 is (10+10+30+30+30)/5 = 22,
    # ending at index 22.
    trace = [10.0] * 20 + [30.0] * 80
    s = _schedule("length_triggered", lr=1.0, length_window=5, length_ratio=2.0, decay_period_factor=1.8)
    lrs = _feed(s, "response_length/mean", trace)
    assert s.trigger_step == 22
    assert "response_length/mean" in s.trigger_reason and "baseline 10" in s.trigger_reason
    assert s.decay_period == round(1.8 * 22) == 40
    assert lrs[:40] == [1.0] * 40  # nothing before the first multiple of 40 after the trigger
    assert lrs[40:80] == [0.5] * 40 and lrs[80:] == [0.25] * 20
    assert s.summary() == {"kind": "length_triggered", "trigger_step": 22, "trigger_reason": s.trigger_reason,
                           "decay_period": 40}


def test_length_trigger_fixed_period_and_floor():
    trace = [10.0] * 10 + [40.0] * 90
    s = _schedule("length_triggered", lr=1.0, length_window=5, length_ratio=2.0, decay_period=10, min_lr_ratio=0.1)
    lrs = _feed(s, "response_length/mean", trace)
    assert s.trigger_step == 11 and s.decay_period == 10
    assert lrs[11] == 1.0 and lrs[19] == 1.0 and lrs[20] == 0.5 and lrs[30] == 0.25
    assert min(lrs) == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)  # 1/16 < 0.1: held at the floor


def test_no_surge_means_no_decay():
    trace = [10.0 + (t % 3) for t in range(100)]  # noisy but flat
    s = _schedule("length_triggered", lr=1.0, length_window=5, length_ratio=1.5)
    assert _feed(s, "response_length/mean", trace) == [1.0] * 100
    assert s.trigger_step is None and s.summary()["trigger_reason"] is None


def test_mismatch_trigger_on_k3_and_log_ppl():
    trace = [0.01] * 30 + [0.5] * 70
    s = _schedule("mismatch_triggered", lr=1.0, mismatch_threshold=0.1, mismatch_window=5, decay_period=20)
    lrs = _feed(s, "rollout_corr/k3_kl", trace)
    assert s.trigger_step == 30  # (4 x 0.01 + 0.5) / 5 = 0.108 > 0.1 at the first high step
    assert "rollout_corr/k3_kl" in s.trigger_reason and "0.108" in s.trigger_reason
    assert lrs[31:40] == [1.0] * 9 and lrs[40] == 0.5 and lrs[60] == 0.25
    s = _schedule("mismatch_triggered", mismatch_metric="rollout_corr/log_ppl_abs_diff", mismatch_threshold=1.0)
    _feed(s, "rollout_corr/k3_kl", [5.0] * 20)  # the other metric: never fires
    assert s.trigger_step is None
    _feed(s, "rollout_corr/log_ppl_abs_diff", [float("nan")] * 3 + [2.0] * 10)  # NaN is skipped, not a trigger
    assert s.trigger_step == 7


def test_schedule_state_round_trip_resumes_identically():
    trace = [10.0] * 20 + [30.0] * 80
    whole = _schedule("length_triggered", length_window=5)
    expected = _feed(whole, "response_length/mean", trace)
    first = _schedule("length_triggered", length_window=5)
    got = _feed(first, "response_length/mean", trace[:30])
    second = _schedule("length_triggered", length_window=5)
    second.load_state_dict(first.state_dict())
    for step in range(30, 100):
        got.append(second.lr(step))
        second.observe(step, {"response_length/mean": trace[step]})
    assert got == expected


def test_schedule_config_errors():
    with pytest.raises(ConfigError, match="lr_schedule.kind"):
        config_from_dict({"lr_schedule": {"kind": "exponential"}})
    with pytest.raises(ConfigError, match="collapse.length_surge_ratio"):
        config_from_dict({"collapse": {"length_surge_ratio": 0.9}})
    with pytest.raises(ConfigError, match="lr_schedule.mismatch_metric"):
        config_from_dict({"lr_schedule": {"mismatch_metric": "k3"}})
    assert math.isclose(config_from_dict({}).lr_schedule.min_lr_ratio, 0.1)


def test_the_length_surge_has_one_setting_and_the_old_keys_still_work(tmp_path):
    """``lr_schedule.length_window`` / ``length_ratio`` moved to ``collapse.length_surge_*``: the old spelling (in
    YAML or ``--set``) sets the new key with a FutureWarning; the same knob twice with two values is an error."""
    with pytest.warns(FutureWarning) as caught:
        cfg = config_from_dict({"lr_schedule": {"kind": "length_triggered", "length_ratio": 1.8, "length_window": 4}})
    assert {str(w.message).split(";")[0] for w in caught} == {"config key 'lr_schedule.length_ratio' is deprecated",
                                                              "config key 'lr_schedule.length_window' is deprecated"}
    assert all("use 'collapse.length_surge_" in str(w.message) for w in caught)
    assert (cfg.collapse.length_surge_ratio, cfg.collapse.length_surge_window) == (1.8, 4)
    assert "length_ratio" not in cfg.to_dict()["lr_schedule"]
    path = tmp_path / "old.yaml"
    path.write_text("lr_schedule:\n  kind: length_triggered\n")
    with pytest.warns(FutureWarning, match="deprecated"):
        assert load_config(path, ["lr_schedule.length_ratio=2.5"]).collapse.length_surge_ratio == 2.5
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="lr_schedule.length_ratio.*keep only"):
        config_from_dict({"lr_schedule": {"length_ratio": 2.0}, "collapse": {"length_surge_ratio": 1.5}})
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="collapse.length_surge_ratio"):
        config_from_dict({"lr_schedule": {"length_ratio": 0.5}})  # out of bounds: named at its new key
    schedule = LRSchedule(cfg.optimizer, cfg.lr_schedule, cfg.steps, cfg.collapse)
    assert (schedule.surge_window, schedule.surge_ratio) == (4, 1.8)


class _Outside(ScheduleKind):
    """An outside kind whose decay returns whatever the test puts in ``value``."""

    name = "outside_decay"
    value: object = 1.0

    def decay(self, s, step):
        return self.value


@pytest.fixture
def outside():
    kind = register_lr_schedule(_Outside())
    yield kind
    LR_SCHEDULES.remove("outside_decay")


def test_an_outside_kinds_decay_is_floored_at_min_lr_ratio(outside):
    """The documented floor, min_lr_ratio x base, holds for any kind (the docs' ``plateau`` at factor 0.01 with
    min_lr_ratio 0.1 gives 0.1 x base, not 0.01 x base); warmup still ramps below it."""
    outside.value = 0.01
    s = _schedule("outside_decay", lr=2e-4, warmup=4, min_lr_ratio=0.1)
    assert s.lr(10) == 2e-4 * 0.1
    assert s.lr(0) == 2e-4 * (1 / 4) * 0.1
    outside.value = 0.5
    assert s.lr(10) == 2e-4 * 0.5


@pytest.mark.parametrize("value, problem", [
    (-1.0, "returned -1.0 at step 3: expected a finite real number >= 0"),
    (float("nan"), "returned nan at step 3: expected a finite"),
    (float("inf"), "returned inf at step 3: expected a finite"),
    ("0.5", "returned '0.5' (a str): expected a finite real number >= 0"),
    (None, "returned None (a NoneType)"),
    (True, "returned True (a bool)"),
    (torch.tensor(0.5), "returned tensor(0.5000) (a Tensor)"),
])
def test_an_outside_kinds_decay_must_be_a_finite_real_number_at_least_0(outside, value, problem):
    """A negative decay would be a negative LR, gradient ascent, which optimizer.lr refuses; a string, None or a
    tensor would fail later, in the arithmetic or the JSON encoder, far from the kind."""
    outside.value = value
    with pytest.raises(PluginCodeError) as err:
        _schedule("outside_decay").lr(3)
    assert str(err.value).startswith("LR schedule 'outside_decay' (decay) ") and problem in str(err.value)


def test_an_outside_kinds_decay_that_raises_is_one_error_naming_it(outside):
    outside.decay = lambda step: 1.0  # the wrong signature: decay(s, step)
    with pytest.raises(PluginCodeError, match=r"^LR schedule 'outside_decay' \(decay\) raised TypeError"):
        _schedule("outside_decay").lr(0)


@pytest.mark.parametrize("kind, kw", [("constant", {}), ("cosine", {}), ("cosine", {"min_lr_ratio": 0.0}),
                                      ("step", {"step_size": 3}), ("step", {"min_lr_ratio": 0.0, "step_size": 1}),
                                      ("length_triggered", {}), ("mismatch_triggered", {})])
def test_the_floor_leaves_the_builtin_kinds_bits_as_they_were(kind, kw):
    """The built-ins floor themselves (or never go below it): the checked, floored decay is their own, bit for
    bit, at every step, warmup included."""
    s = _schedule(kind, lr=3e-4, warmup=5, steps=60, length_window=2, **kw)
    s.trigger_step, s.decay_period = 7, 4  # a triggered kind's decay after its trigger
    for step in range(200):
        warm = (step + 1) / 5 if step < 5 else 1.0
        assert s.lr(step) == 3e-4 * warm * s.kind.decay(s, step), (kind, step)


class _EvalTriggered(ScheduleKind):
    """An outside triggered kind that watches an evaluation metric: fires when it falls below its first value."""

    name = "eval_triggered"
    triggered = True

    def metric(self, s):
        return "eval/reward_mean"

    def fired(self, s, key):
        return "eval fell" if s.observed[-1] < s.observed[0] else None


def test_retract_takes_back_an_off_schedule_evaluation_and_the_trigger_it_fired():
    """A run of 2 steps evaluated its last step (1) off schedule and the outside kind fired there; extended, the
    schedule must be the one a run from the start has after step 1 (no value observed there, no trigger), so the
    trigger comes at step 2 as it does there."""
    register_lr_schedule(_EvalTriggered())
    try:
        fresh, extended = _schedule("eval_triggered"), _schedule("eval_triggered")
        for step, row in enumerate([{"eval/reward_mean": 1.0}, {"reward/mean": 0.3}, {"eval/reward_mean": 0.5}]):
            fresh.observe(step, row)
        extended.observe(0, {"eval/reward_mean": 1.0})
        last = {"reward/mean": 0.3, "eval/reward_mean": 0.25}
        extended.observe(1, last)
        assert extended.trigger_step == 1
        extended.retract(1, last, lambda key: key.startswith("eval/"))
        assert extended.state_dict() == {"observed": [1.0], "trigger_step": None, "trigger_reason": None,
                                         "decay_period": None}
        extended.observe(2, {"eval/reward_mean": 0.5})
        assert extended.state_dict() == fresh.state_dict() and fresh.trigger_step == 2
        extended.retract(2, {"reward/mean": 0.3}, lambda key: key.startswith("eval/"))  # nothing observed: no change
        assert extended.state_dict() == fresh.state_dict()
    finally:
        LR_SCHEDULES.remove("eval_triggered")
