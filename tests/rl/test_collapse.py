"""Collapse detection on hand-built metric histories (no model, no training)."""

from __future__ import annotations

import json

import pytest

from vexact.rl.collapse import detect_collapse, trailing_mean
from vexact.rl.config_schema import CollapseSection

KEYS = {"collapsed", "collapse_step", "collapse_reason", "collapse_unconfirmed_step", "peak_reward", "peak_step",
        "final_reward", "initial_reward", "mean_k3_kl", "mean_abs_dlogp", "mean_k3_kl_before_collapse",
        "length_surge_step", "length_surge_lead", "criteria"}


def run(evals: list, steps: int = 101, every: int = 10, **per_step) -> list[dict]:
    """History of ``steps`` rows; eval rewards ``evals`` on steps 0, every, 2*every, ... (and the last step).

    ``per_step``: metric name (``/`` written as ``__``) -> a function of the step giving that row's value.
    """
    eval_steps = [s for s in range(steps) if s % every == 0 or s == steps - 1]
    assert len(eval_steps) == len(evals)
    rewards = dict(zip(eval_steps, evals))
    history = []
    for s in range(steps):
        row = {"step": s, "reward/mean": 0.3}
        if s in rewards:
            row["eval/reward_mean"] = rewards[s]
        for key, fn in per_step.items():
            row[key.replace("__", "/")] = fn(s)
        history.append(row)
    return history


RISE_AND_FALL = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.02, 0.02, 0.02, 0.02, 0.02]  # steps 0..100, peak at 50


def test_steady_run_does_not_collapse():
    out = detect_collapse(run([0.4] * 11), CollapseSection())
    assert set(out) == KEYS
    assert out["collapsed"] is False
    assert out["collapse_step"] is None and out["collapse_reason"] is None
    assert out["collapse_unconfirmed_step"] is None
    assert out["peak_reward"] == pytest.approx(0.4)
    assert detect_collapse(run([0.4] * 11), CollapseSection(smoothing=1))["peak_step"] == 0  # first of equal maxima
    assert out["initial_reward"] == 0.4 and out["final_reward"] == 0.4
    assert out["criteria"] == {"metric": "eval/reward_mean", "smoothing": 3, "drop": 0.5, "min_peak": 0.1,
                               "patience": 20}
    assert detect_collapse(run([0.4] * 11), CollapseSection())["collapsed"] is False


def test_clean_collapse_step_without_smoothing():
    history = run(RISE_AND_FALL)
    out = detect_collapse(history, CollapseSection(smoothing=1))
    assert out["collapsed"] is True
    assert out["collapse_reason"] == "reward_drop"
    assert out["collapse_step"] == 60  # first eval below 0.5 x 0.5, still below at 70 and 80
    assert out["collapse_unconfirmed_step"] is None
    assert out["peak_reward"] == 0.5 and out["peak_step"] == 50
    assert out["initial_reward"] == 0.0 and out["final_reward"] == 0.02
    assert detect_collapse(history, CollapseSection(smoothing=1))["collapsed"] is True
    json.dumps(out, allow_nan=False)


def test_smoothing_window_delays_and_absorbs():
    # Smoothed (window 3): ..., 50: 0.4 (the peak), 60: 0.3067, 70: 0.18 < 0.2 -> collapse at 70, not 60.
    out = detect_collapse(run(RISE_AND_FALL), CollapseSection(smoothing=3))
    assert out["collapse_step"] == 70
    assert out["peak_reward"] == pytest.approx(0.4) and out["peak_step"] == 50
    assert out["final_reward"] == 0.02  # raw, not smoothed
    # A single bad eval: collapses unsmoothed with patience 0, absorbed by a window of 3 (0.35 >= 0.25).
    dip = [0.5] * 5 + [0.05] + [0.5] * 5
    assert detect_collapse(run(dip), CollapseSection(smoothing=1, patience=0))["collapse_step"] == 50
    assert detect_collapse(run(dip), CollapseSection(smoothing=3, patience=0))["collapsed"] is False


def test_trailing_mean():
    assert trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert trailing_mean([1.0, 2.0, 3.0], 5) == [1.0, 1.5, 2.0]
    assert trailing_mean([], 3) == []


def test_dip_that_recovers_within_patience():
    dip = [0.5] * 6 + [0.1] + [0.5] * 4  # dip at 60, back at 70 <= 60 + 20
    out = detect_collapse(run(dip), CollapseSection(smoothing=1))
    assert out["collapsed"] is False and out["collapse_unconfirmed_step"] is None
    # A recovered dip is discarded and the search goes on to the real collapse later.
    trace = [0.5, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1]
    assert detect_collapse(run(trace), CollapseSection(smoothing=1))["collapse_step"] == 70


def test_patience_boundary_per_step_series():
    # Every-step series: down from step 10; recovering at 10 + patience still counts, one step later does not.
    cfg = CollapseSection(metric="reward/mean", smoothing=1, patience=5)

    def trace(recover_at):
        return [{"step": s, "reward/mean": 0.5 if s < 10 or s >= recover_at else 0.1} for s in range(30)]

    assert detect_collapse(trace(15), cfg)["collapsed"] is False
    out = detect_collapse(trace(16), cfg)
    assert out["collapse_step"] == 10 and out["collapse_reason"] == "reward_drop"


