"""The price of the host guard's fallback: fixed-order / fast time of the exact CPU kernels, and the probes' cost.

    python -m benchmarks.host_guard                       # default shape, fp32 + bf16
    python -m benchmarks.host_guard --shape default --dtype float32 --reps 7 --out runs/bench/g.json

Where a host fails a probe (``vexact_kernels.host_guard``), the exact CPU kernels run that shape class
through the fixed-order path: GEMMs as halving trees of exactly rounded products, exp/log as
polynomials -- invariant by construction, no BLAS. This measures what that costs, in one process,
interleaved: for each op of ``benchmarks.kernels`` (forward, at the shape's sizes) and for the model's
rollout (``generate``) and training-path scoring (``token_logprobs``), the time with every class forced
to the fixed-order path (``HostGuard(mode="fixed-order")``) over the time with the guard's own choice
on this host (``auto``: the fast path wherever the probe passed; the record says which).

It also records what the probes themselves cost: the seconds a fresh guard spends probing every shape
class that one rollout + scoring of the shape's model needs (paid once per process and thread count).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from vexact import Transformer, generate
from vexact.engine.model import short_dtype_name
from vexact.engine.scoring import token_logprobs
from vexact_kernels import cpu_exact
from vexact_kernels.host_guard import HostGuard

from . import kernels
from .common import (
    DTYPES,
    Shape,
    add_common_arguments,
    cli_main,
    compare,
    describe_run,
    fmt_ratio,
    inner_repeats,
    new_record,
    parse_list,
    print_table,
    renamed_sides,
    shapes,
)

OPS = kernels.OPS
MODEL_ITEMS = ("rollout", "scoring")


def _renamed(summary: dict) -> dict:
    """``compare``'s exact/native keys, named for what they are here: fixed-order / fast (auto)."""
    return renamed_sides(summary, "fixed_order", "fast")


def _model_items(shape: Shape, dtype: torch.dtype, fast, fixed, reps: int) -> list[dict]:
    """Rollout and scoring of the shape's model (random weights, random prompts), fixed-order vs fast."""
    model = Transformer(shape.model, backend="exact", dtype=dtype, init_seed=0)
    rng = random.Random(0)
    prompt_len = shape.e2e_prompt_len or shape.context
    prompts = [[rng.randrange(shape.model.vocab_size) for _ in range(prompt_len)] for _ in range(shape.e2e_batch)]

    def rollout(ops) -> object:
        return generate(model, prompts, max_new_tokens=shape.new_tokens, seed=0, ops=ops)

    responses = rollout(fast).tokens

    def scoring(ops) -> object:
        with torch.no_grad():
            return token_logprobs(model, prompts, responses, ops=ops)

    rows = []
    for item, fn in (("rollout", rollout), ("scoring", scoring)):
        summary = compare(lambda fn=fn: fn(fixed), lambda fn=fn: fn(fast), reps=reps).summary()
        rows.append({"item": item, "shape": shape.name, "dtype": str(dtype).removeprefix("torch."),
                     "size": f"{shape.e2e_batch} x ({prompt_len} + {shape.new_tokens}) tokens", "inner_calls": 1,
                     **_renamed(summary)})
    return rows


def _probe_cost(shape: Shape, dtype: torch.dtype) -> dict:
    """A fresh guard: seconds spent probing every shape class one rollout + scoring of the model needs."""
    guard = HostGuard(cpu_exact.ROW_BLOCKS, mode="auto")
    model = Transformer(shape.model, backend="exact", dtype=dtype, init_seed=0)
    ops = cpu_exact.with_host(guard)
    prompts = [[1, 2, 3]] * 2
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=2, seed=0, ops=ops)
    with torch.no_grad():
        token_logprobs(model, prompts, out.tokens, ops=ops)
    total = time.perf_counter() - start
    probes = guard.report()["probes"]
    return {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "shape_classes": len(probes),
            "probe_s": sum(p["seconds"] for p in probes), "first_call_s": total,
            "failed": [f"{p['property']}: {p['shape_class']}" for p in probes if p["passed"] is False]}


def run(shape_names: list[str], dtype_names: list[str], op_names: list[str], reps: int, threads: int | None = None,
        malloc: str = "steady", model_items: bool = True) -> dict:
    """Run the benchmark; returns the JSON-ready record (machine, settings, results, probe cost, host report)."""
    device = torch.device("cpu")
    record = new_record("host_guard", device, shape_names, dtype_names, reps, threads, "exact", malloc,
                        ops=op_names, model_items=model_items)
    fast = cpu_exact  # the process's guard, mode auto (unless VEXACT_CPU_EXACT_PATH says otherwise)
    fixed = cpu_exact.ops_in_mode("fixed-order")
    record["settings"]["fast_guard_mode"] = cpu_exact.HOST.mode
    record["probe_cost"] = []
    known = shapes()
    for shape_name in shape_names:
        shape = known[shape_name]
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            record["probe_cost"].append(_probe_cost(shape, dtype))
            for op in op_names:
                tensors, static, size = kernels._inputs(op, shape, dtype, device)
                fixed_fn = kernels._runner(fixed, op, tensors, static, "fwd")
                fast_fn = kernels._runner(fast, op, tensors, static, "fwd")
                inner = inner_repeats(fast_fn, device)
                summary = compare(fixed_fn, fast_fn, reps=reps, device=device, inner=inner).summary()
                record["results"].append({"item": op, "shape": shape.name, "dtype": dtype_name, "size": size,
                                          "inner_calls": inner, **_renamed(summary)})
            if model_items:
                record["results"] += _model_items(shape, dtype, fast, fixed, reps)
    record["host_report"] = cpu_exact.host_report()
    return record


def print_results(record: dict) -> None:
    where = describe_run(record)
    rows = [[r["item"], r["shape"], short_dtype_name(r["dtype"]), r["size"], fmt_ratio(r),
             f"{r['fixed_order_s_median'] * 1e3:.3f}", f"{r['fast_s_median'] * 1e3:.3f}"] for r in record["results"]]
    print_table(f"fixed-order / fast time of the exact CPU kernels, forward ({where})",
                ["item", "shape", "dtype", "size", "ratio median (min–max)", "fixed-order ms", "fast ms"], rows)
    rows = [[p["shape"], short_dtype_name(p["dtype"]), str(p["shape_classes"]), f"{p['probe_s'] * 1e3:.1f}",
             f"{p['first_call_s'] * 1e3:.1f}", ", ".join(p["failed"]) or "none"] for p in record["probe_cost"]]
    print_table("probe cost (fresh guard; one rollout + scoring)",
                ["shape", "dtype", "shape classes", "probing ms", "first call ms (incl. probing)", "failed"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "host_guard", default_shape="default", default_reps=7)
    p.add_argument("--ops", default="all", help="comma list of: " + ", ".join(OPS))
    p.add_argument("--no-model", action="store_true", help="skip the model rollout and scoring items")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu" or args.exact_backend != "exact":
        raise ValueError("the host guard concerns the exact CPU kernels: use --device cpu and --exact-backend exact")
    return run(parse_list(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               parse_list(args.ops, OPS, "op"), args.reps, args.threads, malloc=args.malloc,
               model_items=not args.no_model)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.host_guard") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, op, a device other than cpu) exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "host_guard", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
