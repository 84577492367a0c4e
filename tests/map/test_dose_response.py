"""vexact.sweeps.dose_response on hand-built sweep directories: the fitted 50% threshold, its bootstrap interval,
and the cases where no threshold can be given (nothing collapsed, everything collapsed, missing metrics)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from vexact.reports.sweep_report import write_report
from vexact.rl.config import ConfigError
from vexact.sweeps.dose_response import dose_response, fit_threshold, threshold_words
from vexact.sweeps.sweep import load_sweep_spec
from vexact.sweeps.sweep_data import read_sweep_results

SEEDS = (0, 1, 2, 3)


def _summary(collapsed: bool, k3: float | None, step: int | None) -> dict:
    collapse = {"collapsed": collapsed, "collapse_step": step if collapsed else None, "mean_k3_kl": k3,
                "mean_k3_kl_before_collapse": k3}
    return {"status": "completed", "steps_completed": 100, "collapse": collapse}


def _sweep(root: Path, outcomes: dict[tuple[str, float], list[bool]], curves: list[str] | None = None,
           no_metric: set[tuple[str, float, int]] = frozenset()) -> Path:
    """outcomes: (old_logprobs, dose) -> collapsed per seed. The dose doubles as the grid magnitude."""
    entries = []
    for (mode, dose), collapsed in outcomes.items():
        for seed, c in zip(SEEDS, collapsed):
            overrides = {"algorithm.old_logprobs": mode, "inject.value": dose, "seed": seed}
            name = f"{mode}-{dose}-{seed}"
            (root / "points" / name).mkdir(parents=True)
            # each seed realises a slightly different mismatch, as real runs do
            k3 = None if (mode, dose, seed) in no_metric else dose * (1 + 0.05 * seed)
            (root / "points" / name / "summary.json").write_text(json.dumps(_summary(c, k3, 40 + seed)))
            # a finished run's log holds a line per step its summary counts (fewer is damage: check_finished)
            steps = _summary(c, k3, 40 + seed)["steps_completed"]
            (root / "points" / name / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n"
                                                                           for i in range(steps)))
            entries.append({"name": name, "dir": f"points/{name}", "overrides": overrides, "status": "completed"})
    grid = {"algorithm.old_logprobs": sorted({m for m, _ in outcomes}),
            "inject.value": sorted({d for _, d in outcomes}), "seed": list(SEEDS)}
    (root / "sweep.json").write_text(json.dumps({"name": "dose", "grid": grid, "curves": curves, "points": entries}))
    return root


RISING = {0.0: [False] * 4, 1e-4: [False] * 4, 1e-3: [False, False, False, True], 1e-2: [True, True, True, False],
          1e-1: [True] * 4}


def test_threshold_lies_where_collapse_becomes_likely_with_a_bracketing_interval(tmp_path: Path) -> None:
    data = read_sweep_results(_sweep(tmp_path, {("rollout", d): c for d, c in RISING.items()}))
    result = dose_response(data)
    [curve] = result["curves"]
    t = curve["threshold"]
    assert t["status"] == "fitted" and t["metric"] == "rollout_corr/k3_kl"
    assert 1e-3 < t["threshold_50"] < 1.2e-2
    assert t["ci_low"] is not None and t["ci_high"] is not None
    assert t["ci_low"] <= t["threshold_50"] <= t["ci_high"]
    # between the tested doses the data cannot place the threshold: the interval spans the bracketing runs
    assert t["bracket_low"] == pytest.approx(1e-3 * 1.10) and t["bracket_high"] == pytest.approx(1e-2)
    assert t["ci_low"] <= t["bracket_low"] and t["ci_high"] >= t["bracket_high"]
    assert curve["baseline"] == {"runs": 4, "collapsed": 0}
    by_value = {p["overrides"]["inject.value"]: p for p in curve["points"]}
    assert by_value[1e-2]["collapsed"] == 3 and by_value[1e-2]["collapse_prob"] == 0.75
    assert by_value[1e-2]["median_collapse_step"] == 41  # seeds 0, 1, 2 collapsed at 40, 41, 42
    assert by_value[1e-4]["median_collapse_step"] is None
    assert by_value[1e-1]["realised_k3_kl"] == pytest.approx(0.1 * 1.075)  # the mean over seeds, not the knob
    assert dose_response(data) == result  # the bootstrap is seeded: the report is deterministic


def test_no_collapse_says_the_threshold_is_above_the_range_and_invents_nothing(tmp_path: Path) -> None:
    data = read_sweep_results(_sweep(tmp_path, {("rollout", d): [False] * 4 for d in (1e-4, 1e-3, 1e-2)}))
    t = dose_response(data)["curves"][0]["threshold"]
    assert t["status"] == "above_range"
    assert t["threshold_50"] is None and t["ci_low"] is None and t["ci_high"] is None
    assert t["lower_bound"] == pytest.approx(1e-2 * 1.15)
    assert "above the largest value tested" in t["note"]


def test_everything_collapsing_says_below_the_range(tmp_path: Path) -> None:
    data = read_sweep_results(_sweep(tmp_path, {("rollout", d): [True] * 4 for d in (1e-3, 1e-2)}))
    t = dose_response(data)["curves"][0]["threshold"]
    assert t["status"] == "below_range" and t["threshold_50"] is None and t["upper_bound"] == 1e-3


def test_a_fitted_50_percent_point_outside_the_tested_doses_is_reported_as_a_side_not_a_number() -> None:
    # The fp8 long sweep's shape: 1 of 4 runs collapsed, all near one dose. The nearly flat fit put its 50% point
    # at k3 = 1.8e8, ten decades above the largest dose tested: an extrapolation, not a measurement.
    runs = [(1.51e-2, False, 0), (1.74e-2, True, 1), (1.87e-2, False, 0), (1.78e-2, False, 1)]
    t = fit_threshold(runs)
    assert t["status"] == "above_range" and t["threshold_50"] is None and t["ci_low"] is None
    assert t["lower_bound"] == 1.87e-2 and t["collapsed"] == 1 and t["runs"] == 4
    assert "1 of 4 runs collapsed" in t["note"] and "above the largest value tested" in t["note"]
    assert threshold_words(t) == "under 50% up to 1.9e-02 (1 of 4 collapsed)"
    # mirrored: most runs collapsed and the fit puts its 50% point below the smallest dose
    below = fit_threshold([(1.51e-2, True, 0), (1.70e-2, False, 1), (1.87e-2, True, 0), (1.78e-2, True, 1)])
    assert below["status"] == "below_range" and below["upper_bound"] == 1.51e-2 and below["threshold_50"] is None
    assert threshold_words(below) == "over 50% from 1.5e-02 (3 of 4 collapsed)"
    # with nothing collapsed the words stay as they were
    assert threshold_words(fit_threshold([(1e-3, False, 0), (1e-2, False, 0)])) == "no collapse up to 1.0e-02"


def test_one_dose_level_or_falling_collapse_gives_no_threshold() -> None:
    one_level = fit_threshold([(1e-3, True, 0), (1e-3, False, 1)])
    assert one_level["status"] == "insufficient" and one_level["threshold_50"] is None
    assert one_level["dose_min"] == one_level["dose_max"] == 1e-3  # what was measured, kept for the verdict's words
    assert "dose_min" not in fit_threshold([])
    falling = [(1e-4, True, s) for s in SEEDS] + [(1e-2, False, s) for s in SEEDS] + [(1e-3, s == 0, s) for s in SEEDS]
    t = fit_threshold(falling)
    assert t["status"] == "not_monotone" and t["threshold_50"] is None


def test_curves_split_by_the_sweep_files_curves_keys(tmp_path: Path) -> None:
    outcomes = {("rollout", d): c for d, c in RISING.items()}
    outcomes.update({("recompute", d): [False] * 4 for d in RISING})
    data = read_sweep_results(_sweep(tmp_path, outcomes, curves=["algorithm.old_logprobs"]))
    result = dose_response(data)
    assert result["curve_keys"] == ["algorithm.old_logprobs"]
    status = {c["keys"]["algorithm.old_logprobs"]: c["threshold"]["status"] for c in result["curves"]}
    assert status == {"rollout": "fitted", "recompute": "above_range"}


def test_runs_without_the_mismatch_metric_are_counted_and_named_not_fitted(tmp_path: Path) -> None:
    outcomes = {("rollout", d): c for d, c in RISING.items()}
    data = read_sweep_results(_sweep(tmp_path, outcomes, no_metric={("rollout", 1e-2, 0), ("rollout", 1e-2, 1)}))
    curve = dose_response(data)["curves"][0]
    point = next(p for p in curve["points"] if p["overrides"]["inject.value"] == 1e-2)
    assert point["runs"] == 2 and point["missing_metric"] == 2
    assert "2 run(s) have no realised rollout_corr/k3_kl" in curve["threshold"]["note"]


def test_report_writes_dose_response_json_and_png_and_prints_the_verdict(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "s", {("rollout", d): c for d, c in RISING.items()})
    console = Console(record=True, width=200)
    write_report(sweep, console=console)
    saved = json.loads((sweep / "report" / "dose_response.json").read_text())
    t = saved["curves"][0]["threshold"]
    assert {"metric", "threshold_50", "ci_low", "ci_high"} <= set(t) and math.isfinite(t["threshold_50"])
    assert (sweep / "report" / "dose_response.png").read_bytes()[:4] == b"\x89PNG"
    assert "dose-response algorithm.old_logprobs=rollout: 50% at k3 =" in console.export_text()


def test_report_of_a_sweep_with_no_results_states_it(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"name": "e", "grid": {"seed": [0]}, "points": [
        {"name": "p", "dir": "points/p", "overrides": {"seed": 0}, "status": "pending"}]}))
    console = Console(record=True, width=200)
    write_report(root, console=console)
    t = json.loads((root / "report" / "dose_response.json").read_text())["curves"][0]["threshold"]
    assert t["status"] == "insufficient" and t["threshold_50"] is None
    assert "no curve to fit" in console.export_text()


def test_sweep_file_curves_must_name_grid_keys(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("base: {steps: 1}\ngrid: {seed: [0, 1]}\ncurves: [algorithm.old_logprobs]\n")
    with pytest.raises(ConfigError, match="'algorithm.old_logprobs' is not a grid key"):
        load_sweep_spec(tmp_path / "s.yaml")


# ---------------------------------------------------------------- the shipped realistic study
EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_realistic_sweeps_ship_and_one_uses_a_realistic_source() -> None:
    sweeps = sorted(EXPERIMENTS.glob("*realistic*sweep.yaml"))
    assert len(sweeps) >= 3
    modes = set()
    for path in sweeps:
        spec = load_sweep_spec(path, output_dir="/nonexistent/never-written")
        modes |= {p.config.inject.mode for p in spec.points}
        assert {p.config.task.name for p in spec.points} == {"sum"}  # the testbed whose lengths can vary
    assert modes & {"precision", "kernel"} and "logit_noise" in modes


def test_realistic_testbed_runs_and_its_response_lengths_vary(tmp_path: Path) -> None:
    from vexact.records.runlog import read_metrics
    from vexact.rl.config import load_config
    from vexact.rl.trainer import Trainer

    overrides = ["steps=2", "warm_start.steps=5", "model.hidden_size=32", "model.num_layers=1",
                 "model.intermediate_size=64", "task.eval_prompts=8", "rollout.prompts_per_step=4",
                 f"warm_start.cache_dir={tmp_path / 'ws'}", f"output_dir={tmp_path / 'run'}", "logging.live=false",
                 "inject.mode=precision", "inject.precision=fp8_e4m3", "inject.sites=[linear, logits]"]
    cfg = load_config(EXPERIMENTS / "realistic_testbed.yaml", overrides)
    Trainer(cfg, console=Console(quiet=True)).run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    assert all(r["response_length/max"] > r["response_length/min"] for r in rows)
    assert all(r["rollout_corr/k3_kl"] > 0 for r in rows)  # fp8 rounding in the rollout path is a mismatch


def test_a_nearly_flat_fit_is_a_side_of_the_range_not_an_overflow():
    """Outcomes symmetric in log dose fit a slope of 1.9e-16: its 50% point, 10^(1.3e16), raised OverflowError."""
    runs = [(d, s < k, s) for d, k in zip((1e-3, 1e-2, 1e-1, 1.0), (0, 1, 1, 0)) for s in range(6)]
    assert fit_threshold(runs)["status"] in ("above_range", "below_range", "not_monotone")


def test_resamples_that_place_the_threshold_outside_the_doses_leave_that_end_open():
    """A resample's 50% point far below the tested doses (10^-1.5e15) came out as a lower end of 0.0, which
    fit_law's log10 then refused; it counts as below the range, as the whole fit's would."""
    doses = (1e-3, 1e-2, 1e-1, 1.0)
    pattern = {0: (0, 1, 0, 1), 1: (1, 0, 1, 1), 2: (0, 0, 1, 0), 3: (1, 0, 0, 1), 4: (0, 1, 0, 0), 5: (1, 1, 0, 1)}
    t = fit_threshold([(d, bool(pattern[s][i]), s) for s in pattern for i, d in enumerate(doses)])
    assert t["status"] == "fitted" and t["ci_low"] is None and t["ci_high"] is None
    assert "its lower end lies below the tested range" in t["note"]


def test_one_group_is_one_dose_level_however_its_seeds_realise_it():
    """The seeds of one group realise slightly different doses: counted as levels, one group with mixed outcomes
    was "fitted" over 0.013 decades."""
    runs = [(1e-2 * (1 + 0.01 * s), s >= 2, s) for s in range(4)]
    assert fit_threshold(runs)["status"] == "fitted"  # the distinct doses, as a direct caller gives them
    t = fit_threshold(runs, levels=1)  # dose_response's count: the groups
    assert t["status"] == "insufficient" and t["threshold_50"] is None


def test_one_seed_gives_the_bracket_not_a_bootstrap_interval():
    """One seed (or runs without one): every resample is the same runs, so "95% interval from 1000 bootstrap
    resamples of 1 seeds" claimed a spread that was never drawn. The bracket, widened to the profile likelihood."""
    t = fit_threshold([(d, d >= 1e-1, None) for d in (1e-3, 1e-2, 1e-1, 1.0) for _ in range(4)])
    assert t["status"] == "fitted" and t["ci_low"] <= t["bracket_low"] and t["ci_high"] >= t["bracket_high"]
    assert t["note"].startswith("one seed: no bootstrap spread") and "bootstrap resamples" not in t["note"]
