"""The vocabulary on the map: vexact ships a main map (the task's 22 characters) and a tail map (the same testbed
with 1,002 distractor tokens, V = 1,024); a user's vocabulary size picks the shipped map nearest it on a log scale,
so any real LLM vocabulary gets the tail map, and the verdict says which vocabulary it is for. Where the tail map
has no verdict at the user's horizon, the main map's is printed for reference, never returned as the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_build_map import HIGH, LOW, _sweep

from vexact.cli import main
from vexact.map import build, verdict
from vexact.map.build import build_map
from vexact.map.verdict import compare_map, map_vocab, place_on_map, shipped_map_for

TAIL = {"task.distractors": 1002}


def _maps(tmp_path: Path) -> tuple[Path, Path]:
    """A main map (α = 1 over L = 8, 16, 32) and a tail map with one horizon (L = 16)."""
    main_map, tail_map = tmp_path / "main.json", tmp_path / "tail.json"
    main_map.write_text(json.dumps(build_map([_sweep(tmp_path, "main", [(8, LOW + HIGH), (16, LOW + HIGH),
                                                                          (32, LOW + HIGH)])])))
    tail_map.write_text(json.dumps(build_map([_sweep(tmp_path, "tail", [(16, LOW + HIGH)], **TAIL)])))
    return main_map, tail_map


def test_map_vocab_is_the_testbeds_characters_plus_its_tail(tmp_path):
    main_map, tail_map = _maps(tmp_path)
    assert map_vocab(verdict.load_map(main_map)) == 22
    assert map_vocab(verdict.load_map(tail_map)) == 1024
    assert map_vocab({"status": "fitted"}) is None  # no testbed: unknown


def test_a_vocabulary_picks_the_shipped_map_nearest_it_on_a_log_scale(tmp_path):
    main_map, tail_map = _maps(tmp_path)
    maps = {main_map: "main", tail_map: "tail"}
    assert shipped_map_for(None, maps) == main_map  # not given: the main map (and the verdict says so)
    for vocab in (2, 22, 100, 149):  # sqrt(22 * 1024) = 150: the two testbeds meet there
        assert shipped_map_for(vocab, maps) == main_map
    for vocab in (151, 1024, 32_000, 151_936):
        assert shipped_map_for(vocab, maps) == tail_map
    for bad in (0, 1, -5, 2.5, True, "50000"):
        with pytest.raises(ValueError, match="a vocabulary size must be an integer >= 2"):
            shipped_map_for(bad, maps)


def test_the_placement_names_the_maps_vocabulary(tmp_path):
    main_map, tail_map = _maps(tmp_path)
    assert place_on_map(verdict.load_map(main_map), 0.01, 16.0)["vocab"] == 22
    assert place_on_map(verdict.load_map(tail_map), 0.01, 16.0)["vocab"] == 1024
    assert set(place_on_map(verdict.load_map(tail_map), 0.01, 16.0)) == set(verdict.MAP_KEYS)


def test_compare_with_a_vocab_uses_the_tail_map_and_refers_to_the_main_one_only_without_a_verdict(
        tmp_path, monkeypatch):
    main_map, tail_map = _maps(tmp_path)
    monkeypatch.setattr(verdict, "DEFAULT_MAP", main_map)
    monkeypatch.setattr(verdict, "DEFAULT_TAIL_MAP", tail_map)
    monkeypatch.setattr(verdict, "SHIPPED_MAPS", {main_map: "the map shipped with vexact",
                                                  tail_map: "the tail map shipped with vexact"})
    near = {"sequences": 2, "tokens": 32, "metrics": {"rollout_corr/k3_kl": 0.01}}  # T = 16: the tail map's horizon
    placed, lines = compare_map(near, None, "bypass", vocab=151_936)
    assert placed["vocab"] == 1024 and not placed["verdict"].startswith("no verdict")
    assert any("vocabulary: yours 151,936 tokens; the map's testbed 1,024" in line for line in lines)
    assert not any("for reference, the main map" in line for line in lines)
    far = {"sequences": 2, "tokens": 2000, "metrics": {"rollout_corr/k3_kl": 0.01}}  # T = 1000: the tail map is mute
    placed, lines = compare_map(far, None, "bypass", vocab=151_936)
    assert placed["vocab"] == 1024 and placed["verdict"].startswith("no verdict at this horizon")
    reference = [line for line in lines if "for reference, the main map" in line]
    assert len(reference) == 1 and "extrapolated" in reference[0]  # the main map's law, labelled, not the verdict
    placed, lines = compare_map(far, None, "bypass")  # no vocabulary given: the main map, and it says so
    assert placed["vocab"] == 22 and "extrapolated" in placed["verdict"]
    assert any("yours was not given (--vocab N" in line for line in lines)


def test_vocab_needs_the_map_and_a_size(capsys):
    assert main(["compare", "--vocab", "50000", "r.jsonl"]) == 2
    assert "--vocab chooses a curve of the collapse map: give --map too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "r.jsonl", "--map", "--vocab", "1"])
    assert "expected a vocabulary size (an integer >= 2), got '1'" in capsys.readouterr().err


def test_vocab_with_a_map_file_is_refused(tmp_path, capsys):
    """--vocab picks a shipped map; with --map=FILE (a map of one's own) it was ignored silently. One error now."""
    rollout = tmp_path / "r.jsonl"
    rollout.write_text('{"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}\n')
    own = Path(verdict.__file__).with_name("default_map.json")
    assert main(["compare", f"--map={own}", "--vocab", "50000", str(rollout), str(rollout)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: --vocab picks one of the maps shipped with vexact, and --map={own} names its "
                                 "own map file: give one of them (--vocab with --map alone, no FILE)\n")


def test_live_monitor_takes_the_vocab(tmp_path, monkeypatch):
    from vexact.live import LiveMonitor

    main_map, tail_map = _maps(tmp_path)
    monkeypatch.setattr(verdict, "SHIPPED_MAPS", {main_map: "main", tail_map: "tail"})
    monitor = LiveMonitor(tmp_path / "live", scaling_map="default", correction="bypass", vocab=128_256)
    assert monitor._map(0.01, 16.0)["vocab"] == 1024
    with pytest.raises(ValueError, match="give scaling_map too"):
        LiveMonitor(tmp_path / "live2", vocab=128_256)
    for own in (main_map, str(main_map), json.loads(main_map.read_text())):  # its own map: vocab chose nothing
        with pytest.raises(ValueError, match=r"vocab picks one of the maps shipped with vexact .* give one of them"):
            LiveMonitor(tmp_path / "live3", scaling_map=own, correction="bypass", vocab=128_256)


def test_build_map_only_takes_one_vocabulary_out_of_a_sweep_that_varies_it(tmp_path):
    """The tail sweep varies task.distractors (0 and 1002): its two vocabularies are two testbeds, so build-map
    refuses to merge them, and ``--only task.distractors=1002`` builds the tail map from the one."""
    import shutil

    both = _sweep(tmp_path, "both", [(16, LOW + HIGH)], **TAIL)
    plain = _sweep(tmp_path, "plain", [(16, LOW + HIGH)])
    spec = json.loads((both / "sweep.json").read_text())
    for point in json.loads((plain / "sweep.json").read_text())["points"]:
        name = point["name"] + ",task.distractors=0"
        shutil.copytree(plain / point["dir"], both / "points" / name)
        spec["points"].append({**point, "name": name, "dir": f"points/{name}"})
    (both / "sweep.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="differ in task.distractors"):
        build_map([both])
    tail = build_map([both], only=build.parse_only(["task.distractors=1002"]))
    assert map_vocab(tail) == 1024 and tail["provenance"]["only"] == {"task.distractors": [1002]}
    assert sum(h["runs_total"] for h in tail["horizons"]) == 12  # the tail's 12 runs, none of the plain ones
    assert build.main(["build-map", str(tmp_path / "t.json"), str(both), "--only", "task.distractors=1002"]) == 0
    for bad, said in ((["nope=1"], "'nope' is not a run config key"), (["task.distractors"], "expected KEY=VALUE")):
        with pytest.raises(ValueError, match=said):
            build.parse_only(bad)
    with pytest.raises(ValueError, match=r"no finished runs with task.distractors in \[7\]"):
        build_map([both], only=build.parse_only(["task.distractors=7"]))


def test_a_scoped_only_filters_one_sweep_and_leaves_the_others_whole(tmp_path):
    """``--only SWEEP:KEY=VALUE``: the filter binds the runs of the sweep directory of that name only (the tail map
    keeps the tail sweep's L = 1 and 16, whose L = 80 drops are unconfirmed, and every horizon of the corrections
    sweep). Counter-test: unscoped, the same filter drops the other sweep's horizon too. A scope that names no sweep
    given is one error naming it."""
    first = _sweep(tmp_path, "first", [(8, LOW + HIGH), (16, LOW + HIGH)])
    second = _sweep(tmp_path, "second", [(8, LOW + HIGH), (16, LOW + HIGH)])

    def runs_by_horizon(built: dict) -> dict:
        return {h["horizon_value"]: sorted(Path(s).name for s in h["sweeps"]) for h in built["horizons"]}

    scoped = build_map([first, second], only=build.parse_only(["first:task.max_len=8"]))
    assert runs_by_horizon(scoped) == {8: ["first", "second"], 16: ["second"]}
    assert scoped["provenance"]["only"] == {"first:task.max_len": [8]}
    unscoped = build_map([first, second], only=build.parse_only(["task.max_len=8"]))
    assert runs_by_horizon(unscoped) == {8: ["first", "second"]}
    with pytest.raises(ValueError, match="--only names sweep\\(s\\) third that are not among the sweep directories "
                                         "given \\(first, second\\)"):
        build_map([first, second], only=build.parse_only(["third:task.max_len=8"]))
    with pytest.raises(ValueError, match="'task.nope' is not a run config key"):
        build.parse_only(["first:task.nope=8"])
    with pytest.raises(ValueError, match="no sweep name before ':'"):
        build.parse_only([":task.max_len=8"])


def test_a_curve_with_one_threshold_and_a_bound_answers_at_the_thresholds_horizon(tmp_path):
    """The tail map's shape: no collapse at L = 1 (a bound) and one fitted threshold at L = 16, no law. At the
    threshold's horizon the verdict is that threshold's; far beyond both it is no verdict."""
    tail = build_map([_sweep(tmp_path, "tail", [(1, LOW + HIGH), (16, LOW + HIGH)], never=(1,), **TAIL)])
    assert tail["status"] == "bounds_only"
    at = place_on_map(tail, 0.5, 16.0)
    assert at["verdict"].startswith("above the measured collapse range: 50% collapse threshold")
    assert place_on_map(tail, 1e-5, 16.0)["verdict"].startswith("far below the measured collapse range")
    assert place_on_map(tail, 0.5, 1000.0)["verdict"].startswith("no verdict at this horizon")
    assert place_on_map(tail, 1e-5, 1.0)["verdict"].startswith("below every level tested")


def test_the_shipped_tail_map_is_made_by_build_map_and_picked_for_a_real_vocabulary():
    tail = verdict.load_map(verdict.DEFAULT_TAIL_MAP)
    assert map_vocab(tail) == 1024 and map_vocab(verdict.load_map()) == 22
    # the tail sweep's L = 80 runs are left out until their late drops are confirmed (a filter scoped to that sweep:
    # the corrections sweep's L = 80 runs are kept), and the corrections sweep's epsilon = -0.7 (no run took a
    # gradient step there: it measures nothing) (docs/results/vocab_tail.md)
    assert tail["provenance"]["made_by"].endswith("--only task.distractors=1002 "
                                                  "--only horizon_scaling_tail_sweep:task.max_len=1,16 "
                                                  "--only inject.value=0.0,-0.08,-0.15,-0.3,-0.5,-0.6")
    horizons = {c["correction"]: [h["horizon_value"] for h in c["horizons"]] for c in tail["curves"]}
    assert horizons == {"bypass": [1, 16], "recompute": [1, 16, 80], "token_tis": [1, 16, 80]}
    assert tail["origin"] == verdict.SHIPPED_MAPS[verdict.DEFAULT_TAIL_MAP]
    assert shipped_map_for(151_936) == verdict.DEFAULT_TAIL_MAP and shipped_map_for(22) == verdict.DEFAULT_MAP
    assert build_map([verdict.DEFAULT_TAIL_MAP])["curves"] == json.loads(verdict.DEFAULT_TAIL_MAP.read_text())["curves"]


@pytest.mark.slow
def test_the_shipped_tail_map_is_what_its_command_builds_from_the_kept_logs(tmp_path, monkeypatch):
    """The shipped tail map's ``made_by``, run on the kept logs of the sweeps it names (docs/results/data), builds
    its curves exactly: bypass from the tail sweep alone, recompute and token_tis from the corrections sweep."""
    import shlex
    import tarfile

    root = Path(__file__).resolve().parents[2]
    shipped = json.loads(verdict.DEFAULT_TAIL_MAP.read_text())
    argv = shlex.split(shipped["provenance"]["made_by"])
    assert argv[:4] == ["python", "-m", "vexact.map", "build-map"]
    sweeps = [a for a in argv[5:] if a.startswith("runs/sweeps/")]
    assert sweeps == shipped["provenance"]["sources"]  # the map is built from the runs alone, no file's curves
    for sweep in sweeps:
        name = Path(sweep).name
        with tarfile.open(root / "docs" / "results" / "data" / f"{name}.tar.gz") as tar:
            tar.extractall(tmp_path / "runs" / "sweeps", filter="data")
    monkeypatch.chdir(tmp_path)
    assert build.main(["build-map", "rebuilt.json", *argv[5:]]) == 0
    rebuilt = json.loads((tmp_path / "rebuilt.json").read_text())
    assert rebuilt["curves"] == shipped["curves"]
    by_name = {c["correction"]: c for c in rebuilt["curves"]}
    assert {s for h in by_name["bypass"]["horizons"] for s in h["sweeps"]} == {sweeps[0]}
    for name in ("recompute", "token_tis"):  # three horizons, no threshold: bounds only
        assert {s for h in by_name[name]["horizons"] for s in h["sweeps"]} == {sweeps[1]}
        assert by_name[name]["status"] == "bounds_only"
