"""The collapse scaling of one sweep in its report: ``scaling.json`` and ``scaling.png`` (``vexact report``), the
meter's bias ratio at each threshold, and the failure each horizon's collapses were.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..records.atomic import publish, write_json_atomic
from ..sweeps.dose_response import METRIC
from ..sweeps.failure import horizon_failure_words
from ..sweeps.sweep_data import SweepData
from .fit import law_band, scaling
from .points import HORIZON_KEY, positive
from .verdict import fmt_t


def write_scaling(data: SweepData, out: Path) -> tuple[list[Path], str]:
    """``scaling.json`` and ``scaling.png`` in ``out`` (the report directory) and the lines the report prints (per
    curve: its law and its shape).

    A sweep without a horizon axis (most sweeps) writes no file: the line says why there is no law."""
    result = scaling(data)
    meter_path = data.path / "meter.json"
    if meter_path.is_file() and result["status"] != "no_horizon":
        result["meter"] = against_meter(result, json.loads(meter_path.read_text()))
    if result["status"] == "no_horizon":
        return [], f"scaling: {result['note']}"
    line = "\n".join(f"scaling ({c['curve']}): {c['status']}: {c['note']}; {c['shape']['note']}"
                     + "".join(f"\n  failure: {f}" for f in failure_lines(c)) for c in result["curves"])
    path = out / "scaling.json"
    # published whole (load_map and vexact compare --map read it while a report may be rewriting it); a failed write
    # leaves the previous map and is a WriteFailed naming the file
    write_json_atomic(path, result, sort_keys=False)
    files = [path]
    try:
        files.append(plot_scaling(result, out / "scaling.png", data.name))
    except ImportError:
        pass
    return files, line


def against_meter(result: dict[str, Any], meter: dict[str, Any]) -> dict[str, Any]:
    """The meter's bias ratio at each horizon's threshold: does collapse happen at a common bias ratio?

    ``meter``: a ``vexact meter`` result whose cells' ``horizon`` is the sweep's ``task.max_len`` (copy meter.json
    into the sweep directory). At each horizon with a fitted threshold, the bias ratio is interpolated in log-log
    over that horizon's cells (every source) by realised k3; outside their k3 range it is not extrapolated."""
    rows = []
    for h in result["horizons"]:
        cells = sorted((c["k3_kl"], c["bias_ratio"]) for c in meter.get("cells", [])
                       if c.get("horizon") == h["horizon_value"] and positive(c.get("k3_kl"))
                       and positive(c.get("bias_ratio")))
        ratio = None
        if h.get("status") == "fitted" and len(cells) >= 2 and cells[0][0] <= h["threshold_50"] <= cells[-1][0]:
            x = math.log10(h["threshold_50"])
            for (k0, b0), (k1, b1) in zip(cells, cells[1:]):
                if k0 <= h["threshold_50"] <= k1:
                    w = 0.0 if k1 == k0 else (x - math.log10(k0)) / (math.log10(k1) - math.log10(k0))
                    ratio = 10 ** (math.log10(b0) + w * (math.log10(b1) - math.log10(b0)))
                    break
        rows.append({"horizon_value": h["horizon_value"], "horizon": h.get("horizon"),
                     "threshold_50": h.get("threshold_50"), "bias_ratio_at_threshold": ratio})
    found = [r["bias_ratio_at_threshold"] for r in rows if r["bias_ratio_at_threshold"] is not None]
    if len(found) < 2:
        note = (f"{len(found)} horizon(s) have both a fitted threshold and meter cells bracketing it: no comparison "
                "across horizons")
    else:
        note = (f"bias ratio at the threshold: {', '.join(f'{v:.2g}' for v in found)} across {len(found)} horizons "
                f"(spread {max(found) / min(found):.2g}x)")
    return {"horizons": rows, "note": note}


OPEN_END_SPAN = 10.0
"""How far (a factor on the threshold axis) ``plot_scaling`` draws the arrow of an interval open on one side."""