def test_drop_at_the_end_is_unconfirmed():
    out = detect_collapse(run([0.5] * 10 + [0.05]), CollapseSection(smoothing=1))
    assert out["collapsed"] is False and out["collapse_step"] is None
    assert out["collapse_unconfirmed_step"] == 100
    # Down at 90 and 100: unconfirmed with patience 20 (needs a point at >= 110), confirmed with patience 10.
    late = [0.5] * 9 + [0.05, 0.05]
    out = detect_collapse(run(late), CollapseSection(smoothing=1, patience=20))
    assert (out["collapsed"], out["collapse_unconfirmed_step"]) == (False, 90)
    out = detect_collapse(run(late), CollapseSection(smoothing=1, patience=10))
    assert (out["collapse_step"], out["collapse_unconfirmed_step"]) == (90, None)
    assert detect_collapse(run(late), CollapseSection(smoothing=1, patience=20))["collapsed"] is False


def test_peak_below_min_peak_is_not_a_collapse():
    low = [0.02, 0.05, 0.08, 0.08] + [0.0] * 7
    out = detect_collapse(run(low), CollapseSection(smoothing=1))
    assert out["collapsed"] is False and out["collapse_unconfirmed_step"] is None
    assert out["peak_reward"] == 0.08 and out["peak_step"] == 20
    # Reaching min_peak exactly is enough.
    at_min = [0.1] * 4 + [0.0] * 7
    assert detect_collapse(run(at_min), CollapseSection(smoothing=1))["collapse_step"] == 40


def test_non_finite_loss_row_and_stopped_reason():
    cfg = CollapseSection(smoothing=1)
    history = run(RISE_AND_FALL, actor__pg_loss=lambda s: "nan" if s == 37 else 0.1)
    out = detect_collapse(history, cfg)
    assert (out["collapse_step"], out["collapse_reason"]) == (37, "non_finite")
    # The trainer's stop: the failing step has no row; stopped_step says where.
    history = run([0.4] * 6, steps=42)
    out = detect_collapse(history, cfg, stopped_reason="non-finite loss (nan)", stopped_step=42)
    assert (out["collapsed"], out["collapse_step"], out["collapse_reason"]) == (True, 42, "non_finite")
    # Without stopped_step: the step after the last row.
    out = detect_collapse(history, cfg, stopped_reason="non-finite gradient norm (inf)")
    assert out["collapse_step"] == 42
    # Other stop reasons are not collapse.
    out = detect_collapse(history, cfg, stopped_reason="exactness violated: ...", stopped_step=42)
    assert out["collapsed"] is False
    # A reward drop confirmed earlier than the stop wins; so does it on a tie.
    history = run(RISE_AND_FALL)
    out = detect_collapse(history, cfg, stopped_reason="non-finite loss (nan)", stopped_step=80)
    assert (out["collapse_step"], out["collapse_reason"]) == (60, "reward_drop")
    out = detect_collapse(history, cfg, stopped_reason="non-finite loss (nan)", stopped_step=60)
    assert (out["collapse_step"], out["collapse_reason"]) == (60, "reward_drop")
    out = detect_collapse(history, cfg, stopped_reason="non-finite loss (nan)", stopped_step=59)
    assert (out["collapse_step"], out["collapse_reason"]) == (59, "non_finite")


def test_grad_norm_and_k3_triggers():
    history = run([0.4] * 11, actor__grad_norm=lambda s: 50.0 if s in (23, 70) else 1.0,
                  rollout_corr__k3_kl=lambda s: 0.5 if s >= 31 else 0.01)
    assert detect_collapse(history, CollapseSection())["collapsed"] is False  # thresholds off by default
    out = detect_collapse(history, CollapseSection(grad_norm_max=10.0))
    assert (out["collapse_step"], out["collapse_reason"]) == (23, "grad_norm")
    out = detect_collapse(history, CollapseSection(k3_kl_max=0.1))
    assert (out["collapse_step"], out["collapse_reason"]) == (31, "k3_kl")
    out = detect_collapse(history, CollapseSection(grad_norm_max=100.0, k3_kl_max=0.1))
    assert (out["collapse_step"], out["collapse_reason"]) == (31, "k3_kl")
    out = detect_collapse(history, CollapseSection(grad_norm_max=10.0, k3_kl_max=0.1))
    assert (out["collapse_step"], out["collapse_reason"]) == (23, "grad_norm")  # the earliest wins
    assert out["mean_k3_kl_before_collapse"] == pytest.approx(0.01)


