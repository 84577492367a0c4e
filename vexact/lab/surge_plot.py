"""The length surge of a sweep's runs in one figure (issue R): mean response length and reward against the step.

``vexact report`` plots the clean eval reward; a surge is read from the length, so this draws, per run, the mean
rollout response length (top), the rollout reward (middle) and the clean eval reward (bottom), with each run's
``length_surge_step`` (the collapse detector's rule, shared by the length-triggered LR schedule) marked, and one
colour per group. Run: ``python -m vexact.lab.surge_plot SWEEP_DIR OUT.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .report import _series, read_sweep_results

PANELS = (("response_length/mean", "mean response length (tokens)"), ("reward/mean", "rollout reward"),
          ("eval/reward_mean", "clean eval reward"))


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
                steps, vals = _series(point, key)
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m vexact.lab.surge_plot SWEEP_DIR OUT.png", file=sys.stderr)
        return 2
    if not (Path(args[0]) / "sweep.json").exists():
        print(f"error: {args[0]} is not a sweep directory (no sweep.json)", file=sys.stderr)
        return 2
    print(plot_surge(args[0], args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
