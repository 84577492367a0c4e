"""``python -m tools.studies.run_on_map``: a finished run's realised k3 (before collapse) and T on the map."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tools.studies.run_on_map import main, run_on_map
from vexact.map.verdict import load_map, place_on_map
from vexact.rl.collapse import detect_collapse
from vexact.rl.config_schema import CollapseSection

K3 = [1e-3 * (1 + step) for step in range(40)]  # rising: the mean before collapse differs from the run mean


def _run(root: Path, old_logprobs: str = "rollout", collapse: bool = True, k3: bool = True) -> Path:
    """40 steps at L = 16 whose eval reward drops at step 25 (collapse confirmed at step 30) when ``collapse``."""
    root.mkdir(parents=True)
    rows = []
    for step in range(40):
        row = {"step": step, "reward/mean": 0.3, "response_length/mean": 18.0 if step < 20 else 22.0}
        if k3:
            row["rollout_corr/k3_kl"] = K3[step]
        if step % 5 == 0 or step == 39:
            row["eval/reward_mean"] = 0.6 if step < 25 or not collapse else 0.05
        rows.append(row)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "config.yaml").write_text(f"name: hand\nsteps: 40\ndtype: bfloat16\ntask: {{max_len: 16}}\n"
                                      f"algorithm: {{old_logprobs: {old_logprobs}}}\ncollapse: {{patience: 5}}\n")
    (root / "summary.json").write_text(json.dumps({
        "name": "hand", "status": "completed", "steps_completed": 40, "steps_planned": 40,
        "collapse": detect_collapse(rows, CollapseSection(patience=5))}))
    return root


def test_dose_and_t_are_the_means_before_collapse(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    map_data = load_map(None)
    placed = run_on_map(run, map_data)
    assert placed["collapsed"] is True
    assert placed["k3"] == pytest.approx(math.fsum(K3[:30]) / 30, rel=1e-12)  # the steps before collapse (step 30)
    assert placed["k3"] != pytest.approx(math.fsum(K3) / 40, rel=1e-3)
    assert placed["horizon"] == (18.0 * 20 + 22.0 * 10) / 30  # the same steps as the dose
    assert placed["correction"] == "bypass" and placed["dtype"] == "bfloat16" and placed["max_len"] == 16
    assert placed["engine"] == "vexact" and placed["final_reward"] == pytest.approx(0.05)
    expected = place_on_map(map_data, placed["k3"], placed["horizon"], "bypass")
    assert {k: placed[k] for k in expected} == expected


def test_a_run_without_collapse_takes_its_whole_mean_and_its_own_correction(tmp_path: Path) -> None:
    map_data = load_map(None)
    kept = run_on_map(_run(tmp_path / "kept", collapse=False), map_data)
    assert kept["collapsed"] is False and kept["k3"] == pytest.approx(math.fsum(K3) / 40, rel=1e-12)
    assert kept["horizon"] == (18.0 * 20 + 22.0 * 20) / 40
    recompute = run_on_map(_run(tmp_path / "recompute", old_logprobs="recompute", collapse=False), map_data)
    assert recompute["correction"] == "recompute"
    assert run_on_map(tmp_path / "recompute", map_data, correction="bypass")["correction"] == "bypass"


def test_cli_table_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "run")
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {run} "))
    assert "| bfloat16 | 16 | 19.3 | 1.6e-02 | yes |" in row and "k3 alone does not set the harm" in out
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a run directory" in err[0]
    assert main([str(_run(tmp_path / "no_k3", k3=False))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no rollout_corr/k3_kl" in err[0]
