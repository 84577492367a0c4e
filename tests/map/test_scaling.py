"""Collapse scaling: the threshold-vs-horizon law, bounds, bad input, and placing a user on the map."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import resource
from pathlib import Path

import pytest

from vexact.map.fit import fit_law, scaling
from vexact.map.scaling_report import OPEN_END_SPAN, interval_drawn, write_scaling
from vexact.map.shapes import compare_shapes
from vexact.map.verdict import MAP_KEYS, load_map, place_on_map
from vexact.records.atomic import WriteFailed
from vexact.sweeps.dose_response import CI_METHOD
from vexact.sweeps.sweep_data import PointData, SweepData

SEEDS = (0, 1, 2, 3)
FACTORS = (0.25, 0.5, 2.0, 4.0)  # doses around the true threshold: the two below survive, the two above collapse


def _point(tmp: Path, length: int, horizon: float | None, dose: float | None, collapsed: bool, seed: int,
           extra: dict | None = None) -> PointData:
    overrides = {"task.max_len": length, "seed": seed, **(extra or {})}
    collapse = {"collapsed": collapsed}
    if dose is not None:
        collapse["mean_k3_kl_before_collapse"] = dose
    metrics = [{"step": s, "response_length/mean": horizon} for s in range(3)] if horizon is not None else [
        {"step": 0}]
    name = ",".join(f"{k}={v}" for k, v in overrides.items())
    return PointData(name, tmp / name, overrides, "completed", summary={"status": "completed", "collapse": collapse},
                     metrics=metrics)


def _sweep(tmp: Path, alpha: float, lengths=(8, 16, 32, 64), thr8: float = 1e-1, extra: dict | None = None,
           safe_at: tuple[int, ...] = ()) -> SweepData:
    """Points whose true 50% threshold is thr8 · (T/8)^(−alpha), T = L (+3 tokens of answer, see below)."""
    points = []
    for length in lengths:
        t = float(length)
        thr = thr8 * (t / 8.0) ** (-alpha)
        for seed in SEEDS:
            for f in FACTORS:
                collapsed = f > 1 and length not in safe_at
                points.append(_point(tmp, length, t, thr * f * (1 + 0.01 * seed), collapsed, seed,
                                     {"inject.value": f, **(extra or {})}))
    keys = ["task.max_len", "inject.value"] + list(extra or {})
    return SweepData(tmp, "synthetic", {k: [] for k in keys + ["seed"]}, keys, points)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.0])
def test_fit_recovers_a_known_exponent(tmp_path, alpha):
    result = scaling(_sweep(tmp_path, alpha))
    assert result["status"] == "fitted", result["note"]
    assert result["alpha"] == pytest.approx(alpha, abs=0.05)
    assert result["alpha_ci_low"] <= alpha <= result["alpha_ci_high"]
    assert [h["status"] for h in result["horizons"]] == ["fitted"] * 4
    for h in result["horizons"]:  # per-horizon threshold inside its bracket [0.5, 2] x the true one
        true = 0.1 * (h["horizon"] / 8) ** (-alpha)
        assert 0.5 * true <= h["threshold_50"] <= 2.2 * true
        assert h["ci_low"] <= h["threshold_50"] <= h["ci_high"]


def test_fit_distinguishes_exponents(tmp_path):
    """Counter-case: data made with alpha = 2 is not read as alpha = 1 (the test above can fail)."""
    result = scaling(_sweep(tmp_path, 2.0))
    assert not result["alpha_ci_low"] <= 1.0 <= result["alpha_ci_high"]


def test_bounds_enter_as_bounds(tmp_path):
    """A horizon where nothing collapsed gives a lower bound, never a number in the fit."""
    result = scaling(_sweep(tmp_path, 1.0, safe_at=(64,)))
    by_len = {h["horizon_value"]: h for h in result["horizons"]}
    assert by_len[64]["status"] == "above_range" and by_len[64]["threshold_50"] is None
    assert result["status"] == "fitted" and "only a bound" in result["note"]
    assert result["alpha"] == pytest.approx(1.0, abs=0.05)  # from the three fitted horizons alone
    assert by_len[64]["lower_bound"] > 0


def test_bounds_only_gives_bounds_on_alpha(tmp_path):
    """One fitted horizon and one bound: no exponent, but a one-sided bound on it."""
    result = scaling(_sweep(tmp_path, 1.0, lengths=(8, 64), safe_at=(64,)))
    assert result["status"] == "bounds_only" and result["alpha"] is None
    # thr(64) > its largest safe dose 4·thr(64)·1.03 (true alpha 1) -> alpha < log(thr8 / that) / log(8)
    assert result["alpha_upper_bound"] is not None and result["alpha_lower_bound"] is None
    assert result["alpha_upper_bound"] < 1.0 and "α ≤" in result["note"]


def test_bad_input_one_sentence_each(tmp_path):
    no_key = _sweep(tmp_path, 1.0)
    for p in no_key.points:
        p.overrides.pop("task.max_len")
    r = scaling(no_key)
    assert r["status"] == "no_horizon" and "task.max_len" in r["note"] and r["alpha"] is None
    files, line = write_scaling(no_key, tmp_path)
    assert files == [] and not (tmp_path / "scaling.json").exists() and line.startswith("scaling: the sweep sets no")

    r = scaling(_sweep(tmp_path, 1.0, lengths=(16,)))
    assert r["status"] == "single_horizon" and r["alpha"] is None and "at least two" in r["note"]

    missing = _sweep(tmp_path, 1.0)
    for p in missing.points:
        p.metrics = [{"step": 0}]
    r = scaling(missing)
    assert r["status"] == "insufficient" and r["alpha"] is None and "response_length/mean" in r["note"]

    assert fit_law([])["status"] == "insufficient"


def test_curves_split_by_mode_and_primary_is_bypass(tmp_path):
    a = _sweep(tmp_path, 1.0, extra={"algorithm.old_logprobs": "recompute"})
    b = _sweep(tmp_path, 2.0, extra={"algorithm.old_logprobs": "rollout"})
    data = SweepData(tmp_path, "two", a.grid, a.group_keys, a.points + b.points)
    r = scaling(data)
    assert len(r["curves"]) == 2
    assert r["curve"] == "correction=bypass" and r["correction"] == "bypass"
    assert r["alpha"] == pytest.approx(2.0, abs=0.05)
    assert [c["correction"] for c in r["curves"]] == ["recompute", "bypass"]


def test_write_scaling_files(tmp_path):
    files = write_scaling(_sweep(tmp_path, 1.0), tmp_path)[0]
    assert [f.name for f in files] == ["scaling.json", "scaling.png"]
    data = json.loads(files[0].read_text())
    for key in ("alpha", "alpha_ci_low", "alpha_ci_high", "metric", "status", "note", "horizons"):
        assert key in data
    assert all("threshold_50" in h and "ci_low" in h and "ci_high" in h for h in data["horizons"])



@contextlib.contextmanager
def file_size_limit(limit: int):
    """A real ``ulimit -f`` (RLIMIT_FSIZE, soft) in this process: a write past ``limit`` bytes fails with EFBIG (Python
    ignores SIGXFSZ). Restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _failing_savefig(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Figure.savefig`` that writes half the image and then fails as a full disk does."""
    from matplotlib.figure import Figure

    real = Figure.savefig

    def half_then_full(fig, target, **kwargs):
        buffer = io.BytesIO()
        real(fig, buffer, **{**kwargs, "format": "png"})
        Path(target).write_bytes(buffer.getvalue()[:buffer.tell() // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_full)


@pytest.mark.parametrize("failing", ("scaling.json", "scaling.png"))
def test_a_failed_rewrite_leaves_the_previous_map_and_names_the_file(tmp_path, failing, monkeypatch):
    """scaling.json and scaling.png were written in place: readers (load_map, vexact compare --map) could see half a
    map, and a write that failed (a file-size limit, a full disk) destroyed the previous good one with an error that
    named no file. Both are now published whole: a failure is WriteFailed naming the file, the old file intact."""
    files = write_scaling(_sweep(tmp_path, 1.0), tmp_path)[0]
    before = {f.name: f.read_bytes() for f in files}
    data = _sweep(tmp_path, 2.0)  # another map, to be written over the first
    with contextlib.ExitStack() as stack:
        if failing == "scaling.json":  # a real file-size limit below the map's size
            stack.enter_context(file_size_limit(len(before["scaling.json"]) // 2))
        else:
            _failing_savefig(monkeypatch)
        with pytest.raises(WriteFailed) as failed:
            write_scaling(data, tmp_path)
    assert failed.value.filename == str(tmp_path / failing)
    assert str(failed.value).startswith(f"cannot write {tmp_path / failing}: ")
    assert (tmp_path / failing).read_bytes() == before[failing]
    assert not list(tmp_path.glob(".*.tmp"))
    load_map(tmp_path / "scaling.json")


# ----------------------------------------------------------------------------- the map


def _map(tmp_path: Path, alpha: float = 1.0) -> dict:
    files = write_scaling(_sweep(tmp_path, alpha), tmp_path)[0]
    return load_map(files[0])


def test_place_on_map_known_k3_and_length(tmp_path):
    m = _map(tmp_path)
    # the law: thr(T) ≈ 0.1 (T/8)^-1 -> at T = 800, ≈ 1e-3
    p = place_on_map(m, 1e-5, 800.0)
    assert p["threshold_50"] == pytest.approx(1e-3, rel=0.15)
    assert p["ratio"] == pytest.approx(1e-5 / p["threshold_50"])
    assert p["verdict"].startswith("far below the measured collapse range; extrapolated")
    assert p["extrapolation_factor"] == pytest.approx(800.0 / 64.0)
    assert p["ci_low"] < p["threshold_50"] < p["ci_high"]
    assert place_on_map(m, 5e-4, 800.0)["verdict"].startswith("near the measured collapse range;")
    assert place_on_map(m, 1e-1, 800.0)["verdict"].startswith("above the measured collapse range;")
    inside = place_on_map(m, 1e-2, 20.0)
    assert inside["extrapolation_factor"] == 1.0
    assert place_on_map(m, 1e-2, 2.0)["extrapolation_factor"] == pytest.approx(4.0)


def test_a_law_without_an_interval_gives_no_verdict(tmp_path):
    """A law fitted to thresholds whose intervals were open has no replicates, so no 95% interval: the verdict
    took the point estimate for both ends ("far below", "above": k3 between 2e-08 .. 2e-08) where it knows nothing
    of the spread."""
    m = _map(tmp_path)
    curves = [c for c in m["curves"] if c.get("status") == "fitted"]
    assert curves
    for curve in curves:
        curve["replicates"] = []
    for k3, horizon in ((1e-5, 800.0), (1e-1, 800.0), (1e-2, 20.0)):
        p = place_on_map(m, k3, horizon)
        assert p["verdict"].startswith("no verdict: the bypass curve's power law has no 95% interval"), p["verdict"]
        assert p["ci_low"] is None and p["range_low"] is None and "anywhere in k3" not in p["verdict"]


def test_place_on_map_bad_input(tmp_path):
    m = _map(tmp_path)
    with pytest.raises(ValueError, match="no response lengths"):
        place_on_map(m, 1e-3, 0.0)
    with pytest.raises(ValueError, match="k3 must be"):
        place_on_map(m, math.nan, 10.0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a scaling.json"):
        load_map(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not found"):
        load_map(tmp_path / "missing.json")


def test_bounds_only_map_says_so(tmp_path):
    files = write_scaling(_sweep(tmp_path, 1.0, lengths=(8, 64), safe_at=(8, 64)), tmp_path)[0]
    m = load_map(files[0])
    p = place_on_map(m, 1e-6, 50.0)  # within 1.5x of the bound at T = 64
    assert p["threshold_50"] is None and p["ratio"] is None
    assert p["verdict"].startswith("below every level tested")
    far = place_on_map(m, 1e-6, 500.0)  # beyond the mapped horizons a bound says nothing without a law
    assert far["verdict"].startswith("no verdict at this horizon") and far["extrapolation_factor"] > 1
    # between the bounds, more than 1.5x from both: the bound at T = 64 is not carried down to T = 30 (the
    # threshold is not monotone in T: the monotone assumption is gone)
    between = place_on_map(m, 1e-6, 30.0)
    assert between["verdict"].startswith("no verdict at this horizon: T = 30 is more than 1.5x from every horizon")
    # the bound D itself ran without collapse: k3 = D is below every level tested (it was "not placed"), above it not
    bound = max(h["lower_bound"] for h in m["curves"][0]["horizons"] if h["horizon"] == 64)
    assert place_on_map(m, bound, 50.0)["verdict"].startswith("below every level tested")
    assert place_on_map(m, bound * 1.01, 50.0)["verdict"].startswith("not placed: your k3 is above the largest level")


def test_a_bound_with_collapses_below_it_is_not_called_safe(tmp_path):
    files = write_scaling(_sweep(tmp_path, 1.0, lengths=(8, 64), safe_at=(8, 64)), tmp_path)[0]
    m = load_map(files[0])
    assert place_on_map(m, 1e-6, 50.0)["verdict"].startswith("below every level tested")
    for h in m["curves"][0]["horizons"]:  # as when the fit puts the 50% point above the doses although one collapsed
        h["collapsed"] = 1
    assert place_on_map(m, 1e-6, 50.0)["verdict"].startswith("unknown")


def test_default_map_loads():
    m = load_map()
    assert m["horizon_range"] and m["status"]
    p = place_on_map(m, 1e-4, 1000.0)
    assert set(p) == set(MAP_KEYS)


def _dump(path: Path, k3_logprobs: list[tuple[list[float], list[float]]]) -> tuple[Path, Path]:
    roll, train = path / "roll.jsonl", path / "train.jsonl"
    with roll.open("w") as r, train.open("w") as t:
        for i, (a, b) in enumerate(k3_logprobs):
            r.write(json.dumps({"id": i, "logprobs": a}) + "\n")
            t.write(json.dumps({"id": i, "logprobs": b}) + "\n")
    return roll, train


def test_compare_map_cli(tmp_path, capsys):
    from vexact.cli import main

    m = tmp_path / "m"
    m.mkdir()
    map_file = write_scaling(_sweep(m, 1.0), m)[0][0]
    # 4 sequences of 100 tokens, r = logp_train - logp_roll = 0.01 on every token: k3 = exp(r) - r - 1
    seqs = [([-1.0] * 100, [-0.99] * 100) for _ in range(4)]
    roll, train = _dump(tmp_path, seqs)
    out = tmp_path / "out.json"
    assert main(["compare", str(roll), str(train), "--map", str(map_file), "--json", str(out), "--verbose"]) == 0
    data = json.loads(out.read_text())["map"]
    assert list(data) == list(MAP_KEYS)
    r = -0.99 - (-1.0)
    assert data["k3"] == pytest.approx(math.exp(r) - r - 1, rel=1e-6)
    assert data["horizon"] == 100.0
    assert data["extrapolation_factor"] == pytest.approx(100.0 / 64.0)
    text = capsys.readouterr().out
    assert "verdict:" in text and "assumptions:" in text


def test_compare_map_dump_without_lengths(tmp_path, capsys):
    from vexact.cli import main

    roll, train = _dump(tmp_path, [([], []), ([], [])])
    assert main(["compare", str(roll), str(train), "--map"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_against_meter(tmp_path):
    """Meter cells bracketing each threshold give the bias ratio there (log-log interpolation); none outside."""
    data = _sweep(tmp_path, 1.0)
    cells = []
    for length in (8, 16, 32, 64):
        thr = 0.1 * (length / 8.0) ** -1.0
        cells += [{"horizon": length, "k3_kl": thr / 10, "bias_ratio": 0.03},
                  {"horizon": length, "k3_kl": thr * 10, "bias_ratio": 0.3}]
    (tmp_path / "meter.json").write_text(json.dumps({"cells": cells}))
    files, _ = write_scaling(data, tmp_path)
    result = json.loads(files[0].read_text())["meter"]
    ratios = [r["bias_ratio_at_threshold"] for r in result["horizons"]]
    assert all(r == pytest.approx(0.1, rel=0.2) for r in ratios), ratios  # midway in log between 0.03 and 0.3
    assert "4 horizons" in result["note"]
    (tmp_path / "meter.json").write_text(json.dumps({"cells": cells[:2]}))
    files, _ = write_scaling(data, tmp_path)
    assert "no comparison" in json.loads(files[0].read_text())["meter"]["note"]


def test_the_horizon_is_measured_over_the_dose_window(tmp_path):
    """A run's T is the mean response length over the steps its dose is (before collapse): a collapsed policy's
    short answers after the collapse step do not shorten the horizon its mismatch acted over."""
    from vexact.map.points import measured_horizon

    lengths = [500.0, 480.0, 460.0, 90.0, 60.0]  # steps 0..4; collapse at step 3
    metrics = [{"step": s, "response_length/mean": t} for s, t in enumerate(lengths)]

    def point(collapse: dict) -> PointData:
        return PointData("p", tmp_path, {}, "completed", summary={"status": "completed", "collapse": collapse},
                         metrics=metrics)

    assert measured_horizon(point({"collapsed": True, "collapse_step": 3})) == pytest.approx(480.0)
    assert measured_horizon(point({"collapsed": False})) == pytest.approx(sum(lengths) / 5)  # no collapse: all
    # an unconfirmed drop is no collapse: its window is the whole run, as its dose's is
    assert measured_horizon(point({"collapsed": False, "collapse_unconfirmed_step": 3})) == pytest.approx(318.0)


# ----------------------------------------------------------------------------- honest intervals (issue AC)


def _horizons(thresholds: dict[float, float], spread: float = 1.3) -> list[dict]:
    """Fitted horizons at T with the given thresholds, each with the interval [thr / spread, thr * spread]."""
    return [{"horizon_value": int(t), "horizon": t, "status": "fitted", "threshold_50": v, "ci_low": v / spread,
             "ci_high": v * spread} for t, v in thresholds.items()]


def test_scatter_about_the_line_widens_the_alpha_interval():
    """Two curves with the same α and the same per-horizon intervals: one whose points lie on the line, one whose
    points scatter about it. The interval must carry the scatter (redrawing each point within its own interval, the
    method before, gave both the same width)."""
    ts = (8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
    on_line = fit_law(_horizons({t: 0.1 * (t / 8) ** -1.0 for t in ts}))
    wiggle = (2.5, 0.4, 1.0, 1.0, 0.4, 2.5)  # orthogonal to log T: the slope stays 1
    scattered = fit_law(_horizons({t: 0.1 * (t / 8) ** -1.0 * w for t, w in zip(ts, wiggle)}))
    assert on_line["alpha"] == pytest.approx(1.0, abs=1e-9) and scattered["alpha"] == pytest.approx(1.0, abs=0.05)
    width_on = on_line["alpha_ci_high"] - on_line["alpha_ci_low"]
    width_scattered = scattered["alpha_ci_high"] - scattered["alpha_ci_low"]
    assert width_scattered > 2 * width_on
    assert scattered["alpha_ci_method"] == on_line["alpha_ci_method"] and "residual" in on_line["alpha_ci_method"]
    assert on_line["band_misses"] == []
    assert set(scattered["alpha_leave_one_out"]) == {str(int(t)) for t in ts}


def test_the_laws_note_gives_the_range_of_its_fitted_horizons():
    """The law is fitted to the horizons with a threshold; a bound at a shorter or longer T is measured (it stays in
    ``horizon_range``) but not in the fit, so the note's "over N horizons with a fitted threshold (T = a .. b)" is
    the fitted horizons' range (the shipped map said T = 5 .. 516 for fitted horizons at T = 8 .. 433)."""
    horizons = _horizons({8.0: 0.1, 16.0: 0.05, 32.0: 0.025})
    horizons += [{"horizon_value": 1, "horizon": 5.0, "status": "above_range", "lower_bound": 2.0},
                 {"horizon_value": 640, "horizon": 516.0, "status": "below_range", "upper_bound": 7.7e-4}]
    law = fit_law(horizons)
    assert law["status"] == "fitted" and law["horizon_range"] == [5.0, 516.0]
    assert "over 3 horizons with a fitted threshold (T = 8 .. 32)" in law["note"]


def _saturating_curve() -> dict:
    """A curve whose thresholds level off at 1e-3 (1e-3 + 0.8 / T, T = 8 .. 128, tight intervals): the power law and
    the saturating shape part far beyond T = 128."""
    horizons = _horizons({t: 1e-3 + 0.8 / t for t in (8.0, 16.0, 32.0, 64.0, 128.0)}, spread=1.05)
    law = fit_law(horizons)
    return {"curve": "bypass", "correction": "bypass", "source": "logit_scale", **law, "horizons": horizons,
            "shape": compare_shapes(horizons)}


def test_a_verdict_far_beyond_the_data_spans_both_shapes():
    curve = _saturating_curve()
    t = 1e5
    floor = curve["shape"]["saturating"]["floor"] + curve["shape"]["saturating"]["scale"] / t
    placed = place_on_map(curve, 1e-4, t, "bypass")
    assert placed["ci_high"] < floor  # the power law's interval alone lies below the saturating shape here
    assert placed["range_low"] <= placed["ci_low"] and placed["range_high"] == pytest.approx(floor)
    k3 = (placed["ci_high"] * floor) ** 0.5  # above the power law's interval, below the saturating shape
    assert k3 > placed["ci_high"]  # the interval alone would call it "above the measured collapse range"
    near = place_on_map(curve, k3, t, "bypass")
    assert near["verdict"].startswith("near the measured collapse range; extrapolated")
    assert "the saturating shape's" in near["verdict"] and "may lie anywhere in k3" in near["verdict"]
    assert place_on_map(curve, floor * 2, t, "bypass")["verdict"].startswith("above the measured collapse range")
    inside = place_on_map(curve, k3, 50.0, "bypass")  # within the measured horizons: no range, no shape
    assert inside["range_low"] is None and "saturating" not in inside["verdict"]


def test_one_run_per_dose_is_flagged(tmp_path):
    """A horizon whose dose levels hold one run each says so in the map file and in every verdict from the law."""
    data = _sweep(tmp_path, 1.0)
    single = [p for p in data.points if p.overrides["task.max_len"] != 64 or p.overrides["seed"] == 0]
    result = scaling(SweepData(tmp_path, "s", data.grid, data.group_keys, single))
    by_len = {h["horizon_value"]: h for h in result["horizons"]}
    assert by_len[64]["single_run_per_dose"] is True and by_len[64]["runs_per_dose"] == [1, 1, 1, 1]
    assert by_len[8]["single_run_per_dose"] is False and by_len[8]["runs_per_dose"] == [4, 4, 4, 4]
    assert result["single_run_horizons"] == [64] and "one run per dose: task.max_len = 64" in result["note"]
    verdict = place_on_map(result, 1e-3, 30.0, "bypass")["verdict"]
    assert "the law rests on horizon(s) fitted from one run per dose (task.max_len = 64)" in verdict
    full = scaling(data)
    assert "single_run_horizons" not in full and "one run per dose" not in place_on_map(full, 1e-3, 30.0)["verdict"]


def test_a_horizon_interval_made_by_an_earlier_method_is_flagged(tmp_path):
    """The shipped bypass curve's L = 4, 16 and 80 came from a map file whose runs are not kept: their intervals
    were made by the seed bootstrap and bracket alone, which can be narrower than ``ci_method``'s. The map file and
    every verdict from the law name them; horizons fitted from runs now carry ``ci_method`` and are not named."""
    fitted = scaling(_sweep(tmp_path, 1.0))
    assert all(h["ci_method"] == CI_METHOD for h in fitted["horizons"] if h["status"] == "fitted")
    assert "earlier_ci_horizons" not in fitted and "earlier method" not in fitted["note"]
    assert "earlier method" not in place_on_map(fitted, 1e-3, 30.0, "bypass")["verdict"]
    horizons = [dict(h) for h in fitted["horizons"]]
    del horizons[1]["ci_method"]  # carried from a file made before the profile likelihood
    law = fit_law(horizons)
    assert law["earlier_ci_horizons"] == [16] and "task.max_len = 16 was made by an earlier method" in law["note"]
    [bypass] = fitted["curves"]
    curve = {**fitted, "curves": [{**bypass, **law, "horizons": horizons}]}
    assert ("its interval rests on threshold intervals made by an earlier method that can be narrower "
            "(task.max_len = 16)") in place_on_map(curve, 1e-3, 30.0, "bypass")["verdict"]


def test_a_horizon_interval_open_on_one_side_enters_alpha_interval_mirrored():
    """A horizon whose seed bootstrap found resamples where every run collapsed has no lower interval end. α's
    interval mirrors its finite side (and says so); with both ends open it stays open, as before."""
    ts = (8.0, 16.0, 32.0, 64.0, 128.0)
    closed = _horizons({t: 0.1 * (t / 8) ** -1.0 for t in ts}, spread=2.0)
    one_sided = [dict(h) for h in closed]
    one_sided[-1]["ci_low"] = None  # the upper end is still threshold * 2: mirrored, the same interval
    mirrored = fit_law(one_sided)
    assert mirrored["alpha_ci_mirrored"] == [128]
    assert "mirrors its finite side" in mirrored["note"]
    as_closed = fit_law(closed)  # its interval is symmetric in log: mirroring the upper end gives it back
    assert (mirrored["alpha_ci_low"], mirrored["alpha_ci_high"]) == (as_closed["alpha_ci_low"],
                                                                     as_closed["alpha_ci_high"])
    both_open = [dict(h) for h in one_sided]
    both_open[-1]["ci_high"] = None
    still_open = fit_law(both_open)
    assert still_open["alpha_ci_low"] is None and still_open["alpha_ci_high"] is None
    assert "no interval" in still_open["note"] and "alpha_ci_mirrored" not in still_open


def test_an_open_interval_end_is_drawn_as_an_arrow_not_a_zero_width_bar():
    """A threshold whose bootstrap interval is open below (every resample collapsed at the lowest dose) must not
    be drawn with an error bar ending at the threshold itself, which reads as certainty."""
    closed = {"threshold_50": 0.004, "ci_low": 0.001, "ci_high": 0.016}
    assert interval_drawn(closed) == ((0.001, 0.016), [])
    open_below = {"threshold_50": 0.004, "ci_low": None, "ci_high": 0.016}
    assert interval_drawn(open_below) == ((0.004, 0.016), [0.004 / OPEN_END_SPAN])
    open_above = {"threshold_50": 0.004, "ci_low": 0.001}
    assert interval_drawn(open_above) == ((0.001, 0.004), [0.004 * OPEN_END_SPAN])


def test_two_thresholds_at_one_horizon_give_no_exponent():
    """Two fitted thresholds a decade apart, both at T = 50: the line through one T got slope 0, reported as a
    fitted alpha = -0.0 with a zero-width interval."""
    h = lambda v, thr: {"horizon_value": v, "horizon": 50.0, "threshold_50": thr, "ci_low": thr / 2,  # noqa: E731
                        "ci_high": thr * 2, "status": "fitted"}
    law = fit_law([h(8, 0.1), h(16, 0.01)])
    assert law["status"] == "single_horizon" and law["alpha"] is None and law["alpha_ci_low"] is None
    assert "a law in T needs at least two distinct horizons" in law["note"]


def test_two_horizons_give_no_alpha_interval():
    """A line through two horizons leaves no residual: the residual bootstrap redrew each threshold within its own
    interval only and called that a regression interval (it covered the true α 42% of the time when the horizons
    scatter about the line). Now α has no interval, no replicates, the note says why, and a verdict from the law
    has no band to rest on: "no verdict", saying why."""
    law = fit_law(_horizons({10.0: 1e-2, 100.0: 1e-3}, spread=1.5))
    assert law["status"] == "fitted" and law["alpha"] == pytest.approx(1.0)
    assert law["alpha_ci_low"] is None and law["alpha_ci_high"] is None and law["replicates"] == []
    assert "no interval: a line through two horizons leaves no residual" in law["note"]
    assert "regression interval]" not in law["note"]
    curve = {**law, "curve": "correction=bypass", "correction": "bypass", "source": None, "policy_lag": 0,
             "horizons": _horizons({10.0: 1e-2, 100.0: 1e-3}, spread=1.5)}
    shipped = {"status": "fitted", "horizon_range": law["horizon_range"], "curves": [curve]}
    for k3 in (1e-7, 3e-3, 1.0):
        verdict = place_on_map(shipped, k3, 30.0, "bypass")["verdict"]
        assert verdict.startswith("no verdict: the bypass curve's power law has no 95% interval (it was fitted to two "
                                  "horizons"), verdict
    three = fit_law(_horizons({10.0: 1e-2, 30.0: 8e-3, 100.0: 1e-3}, spread=1.5))
    assert three["alpha_ci_low"] < three["alpha"] < three["alpha_ci_high"]
    assert "3 horizons: the interval rests on one residual degree of freedom" in three["note"]


@pytest.mark.parametrize("outcomes", [(False, True), (True, True, True), (False, False, False)])
def test_one_dose_level_gives_no_threshold_and_no_bound(tmp_path, outcomes):
    """One sweep group (inject.value 0.3) whose seeds realised slightly different k3: one dose level, whatever the
    outcomes. The map fitted a threshold between the seeds' doses (mixed) or bounded it from them (all collapsed),
    as if each seed were its own level; the sweep report and the docs say one level is ``insufficient``."""
    from vexact.map.fit import fit_curve

    points = [_point(tmp_path, 12, 11.0, 1.0e-3 * (1 + 0.01 * seed), collapsed, seed, {"inject.value": 0.3})
              for seed, collapsed in enumerate(outcomes)]
    curve = fit_curve("correction=bypass", "bypass", {12: points})
    h = curve["horizons"][0]
    assert h["status"] == "insufficient" and h["runs_per_dose"] == [len(outcomes)]
    assert h["threshold_50"] is None and "upper_bound" not in h and "lower_bound" not in h
    assert h["dose_min"] == pytest.approx(1.0e-3)
    shipped = {"status": curve["status"], "horizon_range": curve["horizon_range"],
               "curves": [{**curve, "source": None, "policy_lag": 0}]}
    verdict = place_on_map(shipped, 1.015e-3, 11.0, "bypass")["verdict"]
    assert "above the measured collapse range" not in verdict and "below every level" not in verdict
    assert verdict.startswith("unknown") and "one dose level" in verdict


def test_t_quantiles_solve_the_t_integral():
    """``T_975`` (and the expansion past it) is the two-sided 95% quantile of Student's t: integrate its density."""
    from vexact.map.fit import t_975

    def central(t: float, df: int, steps: int = 4000) -> float:
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
        h = t / steps  # Simpson's rule over [0, t], doubled
        return 2 * h / 3 * (f(0) + f(t) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, steps)))
    for df in (*range(1, 31), 31, 40, 60, 120, 1000):
        assert central(t_975(df), df) == pytest.approx(0.95, abs=2e-4), df


