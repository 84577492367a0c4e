"""The report of ``vexact locate``: its result (``LocateResult``), the verdict line, the tables, the JSON and the
plot. What the summary holds: ``vexact.real.locate``'s docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor


@dataclass
class LocateResult:
    """``summary``: the JSON-able report (keys in the module docstring); ``a`` / ``b``: each path's captures
    (empty for a hash-only dump)."""

    summary: dict[str, Any]
    a: dict[str, Tensor]
    b: dict[str, Tensor]


# --------------------------------------------------------------------------- output
def _fmt(value: float | None) -> str:
    return "-" if value is None else "0" if value == 0 else f"{value:.3g}"


def _where(first: dict[str, Any]) -> str:
    index = first["feature_index"]
    feature = f"feature {first['feature']}" + (f" (head {index[0]}, dim {index[1]})" if len(index) == 2 else "")
    return f"sequence {first['sequence']}, position {first['position']}, {feature}"


def verdict(summary: dict[str, Any]) -> str:
    """One line: no divergence, or the first diverging op, where, and both values with their bits."""
    s, first = summary, summary["first_divergence"]
    if first is None:
        return (f"no divergence: all {len(s['ops'])} compared sites bitwise equal at all {s['positions']} positions "
                f"({s['a']} vs {s['b']}{', by hash' if s.get('compared_by') == 'hash' else ''})")
    if first.get("by") == "hash":
        return (f"first divergence: {first['op']}: its hashes differ ({s['a']} vs {s['b']}; dumps with tensors say "
                "where and by how much)")
    return (f"first divergence: {first['op']} at {_where(first)}: a = {first['a']:.9g} "
            f"({first['a_bits']}), b = {first['b']:.9g} ({first['b_bits']}), |Δ| {first['abs_diff']:.3g}; "
            f"{first['positions_differing']} of {s['positions']} positions differ there")


def weights_line(summary: dict[str, Any]) -> str | None:
    """One line on the weights: the same digest, different (compared anyway), or why they could not be checked;
    None for a summary without ``weights``, or of a run that compared its own two paths (one load: not digested)."""
    w = summary.get("weights")
    if w is None:
        return None
    if w["same"] is None:
        return f"weights not checked: {w['note']}"
    if w["same"] and w["dtype"] is None:  # one run's two paths from one load: nothing to say (the JSON says why)
        return None
    digest = f"sha256 of the {w['dtype']} weights {w['a'][:16]}"
    if w["same"]:
        return f"weights: the same ({digest})"
    return (f"weights DIFFER ({digest} vs {w['b'][:16]}), compared anyway (--allow-different-weights): every site "
            "from the first layer on may differ for that alone")


def print_locate(result: LocateResult, console: Any) -> None:
    """Rich tables: |Δ| op by op (the first diverging op in red), then layer by layer; then the verdict line."""
    from rich.table import Table

    s = result.summary
    first = s["first_divergence"]
    generated = (f"{s['max_new_tokens']} tokens of each generated, seed {s['seed']}" if s["max_new_tokens"] is not None
                 else f"read from --tokens-from {s['tokens_from']}" if "tokens_from" in s else "read from dumps")
    table = Table(title=f"vexact locate: a {s['a']} vs b {s['b']}",
                  caption=f"{s['model']}; {len(s['tokens'])} sequences ({generated}), {s['positions']} positions "
                          f"compared{' by hash' if s.get('compared_by') == 'hash' else ''}")
    for col in ("#", "site", "op / module", "positions differing", "elements differing", "max |Δ|", "mean |Δ|",
                "max |Δ| / max |b|"):
        table.add_column(col, justify="left" if col in ("site", "op / module") else "right")
    for row in s["ops"]:
        style = "green" if row["bitwise_equal"] else ("bold red" if first and row["index"] == first["index"] else "")
        kernel_op = row["kernel_op"] + (" (input)" if row["recorded"] == "input" else "")
        counts = ["-" if row[k] is None else row[k] for k in ("positions_differing", "elements_differing")]
        cells = [row["index"], row["name"], kernel_op, f"{counts[0]} / {s['positions']}",
                 f"{counts[1]} / {row['elements']}", _fmt(row["abs_diff_max"]),
                 _fmt(row["abs_diff_mean"]), _fmt(row["rel_diff_max"])]
        table.add_row(*map(str, cells), style=style or None)
    console.print(table)
    layers = Table(title="|Δ| layer by layer")
    for col in ("group", "ops differing", "max |Δ| in group", "output", "output max |Δ|", "output mean |Δ|"):
        layers.add_column(col, justify="left" if col in ("group", "output") else "right")
    for row in s["layers"]:
        layers.add_row(row["group"], f"{row['ops_differing']} / {row['ops']}", _fmt(row["abs_diff_max"]),
                       row["output"], _fmt(row["output_abs_diff_max"]), _fmt(row["output_abs_diff_mean"]))
    console.print(layers)
    for side in ("a", "b"):
        if s.get(f"sites_only_in_{side}"):
            console.print(f"not compared, only {side} has them: " + ", ".join(s[f"sites_only_in_{side}"]), markup=False,
                          highlight=False, soft_wrap=True)
    line = weights_line(s)
    if line is not None:
        console.print(line, style=None if s["weights"]["same"] else "yellow", markup=False, highlight=False,
                      soft_wrap=True)
    console.print(verdict(s), style="red" if first else "green", markup=False, highlight=False, soft_wrap=True)


def write_json(result: LocateResult, path: Path) -> Path:
    """The summary as JSON (NaN/Inf as strings, see ``runlog.write_json_atomic``)."""
    from ..records.runlog import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result.summary)
    return path


def write_png(result: LocateResult, path: Path) -> Path:
    """max |Δ| per op in forward order on a log scale; bitwise-equal ops as hollow markers on the bottom edge,
    layer boundaries as grey lines, the first divergence as a red dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    s = result.summary
    ops = s["ops"]
    peaks = [row["abs_diff_max"] for row in ops]
    nonzero = [p for p in peaks if p > 0 and math.isfinite(p)]
    means_nonzero = [row["abs_diff_mean"] for row in ops if row["abs_diff_mean"] > 0]
    floor = min(nonzero + means_nonzero) / 10 if nonzero else 1e-12
    fig, ax = plt.subplots(figsize=(max(8.0, 0.16 * len(ops)), 4.8))
    xs = list(range(len(ops)))
    ax.plot([x for x, p in zip(xs, peaks) if p > 0], [p for p in peaks if p > 0], "o-", color="tab:red", ms=4,
            label="max |Δ| (bits differ)")
    means = [row["abs_diff_mean"] for row in ops]
    ax.plot([x for x, m in zip(xs, means) if m > 0], [m for m in means if m > 0], ".", color="tab:orange", ms=4,
            label="mean |Δ|")
    equal = [x for x, row in zip(xs, ops) if row["bitwise_equal"]]
    ax.plot(equal, [floor] * len(equal), "o", mfc="none", color="tab:green", ms=4, label="bitwise equal")
    signed_zeros = [x for x, row, p in zip(xs, ops, peaks) if not row["bitwise_equal"] and p == 0]
    if signed_zeros:  # bits differ but |Δ| is 0: only -0.0 vs 0.0
        ax.plot(signed_zeros, [floor] * len(signed_zeros), "x", color="tab:red", ms=5, label="-0.0 vs 0.0 only")
    ax.set_yscale("log")
    groups = [row["group"] for row in ops]
    for x in range(1, len(ops)):
        if groups[x] != groups[x - 1]:
            ax.axvline(x - 0.5, color="0.85", lw=0.8)
    if s["first_divergence"] is not None:
        ax.axvline(s["first_divergence"]["index"], color="tab:red", ls="--", lw=1,
                   label=f"first divergence: {s['first_divergence']['op']}")
    if len(ops) <= 80:
        ax.set_xticks(xs, [row["name"] for row in ops], rotation=90, fontsize=6)
    ax.set_xlabel("op, in forward order")
    ax.set_ylabel("max |Δ| over positions and features")
    ax.set_title(f"vexact locate: a {s['a']} vs b {s['b']} ({s['positions']} positions)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    from ..records.atomic import publish

    try:
        publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))  # whole: no half image, old one kept
    finally:
        plt.close(fig)
    return path
