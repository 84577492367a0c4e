"""Kernel benchmarks: exact vs native for each op, at the shapes of a model, fp32 and bf16, fwd and fwd+bwd.

    python -m benchmarks.kernels                          # default + llama100m shapes, fp32 + bf16
    python -m benchmarks.kernels --shape default --dtype float32 --reps 9 --out runs/bench/k.json

Ops (inputs sized from the shape, see ``benchmarks.common.shapes``):
``linear`` (training rows through the MLP up-projection D -> I), ``linear_decode`` (one decode step's
rows through the same weight), ``lm_head`` (training rows D -> V), ``rms_norm`` (training rows),
``silu_mul``, ``attention_prefill`` (the training forward: whole sequences from position 0),
``attention_decode`` (one query per sequence against a cache of ``context`` tokens) and
``token_logprobs`` (the log-prob gather over the vocabulary for every training row). ``fwd+bwd``
times the forward and the backward of a fixed upstream gradient (decode has no backward). For the linear
layers (``linear``, ``lm_head``), ``grad_input`` and ``grad_weight`` time the forward and one gradient's backward,
with only that tensor requiring a gradient (the other product never runs): less the ``fwd`` row, which of the two
backward products costs what ``fwd+bwd`` does.

Also: the exact matmul's achieved GFLOP/s against ``torch.mm`` on the same [M, K] x [K, N] (how close
the fixed-tile GEMM gets to the BLAS on that shape).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

import vexact_kernels
from vexact.engine.generation import CACHE_BLOCK
from vexact.engine.model import short_dtype_name

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
    shapes,
)

OPS = ("linear", "linear_decode", "lm_head", "rms_norm", "silu_mul", "attention_prefill", "attention_decode",
       "token_logprobs")
GRADIENT_MODES = ("grad_input", "grad_weight")  # one backward product alone, by the tensor it differentiates
MODES = ("fwd", "fwd+bwd", *GRADIENT_MODES)
NO_BACKWARD = {"attention_decode"}  # a decode step is never differentiated
LINEAR_OPS = ("linear", "lm_head")  # the ops with a weight: where the two gradients are two different products


def _inputs(op: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple[list[Tensor], tuple, str]:
    """(differentiable tensors, static args, size description) for ``op`` at ``shape``."""
    c = shape.model
    g = torch.Generator().manual_seed(0)

    def randn(*size: int, std: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=g) * std).to(device=device, dtype=dtype)

    rows = shape.train_batch * shape.train_len
    hd = c.head_dim
    if op in ("linear", "linear_decode", "lm_head"):
        m = shape.decode_batch if op == "linear_decode" else rows
        n = c.vocab_size if op == "lm_head" else c.intermediate_size
        return [randn(m, c.hidden_size), randn(n, c.hidden_size, std=0.05)], (), f"[{m}x{c.hidden_size}] @ " \
            f"[{c.hidden_size}x{n}]"
    if op == "rms_norm":
        return [randn(rows, c.hidden_size), randn(c.hidden_size)], (c.rms_norm_eps,), f"[{rows}x{c.hidden_size}]"
    if op == "silu_mul":
        return [randn(rows, c.intermediate_size), randn(rows, c.intermediate_size)], (), \
            f"[{rows}x{c.intermediate_size}]"
    if op == "attention_prefill":
        b, t = shape.train_batch, shape.train_len
        q, k, v = randn(b, t, c.num_heads, hd), randn(b, t, c.num_kv_heads, hd), randn(b, t, c.num_kv_heads, hd)
        start = torch.zeros(b, dtype=torch.long, device=device)
        return [q, k, v], (start, 1.0 / math.sqrt(hd)), f"B={b} T={t} H={c.num_heads}/{c.num_kv_heads} hd={hd}"
    if op == "attention_decode":
        b, ctx = shape.decode_batch, shape.context
        cache_len = -(-(ctx + 1) // CACHE_BLOCK) * CACHE_BLOCK  # as generate sizes its cache
        q = randn(b, 1, c.num_heads, hd)
        k, v = randn(b, cache_len, c.num_kv_heads, hd), randn(b, cache_len, c.num_kv_heads, hd)
        start = torch.full((b,), ctx, dtype=torch.long, device=device)
        return [q, k, v], (start, 1.0 / math.sqrt(hd)), f"B={b} pos={ctx} H={c.num_heads}/{c.num_kv_heads} hd={hd}"
    if op == "token_logprobs":
        targets = torch.randint(0, c.vocab_size, (rows,), generator=g).to(device)
        return [randn(rows, c.vocab_size, std=2.0)], (targets,), f"[{rows}x{c.vocab_size}]"
    raise ValueError(f"unknown op {op!r}")


def _op_fn(ops, op: str) -> Callable:
    name = {"linear_decode": "linear", "lm_head": "linear", "attention_prefill": "attention",
            "attention_decode": "attention"}.get(op, op)
    return getattr(ops, name)


def _upstream(out: Tensor) -> Tensor:
    """The fixed upstream gradient every backward is timed with (seeded: the same in every run)."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device=out.device, dtype=out.dtype)


