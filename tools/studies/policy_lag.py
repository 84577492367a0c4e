"""Policy lag against training-inference mismatch: what each lagged run logged, and whether lag moved the collapse.

    python -m tools.studies.policy_lag SWEEP_DIR [--json]

Reads a sweep of ``experiments/policy_lag_sweep.yaml`` (any sweep whose runs vary ``rollout.policy_lag``) and prints
two markdown tables:

* **per dose**: one row per (L, correction, lag k, injected value): runs, collapses, and three run means over the
  steps before collapse (the whole run without one; the window of the run's dose, ``dose_response.run_dose``):
  the total ``rollout_corr/k3_kl`` (what users log: rollout log-probs against the current policy on the training
  path), its lag part ``mismatch/lag_k3_kl`` (the lagged policy against the current one, both on the training
  path: off-policy drift) and its TIM part ``mismatch/tim_k3_kl`` (the rollout against the lagged policy on the
  training path), and total / (lag + TIM): 1 where the two parts add, below 1 where they partly cancel;
* **per lag**: for each (L, correction, lag k), the collapse bracket over the injected doses, in TIM k3: the largest
  TIM k3 of a run that held and the smallest of a run that collapsed (lag 0 logs no split: its TIM k3 is its total).
  Lag moves the TIM threshold where the bracket at k > 0 falls below (or rises above) the one at k = 0.

The correction is the map's name for the run's setup (``scaling.resolve_correction``: ``bypass``,
``bypass_token_tis``, ``recompute``, ``token_tis``, ...). Exit 2 with one ``error:`` line when the directory is not a
sweep or holds no finished run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from vexact.map.verdict import resolve_correction
from vexact.metric_keys import LAG_K3_KL, TIM_K3_KL
from vexact.records import CONFIG_FILE
from vexact.rl.validate import parse_yaml
from vexact.sweeps.dose_response import run_dose
from vexact.sweeps.markdown_table import markdown_table
from vexact.sweeps.sweep_data import PointData, read_sweep_results
from vexact.sweeps.text_table import fmt_sci

DOSE_COLUMNS = ("L", "correction", "lag k", "injected", "runs", "collapsed", "total k3", "lag k3", "TIM k3",
                "total / (lag + TIM)")
BRACKET_COLUMNS = ("L", "correction", "lag k", "doses", "held up to TIM k3", "collapsed from TIM k3")


def _before_collapse_mean(point: PointData, key: str) -> float | None:
    """The run mean of ``key`` over the steps before collapse (all steps without one), as the dose is taken."""
    end = point.collapse_step
    values = [float(m[key]) for m in point.metrics if isinstance(m.get(key), (int, float))
              and (end is None or m.get("step", 0) < end)]
    return sum(values) / len(values) if values else None


def run_row(point: PointData) -> dict[str, Any]:
    """One finished run's setup (from its saved config) and its run means; ValueError naming the run when its
    config cannot be read."""
    path = point.dir / CONFIG_FILE
    try:
        config = parse_yaml(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{point.dir}: no readable config.yaml ({err})") from err
    total = run_dose(point)
    lag = config.get("rollout", {}).get("policy_lag", 0)
    # lag 0 logs no split: all of its k3 is TIM
    lag_k3 = _before_collapse_mean(point, LAG_K3_KL) if lag else 0.0
    tim_k3 = _before_collapse_mean(point, TIM_K3_KL) if lag else total
    return {"run": point.name, "max_len": config.get("task", {}).get("max_len"),
            "correction": resolve_correction(config), "policy_lag": lag,
            "injected": config.get("inject", {}).get("value", 0.0), "collapsed": bool(point.collapse.get("collapsed")),
            "total_k3": total, "lag_k3": lag_k3, "tim_k3": tim_k3}


def sweep_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """``run_row`` of every finished point of the sweep, in the sweep's order; ValueError when none finished."""
    data = read_sweep_results(sweep_dir)
    rows = [run_row(p) for p in data.points if p.has_result]
    if not rows:
        raise ValueError(f"{sweep_dir}: no finished run to report")
    return rows


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def dose_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-dose groups: runs of one (L, correction, lag, injected value), means over their runs."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["max_len"], r["correction"], r["policy_lag"], r["injected"])].append(r)
    out = []
    for (max_len, correction, lag, injected), runs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], abs(kv[0][3]))):
        total, lag_k3, tim_k3 = (_mean([r[k] for r in runs]) for k in ("total_k3", "lag_k3", "tim_k3"))
        parts = None if lag_k3 is None or tim_k3 is None else lag_k3 + tim_k3
        out.append({"max_len": max_len, "correction": correction, "policy_lag": lag, "injected": injected,
                    "runs": len(runs), "collapsed": sum(r["collapsed"] for r in runs), "total_k3": total,
                    "lag_k3": lag_k3, "tim_k3": tim_k3,
                    "additivity": None if total is None or not parts else total / parts})
    return out


def bracket_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (L, correction, lag): the largest TIM k3 of a run that held, and the smallest of one that collapsed, over
    the injected runs (an uninjected run's TIM is zero by construction)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["injected"] and r["tim_k3"] is not None:
            groups[(r["max_len"], r["correction"], r["policy_lag"])].append(r)
    out = []
    for key, runs in sorted(groups.items()):
        held = [r["tim_k3"] for r in runs if not r["collapsed"]]
        fell = [r["tim_k3"] for r in runs if r["collapsed"]]
        out.append({"max_len": key[0], "correction": key[1], "policy_lag": key[2],
                    "doses": len({r["injected"] for r in runs}), "held_up_to": max(held) if held else None,
                    "collapsed_from": min(fell) if fell else None})
    return out


def _sci(v: float | None) -> str:
    return "—" if v is None else fmt_sci(v)


def markdown(rows: list[dict[str, Any]]) -> str:
    """Both tables, as the results page shows them."""
    doses = [(str(g["max_len"]), g["correction"], str(g["policy_lag"]), f"{g['injected']:g}", str(g["runs"]),
              f"{g['collapsed']}/{g['runs']}", _sci(g["total_k3"]), _sci(g["lag_k3"]), _sci(g["tim_k3"]),
              "—" if g["additivity"] is None else f"{g['additivity']:.2f}") for g in dose_table(rows)]
    brackets = [(str(b["max_len"]), b["correction"], str(b["policy_lag"]), str(b["doses"]), _sci(b["held_up_to"]),
                 _sci(b["collapsed_from"])) for b in bracket_table(rows)]
    return markdown_table(DOSE_COLUMNS, doses) + "\n\n" + markdown_table(BRACKET_COLUMNS, brackets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.policy_lag", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="a sweep directory (has sweep.json)")
    parser.add_argument("--json", action="store_true", help="print the per-run rows as a JSON list")
    args = parser.parse_args(argv)
    try:
        rows = sweep_rows(args.sweep)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
