"""The exact CPU path in guard mode ``canonical`` against ``auto``, interleaved in one process.

    python -m benchmarks.guard_modes --shape default,llama100m --dtype all --threads 1,2 --reps 7 --profile 8

What a host whose ``same_bits`` probes fail pays over one whose probes pass, on this host: for each item of
``benchmarks.end_to_end`` that runs the model alone (``decode_step``, ``train_fwd_bwd``), the same model, weights and
batch run with the exact CPU ops bound to a guard in mode ``canonical`` (``cpu_exact.with_host``: the per-tile
arrangements, every library property probed as ``auto`` does) and to one in mode ``auto`` (the faster arrangements
wherever their ``same_bits`` probe passes), back to back, their order alternating. Each figure is canonical / auto
(median over the repetitions, min–max; decode steps after ``end_to_end.DECODE_WARMUP`` untimed ones, past the call at
which a weight version's GEMMs pack, as ``end_to_end`` times them): one run, one process, so the load that slows one
side slows the other -- unlike the ratio of two ``end_to_end`` runs' exact / native medians (``benchmarks.tables
--by-mode``), whose run-to-run spread on a shared machine is larger than the 5% the comparison asks of it.

A third item, ``linear_layers``, is a diagnostic, not a cell the bound judges: the ``train_fwd_bwd`` item's linear
layers alone (``linear_layers_call``: every linear call of its training pass, replayed on seeded inputs of the same
shapes, forward and the gradients the pass took), in wall time -- how much of a training cell's canonical / auto the
linear layers' GEMMs make, where the profiler's self times add up the threads' times of GEMMs spread between them.

``--profile N`` also profiles each side once and records the N (op, input shapes) pairs with the most self CPU time
on either side, and two totals: the matrix products and copies, and every op (where the per-tile arrangement's extra
time sits; a compiled loop's GEMMs count in its own op's self time). The RL step is
not an item: its trainer takes its ops from the process's guard (``VEXACT_CPU_EXACT_PATH``); it is decode steps and a
training step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor

from vexact import Transformer, generate
from vexact.engine.model import short_dtype_name
from vexact_kernels import cpu_exact
from vexact_kernels.host_guard import CANONICAL_PATH, FASTER_PATH, SAME_BITS, HostGuard

from .common import (
    DTYPES,
    Shape,
    add_common_arguments,
    cli_main,
    compare,
    describe_run,
    fmt_ratio,
    inner_repeats,
    is_matrix_product,
    new_record,
    parse_list,
    parse_threads,
    print_table,
    profiled,
    renamed_sides,
    shapes,
)
from .end_to_end import DECODE_WARMUP, LABELS, at_batch, combo_label, decode_step_call, prompts_of, train_call

BOUND_ITEMS = ("decode_step", "train_fwd_bwd")
"""The items whose canonical / auto the bound (``GAP_LIMIT``) judges: ``end_to_end``'s items that run the model
alone."""
ITEMS = (*BOUND_ITEMS, "linear_layers")
MODES = ("canonical", "auto")  # numerator, denominator
GAP_LIMIT = 1.05
"""canonical / auto at or under this is within the issue's bound (AB: ``canonical`` within 5% of ``auto``)."""
PROFILED_OPS = ("aten::copy_",)  # counted with the matrix products (``is_matrix_product``) in the first total
SPLIT_TOTALS = ("all matrix products and copies", "every profiled op")  # the profile's last rows


def shape_split(fn: Callable[[], object], calls: int = 3) -> dict[str, float]:
    """torch.profiler over ``calls`` calls of ``fn``: self CPU ms per call of every recorded op, keyed
    "op [input shapes]" (its first two inputs), and the totals ``SPLIT_TOTALS`` (the matrix products and copies; every
    op). Under the profiler both sides run slower; the split, not the milliseconds, is the evidence."""
    split: dict[str, float] = collections.defaultdict(float)
    for event in profiled(fn, calls, record_shapes=True).events():
        ms = event.self_cpu_time_total / 1e3 / calls
        if ms <= 0:
            continue
        split[f"{event.name.removeprefix('aten::')} {event.input_shapes[:2]}"] += ms
        if is_matrix_product(event.name) or event.name in PROFILED_OPS:
            split[SPLIT_TOTALS[0]] += ms
        split[SPLIT_TOTALS[1]] += ms
    return dict(split)


