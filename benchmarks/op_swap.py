"""Where the exact path's time over native's sits: each exact op in turn swapped for native's, in one process.

    python -m benchmarks.op_swap --shape llama100m --dtype float32 --threads 1,2 --items train_fwd_bwd --reps 5

For each item of ``benchmarks.end_to_end`` that runs the model alone (``decode_step``, ``train_fwd_bwd``), one exact
model, its weights and its batch run as several *variants*: the exact CPU ops (``exact``); the exact ops with one op
replaced by the native backend's (``native <op>``, for every op the item calls: that op's arithmetic native, every
other op exact; ``linear_backward``, the LM head's recomputing backward, goes with ``linear``); and the native
backend's ops throughout (``native``). The variants run in turn, their order rotating every repetition, so the load
that slows one slows the others; each figure is a variant's median. An op's row gives what swapping it saves, exact -
(exact with that op native), and that saving's share of exact - native: an op whose exact kernel costs more than
native's saves time when swapped (a positive share), one that is faster costs time (a negative one). The shares need
not add up to 1 (ops interact: one op's output layout is the next op's input).

Wall time, not profiler self times: a profile splits time by op, but the exact ops' compiled loops and GEMM calls run
inside their autograd nodes and the library's GEMMs differ in kind (oneDNN against MKL), so which op owns an excess is
clearer from what swapping it removes. A swapped variant is neither exact nor native: timing only, no bit of it is
meant to match anything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from vexact import Transformer, generate
from vexact_kernels import cpu_exact, native

from .common import (
    DTYPES,
    add_common_arguments,
    cli_main,
    describe_run,
    inner_repeats,
    new_record,
    parse_list,
    parse_threads,
    print_table,
    shapes,
)
from .end_to_end import DECODE_WARMUP, LABELS, combo_label, decode_step_call, prompts_of, train_call

ITEMS = ("decode_step", "train_fwd_bwd")
OPS = tuple(cpu_exact.HOST_PROPERTIES)
"""The ops a variant may swap: the exact backend's op registry."""
GOES_WITH = {"linear": ("linear_backward",)}
"""Functions swapped together with an op (the same arithmetic under another entry point)."""
EXACT, NATIVE = "exact", "native"


def swapped(ops: SimpleNamespace, op: str) -> SimpleNamespace:
    """``ops`` with ``op`` (and what ``GOES_WITH`` it) taken from the native backend."""
    return SimpleNamespace(**{**vars(ops), **{name: getattr(native, name) for name in (op, *GOES_WITH.get(op, ()))}})


