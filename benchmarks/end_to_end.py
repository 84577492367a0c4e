"""End-to-end benchmarks: rollout, one decode step, the training path's fwd+bwd, and one full RL step.

    python -m benchmarks.end_to_end                       # default shape, fp32 + bf16, RL step included
    python -m benchmarks.end_to_end --shape default,llama100m --dtype float32 --reps 5
    python -m benchmarks.end_to_end --shape default,llama100m --dtype all --threads 1,2 \
        --items decode_step,train_fwd_bwd,rl_step        # the targets table: every figure at 1 and 2 threads

Every figure is exact / native on the same model (identical weights) and the same batch:

- ``rollout``: ``generate`` of ``e2e_batch`` prompts x ``new_tokens`` new tokens (no EOS, so both
  backends produce exactly the same number of tokens); reported as tokens/s and the time ratio.
- ``decode_step``: one decode step of the whole batch against a prefilled KV cache: the model forward
  for one token per sequence, the LM head and the sampled token's log-prob (timed in groups of steps
  lasting ~50 ms, as a single step is too short to time alone on a shared machine), after ``DECODE_WARMUP``
  untimed steps: a long rollout's steady state, its linear layers' plans made and their weights packed where the
  exact path packs them (``gemm_packed.PACK_AFTER_CALLS``).
- ``train_fwd_bwd``: the training path on the exact rollout's prompts + responses: ``token_logprobs``
  with grad, mean log-prob loss, ``backward`` (what one PPO mini-batch costs before the optimizer).
- ``rl_step``: ``Trainer.step`` (rollout + scoring + metrics + PPO update + AdamW) of
  ``experiments/zero_mismatch.yaml`` with ``backend: exact`` vs ``backend: native``; both trainers start
  every repetition from the same weights and optimizer state (the cached warm start unless
  ``--no-warm-start``), so each repetition redoes the same step. CPU only (the Trainer has no device
  option).

For the ``default`` shape the prompts are the zero_mismatch task's (16 problems x 8 samples); other
shapes use random prompts of ``e2e_prompt_len`` tokens (``llama100m``: 8 prompts of 32 tokens, 8 new
tokens -- what 2 CPU cores manage in a few seconds per repetition).

``--prompt-len N[,N...]`` runs the items of a shape with random prompts at each of these prompt lengths instead
(its rows' ``shape``: e.g. ``llama100m, 1900-token prompts``): the decode step then reads a KV cache of N + 1
positions, what a long rollout's decode steps read (``vexact bench end_to_end --shape llama100m --items decode_step
--prompt-len 128,512,1900``).

``--threads 1,2`` measures every figure at each thread count in turn (the RL step's trainer too: its config's
``threads`` is set to the count, as a small model's trainer would otherwise run on 1 thread). Each row records the
count it ran at, and the tables mark each figure against ``TARGETS`` (exact / native, median).

``--profile N`` also runs every item once more per side under torch.profiler and records the N ops
with the most self CPU time and their share (the evidence for where the remaining cost sits).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vexact import Transformer, generate
from vexact.cli_base import non_negative_int
from vexact.engine.generation import CACHE_BLOCK
from vexact.engine.inputs import pad_right
from vexact.engine.model import short_dtype_name
from vexact.engine.scoring import token_logprobs
from vexact.metric_keys import RESPONSE_LENGTH_MEAN
from vexact_kernels import KernelOps
from vexact_kernels.gemm_packed import PACK_AFTER_CALLS

from .common import (
    DTYPES,
    EXPERIMENT,
    Shape,
    add_common_arguments,
    add_rl_step_arguments,
    check_rl_step_flags_used,
    cli_main,
    compare,
    describe_run,
    fmt_ratio,
    inner_repeats,
    new_record,
    parse_list,
    parse_threads,
    print_table,
    profile_top,
    shapes,
)

ITEMS = ("rollout", "decode_step", "train_fwd_bwd", "rl_step")
TARGETS = {"decode_step": 1.0, "train_fwd_bwd": 1.1, "rl_step": 1.05}
"""The exact / native median each item should stay at or under, at every thread count, shape and dtype (the one
definition: the printed table and ``benchmarks.tables``, which writes the docs' tables, both read it)."""
PREFILL_CHUNK = 256
"""Prompt positions per prefill call of the decode step's KV cache: a prompt of thousands of tokens (``--prompt-len``)
in one call would hold [tokens x tokens] attention scores per layer (a gigabyte at 1,900 tokens), which the decode
step does not measure."""
DECODE_WARMUP = PACK_AFTER_CALLS + 1
"""Untimed decode steps before the timed ones: past the call at which the exact path packs a weight version's oneDNN
GEMMs (a rollout of more tokens than this runs packed from then on)."""
LABELS = {"rl_step": "one RL step", "decode_step": "decode step", "train_fwd_bwd": "training fwd+bwd",
          "rollout": "rollout", "linear_layers": "linear layers of a training pass"}


def target_mark(row: dict) -> str:
    """``✓`` when the row's median ratio, as the tables print it (two decimals), is within its item's target, ``✗``
    when not, ``""`` for an item without one (so a printed 1.00× never reads as over a 1.00× target)."""
    target = TARGETS.get(row["item"])
    if target is None:
        return ""
    return "✓" if round(row["ratio_median"], 2) <= target else "✗"


def _thread_label(threads: int) -> str:
    return f"{threads} thread" + ("" if threads == 1 else "s")


def combos(rows: list[dict]) -> list[tuple[str, int]]:
    """The (dtype, threads) pairs of end-to-end rows: dtypes in the order measured, thread counts ascending."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    return sorted(dict.fromkeys((r["dtype"], r["threads"]) for r in rows), key=lambda c: (dtypes.index(c[0]), c[1]))


def combo_label(dtype: str, threads: int) -> str:
    return f"{short_dtype_name(dtype)}, {_thread_label(threads)}"


def target_matrix(rows: list[dict]) -> tuple[list[str], list[list[str]], list[str]]:
    """The targets table of end-to-end rows: one line per (shape, item), one column per (dtype, threads) with the
    median ratio (min–max) and its mark, the target last; plus one summary sentence per (dtype, threads) column
    naming the figures over target. Returns (columns, rows, summary)."""
    pairs = combos(rows)
    keyed = {(r["item"], r["shape"], r["dtype"], r["threads"]): r for r in rows}
    lines = []
    for item, shape in dict.fromkeys((r["item"], r["shape"]) for r in rows):
        line = [f"{shape}: {LABELS.get(item, item)}"]
        for dtype, threads in pairs:
            r = keyed.get((item, shape, dtype, threads))
            line.append(f"{fmt_ratio(r)} {target_mark(r)}".rstrip() if r else "—")
        line.append(f"≤ {TARGETS[item]:.2f}×" if item in TARGETS else "—")
        lines.append(line)
    summary = []
    for dtype, threads in pairs:
        judged = [r for r in rows if (r["dtype"], r["threads"]) == (dtype, threads) and r["item"] in TARGETS]
        missed = [f"{r['shape']} {LABELS.get(r['item'], r['item'])} {r['ratio_median']:.2f}×" for r in judged
                  if target_mark(r) == "✗"]
        summary.append(f"{combo_label(dtype, threads)}: targets met in {len(judged) - len(missed)} of {len(judged)}"
                       + (f"; over: {', '.join(missed)}" if missed else ""))
    columns = ["exact / native", *[combo_label(d, t) for d, t in pairs], "target"]
    return columns, lines, summary


def at_prompt_lengths(shape: Shape, lengths: list[int] | None) -> list[Shape]:
    """``shape`` itself (``lengths`` None), or one copy of it per prompt length, named for it (``--prompt-len``).
    Refused with one ValueError for the ``default`` shape (its prompts are its task's) and for a length whose prompt
    and new tokens do not fit the model's positions."""
    if not lengths:
        return [shape]
    if shape.e2e_prompt_len == 0:
        raise ValueError(f"--prompt-len applies to the shapes with random prompts, not {shape.name!r} (its prompts are "
                         f"its task's)")
    longest = shape.model.max_seq_len - shape.new_tokens - 1
    for length in lengths:
        if not 1 <= length <= longest:
            raise ValueError(f"--prompt-len {length}: {shape.name}'s prompts take 1 to {longest} tokens (its "
                             f"{shape.model.max_seq_len} positions, less {shape.new_tokens} new tokens and the decode "
                             f"step's own)")
    return [dataclasses.replace(shape, name=f"{shape.name}, {length}-token prompts", e2e_prompt_len=length)
            for length in lengths]


def at_batch(shape: Shape, batch: int | None) -> Shape:
    """``shape`` itself (``batch`` None), or a copy of it with ``batch`` random prompts, named for it (``--batch``: a
    decode step of that many rows, a training pass of that many sequences). One ValueError for a shape whose prompts
    are its task's, or a batch under 1."""
    if batch is None:
        return shape
    if shape.e2e_prompt_len == 0:
        raise ValueError(f"--batch applies to the shapes with random prompts, not {shape.name!r} (its prompts are its "
                         f"task's)")
    if batch < 1:
        raise ValueError(f"--batch {batch}: a batch of at least one prompt")
    return dataclasses.replace(shape, name=f"{shape.name}, {batch} prompts", e2e_batch=batch)


def prompts_of(shape: Shape) -> list[list[int]]:
    """The shape's end-to-end prompts: the zero_mismatch task's (``e2e_prompt_len`` 0) or ``e2e_batch`` random ones
    of ``e2e_prompt_len`` tokens (seed 0)."""
    if shape.e2e_prompt_len == 0:  # the default experiment's own prompts: 16 problems x 8 samples
        from vexact.rl.tasks import CharTokenizer, encode_prompt, make_task, training_problems

        task = make_task("reverse", 4, 8)
        problems = [p for p in training_problems(task, shape.e2e_batch // 8, 0, 0) for _ in range(8)]
        return [encode_prompt(CharTokenizer(), p) for p in problems]
    rng = random.Random(0)
    return [[rng.randrange(shape.model.vocab_size) for _ in range(shape.e2e_prompt_len)]
            for _ in range(shape.e2e_batch)]


def _models(shape: Shape, dtype: torch.dtype, device: torch.device, exact_backend: str) -> dict[str, Transformer]:
    """An exact and a native model with identical weights."""
    exact = Transformer(shape.model, backend=exact_backend, dtype=dtype, device=device, init_seed=0)
    native = Transformer(shape.model, backend="native", dtype=dtype, device=device, init_seed=None)
    native.load_state_dict(exact.state_dict())
    return {"exact": exact, "native": native}


def decode_step_call(model: Transformer, prompts: list[list[int]], device: torch.device,
                     ops: KernelOps | None = None) -> Callable[[], object]:
    """The ``decode_step`` item of ``model`` (run with ``ops``, default its own): its KV cache prefilled with
    ``prompts`` now, then a call that decodes one token per sequence on it (the forward, the LM head and the
    sampled token's log-prob; the cache is not advanced, so every call redoes the same step)."""
    ops = ops or model.ops
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    cache = model.new_cache(len(prompts), -(-(int(lengths.max()) + 1) // CACHE_BLOCK) * CACHE_BLOCK)
    tokens = pad_right(prompts, device)
    # prompts of one length in calls of PREFILL_CHUNK positions (the same cache: a query's keys and values do not
    # depend on the call it is in); ragged ones in one call
    chunk = PREFILL_CHUNK if len(set(map(len, prompts))) == 1 else tokens.shape[1]
    with torch.no_grad():
        for start in range(0, tokens.shape[1], chunk):
            model(tokens[:, start : start + chunk], q_start=torch.full_like(lengths, start), cache=cache, ops=ops)
    token = torch.tensor([p[-1] for p in prompts], device=device)

    def step() -> object:
        with torch.no_grad():
            # (positions known in range, as generate's decode steps: nothing read back per step)
            hidden = model(token[:, None], q_start=lengths, cache=cache, ops=ops, q_start_checked=True)[:, 0]
            return ops.token_logprobs(model.logits(hidden, ops=ops).float(), token)
    return step


def train_call(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
               ops: KernelOps | None = None) -> Callable[[], object]:
    """The ``train_fwd_bwd`` item of ``model`` (run with ``ops``, default its own): ``token_logprobs`` of the
    responses with grad, the mean log-prob loss and its ``backward``."""

    def run() -> object:
        model.zero_grad(set_to_none=True)
        loss = -torch.cat(token_logprobs(model, prompts, responses, ops=ops)).mean()
        loss.backward()
        return loss
    return run


def _measure(exact, native, reps: int, device: torch.device, profile: int, inner: int = 1, warmup: int = 1) -> dict:
    """Interleaved comparison (``inner`` calls per timed sample, after ``warmup`` untimed calls of each); with
    ``profile`` > 0 (CPU) also the top ops of each side under torch.profiler."""
    summary = compare(exact, native, reps=reps, warmup=warmup, device=device, inner=inner).summary()
    summary["inner_calls"] = inner
    if profile > 0 and device.type == "cpu":
        summary["profile"] = {"exact": profile_top(exact, profile), "native": profile_top(native, profile)}
    return summary


def _row(item: str, shape: str, dtype: str, summary: dict, tokens: int, **extra: object) -> dict:
    return {"item": item, "shape": shape, "dtype": dtype, "threads": torch.get_num_threads(), "tokens": tokens,
            "exact_tokens_per_s": tokens / summary["exact_s_median"],
            "native_tokens_per_s": tokens / summary["native_s_median"], **extra, **summary}


def bench_shape(shape: Shape, dtype_name: str, items: list[str], reps: int, device: torch.device,
                profile: int = 0, exact_backend: str = "exact") -> list[dict]:
    """rollout, decode_step and train_fwd_bwd rows for one shape and dtype."""
    dtype = DTYPES[dtype_name]
    models = _models(shape, dtype, device, exact_backend)
    prompts = prompts_of(shape)
    n_new = shape.new_tokens
    rows = []

    def rollout(name: str):
        return lambda: generate(models[name], prompts, max_new_tokens=n_new, temperature=1.0, seed=0)

    if "rollout" in items:
        summary = _measure(rollout("exact"), rollout("native"), reps, device, profile)
        rows.append(_row("rollout", shape.name, dtype_name, summary, len(prompts) * n_new))

    if "decode_step" in items:
        steps = {name: decode_step_call(model, prompts, device) for name, model in models.items()}
        # one step lasts milliseconds: time groups of steps (~50 ms) so scheduler noise averages out
        inner = inner_repeats(steps["native"], device, target_s=0.05, exact_backend=exact_backend)
        summary = _measure(steps["exact"], steps["native"], reps, device, profile, inner, warmup=DECODE_WARMUP)
        rows.append(_row("decode_step", shape.name, dtype_name, summary, len(prompts)))

    if "train_fwd_bwd" in items:
        responses = generate(models["exact"], prompts, max_new_tokens=n_new, temperature=1.0, seed=0).tokens
        summary = _measure(train_call(models["exact"], prompts, responses),
                           train_call(models["native"], prompts, responses), reps, device, profile)
        tokens = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses))
        rows.append(_row("train_fwd_bwd", shape.name, dtype_name, summary, tokens))
    return rows


def rl_step_config(config: Path, dtype_name: str, overrides: list[str], backend: str = "exact") -> Any:
    """The RL step's run config on ``backend``: the experiment at ``dtype_name``, with the process's thread count (its
    config's default gives a small model 1 thread) and no live view."""
    from vexact.rl.config import load_config

    return load_config(config, [f"backend={backend}", f"dtype={dtype_name}", f"threads={torch.get_num_threads()}",
                                "logging.live=false", *overrides])


def bench_rl_step(dtype_name: str, reps: int, config: Path, overrides: list[str], warm: bool,
                  profile: int = 0) -> dict:
    """One full ``Trainer.step``, exact vs native, from identical weights and optimizer state every repetition."""
    from rich.console import Console

    from vexact.rl.trainer import Trainer
    from vexact.rl.warmstart import warm_start

    trainers = {name: Trainer(rl_step_config(config, dtype_name, overrides, name), Console(quiet=True))
                for name in ("exact", "native")}
    exact = trainers["exact"]
    if warm:  # the exact run's cached warm start, for both (so the batch is the one the experiment trains on)
        warm_start(exact.master, exact.cfg, exact.task, log=lambda _: None)
    start = copy.deepcopy(exact.master.state_dict())
    opt_start = copy.deepcopy(exact.optimizer.state_dict())
    tokens: dict[str, list[int]] = {"exact": [], "native": []}
    phases: dict[str, dict[str, list[float]]] = {"exact": {}, "native": {}}  # the step's own timing/ metrics

    def step(name: str):
        trainer = trainers[name]

        def run() -> object:
            trainer.load_policy(start, opt_start)  # the same weights and optimizer state every repetition
            metrics = trainer.step(0)
            tokens[name].append(round(metrics[RESPONSE_LENGTH_MEAN] * exact.cfg.rollout.prompts_per_step
                                      * exact.cfg.rollout.samples_per_prompt))
            for key, value in metrics.items():
                if key.startswith("timing/"):
                    phases[name].setdefault(key.removeprefix("timing/"), []).append(value * 1e3)
            return metrics
        return run
    summary = _measure(step("exact"), step("native"), reps, torch.device("cpu"), profile)
    cfg = exact.cfg
    return {"item": "rl_step", "shape": Path(config).stem, "dtype": dtype_name, "threads": torch.get_num_threads(),
            "tokens": tokens["exact"][-1], "response_tokens_exact": tokens["exact"][-1],
            "response_tokens_native": tokens["native"][-1], "config": str(config), "overrides": overrides,
            "warm_start": warm, "sequences": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
            "exact_tokens_per_s": tokens["exact"][-1] / summary["exact_s_median"],
            "native_tokens_per_s": tokens["native"][-1] / summary["native_s_median"],
            "phase_ms_median": {name: {key: statistics.median(values) for key, values in by_phase.items()}
                                for name, by_phase in phases.items()}, **summary}


def run(shape_names: list[str], dtype_names: list[str], items: list[str], reps: int, device: torch.device,
        threads: int | list[int] | None = None, rl_config: Path = EXPERIMENT, rl_overrides: list[str] | None = None,
        warm: bool = True, profile: int = 0, exact_backend: str = "exact",
        malloc: str = "steady", prompt_lengths: list[int] | None = None) -> dict:
    """Run the end-to-end benchmarks; returns the JSON-ready record (``profile`` > 0: top ops per item).

    ``threads``: one torch thread count, a list of them (every figure at each, in turn) or None (torch's).
    ``exact_backend``: ``exact`` (Triton on CUDA, ``cpu_exact`` on CPU) or ``triton`` (the Triton kernels forced;
    on CPU through the interpreter, which checks that the GPU path runs but times nothing useful).
    ``prompt_lengths``: the shapes' items at these prompt lengths instead of their own (``at_prompt_lengths``)."""
    counts = parse_threads(threads)
    known = shapes()
    measured = [s for name in shape_names for s in at_prompt_lengths(known[name], prompt_lengths)]
    record = new_record("end_to_end", device, shape_names, dtype_names, reps, counts[0], exact_backend, malloc,
                        items=items, profile_top=profile)
    record["settings"]["prompt_lengths"] = prompt_lengths
    record["settings"]["threads"] = [count or torch.get_num_threads() for count in counts]
    record["skipped"] = []
    if "rl_step" in items and device.type == "cpu" and exact_backend == "exact":
        for dtype_name in dtype_names:  # the RL step's config, checked before the other items' minutes
            try:
                rl_step_config(rl_config, dtype_name, rl_overrides or [])
            except ValueError as err:
                raise ValueError(f"--rl-config {rl_config} / --rl-set: {err}") from None
    for count in record["settings"]["threads"]:
        for dtype_name in dtype_names:
            torch.set_num_threads(count)
            for shape in measured:
                record["results"] += bench_shape(shape, dtype_name, items, reps, device, profile, exact_backend)
            if "rl_step" in items:
                if device.type != "cpu":
                    record["skipped"].append({"item": "rl_step", "dtype": dtype_name, "threads": count,
                                              "reason": "the Trainer runs on CPU only"})
                elif exact_backend != "exact":
                    record["skipped"].append({"item": "rl_step", "dtype": dtype_name, "threads": count,
                                              "reason": "the RL step compares the experiment's backends "
                                                        "(exact, native)"})
                else:
                    record["results"].append(bench_rl_step(dtype_name, reps, rl_config, rl_overrides or [], warm,
                                                           profile))
    return record


def print_results(record: dict) -> None:
    where = describe_run(record)
    rows = [[r["item"], r["shape"], short_dtype_name(r["dtype"]), str(r["threads"]), str(r["tokens"]),
             f"{fmt_ratio(r)} {target_mark(r)}".rstrip(), f"{r['exact_s_median'] * 1e3:.1f}",
             f"{r['native_s_median'] * 1e3:.1f}", f"{r['exact_tokens_per_s']:.0f}", f"{r['native_tokens_per_s']:.0f}"]
            for r in record["results"]]
    print_table(f"end to end, exact / native ({where})",
                ["item", "shape", "dtype", "threads", "tokens", "ratio median (min–max)", "exact ms", "native ms",
                 "exact tok/s", "native tok/s"], rows)
    for s in record["skipped"]:
        print(f"skipped {s['item']} ({s['dtype']}, {s['threads']} threads): {s['reason']}")
    if any(r["item"] in TARGETS for r in record["results"]):
        columns, lines, summary = target_matrix(record["results"])
        print_table("against the targets (✓: median within target)", columns, lines)
        for line in summary:
            print(line)
    for r in record["results"]:
        if "profile" not in r:
            continue
        what = f"{r['item']} {r['shape']} {short_dtype_name(r['dtype'])} {_thread_label(r['threads'])}"
        for side in ("exact", "native"):
            prof = r["profile"][side]
            rows = [[o["op"][:60], f"{o['calls_per_run']:.0f}", f"{o['self_ms_per_run']:.2f}", f"{o['share']:.1%}"]
                    for o in prof["ops"]]
            print(f"\n{what} {side}: top ops by self CPU time (profiled run: {prof['total_self_ms_per_run']:.1f} ms, "
                  f"{prof['aten_calls_per_run']:.0f} aten and oneDNN calls)")
            print_table("", ["op", "calls", "self ms", "share"], rows)
        print(f"\n{what}, where the profiled time goes (self CPU ms per run under torch.profiler, which slows both "
              "sides)")
        split = {side: r["profile"][side] for side in ("exact", "native")}
        parts = {side: (p["matmul_self_ms_per_run"], p["aten_self_ms_per_run"] - p["matmul_self_ms_per_run"],
                        p["total_self_ms_per_run"] - p["aten_self_ms_per_run"], p["total_self_ms_per_run"])
                 for side, p in split.items()}
        names = ("matrix products (GEMMs, oneDNN linear, SDPA)", "other aten and oneDNN ops",
                 "autograd nodes and other ranges", "total")
        rows = [[name, f"{parts['exact'][i]:.1f}", f"{parts['native'][i]:.1f}",
                 f"{parts['exact'][i] - parts['native'][i]:+.1f}"] for i, name in enumerate(names)]
        print_table("", ["part", "exact", "native", "exact - native"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "end_to_end", default_shape="default", default_reps=11, thread_list=True)
    p.add_argument("--items", default="all", help="comma list of: " + ", ".join(ITEMS))
    add_rl_step_arguments(p)
    p.add_argument("--no-warm-start", action="store_true", help="RL step from the random init, not the warm start")
    p.add_argument("--prompt-len", default=None, metavar="N[,N...]",
                   help="random prompts of N tokens instead of the shape's (a comma list: each in turn); the decode "
                        "step then reads N + 1 cache positions. Not for the default shape (its task's prompts)")
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="N",
                   help="also profile each item per side (torch.profiler): its top N ops, and its self time split "
                        "into matrix products, other aten and oneDNN ops and other ranges")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    items = parse_list(args.items, ITEMS, "item")
    check_rl_step_flags_used(args, "rl_step" in items, f"--items {args.items} holds no rl_step")
    return run(parse_list(args.shape, list(shapes()), "shape"), parse_list(args.dtype, list(DTYPES), "dtype"),
               items, args.reps, device, args.threads, args.rl_config,
               args.rl_set, warm=not args.no_warm_start, profile=args.profile, exact_backend=args.exact_backend,
               malloc=args.malloc, prompt_lengths=parse_lengths(args.prompt_len))


def parse_lengths(text: str | None) -> list[int] | None:
    """``--prompt-len``'s comma list of token counts (None: not given); one ValueError naming a bad entry."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-len takes a comma list of token counts, got {text!r}") from None


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.end_to_end") -> int:
    """Command-line entry point; bad input (unknown shape, dtype, op ...) exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "end_to_end", add_arguments, measure,
                    print_results)


if __name__ == "__main__":
    sys.exit(main())
