"""A sweep's plots: reward_curves.png, mismatch_vs_step.png, collapse_vs_magnitude.png and
outcome_vs_realised_k3.png (``plot_sweep``). Every plot draws a group in one colour and marker and a seed in one line
style, with the legend outside the axes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..metric_keys import EVAL_REWARD_MEAN, K3_KL, REWARD_MEAN
from ..records.atomic import publish
from ..sweeps.sweep_data import SEED_KEY, SweepData, freeze, is_num, metric_series
from .sweep_table import group_table, reward_summary

SEED_LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 1)), (0, (9, 3)),
                                    (0, (3, 1, 1, 1)))
GROUP_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p", "d", "H", "8")


@dataclass(frozen=True)
class GroupStyle:
    """How one group is drawn in every sweep plot: its own colour and marker (seeds differ by line style)."""

    colour: Any
    marker: str
    linewidth: float
    markersize: float
    zorder: float


def undrawn_k3_words(values: list[float]) -> str:
    """Why logged k3 KL values (NaN included) draw nothing on a log axis: "exact" only when every one is finite and
    exactly 0; else how many were NaN/Inf, or that none was above 0."""
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        return f"k3 KL non-finite at {bad} of {len(values)} steps"
    return "k3 KL = 0 at every step (exact)" if all(v == 0 for v in values) else "k3 KL <= 0 at every step"


def distinct_colours(n: int) -> list[Any]:
    """``n`` colours that are told apart at a glance: a qualitative palette, never a scale (with a scale, two
    close magnitudes got two near-identical greens); the legend carries the order."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:  # the strong half of tab20 first, then the light half
        return [matplotlib.colormaps["tab20"](2 * i if i < 10 else 2 * (i - 10) + 1) for i in range(n)]
    return [matplotlib.colormaps["hsv"](i / n) for i in range(n)]


def group_styles(n: int) -> list[GroupStyle]:
    """One style per group, in group order. Earlier groups are drawn wider, with larger markers, *underneath*
    later ones, so groups whose results coincide (a remedy that changes nothing, like ``none`` and ``token_tis``)
    show as nested outlines instead of one hiding the other."""
    colours = distinct_colours(n)
    styles = []
    for i in range(n):
        t = (n - 1 - i) / max(n - 1, 1)  # 1 for the first group, 0 for the last
        styles.append(GroupStyle(colour=colours[i], marker=GROUP_MARKERS[i % len(GROUP_MARKERS)],
                                 linewidth=1.1 + 2.4 * t, markersize=4.5 + 5.5 * t, zorder=2.0 + i / max(n, 1)))
    return styles


def seed_linestyles(data: SweepData) -> dict[str, Any]:
    """Line style per seed (frozen seed value -> style), seeds in grid order, so seeds of a group are told apart."""
    seeds = list(data.grid.get(SEED_KEY) or [])
    seeds += sorted({p.overrides.get(SEED_KEY) for p in data.points} - set(seeds), key=str)
    return {freeze(s): SEED_LINESTYLES[i % len(SEED_LINESTYLES)] for i, s in enumerate(seeds)}


