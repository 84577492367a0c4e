"""build-map over sweep directories: the runs of one (correction, horizon) from several sweeps merged into one
dose-response fit when their configs agree (else one error naming the key), α refitted over every horizon, the
shape printed, and horizons without a collapse kept as bounds (never thresholds) that ``compare --map`` shows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from test_scaling import file_size_limit

from vexact.map import build, fit
from vexact.map.build import build_map
from vexact.map.scaling_report import write_scaling
from vexact.map.verdict import bound_lines, compare_map, load_map
from vexact.metric_keys import K3_KL
from vexact.rl.config_schema import RunConfig
from vexact.rl.horizon_task import horizon_overrides
from vexact.sweeps.sweep_data import read_sweep_results

SEEDS = (0, 1, 2)
LOW, HIGH = (0.25, 0.5), (2.0, 4.0)  # dose factors around the true threshold: below survive, above collapse


def _threshold(length: int) -> float:
    return 0.1 * (length / 8.0) ** -1.0  # the true 50% threshold: α = 1


def _config(length: int, value: float, seed: int, **changes) -> dict:
    """A resolved run config as a run saves it (config.yaml), at scratchpad length ``length``."""
    config = dataclasses.asdict(RunConfig())
    for key, v in {**horizon_overrides(length), "inject.mode": "logit_scale", "inject.value": value, "seed": seed,
                   "name": f"L{length}_{value}_{seed}", **changes}.items():
        section = config
        *parents, leaf = key.split(".")
        for part in parents:
            section = section[part]
        section[leaf] = v
    return config


def _sweep(root: Path, name: str, cells: list[tuple[int, tuple[float, ...]]], never: tuple[int, ...] = (),
           pending: int = 0, **changes) -> Path:
    """A sweep directory as `vexact sweep` leaves it: one variant per (L, factor), 3 seeds each, every point with
    its config.yaml, summary.json and metrics.jsonl (T = L). Runs above the threshold collapse unless L is in
    ``never``; ``pending`` more points that never started (no files)."""
    path = root / name
    points, variants = [], {}
    for length, factors in cells:
        for f in factors:
            variant = f"L{length}_x{f}"
            variants[variant] = {**horizon_overrides(length), "inject.value": -f}
            for seed in SEEDS:
                point = f"variant={variant},seed={seed}"
                folder = path / "points" / point
                folder.mkdir(parents=True)
                (folder / "config.yaml").write_text(yaml.safe_dump(_config(length, -f, seed, **changes)))
                dose = _threshold(length) * f * (1 + 0.01 * seed)
                collapse = {"collapsed": f > 1 and length not in never, "mean_k3_kl_before_collapse": dose}
                (folder / "summary.json").write_text(json.dumps({"status": "completed", "collapse": collapse}))
                (folder / "metrics.jsonl").write_text("".join(
                    json.dumps({"step": s, "response_length/mean": float(length)}) + "\n" for s in range(3)))
                points.append({"name": point, "dir": f"points/{point}", "status": "completed",
                               "overrides": {"variant": variant, "seed": seed}})
    for i in range(pending):
        points.append({"name": f"variant=later,seed={i}", "dir": f"points/variant=later,seed={i}",
                       "status": "pending", "overrides": {"variant": "later", "seed": i}})
    variants["later"] = {**horizon_overrides(8), "inject.value": -9.0}
    (path / "sweep.json").write_text(json.dumps({"name": name, "grid": {"seed": list(SEEDS),
                                                                        "variant": list(variants)},
                                                 "variants": variants, "set": [], "curves": [], "points": points}))
    return path


def _two_rounds(tmp_path: Path, **changes) -> tuple[Path, Path]:
    """Round 1 ran L = 8 below its threshold and L = 16 across it; round 2 ran L = 8 above it and L = 32 across it:
    L = 8 has a threshold only once both rounds are merged."""
    a = _sweep(tmp_path, "round1", [(8, LOW), (16, LOW + HIGH)], pending=2)
    b = _sweep(tmp_path, "round2", [(8, HIGH), (32, LOW + HIGH)], **changes)
    return a, b


def test_runs_of_one_horizon_from_two_sweeps_make_one_fit(tmp_path):
    a, b = _two_rounds(tmp_path)
    for one in (a, b):  # each round alone gives L = 8 only a bound
        alone = fit.scaling(read_sweep_results(one))
        assert {h["horizon_value"]: h["status"] for h in alone["horizons"]}[8] in ("above_range", "below_range")
    built = build_map([a, b])
    (curve,) = built["curves"]
    assert curve["correction"] == "bypass" and curve["status"] == "fitted"
    by_l = {h["horizon_value"]: h for h in curve["horizons"]}
    assert list(by_l) == [8, 16, 32] and all(h["status"] == "fitted" for h in by_l.values())
    assert by_l[8]["runs"] == 12 and by_l[8]["sweeps"] == {str(a): 6, str(b): 6}  # the pending points left out
    for length, h in by_l.items():
        assert 0.5 * _threshold(length) <= h["threshold_50"] <= 2.2 * _threshold(length)
    assert curve["alpha"] == pytest.approx(1.0, abs=0.05)  # refitted over the three horizons of both sweeps
    assert curve["shape"]["status"] == "compared" and "ΔAIC" in curve["shape"]["note"]
    assert curve["testbed"]["inject.mode"] == "logit_scale" and "inject.value" not in curve["testbed"]
    assert built["alpha"] == curve["alpha"]  # the top level is the bypass curve


def test_exempt_keys_may_differ_but_a_testbed_key_may_not(tmp_path):
    # threads and checkpoints do not change a run's bits: the rounds still merge
    assert build_map(list(_two_rounds(tmp_path / "ok", **{"threads": 2, "logging.checkpoint_every": 7})))
    a, b = _two_rounds(tmp_path / "steps", steps=130)
    with pytest.raises(ValueError, match=r"at task\.max_len = 8: .*round1.* and .*round2.* differ in steps "
                                         r"\(100 vs 130\).*not one testbed"):
        build_map([a, b])


def test_a_key_saved_only_by_later_runs_is_the_same_testbed_at_its_default(tmp_path):
    """An extension's key (the vllm engine's ``rollout.vllm_timeout_s``) that older runs' config.yaml lacks counts as
    its default, as a built-in key's does: the shipped map's own rebuild merges such rounds. Monitor sampling
    (``monitor.*``) changes no bit: runs that differ in it merge too."""
    a, b = _two_rounds(tmp_path / "added", **{"rollout.vllm_timeout_s": 900.0, "monitor.sample_fraction": 0.5})
    for saved in a.glob("points/*/config.yaml"):  # round 1 was saved before the key existed
        config = yaml.safe_load(saved.read_text())
        config["rollout"].pop("vllm_timeout_s", None)
        saved.write_text(yaml.safe_dump(config))
    assert build_map([a, b])["curves"][0]["status"] == "fitted"
    a, b = _two_rounds(tmp_path / "changed", **{"rollout.vllm_timeout_s": 60.0})
    with pytest.raises(ValueError, match=r"differ in rollout\.vllm_timeout_s \(900\.0 vs 60\.0\)"):
        build_map([a, b])


def test_runs_saved_before_bypass_mode_was_renamed_merge_with_later_ones(tmp_path):
    """Configs saved before verl's ``correction.bypass_mode`` became ``algorithm.old_logprobs`` hold it at null; later
    ones lack it: one testbed. Saved at true it is another value, a testbed key like any other."""
    a, b = _two_rounds(tmp_path / "renamed")
    for saved in a.glob("points/*/config.yaml"):  # round 1 was saved before the rename
        config = yaml.safe_load(saved.read_text())
        config["correction"]["bypass_mode"] = None
        saved.write_text(yaml.safe_dump(config))
    assert build_map([a, b])["curves"][0]["status"] == "fitted"
    for saved in a.glob("points/*/config.yaml"):
        config = yaml.safe_load(saved.read_text())
        config["correction"]["bypass_mode"] = True
        saved.write_text(yaml.safe_dump(config))
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"differ in correction\.bypass_mode \(True vs "
                                                                      r"None\)"):
        build_map([a, b])


def test_runs_saving_the_knob_under_its_mode_s_key_merge_with_runs_saving_inject_value(tmp_path):
    """Runs saved after modes named their knobs hold ``inject.epsilon`` (logit_scale), earlier ones ``inject.value``:
    the knob is one per-run key however it was saved, so the rounds merge into one fit (the same fit as when both
    saved ``inject.value``)."""
    a, b = _two_rounds(tmp_path / "old")
    before = build_map([a, b])
    a, b = _two_rounds(tmp_path / "new")
    for saved in a.glob("points/*/config.yaml"):  # round 1 saved by the newer code
        config = yaml.safe_load(saved.read_text())
        config["inject"]["epsilon"] = config["inject"].pop("value")
        saved.write_text(yaml.safe_dump(config))
    after = build_map([a, b])
    assert after["curves"][0]["status"] == "fitted" and after["alpha"] == before["alpha"]


def test_the_horizons_of_one_curve_share_a_testbed(tmp_path):
    a = _sweep(tmp_path, "lr3", [(8, LOW + HIGH)])
    b = _sweep(tmp_path, "lr4", [(16, LOW + HIGH)], **{"optimizer.lr": 1e-4})
    with pytest.raises(ValueError, match=r"horizons task\.max_len = 8 and 16: .* differ in optimizer\.lr"):
        build_map([a, b])


def test_a_finished_point_without_its_config_is_named(tmp_path):
    a, b = _two_rounds(tmp_path)
    missing = next((b / "points").iterdir()) / "config.yaml"
    missing.unlink()
    with pytest.raises(ValueError, match=r"has a result but no config\.yaml"):
        build_map([a, b])


def test_a_horizon_without_collapse_is_a_bound_kept_and_shown(tmp_path):
    a = _sweep(tmp_path, "bypass", [(8, LOW + HIGH), (16, LOW + HIGH), (32, LOW + HIGH), (64, LOW + HIGH)],
               never=(64,))
    built = build_map([a])
    (curve,) = built["curves"]
    h64 = curve["horizons"][-1]
    assert h64["status"] == "above_range" and h64["threshold_50"] is None and h64["collapsed"] == 0
    assert curve["alpha"] == pytest.approx(1.0, abs=0.05)  # from the three thresholds; the bound is not a number
    top = max(_threshold(64) * f * 1.02 for f in LOW + HIGH)
    assert bound_lines(curve) == [f"no collapse measured up to k3 {top:.2g} at T 64"]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(built))
    assert load_map(path)["curves"][0]["horizons"][-1]["status"] == "above_range"  # kept in the map
    summary = {"sequences": 4, "tokens": 4 * 20, "metrics": {K3_KL: 1e-3}}
    _, lines = compare_map(summary, path, "bypass")
    assert any(line.startswith("  the bypass curve's bounds (measured, not in its fit): no collapse measured up to "
                               f"k3 {top:.2g} at T 64") for line in lines)


def test_a_file_curve_joins_sweep_horizons_but_never_at_the_same_horizon(tmp_path):
    old = _sweep(tmp_path, "old", [(8, LOW + HIGH), (16, LOW + HIGH)])
    report = tmp_path / "report"
    report.mkdir()
    file = write_scaling(read_sweep_results(old), report)[0][0]
    new = _sweep(tmp_path, "new", [(32, LOW + HIGH)])
    built = build_map([file, new])
    (curve,) = built["curves"]
    assert [h["horizon_value"] for h in curve["horizons"]] == [8, 16, 32] and curve["status"] == "fitted"
    assert curve["alpha"] == pytest.approx(1.0, abs=0.05)
    assert curve["provenance"]["testbed_unchecked"] == [str(file)]  # a scaling.json records no config
    again = _sweep(tmp_path, "again", [(16, LOW + HIGH)])
    with pytest.raises(ValueError, match=r"two sources hold correction 'bypass' at task\.max_len = 16"):
        build_map([file, again])


def test_build_map_cli_prints_the_shape_and_bounds(tmp_path, capsys):
    a, b = _two_rounds(tmp_path)
    out = tmp_path / "map.json"
    assert build.main(["build-map", str(out), str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "bypass (fitted, 3 horizons)" in text and "shape: shape over 3 fitted horizons" in text
    assert "ΔAIC (power − saturating)" in text
    assert load_map(out)["provenance"]["made_by"] == f"python -m vexact.map build-map {out} {a} {b}"
    c, d = _two_rounds(tmp_path / "bad", steps=130)
    assert build.main(["build-map", str(out), str(c), str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: correction 'bypass' at task.max_len = 8") and len(err.strip().splitlines()) == 1
    assert build.main(["build-map", str(out), str(tmp_path)]) == 2  # a directory that is no sweep
    assert "without sweep.json" in capsys.readouterr().err


def test_build_map_over_a_map_that_fails_to_write_leaves_the_old_one(tmp_path, capsys):
    """build-map wrote its map in place: a failed write (here a real file-size limit) left half a map where the old
    one was, and the error named no file. Now the map is published whole: one error line naming it, the old map
    intact."""
    a, b = _two_rounds(tmp_path)
    out = tmp_path / "map.json"
    assert build.main(["build-map", str(out), str(a)]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    with file_size_limit(len(before) // 2):
        assert build.main(["build-map", str(out), str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot write {out}: File too large (the file-size limit: ulimit -f)\n"
    assert out.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


def test_a_horizon_with_one_run_does_not_stretch_the_measured_range(tmp_path):
    """One collapsed run at a long horizon is neither a threshold nor a bound (too few runs): the curve's
    horizon_range stays that of the horizons that measured something, so a verdict there says it extrapolates."""
    base = _sweep(tmp_path, "base", [(8, LOW + HIGH), (16, LOW + HIGH)])
    built = build_map([base])
    one = tmp_path / "one"
    spec = json.loads((base / "sweep.json").read_text())
    (one / "points").mkdir(parents=True)
    long = [p for p in json.loads((_sweep(tmp_path, "long", [(500, HIGH)]) / "sweep.json").read_text())["points"]][:1]
    import shutil

    shutil.copytree(tmp_path / "long" / long[0]["dir"], one / long[0]["dir"])
    (one / "sweep.json").write_text(json.dumps({**spec, "variants": {"L500_x2.0": {"task.max_len": 500}},
                                                "points": long}))
    merged = build_map([base, one])
    statuses = {h["horizon_value"]: h["status"] for h in merged["horizons"]}
    assert statuses[500] == "insufficient"
    assert merged["horizon_range"] == built["horizon_range"] == [8.0, 16.0]


# ----------------------------------------------------------------------------- the detector's sensitivity (issue AC)


def _dip_sweep(root: Path) -> Path:
    """L = 8 and 16 around their thresholds; every run above its threshold loses its reward for 15 steps (steps
    40-55) and recovers: a collapse for a 10-step recovery window, none for the runs' own 20. Each summary is the
    detector's verdict under the saved settings, as a run writes it."""
    from vexact.rl.collapse import detect_collapse
    from vexact.rl.config_schema import CollapseSection

    path = root / "dips"
    points, variants = [], {}
    for length in (8, 16):
        for f in LOW + HIGH:
            variant = f"L{length}_x{f}"
            variants[variant] = {**horizon_overrides(length), "inject.value": -f}
            for seed in SEEDS:
                point = f"variant={variant},seed={seed}"
                folder = path / "points" / point
                folder.mkdir(parents=True)
                (folder / "config.yaml").write_text(yaml.safe_dump(_config(length, -f, seed)))
                dose = _threshold(length) * f * (1 + 0.01 * seed)
                metrics = [{"step": s, "response_length/mean": float(length), K3_KL: dose,
                            "eval/reward_mean": 0.1 if f > 1 and 40 <= s <= 55 else 0.8} for s in range(0, 101, 5)]
                summary = {"status": "completed", "collapse": detect_collapse(metrics, CollapseSection())}
                (folder / "summary.json").write_text(json.dumps(summary))
                (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
                points.append({"name": point, "dir": f"points/{point}", "status": "completed",
                               "overrides": {"variant": variant, "seed": seed}})
    (path / "sweep.json").write_text(json.dumps({"name": "dips", "grid": {"seed": list(SEEDS),
                                                                          "variant": list(variants)},
                                                 "variants": variants, "set": [], "curves": [], "points": points}))
    return path


def test_detector_sensitivity_judges_runs_again(tmp_path):
    sweep = _dip_sweep(tmp_path)
    as_run = build_map([sweep])
    assert [h["status"] for h in as_run["horizons"]] == ["above_range", "above_range"]  # the dips recovered
    rows = build.sensitivity([sweep], patiences=(10, 20), drops=(0.5,))
    short, own = rows
    assert (short["patience"], own["patience"]) == (10, 20)
    assert [h["status"] for h in own["horizons"]] == ["above_range", "above_range"]  # the saved settings: as run
    assert own["horizons"] == [{k: h.get(k) for k in own["horizons"][0]} for h in as_run["horizons"]]
    assert [h["status"] for h in short["horizons"]] == ["fitted", "fitted"]  # a 10-step window: the dips collapse
    assert short["alpha"] == pytest.approx(1.0, abs=0.1) and own["alpha"] is None
    assert short["from_runs"] == [8, 16]
    lines = build.sensitivity_lines(rows)
    assert lines[0].startswith("patience 10, drop 0.5: α 1.0") and "L = 8: " in lines[0] and "(6/12)" in lines[0]
    assert lines[1].startswith("patience 20, drop 0.5: no α (bounds_only); L = 8: above ")
    assert json.loads((sweep / "points" / "variant=L8_x2.0,seed=0" / "summary.json").read_text())["collapse"][
        "collapsed"] is False  # judged again in memory only


def test_sensitivity_cli(tmp_path, capsys):
    sweep = _dip_sweep(tmp_path)
    assert build.main(["sensitivity", str(sweep), "--patience", "10", "--drop", "0.5"]) == 0
    assert capsys.readouterr().out.startswith("patience 10, drop 0.5: α 1.0")
    assert build.main(["sensitivity", str(sweep), "--patience", "ten"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --patience 'ten': expected comma-separated int values") and err.count("\n") == 1
    assert build.main(["sensitivity", str(sweep), "--drop", "1.5"]) == 2
    assert "strictly between 0 and 1" in capsys.readouterr().err
