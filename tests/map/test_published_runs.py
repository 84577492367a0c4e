"""The map against published runs: the docs tables are the command's output, and the map columns are computed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_map_corrections import _two_correction_map

from tools import published
from tools.published import (
    PublishedPoint,
    _horizon_text,
    agreement,
    horizon_at,
    load_published,
    measured_horizon_at,
    points_table,
)
from vexact.map import build, verdict

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results" / "published_runs.md"


def _blocks(text: str) -> dict[str, str]:
    found = re.findall(r"<!-- generated: (.+?) -->\n(.*?)\n<!-- end generated -->", text, flags=re.S)
    return {command: body for command, body in found}


def test_the_page_tables_are_the_command_output(capsys):
    assert published.main([]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    first, second = printed.split("\n\n")
    blocks = _blocks(PAGE.read_text())
    assert blocks["python -m tools.published (first table)"] == first
    assert blocks["python -m tools.published (second table)"] == second
    assert build.main(["shape"]) == 0
    shape = capsys.readouterr().out.rstrip("\n")
    assert blocks["python -m vexact.map shape"] == f"```\n{shape}\n```"


def test_every_point_is_on_the_table_with_its_source():
    points, bars = load_published()
    table = points_table(verdict.load_map(), points)
    assert len(table.splitlines()) == 2 + len(points)
    for p in points:
        assert p.source in table
    assert {p.outcome for p in points} <= set(published.OUTCOMES)
    assert len(bars) >= 4


def test_the_map_columns_are_computed_not_typed(tmp_path):
    """A map with a recompute curve of bounds and a fitted bypass curve: the same data gives other cells."""
    m = _two_correction_map(tmp_path)
    survived = PublishedPoint("a", "src A", "model", "k3 0.025", "survived", k3=0.025, horizon=8.0,
                              correction="recompute")
    collapsed = PublishedPoint("b", "src B", "model", "k3 1e-6", "collapsed", k3=1e-6, horizon=30.0,
                               correction="bypass")
    table = points_table(m, [survived, collapsed]).splitlines()
    assert "below every level tested: no collapse measured up to k3 0.37 at T 8.5 (recompute)" in table[2]
    assert table[2].endswith("| agrees |")
    assert "far below the measured collapse range (threshold" in table[3] and table[3].endswith("| disagrees |")
    bypass_only = {**m, "curves": [c for c in m["curves"] if c["correction"] == "bypass"]}
    missing = points_table(bypass_only, [survived]).splitlines()[2]
    assert "no recompute curve on the map" in missing and "bypass law" in missing  # never the bypass verdict as theirs
    shipped = points_table(verdict.load_map(), [survived]).splitlines()[2]  # the shipped map has a recompute curve
    assert "no collapse measured up to" in shipped and "(recompute)" in shipped and shipped.endswith("| agrees |")


def test_the_tail_column_is_what_compare_vocab_answers(tmp_path):
    """Every published run has a real vocabulary, so ``compare --map --vocab`` answers from the tail map: its column
    is that map's verdict, on their correction's curve when it has one, else on its bypass curve, named."""
    from test_build_map import HIGH, LOW, _sweep

    tail = build.build_map([_sweep(tmp_path, "tail", [(16, LOW + HIGH)], **{"task.distractors": 1002})])
    far = PublishedPoint("a", "src A", "model", "k3 0.01", "survived", k3=0.01, horizon=100_000.0,
                         correction="recompute")
    near = PublishedPoint("b", "src B", "model", "k3 0.5", "collapsed", k3=0.5, horizon=16.0, correction="bypass")
    table = points_table(_two_correction_map(tmp_path), [far, near], tail).splitlines()
    assert table[0].endswith("| tail map (V = 1,024, what --vocab picks) |")
    assert table[2].endswith("| bypass curve: no verdict at T = 100,000 (measured at T = 16 .. 16) |")
    assert table[3].endswith("| above the measured collapse range: 50% collapse threshold k3 0.05 [0.024, 0.11] "
                             "measured at T 16.0 only (bypass) |")  # their correction's curve: no label
    assert len(points_table(_two_correction_map(tmp_path / "m"), [far]).splitlines()[0].split("|")) == 12  # no tail


def test_agreement_and_horizon_at():
    assert agreement("collapsed", "above the measured collapse range") == "agrees"
    assert agreement("survived", "above the measured collapse range; extrapolated") == "disagrees"
    assert agreement("survived", "near the measured collapse range").startswith("consistent")
    assert agreement("collapsed", "far below the measured collapse range") == "disagrees"
    assert agreement("survived", "below every level tested: no collapse measured up to k3 0.37") == "agrees"
    assert agreement("not stated", "above").startswith("cannot test")
    assert agreement("collapsed", "no verdict at this horizon").startswith("cannot test")
    curve = verdict.curve_for(verdict.load_map(), "bypass")
    t = horizon_at(curve, 0.013)
    assert verdict.place_on_map(verdict.load_map(), 0.013, t, "bypass")["threshold_50"] == pytest.approx(0.013)
    assert horizon_at({"status": "bounds_only"}, 0.01) is None
    # a horizon whose runs all collapsed from k3 0.003 at T = 400, where the law (0.1 at T = 1, α = 0.5) says 0.005
    measured = {"status": "fitted", "log10_prefactor": -1.0, "alpha": 0.5,
                "horizons": [{"status": "below_range", "horizon": 400.0, "upper_bound": 0.003}]}
    assert measured_horizon_at(measured, 0.004) == (400.0, 0.003) and measured_horizon_at(measured, 0.002) is None
    assert _horizon_text(measured, 0.004) == ("the threshold is below it by T ≈ 400 (measured: every run collapsed "
                                              "there, from k3 0.003); the law says T ≈ 625")
    # where the fit put the 50% point below the smallest dose though a run held there, the counts say so
    measured["horizons"][0].update(runs=4, collapsed=3)
    assert _horizon_text(measured, 0.004) == ("the threshold is below it by T ≈ 400 (measured: 3 of 4 runs collapsed "
                                              "there, from k3 0.003); the law says T ≈ 625")
    assert _horizon_text(measured, 0.02) == "the threshold falls to it at T ≈ 25"  # the law says earlier: it stands
    assert _horizon_text(measured, 0.002) == "the threshold falls to it at T ≈ 2,500"  # nothing measured at 0.002


def test_bad_data_is_one_sentence(tmp_path):
    entry = {"id": "x", "source": "s", "model": "m", "published": "p", "outcome": "exploded"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"points": [entry]}))
    with pytest.raises(ValueError, match=r"points\[0\] \(x\): outcome 'exploded' is none of collapsed"):
        load_published(path)
    path.write_text(yaml.safe_dump({"points": [{**entry, "outcome": "survived", "correction": "tis"}]}))
    with pytest.raises(ValueError, match="correction 'tis' is none of bypass"):
        load_published(path)
    path.write_text(yaml.safe_dump({"points": [{**entry, "outcome": "survived", "k3": -1}]}))
    with pytest.raises(ValueError, match="k3 must be a positive number"):
        load_published(path)
    path.write_text(yaml.safe_dump({"points": [{**entry, "colour": "red"}]}))
    with pytest.raises(ValueError, match=r"points\[0\]: .*colour"):
        load_published(path)
