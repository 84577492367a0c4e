"""The collapse map per correction: which correction a run (or a user's config) is, curves split by it, a verdict
from the user's own correction's curve only, bound-only curves, the assembled map, and the law's shape."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from vexact.map import build, fit, naming, verdict
from vexact.map.build import build_map
from vexact.map.naming import correction_from_config, correction_name, correction_names
from vexact.map.scaling_report import write_scaling
from vexact.map.shapes import compare_shapes
from vexact.map.verdict import MAP_KEYS, load_map, place_on_map, resolve_correction
from vexact.rl.config_schema import CorrectionSection
from vexact.rl.corrections import CORRECTION_METHODS, PRESETS, CorrectionMethod, register_correction_method
from vexact.sweeps.sweep_data import PointData, SweepData

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

SEEDS = (0, 1, 2)
FACTORS = (0.25, 0.5, 2.0, 4.0)
# the recompute sweep of docs/results/horizon_corrections.md, as bounds: no collapse up to k3 X at T (L = 4, 16, 80)
RECOMPUTE_BOUNDS = {4: (8.5, 0.37), 16: (19.7, 0.051), 80: (83.0, 0.037)}


def _point(tmp: Path, name: str, length: int, horizon: float, dose: float, collapsed: bool, seed: int,
           overrides: dict | None = None, config: dict | None = None) -> PointData:
    """A finished point; ``config``: what the run saved in its config.yaml (None: it saved none)."""
    folder = tmp / "points" / f"{name},seed={seed}"
    if config is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = [{"step": s, "response_length/mean": horizon} for s in range(3)]
    summary = {"status": "completed", "collapse": {"collapsed": collapsed, "mean_k3_kl_before_collapse": dose}}
    return PointData(folder.name, folder, {"task.max_len": length, "seed": seed, **(overrides or {})}, "completed",
                     summary=summary, metrics=metrics)


def _bypass_points(tmp: Path, config: dict | None = None, overrides: dict | None = None) -> list[PointData]:
    """Bypass runs whose 50% threshold is 0.1 (T/8)^-1 at T = 8, 16, 32, 64."""
    points = []
    for length in (8, 16, 32, 64):
        thr = 0.1 * (length / 8.0) ** -1.0
        for seed in SEEDS:
            for f in FACTORS:
                points.append(_point(tmp, f"b_L{length}_{f}", length, float(length), thr * f * (1 + 0.01 * seed),
                                     f > 1, seed, {"inject.value": f, **(overrides or {})}, config))
    return points


def _recompute_points(tmp: Path, config: dict | None = None, overrides: dict | None = None) -> list[PointData]:
    """Recompute runs that never collapse, up to the bounds of ``RECOMPUTE_BOUNDS``."""
    points = []
    for length, (t, top) in RECOMPUTE_BOUNDS.items():
        for seed in SEEDS:
            for f in (0.25, 0.5, 1.0):
                points.append(_point(tmp, f"r_L{length}_{f}", length, t, top * f, False, seed,
                                     {"inject.value": f, **(overrides or {})}, config))
    return points


def _sweep(tmp: Path, points: list[PointData], keys: list[str]) -> SweepData:
    return SweepData(tmp, "synthetic", {k: [] for k in keys + ["seed"]}, keys, points)


def _two_correction_map(tmp: Path) -> dict:
    """A map of two curves: bypass (fitted, α = 1) and recompute (bounds only), through write_scaling + build_map."""
    files = []
    for name, points in (("bypass", _bypass_points(tmp / "b")), ("recompute", _recompute_points(
            tmp / "r", overrides={"algorithm.old_logprobs": "recompute"}))):
        out = tmp / name
        out.mkdir(parents=True, exist_ok=True)
        files.append(write_scaling(_sweep(tmp / name, points, ["task.max_len"]), out)[0][0])
    built = build_map(files)
    path = tmp / "map.json"
    path.write_text(json.dumps(built))
    return load_map(path)


# ----------------------------------------------------------------------------- names


def test_correction_names_come_from_the_registry():
    names = correction_names()
    methods = [m for m, entry in CORRECTION_METHODS.items() if entry.to_verl is not None]
    assert names == ("bypass", "recompute", *methods, *(f"bypass_{m}" for m in methods))
    assert "none" not in names and "token_tis" in names and "bypass_token_tis" in names
    extra = CorrectionMethod("test_tis", "rollout_is token", "w = min(rho, C)",
                             lambda cfg: {"rollout_is": "token", "rollout_is_threshold": cfg.threshold})
    register_correction_method(extra)
    try:
        assert "test_tis" in correction_names() and "bypass_test_tis" in correction_names()
    finally:
        CORRECTION_METHODS.remove("test_tis")
    assert set(naming.TRL_MODES.values()) | {naming.TRL_BAND_METHOD} <= set(names)


def test_one_function_names_every_run_config():
    assert correction_name("rollout") == "bypass"
    assert correction_name("recompute", CorrectionSection()) == "recompute"
    for method in ("token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_rs"):
        assert correction_name("recompute", CorrectionSection(method=method)) == method
        assert correction_name("rollout", CorrectionSection(method=method)) == f"bypass_{method}"
    # verl's own keys name the method whose plan they spell (thresholds aside)
    expected = {"disabled": "recompute", "decoupled_token_is": "token_tis", "decoupled_seq_is": "seq_tis",
                "decoupled_token_icepop": "icepop", "decoupled_geo_rs": "geo_rs", "decoupled_seq_is_rs": "seq_mis"}
    for preset, name in expected.items():
        assert correction_name("recompute", CorrectionSection(preset=preset)) == name, preset
    assert correction_name("recompute", CorrectionSection(rollout_is="token", rollout_is_threshold=5.0)) == "token_tis"
    combo = correction_name("recompute", CorrectionSection(preset="decoupled_geo_rs_token_tis"))
    assert combo == "verl[rollout_is=token,rollout_rs=seq_mean_k1]"  # no registry method spells it: its plan names it
    with pytest.raises(ValueError, match="old_logprobs"):
        correction_name("both")


def test_configs_of_verl_trl_and_vexact():
    verl = {"algorithm": {"adv_estimator": "grpo", "rollout_correction": {
        "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None, "bypass_mode": False,
        "rollout_token_veto_threshold": None}}}  # keys that do not decide the correction are left alone
    assert correction_from_config(verl) == "token_tis"
    assert correction_from_config({"rollout_is": "sequence", "bypass_mode": True}) == "bypass_seq_tis"  # the block
    assert correction_from_config({"algorithm": {"rollout_correction": {"preset": "bypass_ppo_clip"}}}) == "bypass"
    assert correction_from_config({"algorithm": {"rollout_correction": {}}}) == "recompute"  # verl: decoupled
    # TRL's GRPOConfig: old log-probs recomputed; its defaults (correction on, sequence_mask) are seq_mis
    assert correction_from_config({"use_vllm": True, "vllm_importance_sampling_mode": None,
                                   "vllm_importance_sampling_correction": True}) == "seq_mis"
    for mode, name in (("token_truncate", "token_tis"), ("token_mask", "token_mis"),
                       ("sequence_truncate", "seq_tis"), ("sequence_mask", "seq_mis")):
        assert correction_from_config({"vllm_importance_sampling_mode": mode}) == name
    assert correction_from_config({"vllm_importance_sampling_mode": "token_mask",
                                   "vllm_importance_sampling_clip_min": 0.5}) == "icepop"
    assert correction_from_config({"vllm_importance_sampling_correction": False}) == "recompute"
    # TRL corrects only with use_vllm=True: a GRPOConfig without vLLM (a rollout_func, TRL's generate) is recompute
    # whatever its IS keys say (it was read as their seq_mis / token_tis)
    assert correction_from_config({"use_vllm": False, "vllm_importance_sampling_correction": True,
                                   "vllm_importance_sampling_mode": None}) == "recompute"
    assert correction_from_config({"use_vllm": False, "vllm_importance_sampling_mode": "token_truncate"}) == "recompute"
    assert correction_from_config({"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"}) == "token_tis"
    # vexact's own config
    assert correction_from_config({"algorithm": {"old_logprobs": "recompute"}}) == "recompute"
    assert correction_from_config({"algorithm": {"old_logprobs": "rollout"},
                                   "correction": {"method": "token_tis", "threshold": 3.0}}) == "bypass_token_tis"


def test_bad_correction_configs_are_one_sentence_each(tmp_path):
    with pytest.raises(ValueError, match=r"no correction setting found"):
        correction_from_config({"trainer": {"epochs": 1}}, "cfg.yaml")
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode 'tok' is none of TRL's"):
        correction_from_config({"vllm_importance_sampling_mode": "tok"})
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction: .*rollout_is_threshold"):
        correction_from_config({"algorithm": {"rollout_correction": {"rollout_is": "token",
                                                                     "rollout_is_threshold": "x_y"}}})
    with pytest.raises(ValueError, match=r"correction: .*unknown correction method 'tis'"):
        correction_from_config({"correction": {"method": "tis"}})
    with pytest.raises(ValueError, match=r"unknown correction 'tis': expected one of bypass, recompute, token_tis"):
        resolve_correction("tis")
    with pytest.raises(ValueError, match="correction config file not found"):
        resolve_correction(str(tmp_path / "absent.yaml"))
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    with pytest.raises(ValueError, match="is not valid YAML or JSON"):
        resolve_correction(tmp_path / "bad.yaml")


def test_resolve_names_aliases_files_and_objects(tmp_path):
    assert resolve_correction(None) is None
    assert resolve_correction("recompute") == "recompute"
    assert resolve_correction("token_mask") == "token_mis"  # TRL's name for it
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump({"algorithm": {"rollout_correction": {
        "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}}}))
    assert resolve_correction(str(tmp_path / "verl.yaml")) == "icepop"
    (tmp_path / "trl.json").write_text(json.dumps({"vllm_importance_sampling_mode": "token_truncate"}))
    assert resolve_correction(tmp_path / "trl.json") == "token_tis"

    class GRPOConfigLike:  # TRL's GRPOConfig has to_dict()
        def to_dict(self) -> dict:
            return {"use_vllm": True, "vllm_importance_sampling_correction": True,
                    "vllm_importance_sampling_mode": "token_mask"}

    assert resolve_correction(GRPOConfigLike()) == "token_mis"
    assert resolve_correction({"algorithm": {"old_logprobs": "recompute"}}) == "recompute"


# ----------------------------------------------------------------------------- the report groups by correction


def test_report_splits_curves_by_the_correction_each_run_saved(tmp_path):
    """The correction is set outside the grid (the sweep's ``set``), so only each run's config.yaml says it: the
    report must not fit one curve over both (the old report did: one curve, 'all')."""
    points = (_bypass_points(tmp_path, config={"algorithm": {"old_logprobs": "rollout"}})
              + _recompute_points(tmp_path, config={"algorithm": {"old_logprobs": "recompute"}}))
    result = fit.scaling(_sweep(tmp_path, points, ["task.max_len"]))
    assert [c["correction"] for c in result["curves"]] == ["bypass", "recompute"]
    assert result["correction"] == "bypass" and result["curve"] == "correction=bypass"
    assert result["alpha"] == pytest.approx(1.0, abs=0.05)
    recompute = result["curves"][1]
    assert recompute["status"] == "bounds_only" and recompute["alpha"] is None
    bounds = {h["horizon_value"]: (h["status"], h["lower_bound"], h["collapsed"]) for h in recompute["horizons"]}
    assert bounds == {4: ("above_range", 0.37, 0), 16: ("above_range", 0.051, 0), 80: ("above_range", 0.037, 0)}


def test_a_bound_over_runs_that_dropped_unconfirmed_says_so(tmp_path):
    """A run whose reward fell below half its peak too late for the detector's patience is no collapse in the fit,
    but no clean survival either: the bound over it counts it, in the map's lines and in a verdict."""
    points = _recompute_points(tmp_path, overrides={"algorithm.old_logprobs": "recompute"})
    late = next(p for p in points if p.overrides["task.max_len"] == 80)
    late.summary["collapse"]["collapse_unconfirmed_step"] = 110
    result = fit.scaling(_sweep(tmp_path, points, ["task.max_len"]))
    curve = result["curves"][0]
    assert curve["correction"] == "recompute" and [h["dropped_unconfirmed"] for h in curve["horizons"]] == [0, 0, 1]
    assert verdict.bound_lines(curve)[2] == ("no collapse measured up to k3 0.037 at T 83 (1 of 9 runs dropped below "
                                             "half their peak, unconfirmed by the run's end)")
    at_60 = place_on_map(result, 0.01, 60.0, "recompute")["verdict"]  # only L = 80's bound reaches T = 60
    assert at_60.startswith("below every level tested: no collapse measured up to k3 0.037 at T 83 (recompute) "
                            "(1 of 9 runs dropped")
    at_15 = place_on_map(result, 0.01, 15.0, "recompute")["verdict"]  # the largest bound at T >= 15: L = 16's
    assert "no collapse measured up to k3 0.051 at T 19.7 (recompute);" in at_15 and "dropped" not in at_15


def test_a_point_that_never_started_starts_no_curve(tmp_path):
    """A point not yet run has no saved config, so its correction comes from its overrides alone (sweep.json keeps
    no `set:` block): it may join a curve of started runs, never start one that names the wrong correction."""
    pending = PointData("pending", tmp_path / "points" / "pending", {"task.max_len": 8, "seed": 0}, "pending")
    stray = PointData("stray", tmp_path / "points" / "stray",
                      {"task.max_len": 8, "seed": 0, "algorithm.old_logprobs": "recompute"}, "pending")
    result = fit.scaling(_sweep(tmp_path, _bypass_points(tmp_path) + [pending, stray], ["task.max_len"]))
    assert [c["correction"] for c in result["curves"]] == ["bypass"]
    assert result["horizons"][0]["runs_total"] == len(SEEDS) * len(FACTORS) + 1  # the pending bypass point joined


def test_report_labels_a_curve_with_its_correction_and_other_keys(tmp_path):
    grid_points = (_bypass_points(tmp_path, overrides={"correction.method": "none", "lr": 1})
                   + _bypass_points(tmp_path / "tis", overrides={"correction.method": "token_tis", "lr": 1}))
    result = fit.scaling(_sweep(tmp_path, grid_points, ["task.max_len", "correction.method", "lr"]))
    assert [c["curve"] for c in result["curves"]] == ["correction=bypass, lr=1", "correction=bypass_token_tis, lr=1"]
    files, line = write_scaling(_sweep(tmp_path, grid_points, ["task.max_len", "correction.method", "lr"]), tmp_path)
    assert line.count("scaling (correction=") == 2 and "shape over 4 fitted horizons" in line


# ----------------------------------------------------------------------------- the verdict from the user's curve


def test_recompute_dump_at_k3_0025_t8_is_not_near_the_collapse_range(tmp_path):
    """The live monitor inside a TRL run (old log-probs recomputed) used to mark k3 0.025 at T ≈ 8 "near the
    measured collapse range" from the bypass curve, where recompute collapsed nothing up to k3 0.37 there."""
    m = _two_correction_map(tmp_path)
    p = place_on_map(m, 0.025, 8.0, "recompute")
    assert list(p) == list(MAP_KEYS) and p["correction"] == "recompute"
    assert "near the measured collapse range" not in p["verdict"]
    assert p["verdict"].startswith("below every level tested: no collapse measured up to k3 0.37 at T 8.5 "
                                   "(recompute)")
    assert p["threshold_50"] is None and p["ratio"] is None  # never the bypass curve's threshold
    bypass = place_on_map(m, 0.025, 8.0, "bypass")
    assert bypass["threshold_50"] == pytest.approx(0.1, rel=0.3)  # the same point on the bypass curve has one
    assert bypass["verdict"].startswith("near the measured collapse range")
    # above every recompute bound carried to this T: not placed, and still no bypass threshold
    above = place_on_map(m, 0.5, 8.0, "recompute")
    assert above["verdict"].startswith("not placed") and above["threshold_50"] is None
    # a shorter horizon's bound does not carry to a longer one: at T = 500 nothing was measured
    far = place_on_map(m, 0.001, 500.0, "recompute")
    assert far["verdict"].startswith("no verdict at this horizon: T = 500 lies beyond the recompute curve's")
    assert "no collapse measured up to k3 0.037 at T 83" in far["verdict"]


def test_no_correction_given_says_bypass_was_assumed(tmp_path):
    m = _two_correction_map(tmp_path)
    p = place_on_map(m, 0.025, 8.0)
    assert p["correction"] == "bypass" and "correction assumed: bypass (none given" in p["verdict"]
    assert "correction assumed" not in place_on_map(m, 0.025, 8.0, "bypass")["verdict"]


def test_a_correction_absent_from_the_map_is_named_not_replaced(tmp_path):
    """A correction the map has no curve for is one sentence as the verdict (issue AC: not a refusal), never another
    curve's threshold."""
    m = _two_correction_map(tmp_path)
    p = place_on_map(m, 0.025, 8.0, "token_tis")
    assert p["threshold_50"] is None and p["ratio"] is None and p["correction"] == "token_tis"
    assert p["verdict"].startswith("no verdict: the map ") and "\n" not in p["verdict"]
    assert p["verdict"].endswith(" has no curve for your correction (recompute + token_tis: old log-probs recomputed "
                                 "by the trainer, corrected by w_t = min(ρ_t, C)) on source none (its curves there: "
                                 "bypass, recompute), and another correction's threshold would not answer for yours")
    with pytest.raises(ValueError, match="unknown correction 'tis'"):
        place_on_map(m, 0.025, 8.0, "tis")


def test_outside_every_curve_is_one_sentence(tmp_path):
    m = _two_correction_map(tmp_path)
    placed = verdict.placement(m, 1e-7, 5000.0, "bypass")  # a decade under the law's band there (8.5e-06 ..)
    assert placed["verdict"].startswith("far below the measured collapse range; extrapolated: T = 5000 lies")
    sentence = placed["outside_every_curve"]
    assert sentence == ("T = 5000 lies outside every curve's measured horizons (bypass: T = 8.0 .. 64; recompute: "
                        "T = 8.5 .. 83): every threshold the map gives at this T is an extrapolation")
    lines = verdict.map_lines(placed, m)
    assert f"  outside the map: {sentence}" in lines
    inside = verdict.placement(m, 1e-4, 30.0, "bypass")
    assert "outside_every_curve" not in inside and "extrapolated" not in inside["verdict"]


def test_numpy_scalars_are_placed_as_the_numbers_they_are():
    """A k3 the user computed in numpy (float32) was refused as "k3 must be a finite number >= 0, got
    np.float32(0.001)"; it is the placement of its float value. What is no real number is still refused."""
    m = verdict.load_map(None)
    assert verdict.place_on_map(m, np.float32(1e-3), np.int64(20), "bypass") == verdict.place_on_map(
        m, float(np.float32(1e-3)), 20.0, "bypass")
    for k3 in (torch.tensor(1e-3), True, np.float64("nan"), np.float32(-1.0)):
        with pytest.raises(ValueError, match=r"^k3 must be a finite number >= 0, got "):
            verdict.place_on_map(m, k3, 20.0, "bypass")
    with pytest.raises(ValueError, match=r"^the horizon \(mean response length\) must be a positive number, got 0.0:"):
        verdict.place_on_map(m, 1e-3, np.float32(0.0), "bypass")


def test_a_horizon_is_written_with_the_digits_it_has():
    """Whole tokens from 20 on, one decimal below, two significant digits below 0.1 (a mostly masked batch's T =
    0.01 read "T = 0.0")."""
    assert [verdict.fmt_t(t) for t in (516.4, 20.0, 8.25, 0.1, 0.0123)] == ["516", "20", "8.2", "0.1", "0.012"]


def test_outside_every_curve_counts_the_curves_at_the_users_lag_only():
    """The shipped map has curves at policy lags 0, 1, 4 and 8. At lag 1, T = 100 is outside both lag-1 curves
    (T ~8 .. 19): the sentence said nothing, because the lag-0 bypass curve (T 5.3 .. 516) covers 100 -- a curve that
    does not answer at lag 1. At lag 0 the sentence listed 'bypass' and 'recompute' four times, one per lag."""
    m = verdict.load_map(None)
    at_lag_1 = [verdict.curve_for(m, name, policy_lag=1) for name in ("bypass", "recompute")]
    placed = verdict.placement(m, 1e-4, 100.0, "bypass", policy_lag=1)
    assert placed["outside_every_curve"] == (
        "T = 100 lies outside every curve's measured horizons ("
        + "; ".join(f"{c['correction']}: T = {verdict.fmt_t(c['horizon_range'][0])} .. "
                    f"{verdict.fmt_t(c['horizon_range'][1])}" for c in at_lag_1)
        + "): every threshold the map gives at this T is an extrapolation")
    far = verdict.placement(m, 1e-4, 1e5, "bypass")["outside_every_curve"]
    listed = [part.split(":")[0] for part in far.split("(", 1)[1].split("):")[0].split("; ")]
    assert listed == [c["correction"] for c in verdict.map_curves(m)
                      if c["policy_lag"] == 0 and c["source"] == verdict.default_source(m)]
    assert len(listed) == len(set(listed)) and "outside_every_curve" not in verdict.placement(m, 1e-4, 100.0, "bypass")


def _dump(tmp: Path, r: float = 0.22, length: int = 8, sequences: int = 4) -> tuple[Path, Path]:
    """Sequences of ``length`` tokens whose training log-prob exceeds the rollout's by ``r``: k3 = e^r − r − 1."""
    roll, train = tmp / "roll.jsonl", tmp / "train.jsonl"
    with roll.open("w") as fr, train.open("w") as ft:
        for i in range(sequences):
            fr.write(json.dumps({"id": i, "logprobs": [-1.0] * length}) + "\n")
            ft.write(json.dumps({"id": i, "logprobs": [-1.0 + r] * length}) + "\n")
    return roll, train


def test_compare_map_correction_cli(tmp_path, capsys):
    from vexact.cli import main

    m = _two_correction_map(tmp_path)
    map_file = tmp_path / "map.json"
    roll, train = _dump(tmp_path)
    out = tmp_path / "out.json"
    assert main(["compare", str(roll), str(train), "--map", str(map_file), "--correction", "recompute",
                 "--json", str(out), "--verbose"]) == 0
    data = json.loads(out.read_text())["map"]
    assert list(data) == list(MAP_KEYS) and data["correction"] == "recompute" and data["horizon"] == 8.0
    assert data["k3"] == pytest.approx(math.exp(0.22) - 1.22, rel=1e-6)
    assert data["verdict"].startswith("below every level tested: no collapse measured up to k3 0.37")
    text = capsys.readouterr().out
    assert "correction recompute: k3 = 0.0261" in text and BOUND in text
    # a verl config file names the correction too
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump({"algorithm": {"rollout_correction": {"bypass_mode": True}}}))
    assert main(["compare", str(roll), str(train), "--map", str(map_file), "--correction",
                 str(tmp_path / "verl.yaml"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["map"]["correction"] == "bypass"
    assert m["curves"][0]["correction"] == "bypass"


def _tis_map(tmp_path: Path) -> dict:
    """The two-correction map with its recompute curve relabelled ``token_tis``: a map with a recompute + token TIS
    curve and no bypass + token TIS one, as the shipped map's logit_scale source."""
    m = _two_correction_map(tmp_path)
    m["curves"] = [c if c["correction"] == "bypass" else {**c, "correction": "token_tis"} for c in m["curves"]]
    return m


VERL_BYPASS_TIS = {"algorithm": {"rollout_correction": {"bypass_mode": True, "rollout_is": "token",
                                                        "rollout_is_threshold": 2.0}}}


def test_bypass_tis_never_gets_the_recompute_tis_curve(tmp_path):
    """Issue AC: TIS in bypass mode (verl's bypass + rollout_is token) is bypass_token_tis, not token_tis (recompute
    + TIS); on a map with only the recompute + TIS curve its verdict is one sentence saying there is no curve for it,
    never the recompute curve's bound ("below every level tested")."""
    m = _tis_map(tmp_path)
    assert verdict.resolve_correction(VERL_BYPASS_TIS, m) == "bypass_token_tis"
    assert verdict.resolve_correction({"algorithm": {"rollout_correction": {"rollout_is": "token"}}}, m) == "token_tis"
    recompute_tis = place_on_map(m, 0.025, 8.0, "token_tis")
    assert recompute_tis["verdict"].startswith("below every level tested")  # the curve exists for recompute + TIS
    assert recompute_tis["verdict"].endswith("; curve: recompute + token_tis: old log-probs recomputed by the "
                                             "trainer, corrected by w_t = min(ρ_t, C)")
    for spec in (VERL_BYPASS_TIS, "bypass_token_tis"):
        p = place_on_map(m, 0.025, 8.0, spec)
        assert p["correction"] == "bypass_token_tis" and p["threshold_50"] is None
        assert p["verdict"].startswith("no verdict: the map") and "below every level" not in p["verdict"]
        assert "(bypass + token_tis: old log-probs from the rollout, corrected by w_t = min(ρ_t, C))" in p["verdict"]
        assert "\n" not in p["verdict"] and "routing" not in p["verdict"]  # no unrelated source suggested


def test_compare_cli_bypass_tis_config_gets_one_sentence(tmp_path, capsys):
    """A valid verl config with bypass + token TIS is answered (exit 0) with one sentence, not refused."""
    from vexact.cli import main

    m = _tis_map(tmp_path)
    map_file = tmp_path / "tis_map.json"
    map_file.write_text(json.dumps({k: v for k, v in m.items() if k != "origin"}))
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump(VERL_BYPASS_TIS))
    roll, train = _dump(tmp_path)
    out = tmp_path / "out.json"
    assert main(["compare", str(roll), str(train), "--map", str(map_file), "--correction",
                 str(tmp_path / "verl.yaml"), "--json", str(out), "--verbose"]) == 0
    data = json.loads(out.read_text())["map"]
    assert data["correction"] == "bypass_token_tis" and data["threshold_50"] is None
    assert "has no curve for your correction (bypass + token_tis" in data["verdict"]
    assert "your correction: bypass + token_tis: old log-probs from the rollout" in capsys.readouterr().out


BOUND = "a no-collapse bound measured at a horizon holds within 1.5x of it, and is carried no further"


@pytest.mark.parametrize("argv, expected", [
    (["--correction", "tis"], "unknown correction 'tis'"),
    (["--correction", "MISSING.yaml"], "correction config file not found"),
])
def test_compare_bad_correction_is_one_error_line(tmp_path, capsys, argv, expected):
    from vexact.cli import main

    _two_correction_map(tmp_path)
    roll, train = _dump(tmp_path)
    assert main(["compare", str(roll), str(train), "--map", str(tmp_path / "map.json"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error:") and len(captured.err.strip().splitlines()) == 1
    assert expected in captured.err
    assert "map (" not in captured.out  # refused before the dump was read: no report, no verdict


def test_compare_correction_without_map(tmp_path, capsys):
    from vexact.cli import main

    roll, train = _dump(tmp_path)
    assert main(["compare", str(roll), str(train), "--correction", "recompute"]) == 2
    assert "give --map too" in capsys.readouterr().err


def test_live_monitor_takes_the_correction(tmp_path):
    from vexact.live import LiveMonitor

    _two_correction_map(tmp_path)
    map_file = tmp_path / "map.json"
    roll = torch.full((4, 8), -1.0)
    train = roll + 0.22
    summary = {"sequences": 4, "tokens": 32, "metrics": {"rollout_corr/k3_kl": math.exp(0.22) - 1.22}}
    expected, _ = verdict.compare_map(summary, map_file, "recompute")
    with LiveMonitor(tmp_path / "live", scaling_map=map_file, correction="recompute") as monitor:
        row = monitor.step(0, roll, train)
    assert row["map"]["correction"] == "recompute" and list(row["map"]) == list(MAP_KEYS)
    assert row["map"]["verdict"] == expected["verdict"]
    assert row["map"]["k3"] == pytest.approx(expected["k3"], rel=1e-5)  # float32 tensors here
    assert "near the measured collapse range" not in row["map"]["verdict"]
    with LiveMonitor(tmp_path / "live2", scaling_map=map_file, correction="token_tis") as monitor:  # no curve: said
        absent = monitor.step(0, roll, train)["map"]
    assert absent["verdict"].startswith("no verdict: the map")
    assert "has no curve for your correction" in absent["verdict"]
    assert absent["threshold_50"] is None
    with pytest.raises(ValueError, match="unknown correction 'tis'"):
        LiveMonitor(tmp_path / "live3", scaling_map=map_file, correction="tis")
    with pytest.raises(ValueError, match="give scaling_map too"):
        LiveMonitor(tmp_path / "live4", correction="recompute")
    with LiveMonitor(tmp_path / "live5", scaling_map=map_file) as monitor:  # none given: bypass, said so
        assert "correction assumed: bypass" in monitor.step(0, roll, train)["map"]["verdict"]


# ----------------------------------------------------------------------------- the map file


def test_a_single_curve_file_loads_as_bypass(tmp_path):
    """A scaling.json written before corrections were recorded (no ``correction`` anywhere) is a bypass curve."""
    legacy = {"metric": "rollout_corr/k3_kl", "status": "fitted", "horizon_range": [8.0, 64.0], "alpha": 1.0,
              "log10_prefactor": math.log10(0.8), "replicates": [], "horizons": [], "curve": "all",
              "curves": [{"curve": "all", "status": "fitted"}]}
    (tmp_path / "old.json").write_text(json.dumps(legacy))
    m = load_map(tmp_path / "old.json")
    assert [c["correction"] for c in m["curves"]] == ["bypass"]
    assert m["curves"][0]["horizon_range"] == [8.0, 64.0]
    assert place_on_map(m, 1e-3, 16.0, "bypass")["threshold_50"] == pytest.approx(0.05)
    legacy["curve"] = "algorithm.old_logprobs=recompute"
    (tmp_path / "old_r.json").write_text(json.dumps(legacy))
    assert [c["correction"] for c in load_map(tmp_path / "old_r.json")["curves"]] == ["recompute"]


def test_build_map_one_curve_per_correction(tmp_path):
    m = _two_correction_map(tmp_path)
    assert [c["correction"] for c in m["curves"]] == ["bypass", "recompute"]
    assert m["correction"] == "bypass" and m["status"] == "fitted"  # the top level stays the bypass curve
    assert all("shape" in c for c in m["curves"])
    with pytest.raises(ValueError, match=r"two sources hold correction 'bypass' at task\.max_len = 8"):
        build_map([tmp_path / "bypass" / "scaling.json", tmp_path / "map.json"])
    dup = json.loads((tmp_path / "map.json").read_text())
    dup["curves"].append(dict(dup["curves"][0]))
    (tmp_path / "dup.json").write_text(json.dumps(dup))
    with pytest.raises(ValueError, match="has two curves for correction 'bypass'"):
        load_map(tmp_path / "dup.json")


def test_build_map_cli(tmp_path, capsys):
    _two_correction_map(tmp_path)
    out = tmp_path / "built.json"
    files = [str(tmp_path / "bypass" / "scaling.json"), str(tmp_path / "recompute" / "scaling.json")]
    assert build.main(["build-map", str(out), *files]) == 0
    built = json.loads(out.read_text())
    assert built["provenance"]["made_by"] == f"python -m vexact.map build-map {out} {' '.join(files)}"
    assert "bypass (fitted, 4 horizons); recompute (bounds_only, 3 horizons)" in capsys.readouterr().out
    assert build.main(["build-map", str(out), str(tmp_path / "absent.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: map file not found") and len(err.strip().splitlines()) == 1
    # a filter or a detector with map files only: nothing to filter or judge again (each was recorded as applied)
    assert build.main(["build-map", str(out), *files, "--only", "task.max_len=8"]) == 2
    assert capsys.readouterr().err == ("error: --only applies to the runs of sweep directories, and none was given "
                                       "(only map files): nothing would be filtered or judged again\n")
    assert build.main(["shape", str(tmp_path)]) == 2  # a folder: was "map file not found"
    assert capsys.readouterr().err == (f"error: '{tmp_path}' is a directory: give a map file (a sweep's "
                                       "report/scaling.json, or build-map's)\n")


@pytest.mark.slow
def test_the_shipped_map_is_what_its_command_builds_from_the_kept_logs(tmp_path, monkeypatch):
    """The shipped map's ``made_by`` (the map itself, then the sweeps it names), run on the kept logs of those sweeps
    (docs/results/data), rebuilds it exactly but for ``made_by``'s output path: a wording change in what the build
    writes (a horizon's note) no longer leaves the shipped file behind unnoticed."""
    import shlex
    import tarfile

    data = Path(__file__).resolve().parents[2] / "docs" / "results" / "data"
    shipped = json.loads(verdict.DEFAULT_MAP.read_text())
    argv = shlex.split(shipped["provenance"]["made_by"])
    assert argv[:6] == ["python", "-m", "vexact.map", "build-map", "vexact/map/default_map.json",
                        "vexact/map/default_map.json"]
    sweeps = argv[6:]
    for sweep in sweeps:  # its own tarball, else the one that holds it (a control sweep beside its sweep)
        name = Path(sweep).name
        tarball = data / f"{name}.tar.gz"
        if not tarball.is_file():
            tarball = next(t for t in sorted(data.glob("*.tar.gz"))
                           if any(m.split("/")[0] == name for m in tarfile.open(t).getnames()))
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp_path / "runs" / "sweeps", filter="data")
    (tmp_path / argv[5]).parent.mkdir(parents=True)  # the input under its own path: the provenance names it
    (tmp_path / argv[5]).write_text(verdict.DEFAULT_MAP.read_text())
    monkeypatch.chdir(tmp_path)
    assert build.main(["build-map", "rebuilt.json", argv[5], *sweeps]) == 0
    rebuilt = json.loads((tmp_path / "rebuilt.json").read_text())
    for m in (rebuilt, shipped):
        m["provenance"].pop("made_by")
    assert rebuilt == shipped


def test_the_shipped_map_is_made_by_build_map():
    m = load_map()
    # the last build gave the held-length sweeps' directories again, and the corrections at L = 500 (held task):
    # their horizons were refitted from the runs, the map before it kept its other curves; the corrections sweep
    # (L = 4, 16, 80) is given too, so its one-dose-level horizons are refitted to no bound, not carried over; and
    # the MoE routing sweeps, so their curves' threshold intervals are refitted with the current method too
    assert m["provenance"]["made_by"] == ("python -m vexact.map build-map vexact/map/default_map.json "
                                          "vexact/map/default_map.json runs/sweeps/horizon_scaling_held_control "
                                          "runs/sweeps/horizon_scaling_held_sweep "
                                          "runs/sweeps/horizon_scaling_long_sweep "
                                          "runs/sweeps/horizon_scaling_held_corrections_sweep "
                                          "runs/sweeps/horizon_scaling_corrections_sweep "
                                          "runs/sweeps/moe_routing_strong_sweep runs/sweeps/moe_routing_sweep")
    corrections = [c["correction"] for c in m["curves"] if c["source"] == "logit_scale"]
    assert corrections[:3] == ["bypass", "recompute", "token_tis"]  # then the corrections sweep's later rounds
    assert verdict.map_sources(m)[0] == "logit_scale"  # the default source: a placement without one uses it
    routing = verdict.curve_for(m, "bypass", "routing_flip:near_tie")  # MoE routing: its own curve, one horizon
    assert routing["status"] == "single_horizon" and routing["horizons"][0]["status"] == "fitted"
    rebuilt = build_map([verdict.DEFAULT_MAP])  # the command is idempotent on its own output
    assert rebuilt["curves"] == json.loads(verdict.DEFAULT_MAP.read_text())["curves"]
    placed = place_on_map(m, 4.98e-5, 1000.0, "bypass")
    law_at_1000 = 10 ** (m["log10_prefactor"] - m["alpha"] * 3.0)  # docs/reference/map.md's example: the law at T
    assert placed["threshold_50"] == pytest.approx(law_at_1000, rel=1e-12)
    assert placed["range_low"] <= law_at_1000 <= placed["range_high"]
    # the example's k3 lies below the range's low end but within a decade of it, so it reads "near" (it read "far
    # below" before L = 640's second seeds widened the range); a decade lower reads "far below", and the law's own
    # threshold at that T "near"
    assert placed["range_low"] / 10 <= placed["k3"] < placed["range_low"] and placed["verdict"].startswith("near")
    assert place_on_map(m, placed["range_low"] / 20, 1000.0, "bypass")["verdict"].startswith("far below")
    assert place_on_map(m, law_at_1000, 1000.0, "bypass")["verdict"].startswith("near")
    for correction in ("recompute", "token_tis"):  # the corrections sweep (T <= 31) collapsed none: bounds there
        curve = next(c for c in m["curves"] if c["correction"] == correction)
        assert curve["status"] == "bounds_only"
        statuses = [h["status"] for h in curve["horizons"]]
        # L = 4, 16 (T = 7, 17: two doses each); L = 80 (T = 28) ran one dose: no bound
        assert statuses[:3] == ["above_range", "above_range", "insufficient"]
        placed = place_on_map(m, 0.025, 8.0, correction)
        assert placed["threshold_50"] is None and placed["correction"] == correction
        assert "no collapse measured up to" in placed["verdict"] and "near" not in placed["verdict"]
    # at L = 500 (held task): recompute collapsed its three seeds at the larger dose and held its one run at the smaller
    # (a threshold between them; the bootstrap over its three seeds leaves the interval's lower end open: a resample
    # of seed 1 or 2 alone collapsed at every dose; four runs at two doses do not bound it above either: the profile
    # likelihood stays within its 95% cut out to the larger dose); token TIS and IcePop held both seeds at the larger
    # dose and their one run at a third (bounds)
    recompute, token_tis, icepop = ([h for h in next(c for c in m["curves"] if c["correction"] == name
                                                     and c["source"] == "logit_scale" and c["policy_lag"] == 0)[
        "horizons"] if h["horizon_value"] == 500] for name in ("recompute", "token_tis", "icepop"))
    assert [h["status"] for h in recompute + token_tis + icepop] == ["fitted", "above_range", "above_range"]
    assert (recompute[0]["runs"], recompute[0]["collapsed"], recompute[0]["runs_per_dose"]) == (4, 3, [1, 3])
    assert token_tis[0]["runs"] == icepop[0]["runs"] == 3
    assert token_tis[0]["runs_per_dose"] == icepop[0]["runs_per_dose"] == [2, 1]
    assert not any(h["single_run_per_dose"] for h in recompute + token_tis + icepop)
    assert recompute[0]["ci_low"] is None and "lower end lies below the tested range" in recompute[0]["note"]
    assert recompute[0]["ci_high"] is None and "profile-likelihood interval (open" in recompute[0]["note"]
    assert recompute[0]["bracket_low"] < recompute[0]["threshold_50"] < recompute[0]["bracket_high"]
    # an open lower end: every k3 below the interval's top reads "near", never "below"
    for k3 in (recompute[0]["bracket_low"] / 3, recompute[0]["threshold_50"]):
        near = place_on_map(m, k3, recompute[0]["horizon"], "recompute")["verdict"]
        assert near.startswith("near the measured collapse range") and "(one run per dose)" not in near
    for horizon, name in ((token_tis[0], "token_tis"), (icepop[0], "icepop")):
        held = place_on_map(m, horizon["lower_bound"] / 2, horizon["horizon"], name)["verdict"]
        assert held.startswith("below every level tested") and "(one run per dose)" not in held  # two seeds at one


def test_a_below_range_bound_says_how_many_of_its_runs_collapsed():
    """A horizon whose logistic fit puts the 50% point below its smallest dose, though a run held there (L = 640 held:
    3 of 4 collapsed), is not worded "every run collapsed"; a horizon where every run collapsed still is."""
    some = {"horizon": 513.0, "horizon_value": 640, "status": "below_range", "upper_bound": 7.66e-4, "runs": 4,
            "collapsed": 3, "single_run_per_dose": False}
    every = {**some, "collapsed": 4}
    assert verdict.bound_lines({"horizons": [some]}) == [
        "threshold below k3 0.00077 at T 513 (3 of 4 runs collapsed, the fitted 50% point lies below every dose "
        "tested)"]
    assert verdict.bound_lines({"horizons": [every]}) == [
        "threshold below k3 0.00077 at T 513 (every run collapsed, from the smallest dose tested)"]


def test_a_measured_bound_wins_over_the_law_near_it(tmp_path):
    """The law (α = 1 through T = 8 .. 64) is not fitted to the horizons that give only a bound, and may cross them:
    every run at T = 256 collapsed from k3 0.001, where the law says 0.0031; nothing collapsed up to k3 5 at T = 2,
    where it says 0.4. Near those horizons the verdict is the measurement's, with the assumption it rests on."""
    points = _bypass_points(tmp_path)
    points += [_point(tmp_path, f"b_L256_{f}", 256, 256.0, 0.001 * f, True, seed,
                          {"inject.value": f}) for seed in SEEDS for f in (1, 2, 4)]
    points += [_point(tmp_path, f"b_L2_{f}", 2, 2.0, 5.0 * f, False, seed,
                          {"inject.value": f}) for seed in SEEDS for f in (0.25, 0.5, 1)]
    write_scaling(_sweep(tmp_path, points, ["task.max_len"]), tmp_path)
    m = load_map(tmp_path / "scaling.json")
    assert m["status"] == "fitted" and m["alpha"] == pytest.approx(1.0, abs=0.05) and m["bounds_violated"] == [2, 256]

    above = verdict.placement(m, 0.002, 300.0, "bypass")  # the law alone: near its threshold 0.0027
    assert above["verdict"].startswith("above the measured collapse range: every run collapsed from k3 0.001 at T 256")
    assert above["threshold_50"] == pytest.approx(0.1 * 8 / 300, rel=0.05)  # the law's number is still reported
    below = verdict.placement(m, 1e-5, 300.0, "bypass")  # the law alone: far below
    assert below["verdict"].startswith("below k3 0.001 (100x), where runs collapsed")
    assert "cannot say how far below" in below["verdict"] and "far below the measured" not in below["verdict"]
    assert verdict.COLLAPSE_BOUND_ASSUMPTION in "\n".join(verdict.map_lines(below, m))
    assert verdict.placement(m, 0.0, 300.0, "bypass")["verdict"].startswith("below k3 0.001, where runs collapsed")
    far = verdict.placement(m, 1e-5, 100.0, "bypass")  # T = 256 is more than 1.5x longer: the law answers
    assert far["verdict"] == ("far below the measured collapse range; curve: bypass: old log-probs from the rollout, "
                              "no correction")
    survived = verdict.placement(m, 1.0, 2.0, "bypass")  # the law alone: above its threshold 0.4
    assert survived["verdict"].startswith("below every level tested: no collapse measured up to k3 5 at T 2.0")
    assert verdict.BOUND_ASSUMPTION in "\n".join(verdict.map_lines(survived, m))
    untested = verdict.placement(m, 6.0, 2.0, "bypass")  # above the survival, and the law crosses it: unknown
    assert untested["verdict"].startswith("not placed: your k3 is above the largest level tested without collapse")


def test_a_threshold_measured_nearer_the_users_t_wins_over_a_neighbours_bound():
    """The shipped bypass curve's two longest horizons: a threshold 0.0021 [0.0013, 0.0032] fitted at T = 433 (3 of 3
    runs held at k3 1.2e-3), and T = 516, where 5 of 6 runs collapsed from k3 0.00077 (a bound: the fit puts the 50%
    point below that dose though one run held there). At T = 433, and wherever T = 433 is as near as T = 516 or
    nearer, the law fitted to it answers, not the neighbour's bound; nearer T = 516 the bound answers, and never as
    "above the measured collapse range" where a run held."""
    fitted = {"horizon_value": 500, "horizon": 433.0, "status": "fitted", "threshold_50": 0.0021, "ci_low": 0.0013,
              "ci_high": 0.0032, "runs": 7, "collapsed": 4}
    bound = {"horizon_value": 640, "horizon": 516.0, "status": "below_range", "upper_bound": 7.7e-4, "runs": 6,
             "collapsed": 5}
    prefactor = math.log10(0.0021 * 433)  # α = 1 through the fitted horizon's threshold
    curve = {"curve": "bypass", "correction": "bypass", "source": "logit_scale", "status": "fitted",
             "log10_prefactor": prefactor, "alpha": 1.0, "horizon_range": [8.0, 516.0], "horizons": [fitted, bound],
             "replicates": [[prefactor + d / 100, 1.0] for d in (-4, -2, 0, 2, 4)] * 40}
    for k3 in (8e-4, 1.2e-3, 2e-3):
        for t in (433.0, 470.0):  # 470: ln(470/433) < ln(516/470)
            assert place_on_map(curve, k3, t, "bypass")["verdict"].startswith("near the measured collapse range;")
    held = place_on_map(curve, 1.2e-3, 500.0, "bypass")["verdict"]  # T = 516 is the nearer: its bound answers
    assert held.startswith("above the 50% collapse point, which the fit puts below k3 0.00077 though not every run "
                           "collapsed: 5 of 6 runs collapsed from k3 0.00077 at T 516 (bypass)")
    assert "above the measured collapse range" not in held
    every = {**curve, "horizons": [fitted, {**bound, "collapsed": 6}]}
    assert place_on_map(every, 1.2e-3, 500.0, "bypass")["verdict"].startswith(
        "above the measured collapse range: every run collapsed from k3 0.00077 at T 516 (bypass)")
    # a curve without a law: its one threshold at T = 400 answers at T = 410, not a no-collapse bound at T = 500
    lawless = {"horizons": [{"status": "fitted", "horizon": 400.0, "threshold_50": 0.004, "ci_low": 0.002,
                             "ci_high": 0.008, "runs": 6, "collapsed": 3},
                            {"status": "above_range", "horizon": 500.0, "lower_bound": 0.05, "runs": 3,
                             "collapsed": 0}]}
    assert verdict._bound_verdict(lawless, "recompute", 0.01, 410.0, (400.0, 500.0)).startswith(
        "above the measured collapse range: 50% collapse threshold k3 0.004 [0.002, 0.008] measured at T 400")
    assert verdict._bound_verdict(lawless, "recompute", 0.01, 480.0, (400.0, 500.0)).startswith(
        "below every level tested: no collapse measured up to k3 0.05 at T 500")


def test_one_dose_level_near_the_users_t_is_said_but_never_placed(tmp_path):
    """A recompute curve of bounds at T <= 28 and one run at T = 358 that collapsed at its one dose (k3 0.02): too few
    for a threshold or a bound (``insufficient``), so no verdict rests on it, but a verdict within 1.5x of T = 358
    says what was measured there; further away it says nothing of it."""
    points = _recompute_points(tmp_path, overrides={"algorithm.old_logprobs": "recompute"})
    points.append(_point(tmp_path, "r_L500_1", 500, 358.0, 0.02, True, 0, {"algorithm.old_logprobs": "recompute"}))
    write_scaling(_sweep(tmp_path, points, ["task.max_len"]), tmp_path)
    m = load_map(tmp_path / "scaling.json")
    curve = verdict.find_curve(m, "recompute")
    one = next(h for h in curve["horizons"] if h["horizon_value"] == 500)
    assert one["status"] == "insufficient" and one["dose_min"] == 0.02 and one["runs"] == one["collapsed"] == 1
    near = verdict.placement(m, 0.005, 400.0, "recompute")
    assert near["threshold_50"] is None and near["verdict"].startswith("no verdict at this horizon")
    assert ("measured but not placed: 1 of 1 run(s) collapsed at realised k3 0.02 at T 358 (recompute), one dose "
            "level: too few for a threshold or a bound") in near["verdict"]
    assert "measured but not placed" not in verdict.placement(m, 0.005, 30.0, "recompute")["verdict"]
    assert "measured but not placed" not in verdict.placement(m, 0.005, 1000.0, "recompute")["verdict"]


def test_a_law_whose_interval_spans_decades_gives_no_verdict():
    """Two horizons with wide intervals fit a line whose interval at a far T spans many decades: "near" would be
    true of any k3 there, so the verdict says the curve does not pin the threshold (and the law's numbers stay)."""
    curve = {"curve": "bypass", "correction": "bypass", "source": "logit_scale", "status": "fitted",
             "log10_prefactor": -0.5, "alpha": 1.0, "horizon_range": [6.0, 48.0], "horizons": [],
             "replicates": [[-0.5 + d, 1.0 + d / 2] for d in (-4, -2, 0, 2, 4)] * 40}
    wide = place_on_map(curve, 1e-4, 1000.0, "bypass")
    assert wide["verdict"].startswith("no verdict: the law's 95% interval at this T spans k3")
    assert wide["threshold_50"] == pytest.approx(10 ** -3.5) and wide["ci_high"] / wide["ci_low"] > 1e3
    narrow = {**curve, "replicates": [[-0.5 + d / 100, 1.0] for d in (-4, -2, 0, 2, 4)] * 40}
    assert place_on_map(narrow, 1e-6, 1000.0, "bypass")["verdict"].startswith("far below")


# ----------------------------------------------------------------------------- the shape of the law


def _fitted(values: dict[float, float]) -> list[dict]:
    return [{"status": "fitted", "horizon": t, "threshold_50": v} for t, v in values.items()]


def test_shape_comparison_tells_a_floor_from_a_power_law():
    ts = (8, 16, 32, 64, 128, 256)
    floor = compare_shapes(_fitted({t: 0.02 + 0.5 / t for t in ts}))
    power = compare_shapes(_fitted({t: 0.5 * t ** -0.6 for t in ts}))
    assert floor["preferred"] == "saturating" and floor["delta_aic"] > 2
    assert floor["saturating"]["floor"] == pytest.approx(0.02, rel=1e-3)
    assert floor["saturating"]["loo_rmse"] < floor["power"]["loo_rmse"]
    assert power["preferred"] == "power" and power["delta_aic"] < -2
    assert power["power"]["alpha"] == pytest.approx(0.6, abs=1e-9)
    assert power["power"]["loo_rmse"] < power["saturating"]["loo_rmse"]
    assert "the data prefer the saturating shape" in floor["note"]
    too_few = compare_shapes(_fitted({8: 0.1, 16: 0.05}) + [{"status": "above_range", "horizon": 32}])
    assert too_few["status"] == "too_few" and "needs at least 3" in too_few["note"]


def test_a_bound_tests_each_shape():
    """A horizon with only a bound stays out of both fits and says which shape it rules out: a floor at k3 0.02
    cannot pass under an upper bound of 0.015 at T = 1000, where the power law fitted to the same points (α 0.38)
    is at 0.011; a lower bound of 1e-4 rules out neither."""
    ts = (8, 16, 32, 64, 128, 256)
    below = {"status": "below_range", "horizon": 1000, "horizon_value": 1000, "upper_bound": 0.015}
    above = {"status": "above_range", "horizon": 900, "horizon_value": 900, "lower_bound": 1e-4}
    shapes = compare_shapes(_fitted({t: 0.02 + 0.5 / t for t in ts}) + [below, above])
    assert shapes["saturating"]["bounds_violated"] == [1000] and shapes["power"]["bounds_violated"] == []
    assert shapes["saturating"]["floor"] == pytest.approx(0.02, rel=1e-3)  # the bounds did not enter the fit
    assert "the bound at T 900 (threshold above k3 0.0001): both shapes respect it" in shapes["note"]
    assert "the bound at T 1000 (threshold below k3 0.015): it rules out the saturating shape" in shapes["note"]


def test_shape_is_in_scaling_json_and_printed(tmp_path, capsys):
    result = fit.scaling(_sweep(tmp_path, _bypass_points(tmp_path), ["task.max_len"]))
    assert result["shape"]["status"] == "compared" and result["curves"][0]["shape"] == result["shape"]
    assert build.main(["shape"]) == 0
    bypass = verdict.curve_for(verdict.load_map(None), "bypass")  # the shipped map's, as the command prints it
    assert capsys.readouterr().out.startswith(f"bypass / logit_scale: {bypass['shape']['note'][:40]}")


def test_every_verl_preset_has_one_name():
    """Each of verl's presets, as an algorithm.rollout_correction block: its bypass_mode picks the prefix, its plan
    the method; a plan no registry method spells is named from the plan (never silently a registry name)."""
    expected = {
        "disabled": "recompute", "decoupled_token_is": "token_tis", "decoupled_seq_is": "seq_tis",
        "decoupled_token_icepop": "icepop", "decoupled_seq_is_rs": "seq_mis", "decoupled_geo_rs": "geo_rs",
        "decoupled_geo_rs_seq_tis": "verl[rollout_is=sequence,rollout_rs=seq_mean_k1]",
        "decoupled_geo_rs_token_tis": "verl[rollout_is=token,rollout_rs=seq_mean_k1]",
        "decoupled_k3_rs": "verl[rollout_rs=seq_mean_k3]",
        "decoupled_k3_rs_seq_tis": "verl[rollout_is=sequence,rollout_rs=seq_mean_k3]",
        "decoupled_k3_rs_token_tis": "verl[rollout_is=token,rollout_rs=seq_mean_k3]",
        "bypass_ppo_clip": "bypass", "bypass_ppo_clip_geo_rs": "bypass_geo_rs",
        "bypass_ppo_clip_k3_rs": "bypass_verl[rollout_rs=seq_mean_k3]", "bypass_pg_is": "bypass_seq_tis",
        "bypass_pg_token_icepop": "bypass_icepop", "bypass_pg_geo_rs": "bypass_geo_rs",
        "bypass_pg_geo_rs_seq_tis": "bypass_verl[rollout_is=sequence,rollout_rs=seq_mean_k1]",
        "bypass_pg_geo_rs_token_tis": "bypass_verl[rollout_is=token,rollout_rs=seq_mean_k1]",
    }
    assert set(expected) == set(PRESETS)
    for preset, name in expected.items():
        assert correction_from_config({"algorithm": {"rollout_correction": {"preset": preset}}}) == name, preset


@pytest.mark.parametrize("old_logprobs, method, expected", [("rollout", "none", "bypass"),
                                                            ("recompute", "none", "recompute"),
                                                            ("recompute", "token_tis", "token_tis")])
def test_a_saved_run_config_names_its_correction(tmp_path, old_logprobs, method, expected):
    """What ``vexact report`` reads from each point: the config.yaml a real run saved (every key, as written)."""
    from vexact.rl.config import config_from_dict, save_config

    cfg = config_from_dict({}, [f"algorithm.old_logprobs={old_logprobs}", f"correction.method={method}"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert correction_from_config(saved, "config.yaml") == expected


def test_a_single_horizon_interval_open_on_one_side_bounds_nothing_there():
    """A one-horizon threshold whose bootstrap interval is open below (a seed resample collapsed at every dose, as
    recompute's at L = 500) reads "near" however far below the threshold a k3 lies, never "far below"; one open above
    never reads "above". The verdict quotes the open end."""
    def curve(lo, hi):
        return {"horizons": [{"status": "fitted", "horizon": 400.0, "threshold_50": 0.004, "ci_low": lo,
                              "ci_high": hi, "runs": 3, "collapsed": 2, "single_run_per_dose": False}]}

    open_below = curve(None, 0.016)
    for k3 in (1e-6, 1e-3, 0.01):
        assert verdict._bound_verdict(open_below, "recompute", k3, 400.0, (400.0, 400.0)).startswith(
            "near the measured collapse range: 50% collapse threshold k3 0.004 [open below, 0.016]")
    assert verdict._bound_verdict(open_below, "recompute", 0.02, 400.0, (400.0, 400.0)).startswith("above")
    open_above = curve(0.002, None)
    assert verdict._bound_verdict(open_above, "recompute", 1.0, 400.0, (400.0, 400.0)).startswith(
        "near the measured collapse range: 50% collapse threshold k3 0.004 [0.002, open above]")
    assert verdict._bound_verdict(open_above, "recompute", 1e-4, 400.0, (400.0, 400.0)).startswith("far below")
    closed = curve(0.002, 0.008)  # both ends: as before
    assert [verdict._bound_verdict(closed, "recompute", k3, 400.0, (400.0, 400.0)).split(" the ")[0]
            for k3 in (1e-4, 0.005, 0.01)] == ["far below", "near", "above"]


def test_a_single_horizon_interval_open_at_both_ends_places_nothing():
    """A one-horizon threshold whose bootstrap interval is open at both ends (4 doses x 3 seeds: FFTT, FFFF, TTTT)
    was read as the point interval [threshold, threshold]: "far below" at k3 1e-4, where one of three seeds
    collapsed. Now it reads "near" at any k3 and quotes both open ends."""
    from vexact.sweeps.dose_response import fit_threshold

    doses, pattern = (1e-4, 1e-3, 1e-2, 1e-1), {0: (0, 0, 1, 1), 1: (0, 0, 0, 0), 2: (1, 1, 1, 1)}
    t = fit_threshold([(d, bool(c), s) for s, cs in pattern.items() for d, c in zip(doses, cs)])
    assert t["status"] == "fitted" and t["ci_low"] is None and t["ci_high"] is None
    curve = {"horizons": [{"horizon_value": 12, "horizon": 11.0, "runs_per_dose": [3, 3, 3, 3],
                           "single_run_per_dose": False, **t}]}
    for k3 in (1e-6, 1e-4, t["threshold_50"], 5e-2, 1.0):
        said = verdict._bound_verdict(curve, "bypass", k3, 11.0, (11.0, 11.0))
        assert said.startswith("near the measured collapse range: 50% collapse threshold k3 "), said
        assert "[open below, open above]" in said
