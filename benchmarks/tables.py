"""Markdown tables from benchmark JSON files (what the README's "Benchmarks" section shows).

    python -m benchmarks.tables runs/bench/e2e-default.json runs/bench/kernels.json runs/bench/e2e-llama100m.json

Each file is recognised by its ``benchmark`` field (``end_to_end``, ``kernels``, ``host_guard``, ``guard_modes``,
``tile_heights``, ``op_swap``, ``peer_decode`` or ``decode_profile``);
the tables are printed in the order of the files, so the README's numbers are copied from this output, not typed.

    python -m benchmarks.tables --by-mode runs/bench/ab-auto.json runs/bench/ab-canonical.json

puts end-to-end runs of the same items made in different CPU guard modes (``VEXACT_CPU_EXACT_PATH``, recorded as
``machine.exact_path``) in one table, the modes interleaved, and says per cell how far each later mode is from the
first (the benchmarks page's table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vexact.engine.model import short_dtype_name
from vexact.metric_keys import TIMING_ROLLOUT, TIMING_UPDATE
from vexact.sweeps.markdown_table import markdown_table

from . import guard_modes, op_swap, tile_heights
from .common import fmt_ratio, thread_counts
from .decode_profile import PACKED_AT_TILE_ROWS, gemm_table, split_table, vllm_table
from .end_to_end import LABELS as E2E_LABELS
from .end_to_end import combo_label, combos, target_matrix
from .peer_decode import rows_of as peer_rows


def _markdown(columns: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    """vexact's one Markdown table writer, numbers (from column ``right_from`` on) right-aligned."""
    return markdown_table(columns, rows, [None if i < right_from else "right" for i in range(len(columns))])


def _machine(record: dict) -> str:
    m = record["machine"]
    counts = thread_counts(record)
    threads = ", ".join(map(str, counts)) + (" torch thread" if counts == [1] else " torch threads")
    onednn = ", VEXACT_CPU_ONEDNN=off" if m.get("exact_onednn") == "off" else ""  # (auto: the default, unsaid)
    # an installed vexact has no commit (records before vexact_version have no version): name what the record knows
    code = (f"commit {m.get('git_commit')}" if m.get("git_commit") or "vexact_version" not in m
            else f"vexact {m['vexact_version']}")
    return (f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs, {threads}, torch "
            f"{m['torch_version']}, malloc {m.get('malloc', 'default')}, {code}{onednn}, load "
            f"average {m.get('load_average_start')} -> {m.get('load_average_end')}")


def end_to_end_table(record: dict) -> str:
    """One row per item and shape: the ratio per dtype, and exact / native tokens/s per dtype (a record that names
    its thread counts: ``targets_table``)."""
    if "threads" in record["settings"]:
        return targets_table(record)
    dtypes = list(dict.fromkeys(r["dtype"] for r in record["results"]))
    keyed = {(r["item"], r["shape"], r["dtype"]): r for r in record["results"]}
    rows = []
    for item, shape in dict.fromkeys((r["item"], r["shape"]) for r in record["results"]):
        row = [f"{E2E_LABELS.get(item, item)} ({shape}, {keyed[item, shape, dtypes[0]]['tokens']} tokens)"]
        for dtype in dtypes:
            r = keyed.get((item, shape, dtype))
            row.append(fmt_ratio(r) if r else "—")
        for dtype in dtypes:
            r = keyed.get((item, shape, dtype))
            row.append(f"{r['exact_tokens_per_s']:.0f} / {r['native_tokens_per_s']:.0f}" if r else "—")
        rows.append(row)
    short = [short_dtype_name(d) for d in dtypes]
    return _markdown(["exact / native", *short, *[f"exact / native tokens/s ({d})" for d in short]], rows)