def interval_drawn(horizon: dict[str, Any]) -> tuple[tuple[float, float], list[float]]:
    """A fitted horizon's interval as ``plot_scaling`` draws it: the error bar's ends (an open end at the threshold
    itself: no bar on that side) and, per open end, where its arrow points (``OPEN_END_SPAN`` beyond the threshold).
    An open end is not a zero-width interval: drawn as one, it would read as certainty where the data have none."""
    y = horizon["threshold_50"]
    lo, hi = horizon.get("ci_low"), horizon.get("ci_high")
    arrows = ([y / OPEN_END_SPAN] if lo is None else []) + ([y * OPEN_END_SPAN] if hi is None else [])
    return (y if lo is None else lo, y if hi is None else hi), arrows


def plot_scaling(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Threshold (with interval) against T, log-log, one colour per curve; an interval open on one side as a dashed
    arrow (``interval_drawn``); bounds as arrows; the fitted law with its 95% band (the legend names the points the
    band misses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("tab10")
    any_point = False
    ys: list[float] = []
    for i, curve in enumerate(result["curves"]):
        colour = cmap(i % 10)
        for h in curve["horizons"]:
            if not positive(h.get("horizon")):
                continue
            if h["status"] == "fitted":
                t, y = h["horizon"], h["threshold_50"]
                (lo, hi), open_ends = interval_drawn(h)
                ax.errorbar([t], [y], yerr=[[y - lo], [hi - y]], color=colour, marker="o", capsize=3)
                for far in open_ends:  # an interval open on this side: no cap, an arrow a decade long
                    ax.annotate("", xy=(t, far), xytext=(t, y),
                                arrowprops={"arrowstyle": "->", "color": colour, "linestyle": "--"})
                any_point = True
                ys += [lo, hi, *open_ends]
            elif h["status"] in ("above_range", "below_range"):
                up = h["status"] == "above_range"
                y = h["lower_bound"] if up else h["upper_bound"]
                ax.scatter([h["horizon"]], [y], color=colour, marker="^" if up else "v", s=70)
                any_point = True
                ys.append(y)
        label = f"{curve['curve']}: {curve['status']}"
        if curve["status"] == "fitted" and curve["horizon_range"]:
            t0, t1 = curve["horizon_range"]
            xs = [t0 * (t1 / t0) ** (k / 50) for k in range(51)]
            ax.plot(xs, [10 ** (curve["log10_prefactor"] - curve["alpha"] * math.log10(x)) for x in xs],
                    color=colour, lw=1.2)
            bands = [law_band(curve.get("replicates") or [], x) for x in xs]
            if all(b is not None for b in bands):  # the law's 95% band, drawn with the points it should hold
                ax.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands], color=colour, alpha=0.12, lw=0)
            label += f", α = {curve['alpha']:.2f}"
            if curve.get("band_misses"):
                label += f" (band misses {HORIZON_KEY} = {', '.join(map(str, curve['band_misses']))})"
        ax.plot([], [], color=colour, label=label)
    if any_point:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(min(ys) / 5, max(ys) * 5)  # at least a decade: bounds alone would zoom into noise
    ax.set_xlabel("horizon T (mean response length, tokens)")
    ax.set_ylabel(f"50% collapse threshold ({METRIC})")
    ax.set_title((f"{title}\n" if title else "") + "collapse threshold vs horizon (▲ lower bound, ▼ upper bound)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))  # whole, as scaling.json
    finally:
        plt.close(fig)
    return path


def failure_lines(curve: dict[str, Any]) -> list[str]:
    """Per horizon of a curve, which failure its collapses are (``vexact.sweeps.failure``), so which failure its
    threshold or bound measures, and whether a length surge came first; horizons without the record say so."""
    lines = []
    for h in curve.get("horizons") or []:
        t = f" (T {fmt_t(h['horizon'])})" if positive(h.get("horizon")) else ""
        words = horizon_failure_words(h)
        if not h.get("collapsed") and not h.get("collapsed_classified"):
            continue  # nothing collapsed: no failure to name
        lines.append(f"{HORIZON_KEY} = {h.get('horizon_value')}{t}: its collapses, what its threshold or bound "
                     "measures: " + (words or "not classified (the horizon came from a file without its runs)"))
    return lines
