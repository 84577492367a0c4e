"""Where do finished runs sit on the collapse map? Each run's realised k3 and horizon T, placed on a map's curve.

    python -m tools.studies.run_on_map RUN_DIR [RUN_DIR ...] [--map FILE] [--correction NAME] [--source NAME]
                                            [--json]

A run of any mismatch source (vLLM's rollouts, a real engine) is placed the way the map's own runs were measured: its
dose is the run mean of ``rollout_corr/k3_kl`` over the steps before collapse (the whole run without one:
``dose_response.run_dose``) and its T the run mean of ``response_length/mean`` over the same steps
(``scaling.measured_horizon``), on the curve of the run's own correction (from its config: ``algorithm.old_logprobs``
and ``correction``; ``--correction`` overrides it) and the map's default source unless ``--source`` names one
(``scaling.place_on_map``). One markdown row per run: its rollout engine, dtype, L (``task.max_len``), T, realised k3,
whether it collapsed (the run's own detector), its final reward (smoothed, as ``vexact report`` prints it), the map's
50% threshold at T with its interval, k3 / threshold and the verdict. The run's source is usually not the curve's (a
flattened rollout on the shipped map): k3 alone does not set the harm, so the verdict is an order of magnitude. Exit 2
with one ``error:`` line for a directory that is not a run or a run without those metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vexact.map.points import measured_horizon
from vexact.map.verdict import load_map, place_on_map, resolve_correction
from vexact.reports.run_report import read_run
from vexact.reports.sweep_table import reward_summary
from vexact.sweeps.dose_response import run_dose
from vexact.sweeps.markdown_table import markdown_table
from vexact.sweeps.text_table import fmt_sci

COLUMNS = ("run", "engine", "dtype", "L", "T", "realised k3", "collapsed", "final reward", "threshold at T",
           "k3 / threshold", "verdict")


def run_on_map(run_dir: str | Path, map_data: dict[str, Any], correction: str | None = None,
               source: str | None = None) -> dict[str, Any]:
    """One run's placement: ``place_on_map``'s keys plus ``run``, ``engine``, ``dtype``, ``max_len``,
    ``collapsed`` and ``final_reward``. ``correction`` None: the run's own (from its config.yaml). ValueError,
    naming the run, when it is not a run directory or lacks k3 or response lengths."""
    run = read_run(run_dir)
    point, config = run.point, run.config
    if correction is None:
        if config is None:
            raise ValueError(f"{run_dir}: no readable config.yaml to read its correction from: pass --correction")
        correction = resolve_correction(config.to_dict())
    k3 = run_dose(point)
    if k3 is None:
        raise ValueError(f"{run_dir}: no rollout_corr/k3_kl in its metrics: not a run that measured its mismatch")
    horizon = measured_horizon(point)
    if horizon is None:
        raise ValueError(f"{run_dir}: no response_length/mean in its metrics: its horizon T is unknown")
    placed = place_on_map(map_data, k3, horizon, correction, source)
    return {**placed, "run": str(run_dir), "engine": config.rollout.engine if config else None,
            "dtype": config.dtype if config else None, "max_len": config.task.max_len if config else None,
            "collapsed": bool(point.collapse.get("collapsed")), "final_reward": reward_summary(point)["final"]}


def _threshold(p: dict[str, Any]) -> str:
    if p["threshold_50"] is None:
        return "—"
    interval = f" [{fmt_sci(p['ci_low'])}, {fmt_sci(p['ci_high'])}]" if p["ci_low"] is not None else ""
    return fmt_sci(p["threshold_50"]) + interval


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``run_on_map`` results, one row per run."""
    cells = []
    for p in rows:
        final = "—" if p["final_reward"] is None else f"{p['final_reward']:.3f}"
        ratio = "—" if p["ratio"] is None else fmt_sci(p["ratio"])
        cells.append((p["run"], str(p["engine"]), str(p["dtype"]), str(p["max_len"]), f"{p['horizon']:.1f}",
                      fmt_sci(p["k3"]), "yes" if p["collapsed"] else "no", final, _threshold(p), ratio, p["verdict"]))
    return markdown_table(COLUMNS, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.run_on_map",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--map", default=None, help="a scaling.json or map (default: the map shipped with vexact)")
    parser.add_argument("--correction", default=None, help="the curve to place on (default: each run's own)")
    parser.add_argument("--source", default=None, help="the map's source curve (default: the map's default source)")
    parser.add_argument("--json", action="store_true", help="print the placements as a JSON list")
    args = parser.parse_args(argv)
    try:
        map_data = load_map(args.map)
        rows = [run_on_map(run, map_data, args.correction, args.source) for run in args.runs]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(table(rows))
    sources = sorted({str(p["source"]) for p in rows})
    print(f"\ncurve: {', '.join(sorted({p['correction'] for p in rows}))}, source {', '.join(sources)} (the "
          "mismatch the map's runs injected). A run of another source sits at the same k3 with another gradient "
          "bias: k3 alone does not set the harm; read the verdict as an order of magnitude.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
