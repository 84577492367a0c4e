"""The map per mismatch source: runs of two sources (a flattened rollout, flipped MoE routing) never share a curve;
runs with router replay stay off the map; a sweep that does not vary the horizon gives a curve of one horizon, whose
threshold answers at that horizon only; ``--source`` / ``source=`` choose the curves, and a source the map lacks is
one error naming those it has."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from test_build_map import HIGH, LOW, _sweep, _threshold

from vexact.map.build import build_map
from vexact.map.naming import source_name
from vexact.map.verdict import compare_map, curve_for, map_sources, place_on_map
from vexact.rl.config_schema import RunConfig

ROUTING = {"inject.mode": "routing_flip", "inject.flip_kind": "near_tie"}
MOE_T = 12.0  # the MoE testbed's measured horizon


def _nested(flat: dict) -> dict:
    config = dataclasses.asdict(RunConfig())
    for key, value in flat.items():
        section = config
        *parents, leaf = key.split(".")
        for part in parents:
            section = section[part]
        section[leaf] = value
    return config


def _routing_sweep(root: Path, threshold: float = 0.1, replay: bool = True) -> Path:
    """A sweep like experiments/moe_routing_*: flip rates as variants that do not set the horizon (the base config's
    task.max_len = 5 does), 3 seeds each; with ``replay``, every point once more with router replay (k3 0)."""
    path = root / "routing"
    points, variants = [], {}
    for factor in LOW + HIGH:
        variant = f"flip_x{factor}"
        variants[variant] = {"inject.value": factor / 4}
        for replayed in (False, True) if replay else (False,):
            for seed in (0, 1, 2):
                point = f"variant={variant},algorithm.router_replay={replayed},seed={seed}"
                folder = path / "points" / point
                folder.mkdir(parents=True)
                flat = {**ROUTING, "task.max_len": 5, "inject.value": factor / 4, "seed": seed, "name": point,
                        "algorithm.router_replay": replayed}
                (folder / "config.yaml").write_text(yaml.safe_dump(_nested(flat)))
                dose = 0.0 if replayed else threshold * factor * (1 + 0.01 * seed)
                collapse = {"collapsed": factor > 1 and not replayed, "mean_k3_kl_before_collapse": dose}
                (folder / "summary.json").write_text(json.dumps({"status": "completed", "collapse": collapse}))
                (folder / "metrics.jsonl").write_text("".join(
                    json.dumps({"step": s, "response_length/mean": MOE_T}) + "\n" for s in range(3)))
                points.append({"name": point, "dir": f"points/{point}", "status": "completed",
                               "overrides": {"variant": variant, "algorithm.router_replay": replayed, "seed": seed}})
    (path / "sweep.json").write_text(json.dumps({"name": "routing", "grid": {"variant": list(variants)},
                                                 "variants": variants, "set": [], "curves": [], "points": points}))
    return path


def test_source_name_is_the_mode_and_its_own_settings():
    assert source_name({"inject.mode": "logit_scale"}) == "logit_scale"
    assert source_name(ROUTING) == "routing_flip:near_tie"
    assert source_name({**ROUTING, "inject.flip_kind": "random"}) == "routing_flip:random"
    assert source_name({"inject.mode": "routing_flip"}) == "routing_flip:near_tie"  # a missing key: its default


def test_two_sources_give_two_curves_and_router_replay_stays_off_the_map(tmp_path):
    dense = _sweep(tmp_path, "dense", [(8, LOW + HIGH), (16, LOW + HIGH)])
    built = build_map([dense, _routing_sweep(tmp_path)])
    curves = {(c["correction"], c["source"]): c for c in built["curves"]}
    assert set(curves) == {("bypass", "logit_scale"), ("bypass", "routing_flip:near_tie")}
    assert built["provenance"]["router_replay_runs_left_out"] == 12
    assert map_sources(built) == ["logit_scale", "routing_flip:near_tie"]  # the first input's source is the default
    routing = curves[("bypass", "routing_flip:near_tie")]
    assert routing["status"] == "single_horizon" and len(routing["horizons"]) == 1
    assert routing["horizons"][0]["horizon_value"] == 5 and routing["horizons"][0]["runs_with_result"] == 12
    assert routing["horizons"][0]["status"] == "fitted"
    assert 0.05 < routing["horizons"][0]["threshold_50"] < 0.2  # the true 0.1, not the dense runs' thresholds
    assert curves[("bypass", "logit_scale")]["status"] == "fitted"  # the dense law is untouched by routing runs
    assert built["curves"][0]["source"] == "logit_scale" and built["source"] == "logit_scale"


def test_a_curve_of_one_horizon_answers_at_that_horizon_only(tmp_path):
    built = build_map([_sweep(tmp_path, "dense", [(8, LOW + HIGH), (16, LOW + HIGH)]), _routing_sweep(tmp_path)])
    source = "routing_flip:near_tie"
    above = place_on_map(built, 0.5, MOE_T, "bypass", source)
    assert above["source"] == source and above["threshold_50"] is None
    assert above["verdict"].startswith("above the measured collapse range") and "T 12" in above["verdict"]
    assert place_on_map(built, 1e-4, MOE_T, "bypass", source)["verdict"].startswith("far below")
    far = place_on_map(built, 1e-4, 1000.0, "bypass", source)
    assert far["verdict"].startswith("no verdict at this horizon") and "one horizon" in far["verdict"]
    default = place_on_map(built, 1e-4, 1000.0, "bypass")  # no source named: the map's default, with its law
    assert default["source"] == "logit_scale" and default["threshold_50"] == pytest.approx(_threshold(1000), rel=0.5)


def test_a_source_the_map_lacks_is_one_error_naming_those_it_has(tmp_path):
    built = build_map([_sweep(tmp_path, "dense", [(8, LOW + HIGH)]), _routing_sweep(tmp_path, replay=False)])
    with pytest.raises(ValueError, match="no curves for source 'routing_flip:random'.*'logit_scale', "
                                         "'routing_flip:near_tie'"):
        curve_for(built, "bypass", "routing_flip:random")
    with pytest.raises(ValueError, match="no curve for correction 'recompute'"):
        curve_for(built, "recompute", "routing_flip:near_tie")


def test_compare_source_flag(tmp_path, capsys):
    from vexact.cli import main

    built = build_map([_sweep(tmp_path, "dense", [(8, LOW + HIGH)]), _routing_sweep(tmp_path, replay=False)])
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(built))
    summary = {"sequences": 2, "tokens": 24, "metrics": {"rollout_corr/k3_kl": 0.5}}
    placed, lines = compare_map(summary, str(map_path), "bypass", "routing_flip:near_tie")
    assert placed["source"] == "routing_flip:near_tie" and "above the measured" in placed["verdict"]
    assert any("other sources (--source): logit_scale" in line for line in lines)
    assert main(["compare", "--source", "routing_flip:near_tie", "r.jsonl"]) == 2  # --source without --map
    assert "--source chooses a curve of the collapse map: give --map too" in capsys.readouterr().err


def test_live_monitor_takes_the_source(tmp_path):
    from vexact.live import LiveMonitor

    built = build_map([_sweep(tmp_path, "dense", [(8, LOW + HIGH)]), _routing_sweep(tmp_path, replay=False)])
    monitor = LiveMonitor(tmp_path / "live", scaling_map=built, correction="bypass", source="routing_flip:near_tie")
    assert monitor._map(0.5, MOE_T)["source"] == "routing_flip:near_tie"
    with pytest.raises(ValueError, match="no curves for source 'nope'"):
        LiveMonitor(tmp_path / "live2", scaling_map=built, source="nope")
    with pytest.raises(ValueError, match="give scaling_map too"):
        LiveMonitor(tmp_path / "live3", source="routing_flip:near_tie")


def test_a_map_grows_by_rebuilding_it_from_itself_and_the_same_sweep_directories(tmp_path):
    """A horizon a map file got from a sweep directory is superseded when that directory is given again (it now holds
    more runs); a horizon from elsewhere in the same file stays, and two files at one horizon are still an error."""
    first = _sweep(tmp_path, "long", [(8, LOW)])  # round 1: below the threshold only -> a bound
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(build_map([first, _sweep(tmp_path, "other", [(16, LOW + HIGH)])])))
    before = {h["horizon_value"]: h for h in curve_for(json.loads(map_path.read_text()), "bypass")["horizons"]}
    assert before[8]["status"] == "above_range" and before[8]["runs_total"] == 6
    _sweep(tmp_path / "round2", "long", [(8, HIGH)])  # round 2 lands in the same directory
    for point in (tmp_path / "round2" / "long" / "points").iterdir():
        point.rename(first / "points" / point.name)
    spec = json.loads((first / "sweep.json").read_text())
    spec["points"] += json.loads((tmp_path / "round2" / "long" / "sweep.json").read_text())["points"]
    (first / "sweep.json").write_text(json.dumps(spec))
    rebuilt = build_map([map_path, first])
    after = {h["horizon_value"]: h for h in curve_for(rebuilt, "bypass")["horizons"]}
    assert after[8]["status"] == "fitted" and after[8]["runs_total"] == 12  # the directory's runs, both rounds
    assert after[16] == before[16]  # the file's other horizon, kept as it was
    what = curve_for(rebuilt, "bypass")["provenance"]["what"]
    again = curve_for(build_map([map_path, first, tmp_path / "other"]), "bypass")["provenance"]["what"]
    assert what.count("Merged") == 1  # flat: the file's sentence and the directory's, not a merge inside a merge
    assert again.count(str(first)) == 1 and again.count("Merged") == 0  # both inputs given again: their runs only
    with pytest.raises(ValueError, match="two sources hold correction 'bypass' at task.max_len = 8"):
        build_map([map_path, map_path])


def test_a_config_saved_before_a_list_key_existed_matches_one_saved_with_its_default(tmp_path):
    """A run saved before ``model.mlp_only_layers`` existed (its default: an empty tuple) and one saved with it as
    ``[]`` (YAML has no tuples) are one testbed."""
    old = _sweep(tmp_path, "old", [(8, LOW)])
    for config in old.glob("points/*/config.yaml"):
        saved = yaml.safe_load(config.read_text())
        del saved["model"]["mlp_only_layers"]
        config.write_text(yaml.safe_dump(saved))
    new = _sweep(tmp_path, "new", [(8, HIGH)])
    assert curve_for(build_map([old, new]), "bypass")["horizons"][0]["status"] == "fitted"
