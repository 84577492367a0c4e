"""vexact.lab.report on hand-built sweep directories (no training runs)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from vexact.lab.report import (
    group_table,
    markdown_table,
    read_sweep_results,
    render_table,
    write_report,
    write_summary_csv,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 30


def _collapse(collapsed: bool, k3: float, dlogp: float, peak: float, final: float, step: int | None = None,
              lead: int | None = None) -> dict:
    return {"collapsed": collapsed, "collapse_step": step, "collapse_reason": "reward drop" if collapsed else None,
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
    assert low["peak_reward"] == pytest.approx(0.7) and high["peak_reward"] == pytest.approx(0.8)
    assert low["final_reward"] == pytest.approx(0.65) and high["final_reward"] == pytest.approx(0.15)
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
                     "collapse_vs_magnitude.png", "dose_response.json", "dose_response.png", "dynamics.json"}
    for png in ("reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png"):
        _check_png(report / png)
    assert json.loads((report / "table.json").read_text()) == result["rows"]

    md = (report / "table.md").read_text()
    assert "### tim-test" in md
    assert "| inject.value | seeds | failed | realised k3 KL | realised |Δlogp|" not in md  # pipes are escaped
    assert "| inject.value | seeds | failed | realised k3 KL | realised \\|Δlogp\\| | collapse rate |" in md
    assert "| 0.5 | 2 | 1 | 3.0e-03 | 2.0e-01 | 2/2 | 14.5 | 0.800 | 0.150 | 4 |" in md
    assert "| 0.1 | 2 | 0 | 2.0e-04 | 2.0e-02 | 0/2 | — | 0.700 | 0.650 | — |" in md

    text = console.export_text()
    assert "tim-test" in text and "2/2" in text and "3.0e-03" in text and "CUDA out of memory" in text


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
    assert "| 1 | 0 | 1 | — | — | — | — | — | — | — |" in markdown_table([row])
    for png in ("reward_curves.png", "mismatch_vs_step.png", "collapse_vs_magnitude.png"):
        assert (sweep / "report" / png).read_bytes()[:8] == PNG_SIGNATURE


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
    text = markdown_table([none, decay])
    assert "LR decay fired" in text and "| none |" in text and "| 1/2 |" in text
    plain = markdown_table([none])
    assert "LR decay fired" not in plain and "surge before collapse" in plain
