"""Meter cells with and without a vocabulary tail, side by side.

``python -m tools.studies.tail_compare --sweep SWEEP_DIR`` instead prints, per group of a ``vexact sweep`` (its
overrides but the seed), how the rollouts' tail evolved over training: the seed means of ``tail/mass_mean`` at the
first and last step and over the run, and of ``tail/response_frac`` at the first and last step. Points without
``tail/*`` keys (no vocabulary tail) and unfinished points are left out.

``python -m tools.studies.tail_compare TAIL_METER_JSON BASE_METER_JSON`` reads two ``meter.json`` files written by
``vexact meter`` (one with ``task.distractors`` > 0, one on the character vocabulary) and prints one Markdown row
per (horizon, source) cell present in both: realised k3, bias ratio with its 95% interval and whether it is
resolved, the bias ‖E d‖ and the exact gradient ‖E g_π‖ with their Monte-Carlo noise, for each vocabulary, and the
tail's probability mass under the mismatched and the exact rollouts. Cells
in only one file are listed below the table, never guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vexact.metric_keys import TAIL_MASS_MEAN, TAIL_RESPONSE_FRAC
from vexact.records import FINISHED_STATUSES, METRICS_FILE
from vexact.sweeps.bias_meter import resolved

__all__ = ["compare_cells", "main", "sweep_tail_table"]


def _load(path: Path) -> dict[tuple[int, str], dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        return {(c["horizon"], c["source"]): c for c in data["cells"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a meter.json ({e})") from None


def _ratio(c: dict[str, Any]) -> str:
    lo, hi = c["bias_ratio_ci"]
    ci = "[?]" if lo is None else f"[{lo:.3g}, {hi:.3g}]"
    return f"{c['bias_ratio']:.3g} {ci}" + ("" if resolved(c) else " (not resolved)")


def _pair(b: dict[str, Any], t: dict[str, Any], key: str) -> str:
    """``key`` of both cells with its Monte-Carlo noise: ``b ± noise / t ± noise``."""
    return " / ".join(f"{c[key]:.3g} ± {c[key + '_noise']:.2g}" for c in (b, t))


def compare_cells(tail: dict[tuple[int, str], dict[str, Any]], base: dict[tuple[int, str], dict[str, Any]]) -> str:
    """The Markdown table of the cells in both (in ``tail``'s order), then a line naming the cells in one only."""
    lines = ["| L | source | k3 (V = 22) | k3 (tail) | bias ratio (V = 22) | bias ratio (tail) | "
             "‖E d‖ (V = 22 / tail) | ‖E g_π‖ (V = 22 / tail) | tail mass μ | tail mass (exact) | "
             "reward exact (V = 22 / tail) |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, t in tail.items():
        if key not in base:
            continue
        b = base[key]
        t_mass = t.get("tail_mass_mean")
        mass = "—" if t_mass is None else f"{t_mass:.2e}"
        exact = "—" if t.get("tail_mass_mean_exact") is None else f"{t['tail_mass_mean_exact']:.2e}"
        lines.append(f"| {key[0]} | {key[1]} | {b['k3_kl']:.2e} | {t['k3_kl']:.2e} | {_ratio(b)} | {_ratio(t)} | "
                     f"{_pair(b, t, 'bias_abs')} | {_pair(b, t, 'grad_norm')} | {mass} | {exact} | "
                     f"{b['reward_mean_exact']:.2f} / {t['reward_mean_exact']:.2f} |")
    only = [f"L = {h} {s} ({'tail' if (h, s) in tail else 'V = 22'} only)"
            for h, s in sorted(set(tail) ^ set(base))]
    if only:
        lines += ["", "Not compared: " + ", ".join(only)]
    return "\n".join(lines) + "\n"


def sweep_tail_table(sweep_dir: Path) -> str:
    """The tail over training, per group of finished points with ``tail/*`` keys (module docstring)."""
    from vexact.records.metrics_log import read_metrics

    try:
        points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{sweep_dir}: not a vexact sweep directory ({e})") from None
    groups: dict[str, list[list[dict[str, Any]]]] = {}
    for point in points:
        if point.get("status") not in FINISHED_STATUSES:
            continue
        rows = [r for r in read_metrics(sweep_dir / point["dir"] / METRICS_FILE) if TAIL_MASS_MEAN in r]
        if rows:
            label = ", ".join(f"{k}={v}" for k, v in point["overrides"].items() if k != "seed")
            groups.setdefault(label, []).append(rows)
    lines = ["| group | seeds | steps | tail mass μ (first step) | tail mass μ (last step) | tail mass μ (run mean) | "
             "responses with a distractor (first / last step) |", "|:---|---:|---:|---:|---:|---:|---:|"]
    for label, runs in groups.items():
        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        first, last = mean([r[0][TAIL_MASS_MEAN] for r in runs]), mean([r[-1][TAIL_MASS_MEAN] for r in runs])
        whole = mean([mean([x[TAIL_MASS_MEAN] for x in r]) for r in runs])
        frac = (mean([r[0][TAIL_RESPONSE_FRAC] for r in runs]), mean([r[-1][TAIL_RESPONSE_FRAC] for r in runs]))
        steps = "/".join(sorted({str(len(r)) for r in runs}))
        lines.append(f"| {label} | {len(runs)} | {steps} | {first:.2e} | {last:.2e} | {whole:.2e} | "
                     f"{frac[0]:.3f} / {frac[1]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.tail_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("tail", type=Path, nargs="?", help="meter.json of the meter with a vocabulary tail")
    parser.add_argument("base", type=Path, nargs="?", help="meter.json of the meter on the character vocabulary")
    parser.add_argument("--sweep", type=Path, default=None, help="a vexact sweep directory: the tail over training")
    args = parser.parse_args(argv)
    if (args.sweep is None) == (args.tail is None or args.base is None):
        parser.error("give either TAIL_METER_JSON BASE_METER_JSON or --sweep SWEEP_DIR")
    try:
        if args.sweep is not None:
            print(sweep_tail_table(args.sweep), end="")
        else:
            print(compare_cells(_load(args.tail), _load(args.base)), end="")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