def _top_split(sides: dict[str, dict[str, float]], top: int) -> list[dict]:
    """The ``top`` ops with the most time on either side, with both sides' ms (0 where a side has none), then the
    totals (``SPLIT_TOTALS``)."""
    keys = set().union(*sides.values()) - set(SPLIT_TOTALS)
    ranked = sorted(keys, key=lambda k: -max(side.get(k, 0.0) for side in sides.values()))
    return [{"op": k, **{mode: sides[mode].get(k, 0.0) for mode in MODES}} for k in [*ranked[:top], *SPLIT_TOTALS]]


def _row(item: str, shape: str, dtype: str, summary: dict, inner: int) -> dict:
    return {"item": item, "shape": shape, "dtype": dtype, "threads": torch.get_num_threads(), "inner_calls": inner,
            **renamed_sides(summary, *MODES)}


def bench_shape(shape: Shape, dtype_name: str, items: list[str], reps: int, profile: int) -> list[dict]:
    """canonical / auto rows of one shape and dtype at the process's thread count."""
    device = torch.device("cpu")
    model = Transformer(shape.model, backend="exact", dtype=DTYPES[dtype_name], device=device, init_seed=0)
    prompts = prompts_of(shape)
    # each item its own pair of guards, so that each row counts the faster arrangements of its own calls
    ops = {item: {mode: cpu_exact.ops_in_mode(mode) for mode in MODES}
           for item in items}
    calls: dict[str, dict[str, Callable[[], object]]] = {}
    if "decode_step" in items:
        calls["decode_step"] = {mode: decode_step_call(model, prompts, device, ops["decode_step"][mode])
                                for mode in MODES}
    responses = None
    if "train_fwd_bwd" in items or "linear_layers" in items:
        responses = generate(model, prompts, max_new_tokens=shape.new_tokens, temperature=1.0, seed=0).tokens
    if "train_fwd_bwd" in items:
        calls["train_fwd_bwd"] = {mode: train_call(model, prompts, responses, ops["train_fwd_bwd"][mode])
                                  for mode in MODES}
    if "linear_layers" in items:
        calls["linear_layers"] = {mode: linear_layers_call(model, prompts, responses, ops["linear_layers"][mode])
                                  for mode in MODES}
    rows = []
    for item, by_mode in calls.items():
        # a decode step lasts milliseconds: time groups of steps (~50 ms) so scheduler noise averages out
        inner = inner_repeats(by_mode["auto"], device, target_s=0.05) if item == "decode_step" else 1
        # decode steps timed past the call at which a weight version's GEMMs pack, as a rollout's later steps run
        warmup = DECODE_WARMUP if item == "decode_step" else 1
        summary = compare(by_mode["canonical"], by_mode["auto"], reps=reps, device=device, inner=inner,
                          warmup=warmup).summary()
        row = _row(item, shape.name, dtype_name, summary, inner)
        if profile > 0:
            row["profile"] = _top_split({mode: shape_split(by_mode[mode]) for mode in MODES}, profile)
        row["faster_arrangements"] = {mode: faster_arrangements(ops[item][mode].host) for mode in MODES}
        row["refused_arrangements"] = refused_arrangements(ops[item]["auto"].host)
        rows.append(row)
    return rows


LINEAR_INPUTS_SEED = 0
"""The seed of ``linear_layers_call``'s inputs: values of no consequence to its timings, fixed so that every run
multiplies the same numbers."""