def targets_table(record: dict) -> str:
    """The ratio per (dtype, threads) against ``end_to_end.TARGETS`` (✓ within, ✗ over), one sentence per column
    saying how many targets it meets, then exact / native tokens/s per (dtype, threads)."""
    columns, rows, summary = target_matrix(record["results"])
    pairs = combos(record["results"])
    keyed = {(r["item"], r["shape"], r["dtype"], r["threads"]): r for r in record["results"]}
    speed_rows = []
    for item, shape in dict.fromkeys((r["item"], r["shape"]) for r in record["results"]):
        cells = [keyed.get((item, shape, dtype, threads)) for dtype, threads in pairs]
        tokens = next(r for r in cells if r)["tokens"]
        speed_rows.append([f"{shape}: {E2E_LABELS.get(item, item)} ({tokens} tokens)",
                           *[f"{r['exact_tokens_per_s']:.0f} / {r['native_tokens_per_s']:.0f}" if r else "—"
                             for r in cells]])
    return "\n\n".join([_markdown(columns, rows), "\n".join(f"- {line}" for line in summary),
                         _markdown(["exact / native tokens/s", *[combo_label(*c) for c in pairs]], speed_rows)])


def _combo_of(row: dict) -> str:
    """A result row's dtype and thread count (``combo_label``); its dtype alone in records from before thread lists."""
    return combo_label(row["dtype"], row["threads"]) if "threads" in row else short_dtype_name(row["dtype"])


RL_PHASES = tuple(key.removeprefix("timing/") for key in (TIMING_ROLLOUT, TIMING_UPDATE))
"""The RL step's phases the tables split it by: the trainer's own ``timing/`` metrics, kept per side by
``end_to_end``'s RL step (``phase_ms_median``, the prefix dropped)."""


def rl_phase_line(record: dict, mode: str | None = None) -> str:
    """The RL step's exact / native per phase (``RL_PHASES``: its rollout, and its update -- the PPO epochs' forwards,
    backwards and AdamW steps), one clause per (dtype, threads); empty where the record has no RL step with phases."""
    clauses = []
    for r in record["results"]:
        phases = r.get("phase_ms_median")
        if r["item"] != "rl_step" or not phases:
            continue
        exact, native = phases["exact"], phases["native"]
        parts = [f"{p} {exact[p] / native[p]:.2f}× ({exact[p]:.1f} ms against {native[p]:.1f})"
                 for p in RL_PHASES if exact.get(p) and native.get(p)]
        clauses.append(f"{_combo_of(r)}: " + ", ".join(parts))
    if not clauses:
        return ""
    return f"- {E2E_LABELS['rl_step']}, by phase{f' ({mode})' if mode else ''}: " + "; ".join(clauses)


def profile_lines(record: dict, top: int = 4) -> str:
    """Where the time goes per item (records made with --profile N)."""
    lines = []
    for r in record["results"]:
        if "profile" not in r:
            continue
        sides = []
        for side in ("exact", "native"):
            p = r["profile"][side]
            ops = ", ".join(f"{o['op'].removeprefix('aten::')} {o['share']:.0%}" for o in p["ops"][:top])
            sides.append(f"{side} {p['total_self_ms_per_run']:.1f} ms in {p['aten_calls_per_run']:.0f} ops ({ops})")
        what = f"{r['item']} {r['shape']} {_combo_of(r)}" if "threads" in r else f"{r['item']} {_combo_of(r)}"
        lines.append(f"- {what}: " + "; ".join(sides))
    return "\n".join(lines)


def matmul_table(record: dict) -> str:
    """Exact linear vs torch.mm GFLOP/s, fp32 and bf16 side by side."""
    keyed = {(r["shape"], r["matmul"], r["dtype"]): r for r in record["matmul"]}
    rows = []
    for shape, name in dict.fromkeys((r["shape"], r["matmul"]) for r in record["matmul"]):
        first = next(r for (s, n, _), r in keyed.items() if (s, n) == (shape, name))
        row = [shape, name, f"{first['m']} × {first['k']} × {first['n']}"]
        for dtype in ("float32", "bfloat16"):
            r = keyed.get((shape, name, dtype))
            row += [f"{r['exact_gflops']:.0f} / {r['torch_mm_gflops']:.0f}", f"{r['fraction_of_torch_mm']:.0%}"] \
                if r else ["—", "—"]
        rows.append(row)
    return _markdown(["shape", "matmul", "M × K × N", "fp32 exact / mm", "fp32 share", "bf16 exact / mm",
                      "bf16 share"], rows, right_from=3)