def _gradient_runner(fn: Callable, tensors: list[Tensor], static: tuple, mode: str) -> Callable[[], object]:
    """The forward and one linear gradient: ``grad_input`` (the input, tensors[0]) or ``grad_weight`` (the weight,
    tensors[1]), the only tensor that requires a gradient, so the backward runs that product alone.

    Each call builds its graph anew: the exact kernels free what their backward saved once it has run (a graph kept
    for the next call would hold it, or keep nothing to run again)."""
    wanted = GRADIENT_MODES.index(mode)
    leaves = [t.detach().clone().requires_grad_(i == wanted) for i, t in enumerate(tensors)]
    with torch.no_grad():
        upstream = _upstream(fn(*tensors, *static))

    def one_gradient() -> object:
        return torch.autograd.grad(fn(*leaves, *static), leaves[wanted], upstream)[0]
    return one_gradient


def _runner(ops, op: str, tensors: list[Tensor], static: tuple, mode: str) -> Callable[[], object]:
    fn = _op_fn(ops, op)
    if mode in GRADIENT_MODES:
        return _gradient_runner(fn, tensors, static, mode)
    if mode == "fwd":
        def forward() -> object:
            with torch.no_grad():
                return fn(*tensors, *static)
        return forward
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    with torch.no_grad():
        upstream = _upstream(fn(*tensors, *static))

    def forward_backward() -> object:
        for leaf in leaves:
            leaf.grad = None
        out = fn(*leaves, *static)
        out.backward(upstream)
        return out
    return forward_backward


def _measured(op: str, mode: str) -> bool:
    """Whether ``mode`` applies to ``op``: no backward for a decode op; the single gradients for the linear layers."""
    if mode == "fwd":
        return True
    if op in NO_BACKWARD:
        return False
    return mode == "fwd+bwd" or op in LINEAR_OPS


def bench_op(op: str, shape: Shape, dtype: torch.dtype, mode: str, reps: int, device: torch.device,
             exact_backend: str = "exact") -> dict:
    """One row: exact vs native for ``op`` at ``shape``/``dtype``/``mode``."""
    tensors, static, size = _inputs(op, shape, dtype, device)
    exact = _runner(vexact_kernels.get_ops(exact_backend, device), op, tensors, static, mode)
    native = _runner(vexact_kernels.get_ops("native", device), op, tensors, static, mode)
    inner = inner_repeats(native, device, exact_backend=exact_backend)
    summary = compare(exact, native, reps=reps, device=device, inner=inner).summary()
    return {"op": op, "shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "mode": mode, "size": size,
            "inner_calls": inner, **summary}


def bench_matmul(shape: Shape, dtype: torch.dtype, reps: int, device: torch.device,
                 exact_backend: str = "exact") -> list[dict]:
    """Achieved GFLOP/s of the exact linear vs torch.mm on the model's matmul shapes (training rows)."""
    c = shape.model
    rows = shape.train_batch * shape.train_len
    kv = c.num_kv_heads * c.head_dim
    cases = {"q_proj": (c.hidden_size, c.num_heads * c.head_dim), "k_proj": (c.hidden_size, kv),
             "mlp_up": (c.hidden_size, c.intermediate_size), "mlp_down": (c.intermediate_size, c.hidden_size),
             "lm_head": (c.hidden_size, c.vocab_size)}
    exact_linear = vexact_kernels.get_ops(exact_backend, device).linear
    out = []
    g = torch.Generator().manual_seed(2)
    for name, (k, n) in cases.items():
        x = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
        w_t = w.t()

        def exact(x=x, w=w) -> object:
            with torch.no_grad():
                return exact_linear(x, w)

        def mm(x=x, w_t=w_t) -> object:
            with torch.no_grad():
                return torch.mm(x, w_t)
        inner = inner_repeats(mm, device, exact_backend=exact_backend)
        summary = compare(exact, mm, reps=reps, device=device, inner=inner).summary()
        flop = 2.0 * rows * k * n
        exact_gflops = flop / summary["exact_s_median"] / 1e9
        mm_gflops = flop / summary["native_s_median"] / 1e9
        out.append({"matmul": name, "shape": shape.name, "dtype": str(dtype).removeprefix("torch."),
                    "m": rows, "k": k, "n": n, "exact_gflops": exact_gflops, "torch_mm_gflops": mm_gflops,
                    "fraction_of_torch_mm": 1.0 / summary["ratio_median"], **summary})
    return out


