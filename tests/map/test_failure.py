"""Each collapse's failure kind, from synthetic metrics: length lost, limit overrun, reward lost at intact length."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vexact.sweeps.failure import (
    failure_of,
    failure_summary,
    failure_table,
    failure_words,
    horizon_failure_words,
    horizon_failures,
)
from vexact.sweeps.sweep_data import PointData

STEPS = range(0, 101, 10)
FALL = 60  # the raw reward falls here; the detector confirms at COLLAPSE
COLLAPSE = 70


def _from(values: dict[int, float], step: int) -> float:
    """The value set at the latest given step at or before ``step``."""
    return values[max(s for s in values if s <= step)]


def _run(tmp: Path, name: str, lengths: dict[int, float], clips: dict[int, float] | None = None, *,
         collapsed: bool = True, surge: int | None = None, limit: int = 168, task_len: int = 160) -> PointData:
    """A run whose eval reward is 0.8 up to step 50 and 0.1 from FALL on, with the given eval lengths (and training
    clip ratios) from each given step on, its config.yaml holding the limit and the task's L."""
    folder = tmp / name
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"task": {"max_len": task_len},
                                                        "rollout": {"max_new_tokens": limit}}))
    metrics = []
    for step in STEPS:
        row = {"step": step, "eval/reward_mean": 0.8 if step < FALL else 0.1,
               "eval/response_length_mean": _from(lengths, step)}
        if clips is not None:
            row["response_length/clip_ratio"] = _from(clips, step)
        metrics.append(row)
    collapse = {"collapsed": collapsed, "collapse_step": COLLAPSE if collapsed else None,
                "collapse_reason": "reward_drop" if collapsed else None, "peak_reward": 0.8,
                "peak_step": 20, "length_surge_step": surge,
                "criteria": {"metric": "eval/reward_mean", "drop": 0.5, "patience": 20, "smoothing": 3}}
    summary = {"status": "completed", "collapse": collapse}
    (folder / "summary.json").write_text(json.dumps(summary))
    return PointData(name, folder, {"seed": 0}, "completed", summary=summary, metrics=metrics)


def test_length_lost(tmp_path):
    """The held task at L = 500: its eval answers shrink from ~480 to ~240 tokens as the reward falls."""
    p = _run(tmp_path, "lost", {0: 480, 50: 480, 60: 240, 70: 300, 100: 330}, {0: 0.02, 60: 0.05},
             limit=508, task_len=500)
    f = failure_of(p)
    assert f["kind"] == "length_lost" and f["fall_step"] == FALL and f["collapse_step"] == COLLAPSE
    assert f["length_before"] == 480 and f["length_min"] == 240 and f["L"] == 500 and f["max_new_tokens"] == 508
    assert not f["surge_before"] and "no length surge before it" in failure_words(f)


def test_limit_overrun(tmp_path):
    """L = 160: the answers grow into the 168-token limit, half the batch cut there, as the reward falls."""
    p = _run(tmp_path, "over", {0: 120, 50: 80, 60: 150, 70: 155}, {0: 0.02, 50: 0.05, 60: 0.5, 70: 0.55})
    f = failure_of(p)
    assert f["kind"] == "limit_overrun" and f["clip_max"] == 0.55 and f["clip_before"] == 0.05
    assert failure_words(f).startswith("limit overrun (fall at step 60, collapse 70; eval length 80 → 150..155")
    # without the clip ratio the eval length alone, near the limit, says so too
    assert failure_of(_run(tmp_path, "over_len", {0: 80, 60: 165}))["kind"] == "limit_overrun"


def test_reward_lost_at_intact_length(tmp_path):
    """The length holds and the cut fraction does not rise: only the reward went. A task whose answers always
    fill the limit (the cut fraction high before and after) is no overrun."""
    assert failure_of(_run(tmp_path, "intact", {0: 20}, {0: 0.02}))["kind"] == "reward_lost_at_intact_length"
    full = _run(tmp_path, "full", {0: 20}, {0: 0.6, 60: 0.7}, limit=24, task_len=16)
    assert failure_of(full)["kind"] == "reward_lost_at_intact_length"


def test_no_collapse_no_failure_and_the_surge(tmp_path):
    assert failure_of(_run(tmp_path, "held", {0: 20}, collapsed=False)) is None
    surged = failure_of(_run(tmp_path, "surged", {0: 20, 60: 20}, surge=40))
    assert surged["surge_before"] and "length surge at step 40" in failure_words(surged)
    late = failure_of(_run(tmp_path, "late", {0: 20}, surge=90))  # after the collapse: no early warning
    assert not late["surge_before"]


def test_a_horizon_says_which_failure_its_threshold_measures(tmp_path):
    points = [_run(tmp_path, "a", {0: 480, 60: 240}), _run(tmp_path, "b", {0: 480, 60: 200}),
              _run(tmp_path, "c", {0: 480}, surge=30), _run(tmp_path, "d", {0: 480}, collapsed=False)]
    h = horizon_failures(points)
    assert h == {"failure_kinds": {"length_lost": 2, "reward_lost_at_intact_length": 1}, "surge_before_collapse": 1,
                 "collapsed_classified": 3}
    assert horizon_failure_words(h) == ("length lost 2 of 3, reward lost at intact length 1 of 3; a length surge "
                                        "preceded 1 of 3")
    rows = failure_table(points)
    assert [r["point"] for r in rows] == ["a", "b", "c"]
    assert failure_summary(rows) == ("failure kinds of 3 collapse(s): length lost 2, reward lost at intact length 1; "
                                     "a length surge before 1 of 3")


def test_only_a_reward_drop_from_a_positive_peak_is_classified(tmp_path):
    """A collapse on another trigger (k3_kl, a NaN grad norm) is no reward fall, and from a peak of 0 every value
    sits at the drop at once: none gets a kind (the k3_kl run at reward 0 read as "limit overrun, fall at step 0")."""
    for reason in ("k3_kl", "non_finite", "grad_norm"):
        p = _run(tmp_path, reason, {0: 80, 60: 165}, {0: 0.02, 60: 0.5})
        p.summary["collapse"]["collapse_reason"] = reason
        assert failure_of(p) is None
    zero = _run(tmp_path, "zero", {0: 80, 60: 165}, {0: 0.02, 60: 0.5})
    zero.summary["collapse"].update(peak_reward=0.0, collapse_reason="reward_drop")
    assert failure_of(zero) is None
    assert failure_table([zero]) == [] and failure_summary([]) == "failure kinds: no reward-drop collapse"
    assert horizon_failures([zero]) == {"failure_kinds": {}, "surge_before_collapse": 0, "collapsed_classified": 0}