def test_k3_and_dlogp_means():
    history = run(RISE_AND_FALL, rollout_corr__k3_kl=lambda s: 1.0 if s < 60 else 3.0,
                  mismatch__abs_dlogp_mean=lambda s: "nan" if s == 5 else 0.25)
    out = detect_collapse(history, CollapseSection(smoothing=1))
    assert out["collapse_step"] == 60
    assert out["mean_k3_kl"] == pytest.approx((60 * 1.0 + 41 * 3.0) / 101)
    assert out["mean_k3_kl_before_collapse"] == pytest.approx(1.0)
    assert out["mean_abs_dlogp"] == pytest.approx(0.25)
    steady = detect_collapse(run([0.4] * 11, rollout_corr__k3_kl=lambda s: float(s)), CollapseSection())
    assert steady["mean_k3_kl_before_collapse"] == steady["mean_k3_kl"] == pytest.approx(50.0)
    none = detect_collapse(run([0.4] * 11), CollapseSection())
    assert none["mean_k3_kl"] is None and none["mean_abs_dlogp"] is None
    assert none["mean_k3_kl_before_collapse"] is None


def test_length_surge_step_and_lead():
    # Baseline 100 (steps 0-9); 300 from step 30: trailing means 120, 140, 160 > 150 at step 32.
    length = {"response_length__mean": lambda s: 100.0 if s < 30 else 300.0}
    out = detect_collapse(run(RISE_AND_FALL, **length), CollapseSection(smoothing=1))
    assert out["length_surge_step"] == 32
    assert out["length_surge_lead"] == 60 - 32
    # A larger window: baseline still 100; the trailing mean over 20 rows first exceeds 150 at step 35.
    out = detect_collapse(run(RISE_AND_FALL, **length), CollapseSection(smoothing=1, length_surge_window=20))
    assert out["length_surge_step"] == 35  # (14 x 100 + 6 x 300) / 20 = 160
    # A surge after the collapse gives no lead; a surge without a collapse neither.
    late = {"response_length__mean": lambda s: 100.0 if s < 80 else 300.0}
    out = detect_collapse(run(RISE_AND_FALL, **late), CollapseSection(smoothing=1))
    assert (out["length_surge_step"], out["length_surge_lead"]) == (82, None)
    out = detect_collapse(run([0.4] * 11, **length), CollapseSection())
    assert (out["length_surge_step"], out["length_surge_lead"]) == (32, None)
    # Flat length, or too few rows for a baseline and one more: no surge.
    assert detect_collapse(run([0.4] * 11, response_length__mean=lambda s: 100.0),
                           CollapseSection())["length_surge_step"] is None
    assert detect_collapse(run([0.4] * 2, steps=10, response_length__mean=lambda s: 1000.0 * s + 1),
                           CollapseSection())["length_surge_step"] is None


def test_non_finite_strings():
    evals = [0.5, "nan", 0.5, 0.5, "inf", 0.5, 0.5, 0.5, 0.5, 0.5, "-inf"]
    out = detect_collapse(run(evals), CollapseSection(smoothing=1))
    assert out["collapsed"] is False  # non-finite eval values are skipped, not read as drops
    assert out["final_reward"] == 0.5 and out["peak_reward"] == 0.5
    history = run([0.4] * 11, actor__grad_norm=lambda s: "inf" if s == 12 else 1.0)
    out = detect_collapse(history, CollapseSection())
    assert (out["collapse_step"], out["collapse_reason"]) == (12, "non_finite")
    history = run([0.4] * 11, actor__pg_loss=lambda s: "-inf" if s == 77 else 0.0)
    assert detect_collapse(history, CollapseSection())["collapse_step"] == 77
    # +inf grad norm above a configured max at the same step: non_finite wins the tie.
    history = run([0.4] * 11, actor__grad_norm=lambda s: "inf" if s == 12 else 1.0)
    assert detect_collapse(history, CollapseSection(grad_norm_max=5.0))["collapse_reason"] == "non_finite"
    # A NaN k3 is not above a threshold; +inf is.
    history = run([0.4] * 11, rollout_corr__k3_kl=lambda s: {4: "nan", 9: "inf"}.get(s, 0.0))
    out = detect_collapse(history, CollapseSection(k3_kl_max=1.0))
    assert (out["collapse_step"], out["collapse_reason"]) == (9, "k3_kl")
    assert out["mean_k3_kl"] == 0.0  # finite values only
    json.dumps(out, allow_nan=False)


def test_empty_history():
    out = detect_collapse([], CollapseSection())
    assert set(out) == KEYS
    assert out["collapsed"] is False
    assert all(out[k] is None for k in KEYS - {"collapsed", "criteria"})
    json.dumps(out, allow_nan=False)
    assert detect_collapse([], CollapseSection())["collapsed"] is False
    out = detect_collapse([], CollapseSection(), stopped_reason="non-finite rollout log-probs (logits) at step 0",
                          stopped_step=0)
    assert (out["collapsed"], out["collapse_step"], out["collapse_reason"]) == (True, 0, "non_finite")


def test_rows_out_of_order_and_custom_metric():
    history = list(reversed(run(RISE_AND_FALL)))
    assert detect_collapse(history, CollapseSection(smoothing=1))["collapse_step"] == 60
    out = detect_collapse(run([0.4] * 11), CollapseSection(metric="missing/metric"))
    assert out["peak_reward"] is None and out["initial_reward"] is None and out["collapsed"] is False