def test_few_horizons_alpha_interval_holds_the_t_interval():
    """Three horizons (one residual degree of freedom): the bootstrap of three residuals gave α in 0.19 .. 1.83
    where the least-squares t-interval (t = 12.706) is -4.56 .. 6.59; it covered the true α 77% of the time. The
    interval now holds the t-interval on both sides, at any n."""
    t_975 = {1: 12.706, 3: 3.182}.__getitem__  # Student's t, 97.5%, by degrees of freedom
    for thresholds in ({10.0: 1e-2, 30.0: 8e-3, 100.0: 1e-3},
                       {8.0: 0.1, 16.0: 0.03, 32.0: 0.03, 64.0: 0.006, 128.0: 0.005}):
        law = fit_law(_horizons(thresholds, spread=1.5))
        xs = [math.log10(t) for t in thresholds]
        ys = [math.log10(v) for v in thresholds.values()]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        rss = sum((y - (my + b * (x - mx))) ** 2 for x, y in zip(xs, ys))
        half = t_975(n - 2) * math.sqrt(rss / (n - 2) / sxx)
        assert law["alpha"] == pytest.approx(-b)
        assert law["alpha_ci_low"] <= -b - half + 1e-9 and law["alpha_ci_high"] >= -b + half - 1e-9
        assert "at least the least-squares t-interval" in law["alpha_ci_method"]