def called_ops(make_call: Callable[[SimpleNamespace], Callable[[], object]], ops: SimpleNamespace) -> list[str]:
    """The ops of ``OPS`` an item calls: the item made with ``ops`` wrapped to note each call, and run once."""
    seen: set[str] = set()

    def noting(name: str, fn: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            seen.add(name)
            return fn(*args, **kwargs)
        return call

    wrapped = {name: noting(name, getattr(ops, name)) for name in OPS}
    wrapped.update({extra: noting(op, getattr(ops, extra)) for op, extras in GOES_WITH.items() for extra in extras})
    make_call(SimpleNamespace(**{**vars(ops), **wrapped}))()
    return [name for name in OPS if name in seen]


def _variant_calls(item: str, model: Transformer, native_model: Transformer, prompts: list[list[int]],
                   responses: list[list[int]] | None, device: torch.device) -> dict[str, Callable[[], object]]:
    """The item's call per variant: exact, each called op native, native."""
    if item == "decode_step":
        def make(ops: SimpleNamespace | None, on: Transformer = model) -> Callable[[], object]:
            return decode_step_call(on, prompts, device, ops)
    else:
        def make(ops: SimpleNamespace | None, on: Transformer = model) -> Callable[[], object]:
            return train_call(on, prompts, responses, ops)
    exact_ops = cpu_exact.with_host(cpu_exact.HOST)
    calls = {EXACT: make(exact_ops)}
    for op in called_ops(make, exact_ops):
        calls[f"{NATIVE} {op}"] = make(swapped(exact_ops, op))
    calls[NATIVE] = make(None, native_model)
    return calls


def time_variants(calls: dict[str, Callable[[], object]], reps: int, inner: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, ``reps`` samples each (``inner`` calls a sample), after ``warmup`` untimed
    calls; the variants' order rotates by one every repetition."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            for _ in range(inner):
                calls[name]()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def bench_shape(shape_name: str, dtype_name: str, items: list[str], reps: int) -> list[dict]:
    """One row per item of one shape and dtype at the process's thread count."""
    shape = shapes()[shape_name]
    device = torch.device("cpu")
    dtype = DTYPES[dtype_name]
    model = Transformer(shape.model, backend="exact", dtype=dtype, device=device, init_seed=0)
    native_model = Transformer(shape.model, backend="native", dtype=dtype, device=device, init_seed=None)
    native_model.load_state_dict(model.state_dict())
    prompts = prompts_of(shape)
    responses = None
    if "train_fwd_bwd" in items:
        responses = generate(model, prompts, max_new_tokens=shape.new_tokens, temperature=1.0, seed=0).tokens
    rows = []
    for item in items:
        calls = _variant_calls(item, model, native_model, prompts, responses, device)
        # a decode step lasts milliseconds: time groups of steps (~50 ms), past the call at which GEMMs pack
        inner = inner_repeats(calls[NATIVE], device, target_s=0.05) if item == "decode_step" else 1
        warmup = DECODE_WARMUP if item == "decode_step" else 1
        samples = time_variants(calls, reps, inner, warmup)
        rows.append({"item": item, "shape": shape_name, "dtype": dtype_name, "threads": torch.get_num_threads(),
                     "inner_calls": inner, "variants": {name: {"median_s": statistics.median(s), "samples_s": s}
                                                        for name, s in samples.items()}})
    return rows


def op_rows(row: dict) -> list[list[str]]:
    """A result's table rows: each variant's ms, its time / native's, and for a swapped op what the swap saves and
    that saving's share of exact - native."""
    medians = {name: v["median_s"] * 1e3 for name, v in row["variants"].items()}
    exact, native_ms = medians[EXACT], medians[NATIVE]
    excess = exact - native_ms
    out = []
    for name, ms in medians.items():
        saves = share = "—"
        if name not in (EXACT, NATIVE):
            saves = _ms(exact - ms, "+")
            share = f"{(exact - ms) / excess:+.0%}" if excess > 0 else "—"
        out.append([name, _ms(ms), f"{ms / native_ms:.3f}", saves, share])
    return out


def _ms(ms: float, sign: str = "") -> str:
    """Milliseconds to two decimals under 10 ms, else one (``sign`` "+": always signed)."""
    return f"{ms:{sign}.2f}" if abs(ms) < 10 else f"{ms:{sign}.1f}"


COLUMNS = ["variant", "ms", "/ native", "saves ms", "share of exact - native"]


def swap_matrix(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """All results in one table: a column per result (item, dtype, threads); a first row exact / native, a second the
    spread of exact's own samples (the scale of the run's noise: a saving well inside it says nothing), then per
    swapped op what the swap saves (ms) and its share of exact - native ("—" where the item does not call the op)."""
    ops = [op for op in OPS if any(f"{NATIVE} {op}" in r["variants"] for r in results)]
    columns = ["", *(f"{r['shape']} {LABELS.get(r['item'], r['item'])}, {combo_label(r['dtype'], r['threads'])}"
                     for r in results)]
    first = ["exact / native"]
    spread = ["exact's samples: max - min"]
    lines = [[f"{NATIVE} {op}: saves"] for op in ops]
    for r in results:
        medians = {name: v["median_s"] * 1e3 for name, v in r["variants"].items()}
        exact, excess = medians[EXACT], medians[EXACT] - medians[NATIVE]
        first.append(f"{exact / medians[NATIVE]:.2f}× ({_ms(exact)} ms against {_ms(medians[NATIVE])})")
        samples = r["variants"][EXACT]["samples_s"]
        spread.append(f"{_ms((max(samples) - min(samples)) * 1e3)} ms")
        for line, op in zip(lines, ops):
            ms = medians.get(f"{NATIVE} {op}")
            share = f" ({(exact - ms) / excess:+.0%})" if ms is not None and excess > 0 else ""
            line.append("—" if ms is None else f"{_ms(exact - ms, '+')} ms{share}")
    return columns, [first, spread, *lines]


def print_results(record: dict) -> None:
    for row in record["results"]:
        print_table(f"{row['shape']} {LABELS.get(row['item'], row['item'])} {combo_label(row['dtype'], row['threads'])}"
                    f": each exact op swapped for native's ({describe_run(record)})", COLUMNS, op_rows(row))
    print_table("what swapping each op for native's saves (its share of exact - native)",
                *swap_matrix(record["results"]))


def run(shape_names: list[str], dtype_names: list[str], items: list[str], reps: int,
        threads: str | list[int] | None = None, malloc: str = "steady") -> dict:
    """Run the benchmark; returns the JSON-ready record."""
    counts = parse_threads(threads)
    record = new_record("op_swap", torch.device("cpu"), shape_names, dtype_names, reps, counts[0], "exact", malloc,
                        items=items)
    record["settings"]["threads"] = [count or torch.get_num_threads() for count in counts]
    for count in record["settings"]["threads"]:
        torch.set_num_threads(count)
        for dtype_name in dtype_names:
            for shape_name in shape_names:
                record["results"] += bench_shape(shape_name, dtype_name, items, reps)
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "op_swap", default_shape="default", default_reps=5, thread_list=True,
                         default_dtype="float32", cpu_only="cpu: the exact CPU kernels' ops")
    p.add_argument("--items", default="all", help="comma list of: " + ", ".join(ITEMS))

def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu":
        raise ValueError("op_swap swaps the exact CPU kernels' ops: --device cpu")
    return run(parse_list(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               parse_list(args.items, ITEMS, "item"), args.reps, args.threads, args.malloc)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.op_swap") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, item, threads, a device not cpu) exits 2 with one
    line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "op_swap", add_arguments, measure, print_results)


if __name__ == "__main__":
    raise SystemExit(main())