def linear_layers_call(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
                       ops: SimpleNamespace) -> Callable[[], object]:
    """The ``linear_layers`` item: the ``train_fwd_bwd`` item's linear layers alone, run with ``ops`` (an op namespace,
    ``cpu_exact.with_host``). Its training pass runs once with ``ops``' ``linear`` and ``linear_backward`` recording
    each call (the input's shape and dtype, the weight, which gradients the pass took: an LM head recomputed in its
    backward calls ``linear`` without grad, then again on leaves); the item replays the calls in order on seeded
    inputs of those shapes -- each forward, and its gradients where the pass took them -- and nothing else."""
    generator = torch.Generator().manual_seed(LINEAR_INPUTS_SEED)

    def seeded(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    replays: list[Callable[[], object]] = []  # each call's replay, made as the pass makes the call

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        grad_on = torch.is_grad_enabled()
        x_seeded = seeded(x.shape, x.dtype).requires_grad_(grad_on and x.requires_grad)
        inputs = [t for t in (x_seeded, weight) if grad_on and t.requires_grad]
        if inputs:
            grad = seeded((*x.shape[:-1], weight.shape[0]), x.dtype)
            replays.append(functools.partial(_forward_and_gradients, ops, x_seeded, weight, bias, inputs, grad))
        else:
            replays.append(functools.partial(_forward_only, ops, x_seeded, weight, bias))
        return ops.linear(x, weight, bias)

    def linear_backward(x: Tensor, weight: Tensor, grad: Tensor, need_x: bool, need_w: bool
                        ) -> tuple[Tensor | None, Tensor | None]:
        replays.append(functools.partial(ops.linear_backward, seeded(x.shape, x.dtype), weight,
                                         seeded(grad.shape, grad.dtype), need_x, need_w))
        return ops.linear_backward(x, weight, grad, need_x, need_w)

    train_call(model, prompts, responses, SimpleNamespace(**{**vars(ops), "linear": linear,
                                                             "linear_backward": linear_backward}))()
    model.zero_grad(set_to_none=True)

    def run() -> object:
        for replay in replays:
            replay()
        return None
    return run


def _forward_only(ops: SimpleNamespace, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One recorded linear call without grad (an LM head's forward that its backward recomputes)."""
    with torch.no_grad():
        return ops.linear(x, weight, bias)


def _forward_and_gradients(ops: SimpleNamespace, x: Tensor, weight: Tensor, bias: Tensor | None,
                           inputs: list[Tensor], grad: Tensor) -> tuple[Tensor, ...]:
    """One recorded linear call with grad: the forward, then the gradients of ``inputs`` (returned, not accumulated
    into ``.grad``: the weights are the model's parameters)."""
    return torch.autograd.grad(ops.linear(x, weight, bias), inputs, grad)


def faster_arrangements(host: HostGuard) -> int:
    """How many shape classes ``host`` runs in a faster arrangement (a passed ``same_bits`` probe): none in mode
    ``canonical``; in ``auto``, where the canonical / auto figure binds (AB: within 5% wherever ``auto`` takes one;
    a cell whose ``auto`` guard takes none makes the same calls in both modes)."""
    return sum(p["property"] == SAME_BITS and p["path"] == FASTER_PATH for p in host.report()["probes"])


def refused_arrangements(host: HostGuard) -> list[str]:
    """The shape classes whose ``same_bits`` probe failed on ``host`` (mode ``auto``): where ``auto`` keeps the
    canonical arrangement too, because this host's GEMM gave the faster arrangement other bits (an AMX GEMM that
    accumulates by the rows in the call, for linear tiles stacked in one GEMM)."""
    return [p["shape_class"] for p in host.report()["probes"]
            if p["property"] == SAME_BITS and p["path"] == CANONICAL_PATH]


def run(shape_names: list[str], dtype_names: list[str], items: list[str], reps: int,
        threads: str | list[int] | None = None, profile: int = 0, malloc: str = "steady", batch: int | None = None
        ) -> dict:
    """Run the benchmark; returns the JSON-ready record (each result: canonical / auto, the medians of both).
    ``batch``: the shapes with that many random prompts instead of their own (``at_batch``)."""
    counts = parse_threads(threads)
    measured = [at_batch(shapes()[name], batch) for name in shape_names]
    record = new_record("guard_modes", torch.device("cpu"), shape_names, dtype_names, reps, counts[0], "exact",
                        malloc, items=items, modes=list(MODES), profile_top=profile)
    record["settings"]["threads"] = [count or torch.get_num_threads() for count in counts]
    record["settings"]["batch"] = batch
    for count in record["settings"]["threads"]:
        torch.set_num_threads(count)
        for dtype_name in dtype_names:
            for shape in measured:
                record["results"] += bench_shape(shape, dtype_name, items, reps, profile)
    return record


def binds(row: dict) -> bool:
    """Whether the bound applies to the cell: one of ``BOUND_ITEMS`` whose ``auto`` guard took a faster arrangement (a
    record without the count is taken to)."""
    return row["item"] in BOUND_ITEMS and row.get("faster_arrangements", {}).get("auto", 1) > 0


def gap_mark(row: dict) -> str:
    """``✓`` / ``✗``: the cell's canonical / auto against ``GAP_LIMIT``; ``""`` for a diagnostic item (not in
    ``BOUND_ITEMS``)."""
    if row["item"] not in BOUND_ITEMS:
        return ""
    return "✓" if row["ratio_median"] <= GAP_LIMIT else "✗"


def modes_matrix(results: list[dict]) -> tuple[list[str], list[list[str]], str]:
    """canonical / auto per (shape, item) row and (dtype, threads) column, marked against ``GAP_LIMIT``, and one
    sentence counting the cells within it among those where it binds (``binds``)."""
    pairs = list(dict.fromkeys((r["dtype"], r["threads"]) for r in results))
    keyed = {(r["item"], r["shape"], r["dtype"], r["threads"]): r for r in results}
    lines = []
    for shape, item in dict.fromkeys((r["shape"], r["item"]) for r in results):
        cells = [keyed.get((item, shape, dtype, threads)) for dtype, threads in pairs]
        lines.append([f"{shape}: {LABELS.get(item, item)}",
                      *[f"{fmt_ratio(r)} {gap_mark(r)}".rstrip() if r else "—" for r in cells],
                      f"≤ {GAP_LIMIT:.2f}×" if item in BOUND_ITEMS else "—"])
    binding = [r for r in results if binds(r)]
    within = sum(gap_mark(r) == "✓" for r in binding)
    rest = sum(r["item"] in BOUND_ITEMS for r in results) - len(binding)
    summary = (f"canonical within {GAP_LIMIT:.2f}× auto in {within} of the {len(binding)} cells where auto takes a "
               "faster arrangement")
    if rest:
        summary += f"; in {rest} more it takes none (the same calls in both modes)"
    refused = [r for r in results if r.get("refused_arrangements")]
    if refused:
        cells = (f"{r['shape']} {LABELS.get(r['item'], r['item'])} {combo_label(r['dtype'], r['threads'])} "
                 f"({len(r['refused_arrangements'])})" for r in refused)
        summary += ("; `auto` kept the canonical arrangement for classes whose `same_bits` probe failed in "
                    + ", ".join(cells))
    return ["canonical / auto", *[combo_label(*pair) for pair in pairs], "bound"], lines, summary


def split_lines(results: list[dict]) -> list[tuple[str, list[list[str]]]]:
    """Per profiled cell: its title and the rows (op [shapes], canonical ms, auto ms, difference)."""
    out = []
    for r in results:
        if "profile" not in r:
            continue
        rows = [[p["op"], f"{p['canonical']:.2f}", f"{p['auto']:.2f}", f"{p['canonical'] - p['auto']:+.2f}"]
                for p in r["profile"]]
        out.append((f"{r['shape']} {LABELS.get(r['item'], r['item'])} {short_dtype_name(r['dtype'])} "
                    f"{r['threads']} thr", rows))
    return out


SPLIT_COLUMNS = ["op [input shapes]", "canonical ms", "auto ms", "difference"]


def over_bound_lines(results: list[dict]) -> list[str]:
    """One sentence per profiled cell over ``GAP_LIMIT``: how much more every op and the matrix products and copies
    took under the profiler in ``canonical`` (the full split: ``split_lines``)."""
    out = []
    for r in results:
        if "profile" not in r or gap_mark(r) != "✗":
            continue
        total = {p["op"]: p for p in r["profile"] if p["op"] in SPLIT_TOTALS}
        every, products = total[SPLIT_TOTALS[1]], total[SPLIT_TOTALS[0]]
        out.append(f"{r['shape']} {LABELS.get(r['item'], r['item'])} {combo_label(r['dtype'], r['threads'])} "
                   f"({r['ratio_median']:.2f}×): every op {every['canonical']:.1f} ms against "
                   f"{every['auto']:.1f} ({every['canonical'] - every['auto']:+.1f}), of which matrix products and "
                   f"copies {products['canonical']:.1f} against {products['auto']:.1f} "
                   f"({products['canonical'] - products['auto']:+.1f})")
    return out


def print_results(record: dict) -> None:
    columns, lines, summary = modes_matrix(record["results"])
    print_table(f"exact path, guard mode canonical / auto, one process ({describe_run(record)})", columns, lines)
    print(summary)
    for title, rows in split_lines(record["results"]):
        print(f"\n{title}: self CPU ms per call under torch.profiler")
        print_table("", SPLIT_COLUMNS, rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "guard_modes", default_shape="default", default_reps=7, thread_list=True,
                         cpu_only="cpu: the guard modes are the CPU kernels'")
    p.add_argument("--items", default="all", help="comma list of: " + ", ".join(ITEMS))
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile each figure once per mode: the N ops (by input shapes) with the most self "
                        "time on either side, and the totals")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="the shapes with N random prompts instead of their own (a decode step of N rows; not the "
                        "default shape, whose prompts are its task's)")

def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu":
        raise ValueError("guard_modes measures the CPU kernels' guard modes: --device cpu")
    return run(parse_list(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               parse_list(args.items, ITEMS, "item"), args.reps, args.threads, args.profile, args.malloc,
               args.batch)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.guard_modes") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, item, threads, a device not cpu) exits 2 with one
    line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "guard_modes", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
