"""The length surge of a sweep's runs in one figure: mean response length and reward against the step.

``vexact report`` plots the clean eval reward; a surge is read from the length, so this draws, per run, the mean
rollout response length (top), the rollout reward (middle) and the clean eval reward (bottom), with each run's
``length_surge_step`` (the collapse detector's rule, shared by the length-triggered LR schedule) marked, and one
colour per group. Run: ``python -m tools.studies.surge_plot SWEEP_DIR OUT.png``.

``python -m tools.studies.surge_plot SWEEP_DIR --table`` prints instead, as markdown, each group's surge statistics
from ``vexact.sweeps.dynamics.surge_dynamics`` (what ``dynamics.json`` holds under ``surge``): runs surged, the
median surge step, collapse leads, and each quantity's mean before / during / after the surge with the
after/before ratio; and per run the issue's contract: the start length (mean of the first ``EDGE`` steps), the top
(the largest ``EDGE``-step trailing mean), their ratio, and the 10-90% rise time of the trailing mean (steps from
its last value below start + 10% of the rise to its first value above start + 90%) as a fraction of the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vexact.metric_keys import EVAL_REWARD_MEAN, RESPONSE_LENGTH_MEAN, REWARD_MEAN
from vexact.sweeps.dynamics import PHASES, SURGE_TRACKED, surge_dynamics
from vexact.sweeps.sweep_data import metric_series, read_sweep_results

EDGE = 5  # steps averaged for the start length and the trailing mean of the rise
PANELS = ((RESPONSE_LENGTH_MEAN, "mean response length (tokens)"), (REWARD_MEAN, "rollout reward"),
          (EVAL_REWARD_MEAN, "clean eval reward"))


def plot_surge(sweep_dir: str | Path, out: str | Path) -> Path:
    """Write the figure for the sweep in ``sweep_dir`` to ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_sweep_results(Path(sweep_dir))
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 9), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for g, (values, points) in enumerate(data.groups()):
        colour = colours[g % len(colours)]
        label = data.group_label(values) or data.name
        for i, point in enumerate(p for p in points if p.metrics):
            surge = point.collapse.get("length_surge_step")
            for ax, (key, _) in zip(axes, PANELS):
                steps, vals = metric_series(point, key)
                ax.plot(steps, vals, color=colour, lw=1.2, alpha=0.8, label=label if i == 0 and ax is axes[0] else None)
                if isinstance(surge, int):
                    ax.axvline(surge, color=colour, ls=":", lw=0.8)
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"{data.name}: one line per run, dotted = its length_surge_step")
    axes[-1].set_xlabel("RL step")
    out = Path(out)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def surge_table(sweep_dir: str | Path) -> str:
    """The markdown table of ``--table`` (see the module docstring)."""
    data = read_sweep_results(Path(sweep_dir))
    lines = ["| run | start length | top length | top / start | 10-90% rise (steps) | rise / run | surge step | "
             "eval reward first → peak |", "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in data.points:
        if not p.has_result:
            continue
        r = rise(p)
        evals = metric_series(p, EVAL_REWARD_MEAN)[1]
        peak = p.collapse.get("peak_reward")
        lines.append(f"| {p.name} | {r['start']:.2f} | {r['top']:.2f} | {r['top'] / r['start']:.2f}× | "
                     f"{r['rise_steps']} | {r['rise_steps'] / p.run_length:.0%} | "
                     f"{p.collapse.get('length_surge_step')} | {_fmt(evals[0] if evals else None)} → {_fmt(peak)} |")
    lines.append("")
    head = "| group | quantity | " + " | ".join(PHASES) + " | after/before |"
    for values, points in data.groups():
        d = surge_dynamics([p for p in points if p.has_result])
        label = data.group_label(values)
        lines.append(f"**{label}**: {d['runs_surged']}/{d['runs']} runs surged, median surge step {d['surge_step']}, "
                     f"collapses after / before / without a surge: {d['collapsed_after_surge']} / "
                     f"{d['collapsed_before_surge']} / {d['collapsed_without_surge']}, leads {d['length_surge_lead']}")
        lines.append("")
        lines += [head, "|:---|:---|" + "---:|" * (len(PHASES) + 1)]
        for name in SURGE_TRACKED:
            row = d["phases"][name]
            cells = [_fmt(row[ph]) for ph in PHASES] + [_fmt(row["after_before"], ratio=True)]
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def rise(point) -> dict:
    """Start length, top length and the 10-90% rise time in steps of one run (see the module docstring)."""
    steps, vals = metric_series(point, RESPONSE_LENGTH_MEAN)
    trail = [sum(vals[max(0, i - EDGE + 1):i + 1]) / len(vals[max(0, i - EDGE + 1):i + 1]) for i in range(len(vals))]
    start, top = sum(vals[:EDGE]) / len(vals[:EDGE]), max(trail)
    lo, hi = start + 0.1 * (top - start), start + 0.9 * (top - start)
    end = next(i for i, v in enumerate(trail) if v >= hi)
    begin = max((i for i in range(end) if trail[i] <= lo), default=0)
    return {"start": start, "top": top, "rise_steps": int(steps[end] - steps[begin])}


def _fmt(v: float | None, ratio: bool = False) -> str:
    if v is None:
        return "—"
    if ratio:
        return f"{v:.2f}×"
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m tools.studies.surge_plot SWEEP_DIR (OUT.png | --table)", file=sys.stderr)
        return 2
    if not (Path(args[0]) / "sweep.json").exists():
        print(f"error: {args[0]} is not a sweep directory (no sweep.json)", file=sys.stderr)
        return 2
    print(surge_table(args[0]) if args[1] == "--table" else plot_surge(args[0], args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