def plot_sweep(data: SweepData, out_dir: str | Path) -> list[Path]:
    """Write reward_curves.png, mismatch_vs_step.png, collapse_vs_magnitude.png and outcome_vs_realised_k3.png
    (``sweep_figures``); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out_dir / name) for name, fig in sweep_figures(data).items()]


def sweep_figures(data: SweepData) -> dict[str, Any]:
    """The sweep plots as matplotlib Figures, by file name (tests inspect their artists).

    Every plot draws a group in one colour and marker (``group_styles``) and a seed in one line style
    (``seed_linestyles``), with the legend outside the axes so it never covers data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    groups = data.groups()
    style_of_group = {freeze(values): s for (values, _), s in zip(groups, group_styles(len(groups)))}
    style = lambda p: style_of_group[freeze(data.group_values(p))]  # noqa: E731
    linestyle_of_seed = seed_linestyles(data)
    dash = lambda p: linestyle_of_seed.get(freeze(p.overrides.get(SEED_KEY)), "-")  # noqa: E731
    label_of = {freeze(values): data.group_label(values) for values, _ in groups}
    seeds_shown = {freeze(p.overrides.get(SEED_KEY)) for p in data.points if p.metrics}

    def legend_handles(keys: set[str], seeds: bool = True) -> list[Any]:
        """Group entries (colour + marker; a line only where lines are drawn) and, for lines, seed entries."""
        handles = [Line2D([], [], color=s.colour, marker=s.marker, lw=2 if seeds else 0, ms=7, label=label_of[k])
                   for k, s in style_of_group.items() if k in keys]
        if seeds and len(seeds_shown) > 1:
            handles += [Line2D([], [], color="black", ls=ls, lw=1.5, label=f"seed {json.loads(k)}")
                        for k, ls in linestyle_of_seed.items() if k in seeds_shown]
        return handles

    figures = {}

    # reward curves ------------------------------------------------------------------------
    metric = EVAL_REWARD_MEAN
    if not any(is_num(m.get(metric)) for p in data.points for m in p.metrics):
        metric = REWARD_MEAN  # no eval steps at all: fall back to the training reward
    fig, ax = plt.subplots(figsize=(10, 5.5))
    drawn: set[str] = set()
    collapse_marks = False
    for p in data.points:
        steps, values = metric_series(p, metric)
        if not steps:
            continue
        s = style(p)
        ax.plot(steps, values, color=s.colour, ls=dash(p), lw=s.linewidth, marker=s.marker, ms=s.markersize,
                markevery=_mark_every(len(steps)), alpha=0.9, zorder=s.zorder)
        drawn.add(freeze(data.group_values(p)))
        cstep = p.collapse_step
        if is_num(cstep):
            ax.plot([cstep], [_value_at(steps, values, cstep)], marker="X", ms=11, mew=1.2, color=s.colour,
                    markeredgecolor="black", linestyle="none", zorder=10)
            collapse_marks = True
    handles = legend_handles(drawn)
    if collapse_marks:
        handles.append(Line2D([], [], marker="X", ms=10, color="white", markeredgecolor="black", linestyle="none",
                              label="collapse step"))
    ax.set_title(f"{data.name}: {metric} vs step\n(one line per point: colour and marker = group, "
                 "line style = seed)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(metric + (" (clean evaluation)" if metric.startswith("eval/") else " (training rollouts)"))
    _finish(ax, handles)
    figures["reward_curves.png"] = fig

    # mismatch vs step -----------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(10, 5.5))
    drawn = set()
    zero_groups = []
    for values, points in groups:
        key = freeze(values)
        for p in points:
            steps, ks = metric_series(p, K3_KL)
            keep = [(s, k) for s, k in zip(steps, ks) if k > 0 and math.isfinite(k)]
            if keep:
                s = style(p)
                ax.plot(*zip(*keep), color=s.colour, ls=dash(p), lw=s.linewidth * 0.8, marker=s.marker,
                        ms=s.markersize * 0.8, markevery=_mark_every(len(keep)), alpha=0.9, zorder=s.zorder)
                drawn.add(key)
        logged = [v for p in points for v in metric_series(p, K3_KL, keep_nan=True)[1]]
        if key not in drawn and logged:
            zero_groups.append(f"{label_of[key]}: {undrawn_k3_words(logged)}")
    handles = legend_handles(drawn)
    handles += [Line2D([], [], color="none", label=f"{words}; not drawable on a log axis") for words in zero_groups]
    ax.set_title(f"{data.name}: realised mismatch vs step\n(one line per point: colour and marker = group, "
                 "line style = seed)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("k3 KL between rollout and training log-probs\n(log scale; zero values skipped)")
    if drawn:
        ax.set_yscale("log")
    _finish(ax, handles)
    figures["mismatch_vs_step.png"] = fig

    # collapse vs magnitude --------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(10, 5.5))
    pts = [(p, p.collapse.get("mean_k3_kl")) for p in data.points if p.has_result]
    pts = [(p, k) for p, k in pts if is_num(k) and not math.isnan(k) and k >= 0]
    floor = _log_floor(k for _, k in pts)
    top = max((p.run_length for p, _ in pts), default=0)
    drawn = set()
    stacked: dict[tuple[float, float], int] = {}
    for p, k in pts:
        s = style(p)
        x = floor if k == 0 else k
        collapsed = p.collapse.get("collapsed") is True and is_num(p.collapse.get("collapse_step"))
        y = p.collapse["collapse_step"] if collapsed else p.run_length
        stacked[(x, y)] = stacked.get((x, y), 0) + 1
        ax.scatter([x], [y], s=(s.markersize * 1.5) ** 2, marker=s.marker, zorder=s.zorder + 1, linewidths=1.8,
                   edgecolors=[s.colour], facecolors=[s.colour] if collapsed else "none")
        drawn.add(freeze(data.group_values(p)))
    for (x, y), n in stacked.items():
        if n > 1:  # identical points (e.g. the seeds of a zero-mismatch group) would hide each other
            ax.annotate(f"×{n}", (x, y), xytext=(9, -13), textcoords="offset points", fontsize=8)
    handles = legend_handles(drawn, seeds=False)
    if pts:
        handles += [Line2D([], [], marker="o", ms=8, color="black", linestyle="none",
                           label="filled: collapsed (y = collapse step)"),
                    Line2D([], [], marker="o", ms=8, markerfacecolor="none", markeredgecolor="black",
                           linestyle="none", label="hollow: no collapse (y = run length)")]
        ax.axhline(top, color="grey", lw=0.8, ls=":", zorder=1)
        ax.set_ylim(0, max(top, 1) * 1.08)
    if any(k == 0 for _, k in pts):
        ax.axvline(floor, color="grey", lw=0.8, ls="--", zorder=1)
        handles.append(Line2D([], [], color="grey", lw=0.8, ls="--", label=f"zero mismatch, drawn at {floor:.0e}"))
    _log_x(ax)
    ax.set_title(f"{data.name}: when runs collapsed vs their realised mismatch (one marker per run)")
    ax.set_xlabel(REALISED_K3_WORDS)
    ax.set_ylabel("collapse step, or run length without collapse (RL steps)")
    _finish(ax, handles)
    figures["collapse_vs_magnitude.png"] = fig
    figures["outcome_vs_realised_k3.png"] = _outcome_vs_k3(data, group_table(data), style_of_group, label_of)
    return figures


REALISED_K3_WORDS = ("realised mismatch: k3 KL between rollout and training log-probs, mean over the run's steps "
                     "(log scale)")


def _outcome_vs_k3(data: SweepData, rows: list[dict[str, Any]], style_of_group: dict[str, GroupStyle],
                   label_of: dict[str, str]) -> Any:
    """outcome_vs_realised_k3.png: collapse rate (per group) and final reward (per run and group mean) against
    realised k3 -- the table's ``realised_k3_kl``, the run mean of ``rollout_corr/k3_kl`` (collapse.mean_k3_kl)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    by_group = {freeze(values): points for values, points in data.groups()}
    xs = [r["realised_k3_kl"] for r in rows if r["realised_k3_kl"] is not None]
    xs += [p.collapse.get("mean_k3_kl") for pts in by_group.values() for p in pts if p.has_result]
    floor = _log_floor(x for x in xs if is_num(x))
    place = lambda k: floor if k == 0 else k  # noqa: E731
    handles, any_rate, any_reward, zero = [], False, False, False
    for row in rows:
        key = freeze(tuple(row.get(k) for k in data.group_keys))
        s = style_of_group.get(key)
        k3 = row["realised_k3_kl"]
        if s is None or k3 is None or not math.isfinite(k3):
            continue
        zero = zero or k3 == 0
        handles.append(Line2D([], [], color=s.colour, marker=s.marker, lw=0, ms=8, label=label_of[key]))
        if row["collapse_rate"] is not None:
            top.scatter([place(k3)], [row["collapse_rate"]], s=(s.markersize * 1.5) ** 2, marker=s.marker,
                        color=s.colour, zorder=s.zorder + 1, edgecolors="black", linewidths=0.6)
            top.annotate(f"{row['collapsed']}/{row['seeds']}", (place(k3), row["collapse_rate"]),
                         xytext=(8, 5), textcoords="offset points", fontsize=7, color=s.colour)
            any_rate = True
        for p in by_group[key]:
            final, k = reward_summary(p)["final"], p.collapse.get("mean_k3_kl")
            if p.has_result and final is not None and is_num(k) and math.isfinite(k) and k >= 0:
                bottom.scatter([place(k)], [final], s=(s.markersize * 0.9) ** 2, marker=s.marker,
                               facecolors="none", edgecolors=[s.colour], linewidths=1.2, zorder=s.zorder)
                any_reward = True
        if row["final_reward"] is not None:
            bottom.scatter([place(k3)], [row["final_reward"]], s=(s.markersize * 1.5) ** 2, marker=s.marker,
                           color=s.colour, edgecolors="black", linewidths=0.6, zorder=s.zorder + 1)
    if any_reward:
        handles += [Line2D([], [], marker="o", ms=8, color="black", lw=0, label="filled: group (mean over seeds)"),
                    Line2D([], [], marker="o", ms=6, markerfacecolor="none", markeredgecolor="black", lw=0,
                           label="hollow: one run")]
    if zero:
        for ax in (top, bottom):
            ax.axvline(floor, color="grey", lw=0.8, ls="--", zorder=1)
        handles.append(Line2D([], [], color="grey", lw=0.8, ls="--", label=f"zero mismatch, drawn at {floor:.0e}"))
    top.set_ylim(-0.1, 1.15)
    top.set_ylabel("collapse rate\n(fraction of seeds that collapsed)")
    top.set_title(f"{data.name}: outcome vs realised mismatch")
    bottom.set_ylabel("final reward (smoothed)")
    bottom.set_xlabel(REALISED_K3_WORDS)
    if any_rate or any_reward:
        _log_x(bottom)
    _finish(top, handles if any_rate else [])
    _finish(bottom, [], legend=False)
    return fig


def _log_x(ax: Any) -> None:
    """A log x axis over the plotted points; a decade either side when they share one x (every run at zero
    mismatch), and linear when nothing is plotted (a log axis needs a positive range)."""
    xs = [float(x) for c in ax.collections for x, _ in c.get_offsets() if x > 0]
    if not xs:
        return
    if min(xs) == max(xs):
        ax.set_xlim(xs[0] / 10, xs[0] * 10)
    ax.set_xscale("log")


def _log_floor(values: Any) -> float:
    """Where a zero is drawn on a log axis: a decade below the smallest positive value."""
    positive = [v for v in values if 0 < v < math.inf]
    return min(positive) / 10 if positive else 1e-12


def _mark_every(n: int) -> int:
    """Markers on about 15 points of a line: enough to tell groups apart, few enough to see the line."""
    return max(1, n // 15)


def _value_at(steps: list[float], values: list[float], step: float) -> float:
    """The series linearly interpolated at ``step`` (clamped to its ends), so a marker sits on the line."""
    if step <= steps[0]:
        return values[0]
    for (s0, v0), (s1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:])):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return values[-1]


def _finish(ax: Any, handles: list[Any], legend: bool = True) -> None:
    """Legend outside the axes (right), so it never covers data; "no data" when there is nothing to show."""
    if handles and legend:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  frameon=False)
    elif not handles and not ax.has_data():
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="grey")
    ax.grid(True, which="major", alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    # "tight" keeps the outside legend in the image
    publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