def kernel_table(record: dict) -> str:
    """One row per op and shape: median ratio for each dtype x mode."""
    keyed = {(r["op"], r["shape"], r["dtype"], r["mode"]): r for r in record["results"]}
    combos = list(dict.fromkeys((r["dtype"], r["mode"]) for r in record["results"]))
    rows = []
    for op, shape in dict.fromkeys((r["op"], r["shape"]) for r in record["results"]):
        size = next(r["size"] for (o, s, _, _), r in keyed.items() if (o, s) == (op, shape))
        row = [op, shape, size]
        for dtype, mode in combos:
            r = keyed.get((op, shape, dtype, mode))
            row.append(f"{r['ratio_median']:.2f}×" if r else "—")
        rows.append(row)
    return _markdown(["op", "shape", "size", *[f"{short_dtype_name(d)} {m}" for d, m in combos]], rows,
                     right_from=3)


def host_guard_table(record: dict) -> str:
    """One row per item and shape: fixed-order / fast per dtype; then the probes' cost per dtype."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in record["results"]))
    keyed = {(r["item"], r["shape"], r["dtype"]): r for r in record["results"]}
    rows = []
    for item, shape in dict.fromkeys((r["item"], r["shape"]) for r in record["results"]):
        size = keyed[item, shape, dtypes[0]]["size"]
        rows.append([item, shape, size, *[fmt_ratio(keyed[item, shape, d]) if (item, shape, d) in keyed else "—"
                                          for d in dtypes]])
    ratios = _markdown(["fixed-order / fast", "shape", "size", *[short_dtype_name(d) for d in dtypes]], rows,
                       right_from=3)
    cost = [[p["shape"], short_dtype_name(p["dtype"]), str(p["shape_classes"]), f"{p['probe_s'] * 1e3:.1f}",
             ", ".join(p["failed"]) or "none"] for p in record.get("probe_cost", [])]
    return ratios + "\n\n" + _markdown(["probes", "dtype", "shape classes", "probing ms", "failed"], cost)


def guard_modes_table(record: dict) -> str:
    """canonical / auto per (shape, item) and (dtype, threads), the sentence counting the cells within the bound, then
    per profiled cell over it the profiled milliseconds per call (the full split per op: ``python -m
    benchmarks.guard_modes`` prints it, the JSON keeps it)."""
    columns, lines, summary = guard_modes.modes_matrix(record["results"])
    over = guard_modes.over_bound_lines(record["results"])
    return "\n\n".join([_markdown(columns, lines), f"- {summary}",
                         *(["Under torch.profiler, per call:\n\n" + "\n".join(f"- {line}" for line in over)]
                           if over else [])])


def tile_rows_line(padded: dict, rows: int) -> str:
    """A ``--gemm`` record's ``at_exact_tile_rows`` as one line: per weight shape the rows the exact path multiplies
    for ``rows`` (and the dtype it computes in), then F.linear's time for the decode step's GEMMs at those rows over
    its time at ``rows``; where recorded, oneDNN's linear on the packed weight at those rows against F.linear at
    ``rows`` (what the exact path's GEMMs cost after packing, against native's)."""
    step = padded["decode_step_gemm_s"]
    shapes_ = ", ".join(f"{shape} {entry['tile_rows']} ({entry['computed_in']})"
                        for shape, entry in padded["per_shape"].items())
    line = (f"- the rows the exact path multiplies at {rows} rows: {shapes_}; F.linear at those rows / at {rows} rows, "
            f"the decode step's GEMMs: {step['F.linear_at_tile_rows_s'] / step['F.linear_s']:.2f}× "
            f"({step['F.linear_at_tile_rows_s'] * 1e3:.1f} ms against {step['F.linear_s'] * 1e3:.1f})")
    packed = step.get(PACKED_AT_TILE_ROWS)
    if packed is not None:
        line += (f"; oneDNN's linear on the packed weights at those rows: {packed * 1e3:.1f} ms, "
                 f"{packed / step['F.linear_s']:.2f}× F.linear at {rows} rows")
    return line


def packed_line(packed: dict) -> str:
    """A ``--gemm`` record's ``onednn_packed`` as one line: whether the packed weight keeps oneDNN's bits, and what
    packing costs (one layer's weights, summed, and each other shape)."""
    same = all(entry["same_bits"] for entry in packed.values())
    bits = ("the same bits as on the weight as stored, at every tile height and GEMM shape" if same else
            "other bits at " + ", ".join(shape for shape, entry in packed.items() if not entry["same_bits"]))
    costs = ", ".join(f"{shape} {entry['pack_s'] * 1e3:.2f} ms" for shape, entry in packed.items())
    return f"- torch's oneDNN linear on a weight packed once: {bits}; packing a weight: {costs}"


def tables(record: dict) -> str:
    if record.get("benchmark") == "end_to_end":
        parts = [end_to_end_table(record), rl_phase_line(record), profile_lines(record)]
    elif record.get("benchmark") == "kernels":
        parts = [matmul_table(record) if record.get("matmul") else "", kernel_table(record)]
    elif record.get("benchmark") == "host_guard":
        parts = [host_guard_table(record)]
    elif record.get("benchmark") == "guard_modes":
        parts = [guard_modes_table(record)]
    elif record.get("benchmark") == "tile_heights":
        parts = [_markdown(*tile_heights.table(record), right_from=2)]
    elif record.get("benchmark") == "op_swap":
        parts = [_markdown(*op_swap.swap_matrix(record["results"]))]
    elif record.get("benchmark") == "peer_decode":
        parts = [_markdown(*peer_rows(record), right_from=2)]
    elif record.get("benchmark") == "decode_profile" and record.get("side") == "gemm":
        differing = record["results"].get("onednn_row_heights_differing")
        per_shape = record["results"].get("per_shape_at_decode_rows", {})
        padded = record["results"].get("at_exact_tile_rows")
        packed = record["results"].get("onednn_packed")
        parts = [_markdown(*gemm_table(record)),
                 "" if padded is None else tile_rows_line(padded, record["prompts"]),
                 "" if not per_shape else
                 f"- each weight shape alone at {record['prompts']} rows, F.linear / torch_onednn_linear: " + ", ".join(
                     f"{shape} {t['F.linear_s'] / t['torch_onednn_linear_s']:.2f}×" for shape, t in per_shape.items()),
                 "" if differing is None else
                 "- torch's oneDNN linear: " + ("a row keeps its bits at every tile height of the exact kernels, "
                                                "at every GEMM shape of the model" if not any(differing.values()) else
                                                "rows differ at tile heights " + "; ".join(
                                                    f"{shape}: {heights}" for shape, heights in differing.items()
                                                    if heights)),
                 "" if packed is None else packed_line(packed)]
    elif record.get("benchmark") == "decode_profile" and record.get("side") == "vllm":
        parts = [_markdown(*vllm_table(record)), _markdown(*gemm_table(record))]
    elif record.get("benchmark") == "decode_profile":
        parts = [_markdown(*split_table(record))]
    else:
        raise ValueError(f"not a benchmark record (benchmark = {record.get('benchmark')!r})")
    return "\n\n".join(p for p in [f"Measured on: {_machine(record)}", *parts] if p)


MODE_GAP_LIMIT = 1.05
"""How far a guard mode's exact / native median may sit above the first mode's before ``modes_table`` names the cell
(issue AB: ``canonical`` within 5% of ``auto``)."""


SAME_HOST_FIELDS = ("cpu_model", "logical_cpus", "torch_version")
"""What records compared mode against mode (``--by-mode``) must share: a ratio across hosts compares the hosts."""


def modes_machine(records: list[dict], files: list[Path]) -> str:
    """The "Measured on" line of a ``--by-mode`` table: records from another host than the first (a field of
    ``SAME_HOST_FIELDS`` differs) are refused; records made at different commits get one line each, with its mode."""
    first = records[0]["machine"]
    for path, record in zip(files[1:], records[1:], strict=True):
        differs = [f"{field} {record['machine'].get(field)!r} vs {first.get(field)!r}" for field in SAME_HOST_FIELDS
                   if record["machine"].get(field) != first.get(field)]
        if differs:
            raise ValueError(f"{path} was measured on another host than {files[0]} ({'; '.join(differs)}): "
                             "--by-mode compares one host's guard modes")
    if len({record["machine"].get("git_commit") for record in records}) == 1:
        return f"Measured on: {_machine(records[0])}"
    return "Measured on (the runs' commits differ):\n" + "\n".join(
        f"- {record['machine'].get('exact_path')}: {_machine(record)}" for record in records)


def modes_table(records: list[dict]) -> str:
    """End-to-end runs of the same items in different guard modes as one targets table: a row per (shape, item) and
    mode, then one sentence per later mode naming the cells more than ``MODE_GAP_LIMIT`` over the first mode's."""
    modes = []
    for record in records:
        if record.get("benchmark") != "end_to_end" or "threads" not in record.get("settings", {}):
            raise ValueError("--by-mode takes end_to_end records made with a thread list (--threads)")
        mode = record["machine"].get("exact_path")
        if mode is None:
            raise ValueError("a record does not say its guard mode (machine.exact_path: records from before it was "
                             "kept); re-run it")
        if mode in modes:
            raise ValueError(f"two records in guard mode {mode!r}: --by-mode takes one per mode")
        modes.append(mode)
    columns, _, _ = target_matrix([r for record in records for r in record["results"]])
    by_label = []  # per mode: row label -> {column: cell}
    for record in records:
        mode_columns, mode_rows, _ = target_matrix(record["results"])
        by_label.append({row[0]: dict(zip(mode_columns, row, strict=True)) for row in mode_rows})
    labels = list(dict.fromkeys(label for rows in by_label for label in rows))
    lines = [[label, mode, *[rows.get(label, {}).get(c, "—") for c in columns[1:]]]
             for label in labels for mode, rows in zip(modes, by_label, strict=True)]
    keyed = [{(r["item"], r["shape"], r["dtype"], r["threads"]): r for r in record["results"]} for record in records]
    gaps = []
    for mode, cells in zip(modes[1:], keyed[1:], strict=True):
        over = [f"{shape} {E2E_LABELS.get(item, item)} {combo_label(dtype, threads)} "
                f"{r['ratio_median'] / keyed[0][key]['ratio_median']:.2f}×"
                for key, r in cells.items() for item, shape, dtype, threads in [key]
                if key in keyed[0] and r["ratio_median"] > MODE_GAP_LIMIT * keyed[0][key]["ratio_median"]]
        gaps.append(f"- {mode} / {modes[0]}: " + (f"over {MODE_GAP_LIMIT:.2f}× in {len(over)} of {len(cells)} cells: "
                                                  + ", ".join(over) if over else
                                                  f"within {MODE_GAP_LIMIT:.2f}× in every cell"))
    table = _markdown([columns[0], "mode", *columns[1:]], lines, right_from=2)
    phases = [line for record, mode in zip(records, modes, strict=True) if (line := rl_phase_line(record, mode))]
    return "\n\n".join([table, "\n".join(gaps + phases)])


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.tables") -> int:
    """Command-line entry point; an unreadable or foreign JSON file exits 2 with one line."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON written by benchmarks.kernels / end_to_end")
    parser.add_argument("--by-mode", action="store_true",
                        help="end-to-end runs made in different guard modes (VEXACT_CPU_EXACT_PATH) as one table")
    args = parser.parse_args(argv)
    try:
        records = []
        for path in args.files:
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}: cannot read benchmark JSON ({err})") from None
        if args.by_mode:
            table = modes_table(records)  # first: it refuses a record that is no end_to_end one
            print(f"{modes_machine(records, args.files)}\n\n{table}")
            return 0
        for path, record in zip(args.files, records, strict=True):
            print(f"## {path}\n\n{tables(record)}\n")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
