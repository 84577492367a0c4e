"""dynamics.json's ``surge`` block: each quantity before / during / after the length surge, the ratio,
and the collapse lead, on synthetic runs whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.studies.surge_plot import surge_table
from vexact.sweeps.dynamics import mismatch_dynamics, run_phases
from vexact.sweeps.sweep_data import read_sweep_results

STEPS = 60
SURGE = 30  # the detector's step: steps [20, 40) are "during", [0, 20) "before", [40, 60) "after"


def _rows(seed: int) -> list[dict]:
    """Length 4 -> 12 at step 25; the per-sequence mismatch grows with it, the per-token k3 stays flat."""
    out = []
    for s in range(STEPS):
        length = 4.0 if s < 25 else 12.0
        out.append({"step": s, "response_length/mean": length, "reward/mean": 0.5 if s < 25 else 0.9,
                    "rollout_corr/k3_kl": 1e-3 * (1 + 0.01 * seed), "rollout_corr/log_ppl_abs_diff": 0.01,
                    "mismatch/log_ppl_abs_diff_sum": 0.01 * length, "actor/grad_norm": 1.0,
                    "actor/entropy": 0.3 if s < 25 else 0.1})
    return out


def _sweep(root: Path, collapse: dict[str, dict]) -> Path:
    entries = []
    for name, col in collapse.items():
        d = root / "points" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(int(name[-1]))))
        (d / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": STEPS,
                                                    "collapse": col}))
        entries.append({"name": name, "dir": f"points/{name}", "overrides": {"src": name[:-1], "seed": int(name[-1])},
                        "status": "completed"})
    (root / "sweep.json").write_text(json.dumps({"name": "s", "grid": {}, "points": entries}))
    return root


def test_phases_and_ratios(tmp_path: Path) -> None:
    surged = {"collapsed": False, "length_surge_step": SURGE}
    data = read_sweep_results(_sweep(tmp_path, {"a0": surged, "a1": surged, "b0": {"collapsed": False}}))
    by_group = {d["group"]: d["surge"] for d in mismatch_dynamics(data)}
    a = by_group["src=a"]
    assert a["runs"] == 2 and a["runs_surged"] == 2 and a["surge_step"] == SURGE
    length = a["phases"]["response_length"]
    assert length["before"] == 4.0 and length["after"] == 12.0 and length["after_before"] == pytest.approx(3.0)
    assert length["during"] == pytest.approx((5 * 4.0 + 15 * 12.0) / 20)  # steps 20..39: 5 before 25, 15 from it
    assert a["phases"]["seq_log_ratio_abs"]["after_before"] == pytest.approx(3.0)  # grows with the length ...
    assert a["phases"]["k3"]["after_before"] == pytest.approx(1.0)  # ... the per-token k3 does not
    assert by_group["src=b"]["runs_surged"] == 0 and by_group["src=b"]["phases"]["k3"]["before"] is None
    assert "| src=a | response_length | 4 | 10 | 12 | 3.00× |" in surge_table(tmp_path)


def test_steps_from_the_collapse_on_are_left_out_and_the_lead_is_counted(tmp_path: Path) -> None:
    col = {"collapsed": True, "collapse_step": 45, "length_surge_step": SURGE, "length_surge_lead": 15}
    data = read_sweep_results(_sweep(tmp_path, {"a0": col}))
    point = data.points[0]
    point.metrics[50]["response_length/mean"] = 1000.0  # after the collapse: must not count
    assert run_phases(point)["response_length"]["after"] == 12.0
    s = mismatch_dynamics(data)[0]["surge"]
    assert s["length_surge_lead"] == [15] and s["collapsed_after_surge"] == 1 and s["collapsed_without_surge"] == 0