@pytest.mark.parametrize(("lo", "hi", "text"), [(0.034, None, "[0.034, open above]"),
                                                 (None, 0.0074, "[open below, 0.0074]"),
                                                 (None, None, "[open below, open above]"),
                                                 (0.01, 0.083, "[0.01, 0.083]")])
def test_a_half_open_threshold_interval_is_printed_with_its_open_end(lo, hi, text):
    """build-map's sensitivity and band lines and the single-horizon note printed a threshold's interval only when
    both ends were numbers: a half-open one vanished and the bare point read as precise. All print it as the verdict
    does (``points.interval_text``)."""
    from vexact.map.build import _horizon_cell, band_lines
    h = {"status": "fitted", "threshold_50": 0.05, "ci_low": lo, "ci_high": hi, "collapsed": 3, "runs": 6,
         "horizon": 100.0, "horizon_value": 40}
    assert text in _horizon_cell(h)
    curve = {"horizons": [h], "replicates": [(0.0, 1.0)]}
    [line] = band_lines(curve)
    assert f"threshold 0.05 {text}" in line
    one = fit_law([{**h, "horizon": 100.0}])
    assert one["status"] == "single_horizon" and f"its 50% threshold: k3 0.05 {text}" in one["note"]


def test_a_map_made_before_ci_method_is_flagged_without_its_earlier_ci_horizons_key():
    """A map file (or scaling.json) made before ``ci_method`` existed has neither the key on its horizons nor
    ``earlier_ci_horizons`` on its curves (that list is written only where ``fit_law`` ran). The placement derives
    the list from the fitted horizons themselves, so such a map's verdicts carry the same warning as the shipped
    map's."""
    shipped = load_map(None)
    old = json.loads(json.dumps(shipped))
    for curve in old["curves"]:
        curve.pop("earlier_ci_horizons", None)
        for h in curve.get("horizons") or []:
            h.pop("ci_method", None)
    for data in (shipped, old):
        verdict = place_on_map(data, 1e-3, 30.0, "bypass")["verdict"]
        assert "threshold intervals made by an earlier method that can be narrower" in verdict, verdict
    [bypass] = [c for c in old["curves"] if c["correction"] == "bypass" and c.get("status") == "fitted"]
    listed = [h["horizon_value"] for h in bypass["horizons"] if h.get("status") == "fitted"]
    assert f"(task.max_len = {', '.join(map(str, listed))})" in place_on_map(old, 1e-3, 30.0, "bypass")["verdict"]