def run(shape_names: list[str], dtype_names: list[str], op_names: list[str], mode_names: list[str], reps: int,
        device: torch.device, threads: int | None = None, matmul: bool = True, exact_backend: str = "exact",
        malloc: str = "steady", train_len: int | None = None) -> dict:
    """Run the kernel benchmarks; returns the JSON-ready record (machine, settings, results).

    ``train_len``: tokens per training sequence in place of each shape's own (its training rows, the linear layers' M,
    are ``train_batch`` times it: e.g. llama100m at 156 has end_to_end's 312 training tokens).

    ``exact_backend``: ``exact`` (Triton on CUDA, ``cpu_exact`` on CPU) or ``triton`` (the Triton kernels forced;
    on CPU through the interpreter, which checks that the GPU path runs but times nothing useful)."""
    if train_len is not None and train_len < 1:
        raise ValueError(f"--train-len must be >= 1, got {train_len}")
    record = new_record("kernels", device, shape_names, dtype_names, reps, threads, exact_backend, malloc,
                        ops=op_names, modes=mode_names, train_len=train_len)
    record["matmul"] = []
    known = shapes()
    for shape_name in shape_names:
        shape = known[shape_name] if train_len is None else replace(known[shape_name], train_len=train_len)
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            for op in op_names:
                for mode in mode_names:
                    if not _measured(op, mode):
                        continue
                    record["results"].append(bench_op(op, shape, dtype, mode, reps, device,
                                                              exact_backend))
            if matmul:
                record["matmul"] += bench_matmul(shape, dtype, reps, device, exact_backend)
    return record


def print_results(record: dict) -> None:
    where = describe_run(record)
    rows = [[r["op"], r["shape"], short_dtype_name(r["dtype"]), r["mode"], r["size"], fmt_ratio(r),
             f"{r['exact_s_median'] * 1e3:.3f}", f"{r['native_s_median'] * 1e3:.3f}"] for r in record["results"]]
    print_table(f"exact / native time ({where})",
                ["op", "shape", "dtype", "mode", "size", "ratio median (min–max)", "exact ms", "native ms"], rows)
    if record["matmul"]:
        rows = [[r["matmul"], r["shape"], short_dtype_name(r["dtype"]), f"{r['m']}x{r['k']}x{r['n']}",
                 f"{r['exact_gflops']:.1f}", f"{r['torch_mm_gflops']:.1f}", f"{r['fraction_of_torch_mm']:.0%}"]
                for r in record["matmul"]]
        print_table("exact linear vs torch.mm (GFLOP/s, median)",
                    ["matmul", "shape", "dtype", "M x K x N", "exact", "torch.mm", "exact / mm"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "kernels", default_shape="default,llama100m", default_reps=7)
    p.add_argument("--ops", default="all", help="comma list of: " + ", ".join(OPS))
    p.add_argument("--modes", default="fwd,fwd+bwd",
                   help="comma list of: " + ", ".join(MODES) + f"; or all ({', '.join(GRADIENT_MODES)}: "
                   f"{' and '.join(LINEAR_OPS)} only)")
    p.add_argument("--no-matmul", action="store_true", help="skip the GFLOP/s comparison with torch.mm")
    p.add_argument("--train-len", type=int, default=None, metavar="N",
                   help="tokens per training sequence in place of the shape's (training rows = its train_batch x N)")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    return run(parse_list(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               parse_list(args.ops, OPS, "op"), parse_list(args.modes, MODES, "mode"), args.reps, device,
               args.threads, matmul=not args.no_matmul, exact_backend=args.exact_backend,
               malloc=args.malloc, train_len=args.train_len)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.kernels") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, op ...) exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "kernels", add_arguments, measure,
                    print_results)


if __name__ == "__main__":
    sys.exit(main())
