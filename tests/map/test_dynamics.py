"""vexact.sweeps.dynamics: growth of the realised mismatch during a run and what it moves with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vexact.sweeps.dynamics import mismatch_dynamics, run_dynamics
from vexact.sweeps.sweep_data import read_sweep_results

STEPS = 50


def _sweep(root: Path, runs: dict[str, list[dict]]) -> Path:
    entries = []
    for name, rows in runs.items():
        (root / "points" / name).mkdir(parents=True)
        (root / "points" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"status": "completed", "steps_completed": STEPS, "collapse": {"collapsed": False}}
        (root / "points" / name / "summary.json").write_text(json.dumps(summary))
        entries.append({"name": name, "dir": f"points/{name}", "overrides": {"src": name[:-1], "seed": int(name[-1])},
                        "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"name": "d", "grid": {}, "points": entries}))
    return root


def _sharpening(seed: int) -> list[dict]:
    """k3 doubles over the run while entropy falls; length is flat noise."""
    return [{"step": s, "rollout_corr/k3_kl": 1e-4 * 2 ** (s / STEPS) * (1 + 0.01 * seed),
             "actor/entropy": 0.3 - 0.004 * s, "actor/grad_norm": 1.0 + 0.01 * ((s * 7) % 5),
             "response_length/mean": 10.0 + (s * 3) % 4} for s in range(STEPS)]


def test_growing_mismatch_is_reported_with_what_it_tracks(tmp_path: Path) -> None:
    exact = [{"step": s, "rollout_corr/k3_kl": 0.0, "actor/entropy": 0.2} for s in range(STEPS)]
    data = read_sweep_results(_sweep(tmp_path, {"bf0": _sharpening(0), "bf1": _sharpening(1), "none0": exact}))
    by_group = {d["group"]: d for d in mismatch_dynamics(data)}
    bf = by_group["src=bf"]
    assert bf["runs"] == 2 and bf["runs_growing"] == 2
    assert bf["growth"] == pytest.approx(2 ** 0.8, rel=0.05)  # last fifth vs first fifth of a doubling
    assert bf["corr"]["entropy"] == pytest.approx(-1.0, abs=1e-6)  # log k3 is linear in step, entropy too
    assert abs(bf["corr"]["response_length"]) < 0.5
    none = {k: v for k, v in by_group["src=none"].items() if k != "surge"}  # surge: tests/map/test_surge_phases.py
    assert none == {"group": "src=none", "runs": 0}  # k3 = 0 throughout: no statement
    assert by_group["src=none"]["surge"]["runs_surged"] == 0  # flat length: no surge


def test_steps_after_a_collapse_do_not_count(tmp_path: Path) -> None:
    rows = _sharpening(0)
    for r in rows[30:]:
        r["rollout_corr/k3_kl"] = 10.0  # the collapsed policy's mismatch explodes
    data = read_sweep_results(_sweep(tmp_path, {"bf0": rows}))
    point = data.points[0]
    point.summary["collapse"] = {"collapsed": True, "collapse_step": 30}
    assert run_dynamics(point)["k3_late"] < 1e-3
