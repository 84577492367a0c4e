"""vexact.reports.sweep_report on hand-built sweep directories (no training runs)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from vexact.reports.sweep_plots import sweep_figures
from vexact.reports.sweep_report import write_report
from vexact.reports.sweep_table import (
    _table_cells,
    group_markdown,
    group_table,
    render_table,
    reward_definition,
    reward_summary,
    write_summary_csv,
)
from vexact.sweeps.sweep_data import read_sweep_results
from vexact.sweeps.text_table import TextColumn, print_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 30


def _collapse(collapsed: bool, k3: float, dlogp: float, peak: float, final: float, step: int | None = None,
              lead: int | None = None) -> dict:
    return {"collapsed": collapsed, "collapse_step": step, "collapse_reason": "reward_drop" if collapsed else None,
            "peak_reward": peak, "peak_step": 8, "final_reward": final, "initial_reward": 0.2, "mean_k3_kl": k3,
            "mean_abs_dlogp": dlogp, "mean_k3_kl_before_collapse": k3 / 2 if collapsed else None,
            "length_surge_step": step - lead if lead is not None else None, "length_surge_lead": lead,
            "collapse_unconfirmed_step": None, "criteria": {"drop": 0.5, "patience": 20}}


def _metrics(k3: float, peak: float, collapse_step: int | None) -> list[dict]:
    rows = []
    for step in range(STEPS):
        reward = min(0.2 + 0.1 * step, peak)
        if collapse_step is not None and step >= collapse_step:
            reward = 0.05
        row = {"step": step, "reward/mean": reward, "rollout_corr/k3_kl": k3 * (1 + step / STEPS),
               "mismatch/abs_dlogp_mean": k3 ** 0.5, "response_length/mean": 20.0 + step, "actor/grad_norm": 1.0}
        if step % 5 == 0 or step == STEPS - 1:
            row["eval/reward_mean"] = reward
        rows.append(row)
    rows[7]["actor/grad_norm"] = "nan"  # how runlog writes non-finite floats
    rows[9]["rollout_corr/k3_kl"] = "inf"
    return rows


def _make_sweep(root: Path, points: list[dict], grid: dict, name: str = "tim-test") -> Path:
    """points: dicts with overrides, status, optional error/collapse/metrics."""
    entries = []
    for p in points:
        pname = ",".join(f"{k}={v}" for k, v in p["overrides"].items())
        pdir = Path("points") / pname
        entries.append({"name": pname, "dir": str(pdir), "overrides": p["overrides"], "status": p["status"],
                        "error": p.get("error")})
        (root / pdir).mkdir(parents=True, exist_ok=True)
        if "metrics" in p:
            (root / pdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in p["metrics"]))
        if "collapse" in p:
            summary = {"status": p["status"], "reason": None, "steps_completed": STEPS, "collapse": p["collapse"]}
            (root / pdir / "summary.json").write_text(json.dumps(summary))
    (root / "sweep.json").write_text(json.dumps({"name": name, "grid": grid, "points": entries}))
    return root


def _point(value: float, seed: int, collapsed: bool, k3: float, dlogp: float, peak: float, final: float,
           step: int | None = None, lead: int | None = None) -> dict:
    return {"overrides": {"inject.value": value, "seed": seed}, "status": "completed",
            "collapse": _collapse(collapsed, k3, dlogp, peak, final, step, lead),
            "metrics": _metrics(k3, peak, step if collapsed else None)}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    points = [
        _point(0.1, 0, False, 1e-4, 0.01, 0.8, 0.75),
        _point(0.1, 1, False, 3e-4, 0.03, 0.6, 0.55),
        _point(0.5, 0, True, 2e-3, 0.1, 0.9, 0.1, step=12, lead=3),
        _point(0.5, 1, True, 4e-3, 0.3, 0.7, 0.2, step=17, lead=5),
        {"overrides": {"inject.value": 0.5, "seed": 2}, "status": "failed", "error": "CUDA out of memory"},
    ]
    return _make_sweep(tmp_path / "sweep", points, {"inject.value": [0.1, 0.5], "seed": [0, 1, 2]})


def _check_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    assert path.stat().st_size > 10_000, path


def test_load_sweep_reads_points_and_decodes_non_finite(sweep: Path) -> None:
    data = read_sweep_results(sweep)
    assert data.name == "tim-test" and data.group_keys == ["inject.value"]
    assert [p.status for p in data.points] == ["completed"] * 4 + ["failed"]
    failed = data.points[-1]
    assert failed.metrics == [] and failed.summary is None and failed.error == "CUDA out of memory"
    first = data.points[0]
    assert len(first.metrics) == STEPS and first.run_length == STEPS
    assert math.isnan(first.metrics[7]["actor/grad_norm"]) and first.metrics[9]["rollout_corr/k3_kl"] == math.inf


def test_group_table_values(sweep: Path) -> None:
    low, high = group_table(read_sweep_results(sweep))
    assert low["inject.value"] == 0.1 and high["inject.value"] == 0.5
    assert low["group"] == "inject.value=0.1"
    assert (low["seeds"], low["failed"], low["collapsed"]) == (2, 0, 0)
    assert (high["seeds"], high["failed"], high["collapsed"]) == (2, 1, 2)
    assert low["collapse_rate"] == 0 and high["collapse_rate"] == 1
    assert low["median_collapse_step"] is None and high["median_collapse_step"] == 14.5
    assert low["realised_k3_kl"] == pytest.approx(2e-4) and high["realised_k3_kl"] == pytest.approx(3e-3)
    assert low["realised_abs_dlogp"] == pytest.approx(0.02) and high["realised_abs_dlogp"] == pytest.approx(0.2)
    # peak / final: eval/reward_mean smoothed over 3 evaluations (reward_summary), not the summary's raw final
    assert low["peak_reward"] == pytest.approx(0.7) and high["peak_reward"] == pytest.approx(0.65)
    assert low["final_reward"] == pytest.approx(0.7) and high["final_reward"] == pytest.approx(0.05)
    assert low["length_surge_lead_median"] is None and high["length_surge_lead_median"] == 4


def test_groups_follow_grid_order_with_several_keys(tmp_path: Path) -> None:
    grid = {"inject.value": [0.5, 0.0], "algorithm.old_logprobs": ["rollout", "recompute"], "seed": [0]}
    points = []
    for value in (0.0, 0.5):  # written in the opposite order to the grid
        for mode in ("recompute", "rollout"):
            points.append({"overrides": {"inject.value": value, "algorithm.old_logprobs": mode, "seed": 0},
                           "status": "completed", "collapse": _collapse(False, 1e-3, 0.01, 0.5, 0.5)})
    rows = group_table(read_sweep_results(_make_sweep(tmp_path, points, grid)))
    assert [r["group"] for r in rows] == [
        "inject.value=0.5, algorithm.old_logprobs=rollout", "inject.value=0.5, algorithm.old_logprobs=recompute",
        "inject.value=0, algorithm.old_logprobs=rollout", "inject.value=0, algorithm.old_logprobs=recompute"]
    assert all(r["seeds"] == 1 for r in rows)


def test_summary_csv(sweep: Path, tmp_path: Path) -> None:
    path = write_summary_csv(read_sweep_results(sweep), tmp_path / "out" / "summary.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 5
    for col in ("name", "inject.value", "seed", "status", "error", "collapsed", "collapse_step", "mean_k3_kl",
                "length_surge_lead", "criteria.drop"):
        assert col in rows[0], col
    assert rows[2]["collapsed"] == "true" and rows[2]["collapse_step"] == "12" and rows[0]["collapse_step"] == ""
    assert rows[4]["status"] == "failed" and rows[4]["error"] == "CUDA out of memory" and rows[4]["collapsed"] == ""


def test_write_report(sweep: Path) -> None:
    console = Console(file=io.StringIO(), width=200, record=True)
    result = write_report(sweep, console=console)
    report = sweep / "report"
    names = {p.name for p in result["files"]}
    assert names == {"summary.csv", "table.json", "table.md", "reward_curves.png", "mismatch_vs_step.png",
                     "collapse_vs_magnitude.png", "outcome_vs_realised_k3.png", "dose_response.json",
                     "dose_response.png", "dynamics.json", "failures.json"}  # issue AC: each collapse's failure
    for png in ("reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png",
                "outcome_vs_realised_k3.png"):
        _check_png(report / png)
    assert json.loads((report / "table.json").read_text()) == result["rows"]

    md = (report / "table.md").read_text()
    assert "### tim-test" in md
    assert "| inject.value | seeds | failed | realised k3 KL | realised |Δlogp|" not in md  # pipes are escaped
    assert "| inject.value | seeds | failed | realised k3 KL | realised \\|Δlogp\\| | collapse rate |" in md
    assert "| 0.5 | 2 | 1 | 3.0e-03 | 2.0e-01 | 2/2 | 14.5 | 0.650 | 0.050 | 4 |" in md
    assert "| 0.1 | 2 | 0 | 2.0e-04 | 2.0e-02 | 0/2 | — | 0.700 | 0.700 | — |" in md
    assert "peak reward (smoothed) | final reward (smoothed)" in md
    assert "eval/reward_mean as a trailing mean of 3 evaluation points" in md  # the footnote defines them

    text = console.export_text()
    assert "tim-test" in text and "2/2" in text and "3.0e-03" in text and "CUDA out of memory" in text
    assert text.count("report written to") == 1 and "reward_curves.png" in text
    failures = json.loads((report / "failures.json").read_text())  # each collapse classified, and said
    assert len(failures) == 2 and {f["kind"] for f in failures} <= {"length_lost", "limit_overrun",
                                                                     "reward_lost_at_intact_length"}
    assert "failure kinds of 2 collapse(s)" in text


def test_no_collapse_and_zero_mismatch_group(tmp_path: Path) -> None:
    points = [_point(0.0, s, False, 0.0, 0.0, 0.8, 0.8) for s in (0, 1)]
    points += [_point(0.5, s, False, 1e-3 * (s + 1), 0.05, 0.7, 0.6) for s in (0, 1)]
    sweep = _make_sweep(tmp_path / "zero", points, {"inject.value": [0.0, 0.5], "seed": [0, 1]}, name="zero")
    result = write_report(sweep, console=Console(file=io.StringIO()))
    zero, half = result["rows"]
    assert zero["realised_k3_kl"] == 0 and zero["collapse_rate"] == 0 and zero["median_collapse_step"] is None
    assert half["realised_k3_kl"] == pytest.approx(1.5e-3) and half["collapsed"] == 0
    md = (sweep / "report" / "table.md").read_text()
    assert "failed" not in md  # column shown only when something failed
    assert "| 0 | 2 | 0 | 0 | 0/2 | — | 0.800 | 0.800 | — |" in md
    for png in ("reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png"):
        _check_png(sweep / "report" / png)


def test_empty_sweep_still_reports(tmp_path: Path) -> None:
    points = [{"overrides": {"inject.value": 1.0, "seed": 0}, "status": "failed", "error": "boom"},
              {"overrides": {"inject.value": 1.0, "seed": 1}, "status": "pending"}]
    sweep = _make_sweep(tmp_path / "empty", points, {"inject.value": [1.0], "seed": [0, 1]})
    (row,) = write_report(sweep, console=Console(file=io.StringIO()))["rows"]
    assert (row["seeds"], row["failed"], row["incomplete"], row["collapse_rate"]) == (0, 1, 1, None)
    assert "| 1 | 0 | 1 | — | — | — | — | — | — | — |" in group_markdown([row])
    for png in ("reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png"):
        assert (sweep / "report" / png).read_bytes()[:8] == PNG_SIGNATURE


def test_a_partial_sweep_says_which_points_have_no_result(tmp_path: Path) -> None:
    """A report of a sweep still running, killed or run in rounds (--only) says how many points it leaves out;
    its tables alone read as a smaller sweep."""
    points = [_point(0.0, 0, False, 0.0, 0.0, 0.8, 0.8), _point(0.5, 0, False, 1e-3, 0.05, 0.7, 0.6),
              {"overrides": {"inject.value": 0.0, "seed": 1}, "status": "interrupted"},
              {"overrides": {"inject.value": 0.5, "seed": 1}, "status": "pending"},
              {"overrides": {"inject.value": 0.5, "seed": 2}, "status": "pending"},
              {"overrides": {"inject.value": 0.0, "seed": 2}, "status": "failed", "error": "boom"}]
    sweep = _make_sweep(tmp_path / "partial", points, {"inject.value": [0.0, 0.5], "seed": [0, 1, 2]})
    out = io.StringIO()
    write_report(sweep, console=Console(file=out, width=200))
    note = ("3 of 6 points have no result yet (1 interrupted, 2 pending): the tables cover the points that finished; "
            "re-running the sweep runs or resumes the others.")
    assert note in " ".join(out.getvalue().split())  # the console wraps it
    assert (sweep / "report" / "table.md").read_text().splitlines()[-1] == note
    assert "failed: inject.value=0.0,seed=2 -- boom" in out.getvalue()  # a failed point is named on its own line
    # counter-case: every point has a result, so no note
    done = _make_sweep(tmp_path / "done", points[:2], {"inject.value": [0.0, 0.5], "seed": [0]})
    out = io.StringIO()
    write_report(done, console=Console(file=out, width=200))
    assert "no result yet" not in out.getvalue() and "no result yet" not in (done / "report" / "table.md").read_text()


def test_render_table_returns_table(sweep: Path) -> None:
    console = Console(file=io.StringIO(), width=200, record=True)
    table = render_table(group_table(read_sweep_results(sweep)), console, title="my sweep")
    assert table.title == "my sweep" and table.row_count == 2
    assert "collapse rate" in console.export_text()


def test_missing_sweep_json_raises(tmp_path: Path) -> None:
    (tmp_path / "notasweep").mkdir()
    with pytest.raises(ValueError, match=r"notasweep.*sweep\.json"):
        read_sweep_results(tmp_path / "notasweep")
    with pytest.raises(ValueError, match="sweep.json"):
        write_report(tmp_path / "does-not-exist")


def test_variant_groups_with_lr_trigger_and_surge_columns(tmp_path: Path) -> None:
    """Remedy sweeps group by variant; the LR-trigger columns appear once a point has a triggered schedule."""
    points = []
    for seed in (0, 1):
        points.append({"overrides": {"variant": "none", "seed": seed}, "status": "completed",
                       "collapse": _collapse(True, 0.4, 0.5, 0.5, 0.0, step=40, lead=10 if seed else None)})
        decay = {"overrides": {"variant": "length_lr_decay", "seed": seed}, "status": "completed",
                 "collapse": _collapse(False, 0.4, 0.5, 0.5, 0.45)}
        points.append(decay)
    root = _make_sweep(tmp_path, points, {"variant": ["none", "length_lr_decay"], "seed": [0, 1]})
    for seed, trigger in ((0, 30), (1, None)):
        path = root / "points" / f"variant=length_lr_decay,seed={seed}" / "summary.json"
        summary = json.loads(path.read_text())
        summary["lr_schedule"] = {"kind": "length_triggered", "trigger_step": trigger, "trigger_reason": None,
                                  "decay_period": None}
        path.write_text(json.dumps(summary))
    none, decay = group_table(read_sweep_results(root))
    assert none["group"] == "variant=none" and none["collapsed"] == 2 and none["surge_before_collapse"] == 1
    assert none["lr_decay_triggered"] is None
    assert decay["lr_decay_triggered"] == 1 and decay["lr_trigger_step_median"] == 30
    text = group_markdown([none, decay])
    assert "LR decay fired" in text and "| none |" in text and "| 1/2 |" in text
    plain = group_markdown([none])
    assert "LR decay fired" not in plain and "surge before collapse" in plain


# ----------------------------------------------------------------------------- one reward definition


def test_peak_and_final_reward_share_one_smoothed_definition(tmp_path: Path) -> None:
    """The last raw evaluation (0.7) sits above the smoothed peak (0.6): the old table showed final > peak."""
    evals = [0.6, 0.6, 0.6, 0.5, 0.7]
    metrics = [{"step": 5 * i, "eval/reward_mean": v, "reward/mean": 0.1} for i, v in enumerate(evals)]
    collapse = _collapse(False, 1e-3, 0.01, peak=0.6, final=0.7)  # what collapse.py writes: raw final
    collapse["criteria"] = {"metric": "eval/reward_mean", "smoothing": 3}
    sweep = _make_sweep(tmp_path / "s", [{"overrides": {"inject.value": 0.1, "seed": 0}, "status": "completed",
                                          "collapse": collapse, "metrics": metrics}],
                        {"inject.value": [0.1], "seed": [0]})
    data = read_sweep_results(sweep)
    r = reward_summary(data.points[0])
    assert r["peak"] == pytest.approx(0.6) and r["peak_step"] == 0  # smoothed: 0.6 0.6 0.6 0.567 0.6
    assert r["final"] == pytest.approx((0.6 + 0.5 + 0.7) / 3) and r["final_step"] == 20
    assert r["final"] <= r["peak"]
    (row,) = group_table(data)
    assert row["peak_reward"] == pytest.approx(0.6) and row["final_reward"] == pytest.approx(0.6)
    csv_row = next(csv.DictReader(write_summary_csv(data, tmp_path / "summary.csv").open()))
    assert float(csv_row["final_reward"]) == 0.7  # the collapse summary's raw value, kept as it is ...
    assert float(csv_row["final_reward_smoothed"]) == pytest.approx(0.6)  # ... next to the table's definition
    # another smoothing in the run's criteria changes both numbers and the footnote together
    data.points[0].summary["collapse"]["criteria"]["smoothing"] = 1
    r1 = reward_summary(data.points[0])
    assert (r1["peak"], r1["final"]) == (0.7, 0.7)
    assert "unsmoothed" in reward_definition(data.points)


def test_peak_reward_without_metrics_falls_back_to_the_summary_peak() -> None:
    from vexact.sweeps.sweep_data import PointData

    point = PointData(name="p", dir=Path("."), overrides={}, status="completed",
                      summary={"collapse": _collapse(False, 1e-3, 0.01, peak=0.55, final=0.9)})
    r = reward_summary(point)
    assert r["peak"] == 0.55 and r["final"] is None  # the raw final is not passed off as the smoothed one


# ----------------------------------------------------------------------------- tables at any width


def _wide_sweep(root: Path) -> Path:
    """Long keys and values, every optional column (failed, LR trigger), numbers of every format."""
    grid = {"algorithm.old_logprobs": ["rollout", "recompute"],
            "variant": ["none", "recompute_token_tis", "tis_length_lr_decay"], "seed": [0, 1]}
    points = []
    for i, mode in enumerate(grid["algorithm.old_logprobs"]):
        for j, variant in enumerate(grid["variant"]):
            for seed in (0, 1):
                k3 = 5.2e-2 * 10 ** (-(i + j)) * (1 + seed)
                collapsed = j == 0 and mode == "rollout"
                points.append({"overrides": {"algorithm.old_logprobs": mode, "variant": variant, "seed": seed},
                               "status": "completed",
                               "collapse": _collapse(collapsed, k3, 3.7e-2 * (j + 1), 0.9, 0.1,
                                                     step=12 + seed if collapsed else None, lead=3 if collapsed
                                                     else None),
                               "metrics": _metrics(k3, 0.6 + 0.1 * j, 12 + seed if collapsed else None)})
    points.append({"overrides": {"algorithm.old_logprobs": "recompute", "variant": "none", "seed": 2},
                   "status": "failed", "error": "boom"})
    root = _make_sweep(root, points, grid, name="a-sweep-with-a-rather-long-name")
    path = root / "points" / "algorithm.old_logprobs=rollout,variant=tis_length_lr_decay,seed=0" / "summary.json"
    summary = json.loads(path.read_text())
    summary["lr_schedule"] = {"kind": "length_triggered", "trigger_step": 17}
    path.write_text(json.dumps(summary))
    return root


@pytest.mark.parametrize("width", [80, 100, 160])
def test_table_never_cuts_a_number_or_a_header_word(tmp_path: Path, width: int) -> None:
    data = read_sweep_results(_wide_sweep(tmp_path / "wide"))
    rows = group_table(data)
    console = Console(file=io.StringIO(), width=width, record=True)
    render_table(rows, console, title=data.name, notes=[reward_definition(data.points)])
    text = console.export_text()
    headers, body = _table_cells(rows, data.group_keys)
    assert len(body) == 6 and len(headers) >= 14  # failed and both LR columns are shown
    for cells in body:
        for cell in cells:
            assert cell in text, (width, cell)  # never "5.2e…" or a number split over two lines
    for word in {w for h in headers for w in h.split()}:
        assert word in text, (width, word)  # full header words, in the header or in the legend
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    if width == 80:  # no layout fits 80 columns but the vertical one: every header is a row label
        assert all(h in text for h in headers)


def test_narrow_table_uses_a_legend_for_abbreviated_headers(tmp_path: Path) -> None:
    data = read_sweep_results(_wide_sweep(tmp_path / "wide"))
    rows = [r for r in group_table(data) if r["algorithm.old_logprobs"] == "rollout"]
    for row in rows:  # keep the table narrow enough for the abbreviated layout at 100 columns
        row["variant"] = row["variant"][:4]
    console = Console(file=io.StringIO(), width=100, record=True)
    render_table(rows, console, title="t")
    text = console.export_text()
    assert "columns: old_logprobs = algorithm.old_logprobs; n = seeds; k3 = realised k3 KL" in " ".join(text.split())
    for cells in _table_cells(rows, data.group_keys)[1]:
        assert all(cell in text for cell in cells)


def test_dynamics_table_fits_80_columns(tmp_path: Path) -> None:
    """Long group labels wrap at spaces; the numbers beside them stay whole."""
    columns = [TextColumn("group", ["algorithm.old_logprobs=recompute, variant=tis_length_lr_decay"],
                          justify="left", wrap=True),
               *[TextColumn(f"numeric column {i}", ["-1.234567e-05"]) for i in range(4)]]
    console = Console(file=io.StringIO(), width=80, record=True)
    print_table(console, "t", columns)
    text = console.export_text()
    assert text.count("-1.234567e-05") == 4 and "tis_length_lr_decay" in text
    assert max(len(line) for line in text.splitlines()) <= 80


# ----------------------------------------------------------------------------- plots


def _colour_distance(a: tuple, b: tuple) -> float:
    return max(abs(x - y) for x, y in zip(a[:3], b[:3]))


def _legend_is_outside(fig, ax) -> bool:
    fig.canvas.draw()
    legend = ax.get_legend()
    return legend is not None and legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_plots_tell_groups_and_seeds_apart(sweep: Path) -> None:
    from matplotlib.colors import to_rgba

    data = read_sweep_results(sweep)
    figures = sweep_figures(data)
    assert set(figures) == {"reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png",
                            "outcome_vs_realised_k3.png"}
    for name in ("reward_curves.png", "mismatch_vs_step.png"):
        ax = figures[name].axes[0]
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
        assert len(lines) == 4, name  # one per point with metrics (the failed one has none)
        low, high = lines[:2], lines[2:]  # points in sweep order: value 0.1 seeds 0, 1; value 0.5 seeds 0, 1
        # close magnitudes get clearly different colours and markers ...
        assert _colour_distance(to_rgba(low[0].get_color()), to_rgba(high[0].get_color())) > 0.3, name
        assert low[0].get_marker() != high[0].get_marker()
        # ... seeds of a group share both and differ in line style
        assert low[0].get_color() == low[1].get_color() and low[0].get_linestyle() != low[1].get_linestyle()
        assert _legend_is_outside(figures[name], ax), name
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {"inject.value=0.1", "inject.value=0.5", "seed 0", "seed 1"} <= set(labels)
    xlabel = figures["collapse_vs_magnitude.png"].axes[0].get_xlabel()
    assert "collapse." not in xlabel and "realised mismatch" in xlabel
    import matplotlib.pyplot as plt

    plt.close("all")


def test_coinciding_groups_stay_visible(tmp_path: Path) -> None:
    """Two remedies with identical curves ("none" and "token_tis"): the first is drawn wider, underneath."""
    grid = {"variant": ["none", "token_tis"], "seed": [0]}
    points = [{"overrides": {"variant": v, "seed": 0}, "status": "completed",
               "collapse": _collapse(True, 0.5, 1.0, 0.5, 0.1, step=12), "metrics": _metrics(0.5, 0.5, 12)}
              for v in grid["variant"]]
    figures = sweep_figures(read_sweep_results(_make_sweep(tmp_path, points, grid)))
    none, tis = [line for line in figures["reward_curves.png"].axes[0].get_lines() if len(line.get_xdata()) > 1]
    assert list(none.get_ydata()) == list(tis.get_ydata())
    assert none.get_linewidth() > tis.get_linewidth() and none.get_zorder() < tis.get_zorder()
    assert none.get_markersize() > tis.get_markersize() and none.get_marker() != tis.get_marker()
    ax = figures["collapse_vs_magnitude.png"].axes[0]
    a, b = ax.collections[:2]
    assert a.get_sizes()[0] > b.get_sizes()[0] and a.get_zorder() < b.get_zorder()  # nested, not hidden
    assert _legend_is_outside(figures["collapse_vs_magnitude.png"], ax)
    import matplotlib.pyplot as plt

    plt.close("all")


def test_outcome_vs_realised_k3_plots_the_table_values(sweep: Path) -> None:
    data = read_sweep_results(sweep)
    rows = group_table(data)
    fig = sweep_figures(data)["outcome_vs_realised_k3.png"]
    top, bottom = fig.axes[:2]
    rate_points = sorted(tuple(c.get_offsets()[0]) for c in top.collections)
    assert rate_points == sorted((r["realised_k3_kl"], r["collapse_rate"]) for r in rows)
    filled = [c for c in bottom.collections if len(c.get_facecolor())]  # group means; runs are hollow
    group_means = [tuple(c.get_offsets()[0]) for c in filled]
    assert sorted(group_means) == sorted((r["realised_k3_kl"], r["final_reward"]) for r in rows)
    assert len(bottom.collections) == len(rows) + 4  # plus one hollow marker per run with a result
    assert top.get_ylabel().startswith("collapse rate") and bottom.get_ylabel() == "final reward (smoothed)"
    assert "realised mismatch" in bottom.get_xlabel() and bottom.get_xscale() == "log"
    import matplotlib.pyplot as plt

    plt.close("all")


# ----------------------------------------------------------------------------- the command


def test_cli_report_prints_the_written_line_once(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vexact.cli import main

    assert main(["report", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert out.count("report written to") == 1 and "wrote " not in out


def test_report_of_a_directory_that_is_neither_a_run_nor_a_sweep(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from vexact.cli import main
    from vexact.reports.run_report import write_any_report

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a sweep directory .* nor a run directory"):
        write_any_report(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        write_any_report(tmp_path / "missing")
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a sweep directory" in err


def test_unconfirmed_drops_get_their_own_column_only_when_there_are_some(tmp_path: Path) -> None:
    """A run that fell below the drop too late for the detector's patience is neither a collapse nor a survival:
    the table counts it in its own column (absent while no run has one)."""
    points = [_point(0.5, seed, False, 0.3, 0.5, 0.8, 0.2) for seed in (0, 1)] + [
        _point(0.1, seed, False, 0.01, 0.1, 0.8, 0.8) for seed in (0, 1)]
    points[1]["collapse"]["collapse_unconfirmed_step"] = 25
    rows = {r["inject.value"]: r for r in group_table(read_sweep_results(
        _make_sweep(tmp_path / "late", points, {"inject.value": [0.5, 0.1], "seed": [0, 1]})))}
    assert rows[0.5]["unconfirmed"] == 1 and rows[0.5]["collapsed"] == 0 and rows[0.1]["unconfirmed"] == 0
    write_report(tmp_path / "late", console=Console(file=io.StringIO()))
    text = (tmp_path / "late" / "report" / "table.md").read_text()
    assert "dropped, unconfirmed at the end" in text and "| 1/2 |" in text
    points[1]["collapse"]["collapse_unconfirmed_step"] = None
    _make_sweep(tmp_path / "none_late", points, {"inject.value": [0.5, 0.1], "seed": [0, 1]})
    write_report(tmp_path / "none_late", console=Console(file=io.StringIO()))
    assert "unconfirmed" not in (tmp_path / "none_late" / "report" / "table.md").read_text()


# ----------------------------------------------------------------------------- user text, and hand-edited sweep.json


def test_user_text_is_printed_as_text_not_markup(tmp_path: Path) -> None:
    """A sweep error holding "[/data/shard-7]" ended the report (and vexact sweep, demo) with a MarkupError; a name
    like exp[v2] lost its "[v2]", and a value "[batch, seq, hidden]" vanished from its cell."""
    points = [{"overrides": {"inject.mode": "[batch, seq, hidden]", "seed": 0}, "status": "failed",
               "error": "OSError: cannot read [/data/shard-7]"},
              {**_point(0.1, 1, False, 1e-4, 0.01, 0.8, 0.75), "overrides": {"inject.mode": "[batch, seq, hidden]",
                                                                              "seed": 1}}]
    sweep = _make_sweep(tmp_path / "marked", points, {"inject.mode": ["[batch, seq, hidden]"], "seed": [0, 1]},
                        name="exp[v2]")
    console = Console(file=io.StringIO(), width=200, record=True)
    write_report(sweep, console=console)
    text = console.export_text()
    assert "failed: inject.mode=[batch, seq, hidden],seed=0 -- OSError: cannot read [/data/shard-7]" in text
    assert "exp[v2]" in text and "│ [batch, seq, hidden] │" in text
    narrow = Console(file=io.StringIO(), width=24, record=True)  # the vertical layout too
    print_table(narrow, "exp[v2]", [TextColumn("[group]", ["[b,s]", "[x]"]), TextColumn("[/n]", ["1", "2"]),
                                    TextColumn("[value]", ["[batch, seq, hidden]", "3"])])
    text = narrow.export_text()
    assert "exp[v2] (1/2)" in text and "│ [group] │ [x] │" in text and "│ [/n]    │   2 │" in text


def test_the_mismatch_plot_says_exact_only_for_k3_logged_finite_and_zero(tmp_path: Path) -> None:
    """A group whose k3 was Inf at every step was labelled "k3 KL = 0 throughout"."""
    import matplotlib.pyplot as plt

    points = [_point(0.0, 0, False, 0.0, 0.0, 0.8, 0.8), _point(0.5, 0, False, 1e-3, 0.05, 0.7, 0.6)]
    for row in points[1]["metrics"]:
        row["rollout_corr/k3_kl"] = "inf"
    sweep = _make_sweep(tmp_path / "inf", points, {"inject.value": [0.0, 0.5], "seed": [0]})
    fig = sweep_figures(read_sweep_results(sweep))["mismatch_vs_step.png"]
    labels = [t.get_text() for ax in fig.axes for legend in [ax.get_legend()] if legend for t in legend.get_texts()]
    labels += [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    plt.close("all")
    assert "inject.value=0: k3 KL non-finite at 1 of 30 steps; not drawable on a log axis" in labels
    assert "inject.value=0.5: k3 KL non-finite at 30 of 30 steps; not drawable on a log axis" in labels


def _edited_sweep(tmp_path: Path, edit) -> Path:
    points = [_point(0.1, seed, False, 1e-4, 0.01, 0.8, 0.75) for seed in (0, 1)]
    sweep = _make_sweep(tmp_path / "edited", points, {"inject.value": [0.1], "seed": [0, 1]})
    spec = json.loads((sweep / "sweep.json").read_text())
    edit(spec)
    (sweep / "sweep.json").write_text(json.dumps(spec))
    return sweep


@pytest.mark.parametrize(("edit", "damage", "kept"), [
    (lambda s: s["points"].append("oops"), "points[2] (sweep.json points[2]: 'oops', expected a point entry", 2),
    (lambda s: s["points"][0].update(overrides=[1, 2]),
     "(sweep.json points[0]: field 'overrides' is [1, 2], expected a mapping of keys to values or null)", 1),
    (lambda s: s["points"][0].update(dir=5), "(sweep.json points[0]: field 'dir' is 5, expected a path string", 1),
])
def test_a_hand_edited_sweep_entry_is_damage_naming_it(tmp_path, edit, damage, kept) -> None:
    """Such entries gave tracebacks, --skip-damaged or not."""
    sweep = _edited_sweep(tmp_path, edit)
    with pytest.raises(ValueError, match="1 damaged or unreadable point: ") as err:
        write_report(sweep, console=Console(file=io.StringIO()))
    assert damage in str(err.value)
    result = write_report(sweep, console=Console(file=io.StringIO()), skip_damaged=True)
    assert len(result["skipped"]) == 1 and result["rows"][0]["seeds"] == kept


def test_a_hand_edited_sweep_grid_is_one_error_naming_file_and_field(tmp_path) -> None:
    sweep = _edited_sweep(tmp_path, lambda s: s.update(grid=["a"]))
    with pytest.raises(ValueError, match=r"edited/sweep.json: field 'grid' is \['a'\], expected a mapping"):
        write_report(sweep, console=Console(file=io.StringIO()), skip_damaged=True)
    sweep = _edited_sweep(tmp_path / "b", lambda s: s["grid"].update({"inject.value": "abc"}))
    with pytest.raises(ValueError, match=r"sweep.json: field 'grid.inject.value' is 'abc', expected a list"):
        write_report(sweep, console=Console(file=io.StringIO()))
