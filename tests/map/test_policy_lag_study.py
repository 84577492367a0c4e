"""``python -m tools.studies.policy_lag``: a policy-lag sweep's total k3 split into lag and TIM, and the brackets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from tools.studies.policy_lag import bracket_table, dose_table, main, sweep_rows
from vexact.metric_keys import K3_KL, LAG_K3_KL, TIM_K3_KL
from vexact.rl.config_schema import RunConfig

# (lag, injected) -> (lag k3, TIM k3, collapsed at step or None); total = 0.9 x (lag + TIM) where both are logged
RUNS = {(0, 0.0): (0.0, 0.0, None), (0, -0.3): (0.0, 0.05, None), (0, -0.5): (0.0, 0.4, 4),
        (4, 0.0): (0.002, 0.0, None), (4, -0.3): (0.005, 0.06, 5), (4, -0.5): (0.006, 0.5, 3)}
AFTER_COLLAPSE = 100.0  # metrics logged after the collapse step: never in a run mean


def _sweep(root: Path) -> Path:
    path = root / "lag"
    points = []
    for (lag, injected), (lag_k3, tim_k3, collapse_step) in RUNS.items():
        name = f"lag={lag},inj={injected}"
        folder = path / "points" / name
        folder.mkdir(parents=True)
        config = dataclasses.asdict(RunConfig())
        config["rollout"]["policy_lag"], config["inject"]["value"] = lag, injected
        config["task"]["max_len"] = 4
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        total = 0.9 * (lag_k3 + tim_k3) if lag else tim_k3
        rows = []
        for step in range(8):
            after = collapse_step is not None and step >= collapse_step
            row = {"step": step, K3_KL: AFTER_COLLAPSE if after else total}
            if lag:  # lag 0 logs no split
                row.update({LAG_K3_KL: AFTER_COLLAPSE if after else lag_k3,
                            TIM_K3_KL: AFTER_COLLAPSE if after else tim_k3})
            rows.append(row)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        collapse = {"collapsed": collapse_step is not None, "collapse_step": collapse_step,
                    "mean_k3_kl_before_collapse": total}
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "collapse": collapse}))
        points.append({"name": name, "dir": f"points/{name}", "status": "completed", "overrides": {}})
    (path / "sweep.json").write_text(json.dumps({"name": "lag", "grid": {}, "variants": {}, "set": [],
                                                 "curves": [], "points": points}))
    return path


def test_the_total_k3_splits_into_lag_and_tim_over_the_steps_before_collapse(tmp_path):
    groups = {(g["policy_lag"], g["injected"]): g for g in dose_table(sweep_rows(_sweep(tmp_path)))}
    lagged = groups[(4, -0.3)]  # collapsed at step 5: the metrics after it (AFTER_COLLAPSE) are left out
    assert (lagged["lag_k3"], lagged["tim_k3"]) == (0.005, 0.06)
    assert abs(lagged["additivity"] - 0.9) < 1e-12
    assert (lagged["runs"], lagged["collapsed"], lagged["correction"]) == (1, 1, "bypass")
    on_policy = groups[(0, -0.3)]  # lag 0: no split logged, all of the k3 is TIM
    assert (on_policy["lag_k3"], on_policy["tim_k3"], on_policy["additivity"]) == (0.0, 0.05, 1.0)
    assert groups[(0, 0.0)]["additivity"] is None  # nothing to split


def test_the_bracket_per_lag_is_in_tim_k3_over_injected_runs(tmp_path):
    brackets = {b["policy_lag"]: b for b in bracket_table(sweep_rows(_sweep(tmp_path)))}
    assert (brackets[0]["held_up_to"], brackets[0]["collapsed_from"]) == (0.05, 0.4)
    # lag 4 collapsed at both doses: no run held, and the bracket's low end is the smaller TIM k3
    assert (brackets[4]["held_up_to"], brackets[4]["collapsed_from"], brackets[4]["doses"]) == (None, 0.06, 2)


def test_cli_prints_both_tables_and_refuses_a_non_sweep(tmp_path, capsys):
    assert main([str(_sweep(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "| total / (lag + TIM) |" in out and "| collapsed from TIM k3 |" in out
    assert "| 4 | bypass | 4 | -0.3 | 1 | 1/1 | 5.9e-02 | 5.0e-03 | 6.0e-02 | 0.90 |" in out
    assert main([str(tmp_path / "nothing")]) == 2
    assert "is not a sweep directory" in capsys.readouterr().err
