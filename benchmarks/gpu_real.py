"""vexact on a GPU at the size users train: one part per call, its JSON merged into ``--out``.

    python -m benchmarks.gpu_real --part exactness --out runs/gpu_check/gpu_real.json     # on the GPU machine
    python -m benchmarks.gpu_real --part exactness --out X.json --rehearse --device cpu   # CPU rehearsal

``benchmarks/gpu_check.sh`` runs every part in ``PARTS`` with its own time limit; a part that ran out of time is
recorded by ``--timed-out PART``. The parts:

- ``exactness``: ``qwen3_1_7b`` in bf16, random weights: 16 prompts generated inside a batch of 64 and in batches
  of 3, the first ``alone`` of them one at a time (256 new tokens), then rescored by the training path at
  micro-batches 8 and 3. Per backend: the tokens mismatched between rollout and training log-probs (the exact
  backend must give 0; native's count is recorded) and, for the exact backend, whether the arrangements generated
  the same bits (native is rescored only: its generations cannot be expected to agree, and each decode step costs
  the same device time at batch 1 as at 64).
- ``train_memory``: ``qwen3_1_7b`` in bf16, the exact backend, 64 sequences of 1,536 tokens (512 prompt, 1,024
  response) through ``token_logprobs`` + backward in micro-batches of 8, gradients accumulated: the GPU's peak
  memory (allocated and reserved) and tokens/s; passes when nothing ran out of memory and the peak reserved stays
  under an 80 GB card's capacity.
- ``speed``: peak GPU memory and tokens/s of prefill, of one decode step at positions 0, 512 and 1,023, and of a
  training forward + backward (``token_logprobs``), exact and native.
- ``launches``: GPU kernel launches per decode step (torch.profiler's CUDA kernel events), exact and native, and
  the GPU's busy time per step (the kernels' summed durations) against the step's wall time: how launch-bound it is.
- ``graphed``: ``qwen3_1_7b`` bf16, one decode step at batch 64 (positions 0, 512 and 1,023 of a 1,024-position
  cache) eager and captured in a CUDA graph (``torch.cuda.graph``: the same kernels without Python or launch
  overhead), exact and native: tokens/s of each, and whether the graph's replay gives the eager step's logits bit
  for bit. A step that cannot be captured (a host synchronisation inside it) is recorded with the error, not timed.
- ``profiles``: where the time goes, exact and native, at ``qwen3_1_7b`` bf16: one decode step at batch 64 and one
  training forward + backward of 8 x 1,024 tokens under torch.profiler: launches, GPU-busy time against wall time,
  and the kernels that take the most GPU time.
- ``tiles``: the exact matmul's tile survey at ``qwen3_1_7b``'s linear shapes in bf16 (``TILE_CANDIDATES``): per
  tile, its time at 64 rows (a decode step) and 8,192 (a prefill) against ``F.linear``, and whether its bits equal
  the current tiles' (the evidence a decode-shaped tile needs).
- ``rollout``: ``generate`` at ``qwen3_1_7b`` bf16 (64 ragged prompts, 128 new tokens) eager and with
  ``cuda_graphs=True``, exact and native: tokens/s, and whether the graphed rollout gives the eager one's bits.
- ``rl_run``: ``vexact run experiments/gpu_qwen3_0_6b.yaml --device cuda``, 10 RL steps at ``qwen3_0_6b``; passes
  when every step's ``mismatch/bitwise_equal_frac`` is 1.0.
- ``moe``: the ``vexact check`` procedure at ``qwen3_30b_a3b`` with ``num_layers`` reduced (128 experts, top-8):
  0 mismatched tokens and 0 routing flips on the exact backend.

``--rehearse`` runs each part at tiny sizes (one narrow layer, a small vocabulary, a few tokens) on the CPU: the
code path, not a measurement. What only a GPU has (peak GPU memory, kernel launches) is then recorded as skipped
with the reason, never estimated.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from vexact.engine.decode_graph import CudaGraphRecorder
from vexact.engine.devices import resolve_device
from vexact.engine.generation import generate
from vexact.engine.model import ModelConfig, Transformer, resolve_dtype
from vexact.engine.presets import preset_values
from vexact.engine.scoring import token_logprobs
from vexact.metric_keys import BITWISE_EQUAL_FRAC, K3_KL, TIMING_STEP
from vexact.records import METRICS_FILE

from .common import experiment
from .gpu_triton import median_seconds, sync

EXPERIMENT = "gpu_qwen3_0_6b.yaml"  # the rl_run part's run, found by common.experiment (shipped when installed)

TINY = dict(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=64)
"""The rehearsal's narrowing of a real-size preset (its structure kept: qk-norm, tying, MoE, top-k)."""
TINY_MOE = dict(num_experts=16, moe_intermediate_size=16)

SIZES = {
    "exactness": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "batch": 64, "prompts": 16, "max_prompt_len": 64,
                  "new_tokens": 256, "batch_of": 3, "alone": 4, "micro_batches": (8, 3)},
    "train_memory": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "batch": 64, "prompt_len": 512,
                     "response_len": 1024, "micro_batch": 8},
    "speed": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "prefill_batch": 64, "prefill_len": 1024,
              "decode_batch": 64, "cache_len": 1024, "positions": (0, 512, 1023), "train_batch": 8,
              "train_prompt_len": 512, "train_response_len": 512, "reps": 3},
    "launches": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "decode_batch": 64, "cache_len": 1024,
                 "position": 512, "reps": 5},
    "graphed": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "decode_batch": 64, "cache_len": 1024,
                "positions": (0, 512, 1023), "reps": 5},
    "profiles": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "decode_batch": 64, "cache_len": 1024, "position": 512,
                 "train_batch": 8, "train_len": 1024, "reps": 3, "top": 12},
    "tiles": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "rows": (64, 8192), "reps": 20},
    "rollout": {"preset": "qwen3_1_7b", "dtype": "bfloat16", "batch": 64, "max_prompt_len": 64, "new_tokens": 128},
    "rl_run": {"steps": 10},
    "moe": {"preset": "qwen3_30b_a3b", "dtype": "bfloat16", "num_layers": 2, "num_prompts": 8, "max_prompt_len": 32,
            "max_new_tokens": 32},
}
"""Each part's sizes on the GPU (the issue's)."""

GPU_TARGETS = {"prefill": 1.2, "decode": 1.2, "train_fwd_bwd": 1.25}
"""exact / native time at ``qwen3_1_7b``, bf16, batch 64 that the exact path aims at on an H100/H200 (issue AB): the
limit is 1.0x, the same GEMMs; the benchmarks page marks the ``speed_batch_64`` ratios against these."""

REHEARSAL = {
    "exactness": {"batch": 8, "prompts": 4, "max_prompt_len": 6, "new_tokens": 4, "alone": 2},
    "train_memory": {"batch": 4, "prompt_len": 4, "response_len": 6, "micro_batch": 2},
    "speed": {"prefill_batch": 2, "prefill_len": 8, "decode_batch": 2, "cache_len": 16, "positions": (0, 8, 15),
              "train_batch": 2, "train_prompt_len": 4, "train_response_len": 4, "reps": 1},
    "launches": {"decode_batch": 2, "cache_len": 16, "position": 8, "reps": 1},
    "graphed": {"decode_batch": 2, "cache_len": 16, "positions": (0, 8, 15), "reps": 1},
    "profiles": {"decode_batch": 2, "cache_len": 16, "position": 8, "train_batch": 2, "train_len": 8, "reps": 1},
    "tiles": {"rows": (3, 8), "reps": 1},
    "rollout": {"batch": 3, "max_prompt_len": 5, "new_tokens": 4},
    "rl_run": {"steps": 2},
    "moe": {"num_layers": 1, "num_prompts": 3, "max_prompt_len": 4, "max_new_tokens": 3},
}
"""What the CPU rehearsal changes (with ``TINY`` shapes)."""

REHEARSAL_RUN = ["model.hidden_size=64", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
                 "model.head_dim=16", "model.intermediate_size=64", "task.distractors=0", "warm_start.steps=2",
                 "rollout.prompts_per_step=2", "task.eval_prompts=2", "dtype=float32"]
"""``--set`` items of the rehearsal's RL run (one narrow layer, no vocabulary tail, fp32: the CPU's exact bf16
GEMM depends on the host's library)."""


def _model_config(preset: str, rehearse: bool, max_seq_len: int, **extra: int) -> ModelConfig:
    values = preset_values(preset)
    if rehearse:
        values.update(TINY, **(TINY_MOE if values.get("num_experts") else {}))
    return ModelConfig(**{**values, **extra, "max_seq_len": max_seq_len})


def _backends(s: dict) -> tuple[str, ...]:
    """The exact backend first (``exact``: Triton, compiled, on CUDA; the exact CPU kernels on the CPU; ``triton``
    in a ``--triton-interpreter`` rehearsal) and, for contrast, native."""
    return (s["exact_backend"], "native")


def _timed(fn: Callable[[], object], device: torch.device, reps: int = 1) -> float:
    """Median seconds of ``reps`` calls after one warm-up call (device-synchronised)."""
    return median_seconds(fn, reps, device)


def _peak(device: torch.device, fn: Callable[[], object]) -> tuple[object, int | None]:
    """``fn()`` and the GPU's peak allocated bytes during it (None on the CPU: a process high-water mark there
    cannot be reset per measurement, so none is given)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device)


def _prompts(n: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def _mismatched(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """Tokens whose two log-probs differ in any bit."""
    return sum(int((x.cpu().view(torch.int32) != y.cpu().view(torch.int32)).sum()) for x, y in zip(a, b))


# --------------------------------------------------------------------------- the parts
def part_exactness(device: torch.device, rehearse: bool, s: dict) -> dict:
    cfg = _model_config(s["preset"], rehearse, s["max_prompt_len"] + s["new_tokens"])
    prompts = _prompts(s["batch"], s["max_prompt_len"], cfg.vocab_size)
    ours = prompts[: s["prompts"]]  # the prompts compared: the first ones of the big batch, ids 0 .. prompts - 1
    alone = ours[: s["alone"]]
    rows = []
    for backend in _backends(s):
        model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
        row: dict = {"backend": backend}
        with torch.no_grad():
            inside = generate(model, prompts, max_new_tokens=s["new_tokens"], seed=0)
            tokens, roll = inside.tokens[: s["prompts"]], inside.logprobs[: s["prompts"]]
            if backend == s["exact_backend"]:
                # the same prompts keep their ids (0 ..), so the same seed must draw the same tokens
                split = generate(model, ours, max_new_tokens=s["new_tokens"], seed=0, batch_size=s["batch_of"])
                single = generate(model, alone, max_new_tokens=s["new_tokens"], seed=0, batch_size=1)
                row["generation_batch_invariant"] = {
                    f"batches_of_{s['batch_of']}": split.tokens == tokens and _mismatched(split.logprobs, roll) == 0,
                    f"alone_first_{s['alone']}": (single.tokens == tokens[: s["alone"]]
                                                  and _mismatched(single.logprobs, roll[: s["alone"]]) == 0)}
            rescored = {mb: _mismatched(token_logprobs(model, ours, tokens, micro_batch_size=mb), roll)
                        for mb in s["micro_batches"]}
        row.update(tokens=sum(len(t) for t in tokens),
                   mismatched_by_micro_batch={str(mb): n for mb, n in rescored.items()})
        rows.append(row)
        del model
    exact = rows[0]
    passed = all(exact["generation_batch_invariant"].values()) and not any(exact["mismatched_by_micro_batch"].values())
    return {"status": "passed" if passed else "failed", "rows": rows,
            "sizes": {k: v for k, v in s.items() if k != "preset"}}


EIGHTY_GB_CARD_BYTES = 79 * 2**30
"""What an "80 GB" card (H100 80GB) lets PyTorch reserve, rounded down: its 81,559 MiB less the CUDA context."""


def part_train_memory(device: torch.device, rehearse: bool, s: dict) -> dict:
    cfg = _model_config(s["preset"], rehearse, s["prompt_len"] + s["response_len"])
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, cfg.vocab_size, (s["batch"], s["prompt_len"]), generator=gen).tolist()
    responses = torch.randint(0, cfg.vocab_size, (s["batch"], s["response_len"]), generator=gen).tolist()
    model = Transformer(cfg, backend=s["exact_backend"], dtype=s["dtype"], device=device, init_seed=0)
    mb = s["micro_batch"]

    def train() -> None:  # one update's gradients: each micro-batch's backward frees its activations
        model.zero_grad(set_to_none=True)
        for start in range(0, s["batch"], mb):
            logprobs = token_logprobs(model, prompts[start : start + mb], responses[start : start + mb])
            torch.stack([lp.sum() for lp in logprobs]).sum().backward()

    begin = time.perf_counter()
    _, peak = _peak(device, train)  # resets the peak statistics itself
    seconds = time.perf_counter() - begin
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    out = {"tokens": s["batch"] * (s["prompt_len"] + s["response_len"]), "seconds_first_pass": round(seconds, 3),
           "tokens_per_s_first_pass": s["batch"] * (s["prompt_len"] + s["response_len"]) / seconds,
           "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved, "gradients_finite": finite,
           "parameters": sum(p.numel() for p in model.parameters()),
           "sizes": {k: v for k, v in s.items() if k != "preset"}}
    if device.type != "cuda":
        return {"status": "passed" if finite else "failed", **out,
                "peak_memory_skipped": "no CUDA: peak GPU memory exists only on a GPU (CPU rehearsal)"}
    fits = reserved is not None and reserved <= EIGHTY_GB_CARD_BYTES
    return {"status": "passed" if fits and finite else "failed", "fits_80gb_card": fits,
            "eighty_gb_card_bytes": EIGHTY_GB_CARD_BYTES, **out}


def _decode_inputs(cfg: ModelConfig, batch: int, position: int, device: torch.device):
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1)).to(device)
    return tokens, torch.full((batch,), position, dtype=torch.long, device=device)


def _decode_step(model: Transformer, cfg: ModelConfig, batch: int, position: int, cache: object,
                 device: torch.device) -> Callable[[], torch.Tensor]:
    """The speed parts' decode step: the forward and LM head of one token per sequence at ``position`` against
    ``cache`` (no sampling, no grad), returning the logits."""
    tokens, q_start = _decode_inputs(cfg, batch, position, device)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return model.logits(model(tokens, q_start=q_start, cache=cache)[:, -1])
    return step


def _one_line(err: BaseException) -> str:
    """An error as the record keeps it: its type and the first line of its message."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


def part_speed(device: torch.device, rehearse: bool, s: dict) -> dict:
    length = max(s["prefill_len"], s["cache_len"], s["train_prompt_len"] + s["train_response_len"])
    cfg = _model_config(s["preset"], rehearse, length)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for backend in _backends(s):
        model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
        row: dict = {"backend": backend}
        prefill = torch.randint(0, cfg.vocab_size, (s["prefill_batch"], s["prefill_len"]), generator=gen).to(device)

        def run_prefill(model=model, prefill=prefill):
            with torch.no_grad():
                model.logits(model(prefill, cache=model.new_cache(s["prefill_batch"], s["prefill_len"]))[:, -1])

        seconds = _timed(run_prefill, device, s["reps"])
        _, peak = _peak(device, run_prefill)
        row["prefill"] = {"tokens_per_s": s["prefill_batch"] * s["prefill_len"] / seconds, "peak_bytes": peak}
        cache = model.new_cache(s["decode_batch"], s["cache_len"])
        row["decode"] = {}
        for position in s["positions"]:
            step = _decode_step(model, cfg, s["decode_batch"], position, cache, device)
            seconds = _timed(step, device, s["reps"])
            _, peak = _peak(device, step)
            row["decode"][str(position)] = {"tokens_per_s": s["decode_batch"] / seconds, "peak_bytes": peak}
        del step, cache  # the step holds the cache: both go before the training pass
        prompts = torch.randint(0, cfg.vocab_size, (s["train_batch"], s["train_prompt_len"]), generator=gen).tolist()
        responses = torch.randint(0, cfg.vocab_size, (s["train_batch"], s["train_response_len"]),
                                  generator=gen).tolist()

        def train(model=model, prompts=prompts, responses=responses):
            model.zero_grad(set_to_none=True)
            torch.stack([lp.sum() for lp in token_logprobs(model, prompts, responses)]).sum().backward()

        try:
            seconds = _timed(train, device, s["reps"])
            _, peak = _peak(device, train)
            row["train_fwd_bwd"] = {"tokens_per_s": s["train_batch"] * (s["train_prompt_len"] +
                                                                       s["train_response_len"]) / seconds,
                                    "peak_bytes": peak}
        except torch.OutOfMemoryError as err:  # recorded as what it is (the chunked scoring's memory work)
            row["train_fwd_bwd"] = {"out_of_memory": str(err).splitlines()[0]}
        except Exception as err:  # noqa: BLE001 -- recorded; the prefill and decode rows already measured stay
            row["train_fwd_bwd"] = {"error": _one_line(err)}
        model.zero_grad(set_to_none=True)
        rows.append(row)
        del model
    out = {"status": "passed", "rows": rows, "sizes": {k: v for k, v in s.items() if k != "preset"}}
    if device.type != "cuda":
        out["peak_memory_skipped"] = "no CUDA: peak GPU memory exists only on a GPU (CPU rehearsal)"
    return out


def part_launches(device: torch.device, rehearse: bool, s: dict) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA: kernel launches are counted from the profiler's CUDA "
                                               "kernel events, which only a GPU has"}
    from torch.profiler import ProfilerActivity, profile

    cfg = _model_config(s["preset"], rehearse, s["cache_len"])
    rows = []
    for backend in _backends(s):
        model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
        cache = model.new_cache(s["decode_batch"], s["cache_len"])
        step = _decode_step(model, cfg, s["decode_batch"], s["position"], cache, device)
        step()  # warm-up: compile, autotune
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
        wall_us = 1e6 * _timed(step, device, s["reps"])
        rows.append({"backend": backend, "kernel_launches_per_decode_step": len(kernels),
                     "gpu_busy_us_per_decode_step": round(busy_us, 1), "wall_us_per_decode_step": round(wall_us, 1),
                     "gpu_busy_fraction": round(busy_us / wall_us, 4)})
        del step, model, cache
    return {"status": "passed", "rows": rows, "note": "forward + lm_head of one decode step (no sampling); busy: "
                                                      "the step's kernels' summed durations, wall: the step unprofiled"}


def kernel_table(events: list, device_type: object, top: int) -> dict:
    """The ``top`` kernels by summed GPU time among a profile's ``events`` of ``device_type`` (each kernel name
    once: its calls and summed microseconds, its share of the busy time), with the busy time and the launches."""
    totals: dict[str, list] = {}
    for event in events:
        if event.device_type == device_type:
            entry = totals.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    busy = sum(us for _, us in totals.values())
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return {"launches": sum(n for n, _ in totals.values()), "busy_us": round(busy, 1),
            "top": [{"kernel": name[:160], "calls": n, "us": round(us, 1),
                     "share": round(us / busy, 4) if busy else 0.0} for name, (n, us) in ranked]}


def part_profiles(device: torch.device, rehearse: bool, s: dict) -> dict:
    """Where each side's time goes: one decode step (batch ``decode_batch`` at ``position``) and one training
    forward + backward (``train_batch`` x ``train_len``), profiled once after a warm-up, exact and native: kernel
    launches, GPU-busy time against the unprofiled wall time (median of ``reps``), and the ``top`` kernels by GPU
    time. On the CPU (rehearsal) the events are the CPU's operators, nested ones included: the code path only."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activity, kind = ((ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA) if cuda
                      else (ProfilerActivity.CPU, torch.autograd.DeviceType.CPU))
    cfg = _model_config(s["preset"], rehearse, max(s["cache_len"], s["train_len"]))
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, cfg.vocab_size, (s["train_batch"], s["train_len"] // 2), generator=gen).tolist()
    responses = torch.randint(0, cfg.vocab_size, (s["train_batch"], s["train_len"] // 2), generator=gen).tolist()
    rows = []
    for backend in _backends(s):
        model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
        cache = model.new_cache(s["decode_batch"], s["cache_len"])

        def train(model=model):
            model.zero_grad(set_to_none=True)
            torch.stack([lp.sum() for lp in token_logprobs(model, prompts, responses)]).sum().backward()

        row: dict = {"backend": backend}
        for name, fn in (("decode_step", _decode_step(model, cfg, s["decode_batch"], s["position"], cache, device)),
                         ("train_fwd_bwd", train)):
            try:
                wall_us = 1e6 * _timed(fn, device, s["reps"])  # warms up (compiles, autotunes) first
                with profile(activities=[activity]) as prof:
                    fn()
                    if cuda:
                        torch.cuda.synchronize(device)
                table = kernel_table(prof.events(), kind, s["top"])
                row[name] = {"wall_us": round(wall_us, 1), **table,
                             "busy_fraction": round(table["busy_us"] / wall_us, 4)}
            except Exception as err:  # noqa: BLE001 -- one item's failure recorded, the others still profiled
                row[name] = {"error": _one_line(err)}
        model.zero_grad(set_to_none=True)
        rows.append(row)
        del model, cache, fn
    out = {"status": "passed", "rows": rows, "sizes": {k: v for k, v in s.items() if k != "preset"},
           "note": "busy: the kernels' summed durations in one profiled call; wall: the call unprofiled"}
    if not cuda:
        out["events"] = "CPU operators, nested ones counted too (rehearsal: not kernels, not a measurement)"
    return out


TILE_CANDIDATES = {
    "current": None,  # the dtype's own _MATMUL_TILES: (64, 128, 64, 4, 3) in bf16 (a decode tile may run instead)
    "n64": (64, 64, 64, 4, 3), "n32": (64, 32, 64, 4, 4), "n16": (64, 16, 64, 4, 4),
    "n128_s4": (64, 128, 64, 4, 4), "n256_w8": (64, 256, 64, 8, 3),
    "m128_n128_w8": (128, 128, 64, 8, 3), "m128_n256_w8": (128, 256, 64, 8, 3),
    "m32_n64": (32, 64, 64, 4, 3), "m16_n64": (16, 64, 64, 4, 3),
}
"""The bf16 matmul tiles the ``tiles`` part surveys, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): BLOCK_K
stays 64 (the K loop's chunks, in order, are the reduction order); BLOCK_N, BLOCK_M, warps and stages vary. The
survey says, per candidate, whether its bits equal the current tiles' (a decode-shaped tile may serve decode only
if every output element is summed the same whatever the tile) and what it costs at decode and at prefill."""
LINEAR_WEIGHTS = {"q_o": ((2048, 2048), 2), "k_v": ((1024, 2048), 2), "gate_up": ((6144, 2048), 2),
                  "down": ((2048, 6144), 1), "head": ((151936, 2048), 0)}
"""qwen3_1_7b's linear weights: name -> ((N, K), calls per layer); the LM head runs once per step."""
REHEARSAL_TILES = {"current": None, "n16": (16, 16, 32, 1, 1), "n32": (16, 32, 32, 1, 1)}
"""The rehearsal's candidates: the interpreter's BLOCK_K (32), small tiles (the interpreter is slow)."""
REHEARSAL_WEIGHTS = {"q_o": ((64, 64), 2), "head": ((512, 64), 0)}


def _bench_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median microseconds of ``fn``: CUDA events with the L2 cache flushed between calls (``do_bench``: a decode
    step streams its weights from memory) on a GPU; the host clock in a CPU rehearsal."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=max(reps, 10), return_mode="median")
    return 1e6 * _timed(fn, device, reps)


def part_tiles(device: torch.device, rehearse: bool, s: dict) -> dict:
    """The exact matmul's tile survey at ``qwen3_1_7b``'s linear shapes in bf16, for rows ``s["rows"]`` (a decode
    step's batch and a prefill's tokens): per candidate tile and weight, the median time against ``F.linear``'s,
    whether its output equals the current tiles' bit for bit, and whether its rows at the smaller row count equal
    the same rows computed among the larger (row invariance); then each candidate's summed time for one decode
    step's linear calls and one prefill's."""
    if s["exact_backend"] != "triton" and device.type != "cuda":
        return {"status": "skipped", "reason": "the Triton kernels run on CUDA, or in a --triton-interpreter rehearsal"}
    from vexact_kernels import triton_exact

    dtype = resolve_dtype(s["dtype"])
    candidates = REHEARSAL_TILES if rehearse else TILE_CANDIDATES
    weights = REHEARSAL_WEIGHTS if rehearse else LINEAR_WEIGHTS
    gen = torch.Generator().manual_seed(4)
    rows_small, rows_large = s["rows"]
    results: dict = {name: {"tiles": tiles, "weights": {}} for name, tiles in candidates.items()}
    native_us: dict = {}
    chosen: dict = {}  # weight -> the tiles linear runs a call of rows_small rows with (a decode tile, checked)
    canonical = triton_exact._MATMUL_TILES[dtype]
    for weight_name, ((n, k), _) in weights.items():
        w = torch.randn(n, k, generator=gen).to(dtype).to(device)
        x = torch.randn(rows_large, k, generator=gen).to(dtype).to(device)
        native_us[weight_name] = {str(m): _bench_us(partial(torch.nn.functional.linear, x[:m], w), device, s["reps"])
                                  for m in (rows_small, rows_large)}
        reference = {m: triton_exact._linear_forward(x[:m], w, None, canonical) for m in (rows_small, rows_large)}
        chosen[weight_name] = triton_exact.linear_tiles(rows_small, k, n, dtype, device)
        for name, tiles in candidates.items():
            tiles = tiles or canonical
            entry: dict = {}
            try:
                outputs = {m: triton_exact._linear_forward(x[:m], w, None, tiles) for m in (rows_small, rows_large)}
                entry["same_bits_as_current"] = all(torch.equal(outputs[m], reference[m]) for m in outputs)
                entry["rows_invariant"] = torch.equal(outputs[rows_small], outputs[rows_large][:rows_small])
                entry["us"] = {str(m): round(_bench_us(partial(triton_exact._linear_forward, x[:m], w, None, tiles),
                                                       device, s["reps"]), 2) for m in (rows_small, rows_large)}
            except Exception as err:  # noqa: BLE001 -- a tile the compiler refuses is recorded, the rest surveyed
                entry["error"] = _one_line(err)
            results[name]["weights"][weight_name] = entry
        del w, x, reference
    layers = _model_config(s["preset"], rehearse, 8).num_layers
    for result in results.values():
        measured = result["weights"].values()
        if all("us" in e for e in measured):
            for m in (rows_small, rows_large):
                result[f"summed_us_{m}_rows"] = round(sum(
                    e["us"][str(m)] * (count * layers or 1)
                    for e, (_, count) in zip(measured, weights.values())), 1)
    native_sums = {str(m): round(sum(native_us[w][str(m)] * (count * layers or 1)
                                     for w, (_, count) in weights.items()), 1) for m in (rows_small, rows_large)}
    return {"status": "passed", "candidates": results, "native_us": native_us, "native_summed_us": native_sums,
            "linear_tiles_at_decode": {w: list(t) for w, t in chosen.items()},
            "sizes": {k: v for k, v in s.items() if k != "preset"},
            "note": "summed: each weight's time x its calls in one forward (count x layers; the head once)"}


def _captured(step: Callable[[], torch.Tensor], device: torch.device
              ) -> tuple[Callable[[], None], torch.Tensor] | str:
    """``step`` recorded by the recorder ``generate(cuda_graphs=True)`` uses (``CudaGraphRecorder``): (replay, the
    output tensor each replay refills), or why it could not be recorded (a host synchronisation or an op CUDA
    graphs refuse inside the step)."""
    recorder = CudaGraphRecorder(device)
    try:
        recorder.warm_up(step)
        return recorder.record(step)
    except Exception as err:  # noqa: BLE001 -- recorded as the reason; the part goes on
        return _one_line(err)


def part_graphed(device: torch.device, rehearse: bool, s: dict) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA: CUDA graphs exist only on a GPU"}
    cfg = _model_config(s["preset"], rehearse, s["cache_len"])
    rows = []
    for backend in _backends(s):
        row: dict = {"backend": backend, "decode": {}}
        try:
            model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
            cache = model.new_cache(s["decode_batch"], s["cache_len"])
            for position in s["positions"]:
                step = _decode_step(model, cfg, s["decode_batch"], position, cache, device)
                entry = {"eager_tokens_per_s": s["decode_batch"] / _timed(step, device, s["reps"])}
                eager = step().clone()
                captured = _captured(step, device)
                if isinstance(captured, str):
                    entry["not_captured"] = captured
                else:
                    replay, out = captured
                    entry["graphed_tokens_per_s"] = s["decode_batch"] / _timed(replay, device, s["reps"])
                    replay()
                    sync(device)
                    entry["graphed_equals_eager"] = bool(torch.equal(out, eager))
                    del replay, out
                row["decode"][str(position)] = entry
            del step, model, cache
        except Exception as err:  # noqa: BLE001 -- one backend's failure recorded, the other still measured
            row["error"] = _one_line(err)
        rows.append(row)
    exact = rows[0]
    passed = "error" not in exact and all(e.get("graphed_equals_eager") for e in exact["decode"].values())
    return {"status": "passed" if passed else "failed", "rows": rows,
            "sizes": {k: v for k, v in s.items() if k != "preset"},
            "note": "forward + lm_head of one decode step (no sampling), at a fixed position: the graph is replayed "
                    "on the same inputs"}


def part_rollout(device: torch.device, rehearse: bool, s: dict) -> dict:
    """``generate`` as a user runs it, eager and with ``cuda_graphs=True``, exact and native: tokens/s of each (after
    a short warm-up generation that compiles the kernels) and whether the graphed rollout's tokens and log-probs
    equal the eager one's bit for bit."""
    cfg = _model_config(s["preset"], rehearse, s["max_prompt_len"] + s["new_tokens"])
    prompts = _prompts(s["batch"], s["max_prompt_len"], cfg.vocab_size, seed=6)
    graphs = (False, True) if device.type == "cuda" else (False,)
    rows = []
    for backend in _backends(s):
        model = Transformer(cfg, backend=backend, dtype=s["dtype"], device=device, init_seed=0)
        row: dict = {"backend": backend}
        outputs = {}
        for graphed in graphs:
            try:
                generate(model, prompts, max_new_tokens=2, seed=0, cuda_graphs=graphed)  # compiles, autotunes
                sync(device)
                begin = time.perf_counter()
                outputs[graphed] = generate(model, prompts, max_new_tokens=s["new_tokens"], seed=0,
                                            cuda_graphs=graphed)
                sync(device)
                seconds = time.perf_counter() - begin
                tokens = sum(len(t) for t in outputs[graphed].tokens)
                row["graphed" if graphed else "eager"] = {"tokens": tokens, "seconds": round(seconds, 3),
                                                          "tokens_per_s": tokens / seconds}
            except Exception as err:  # noqa: BLE001 -- one mode's failure recorded, the other still measured
                row["graphed" if graphed else "eager"] = {"error": _one_line(err)}
        if len(outputs) == 2:
            eager, graphed_out = outputs[False], outputs[True]
            row["graphed_equals_eager"] = (graphed_out.tokens == eager.tokens and
                                           _mismatched(graphed_out.logprobs, eager.logprobs) == 0)
        rows.append(row)
        del model
    exact = rows[0]
    passed = all("error" not in exact.get(k, {}) for k in ("eager", "graphed")) and (
        device.type != "cuda" or exact.get("graphed_equals_eager") is True)
    out = {"status": "passed" if passed else "failed", "rows": rows,
           "sizes": {k: v for k, v in s.items() if k != "preset"}}
    if device.type != "cuda":
        out["graphed_skipped"] = "no CUDA: cuda_graphs=True needs a GPU (the CPU checks its plumbing in tests)"
    return out


def part_rl_run(device: torch.device, rehearse: bool, s: dict, out_dir: Path) -> dict:
    from vexact.cli import main as vexact_main
    from vexact.records.runlog import read_metrics

    run_dir = out_dir / "rl_run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # a fresh run each time the script runs
    sets = [f"output_dir={run_dir}", f"warm_start.cache_dir={out_dir / 'warmstart_cache'}", f"steps={s['steps']}",
            *(REHEARSAL_RUN if rehearse else []), f"backend={s['exact_backend']}"]
    argv = ["run", str(experiment(EXPERIMENT)), "--device", str(device), *(f"--set={x}" for x in sets)]
    code = vexact_main(argv)
    rows = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).exists() else []
    fractions = [r[BITWISE_EQUAL_FRAC] for r in rows]
    k3 = [r[K3_KL] for r in rows]
    passed = code == 0 and len(rows) == s["steps"] and all(f == 1.0 for f in fractions) and all(k == 0.0 for k in k3)
    return {"status": "passed" if passed else "failed", "command": "vexact " + " ".join(argv), "exit_code": code,
            "steps": len(rows), "bitwise_equal_frac_by_step": fractions, "k3_kl_by_step": k3,
            "seconds_by_step": [r.get(TIMING_STEP) for r in rows]}


def part_moe(device: torch.device, rehearse: bool, s: dict) -> dict:
    from vexact.real.check import CheckSettings, mismatched, run_check

    values = preset_values(s["preset"])
    if rehearse:
        values.update(TINY, **TINY_MOE)
    shape = {k: v for k, v in values.items() if k in CheckSettings.__dataclass_fields__}
    shape["num_layers"] = s["num_layers"]
    settings = CheckSettings(**shape, num_prompts=s["num_prompts"], max_prompt_len=s["max_prompt_len"],
                             max_new_tokens=s["max_new_tokens"], dtype=s["dtype"], batch_sizes=(None, 1, 3),
                             micro_batch_sizes=(None, 3))
    rows = [{"backend": r["backend"], "tokens": r["tokens"], "mismatched": mismatched(r),
             "routing_flip_rate": r["routing_flip_rate"], "sampling_batch_invariant": r["sampling_batch_invariant"]}
            for r in run_check(settings, backends=_backends(s), device=device)]
    exact = rows[0]
    passed = exact["mismatched"] == 0 and not exact["routing_flip_rate"] and exact["sampling_batch_invariant"]
    return {"status": "passed" if passed else "failed", "num_layers": s["num_layers"], "rows": rows}


PARTS: dict[str, Callable[..., dict]] = {"exactness": part_exactness, "train_memory": part_train_memory,
                                        "rl_run": part_rl_run, "moe": part_moe, "speed": part_speed,
                                        "launches": part_launches, "graphed": part_graphed,
                                        "profiles": part_profiles, "tiles": part_tiles,
                                        "rollout": part_rollout}
"""The parts, in the order ``gpu_check.sh`` runs them."""


# --------------------------------------------------------------------------- the price table
def _by_backend(rows: list[dict]) -> tuple[dict, dict]:
    """(the exact row, the native row) of a part's rows (the exact backend is ``exact`` or, in a rehearsal,
    ``triton``)."""
    return rows[0], next(r for r in rows if r["backend"] == "native")


def price_table(speed: dict, graphed: dict | None = None, launches: dict | None = None) -> str:
    """Markdown: exact / native time per item of a ``speed`` record (eager), with the ``graphed`` part's decode
    steps (both sides captured in a CUDA graph) where given, each marked against ``GPU_TARGETS``; then the
    ``launches`` part's kernel launches and GPU-busy fraction per decode step where given. A ratio is native's
    tokens/s over exact's: the exact path's time in units of native's."""

    def cell(exact_tps: float, native_tps: float, target: float) -> str:
        ratio = native_tps / exact_tps
        return f"{ratio:.2f}× {'✓' if ratio <= target else '✗'}"

    exact, native = _by_backend(speed["rows"])
    s = speed["sizes"]
    lines = ["| qwen3_1_7b bf16 | batch | CUDA graph | exact / native | target |", "|---|---:|---|---:|---:|"]
    target = GPU_TARGETS["prefill"]
    lines.append(f"| prefill | {s['prefill_batch']} x {s['prefill_len']:,} | no | "
                 f"{cell(exact['prefill']['tokens_per_s'], native['prefill']['tokens_per_s'], target)} | "
                 f"≤ {target:.2f}× |")
    target = GPU_TARGETS["decode"]
    for position, step in exact["decode"].items():
        shown = cell(step["tokens_per_s"], native["decode"][position]["tokens_per_s"], target)
        lines.append(f"| decode step at position {position} | {s['decode_batch']} | no | {shown} | ≤ {target:.2f}× |")
    if graphed is not None and graphed.get("status") in ("passed", "failed"):
        g_exact, g_native = _by_backend(graphed["rows"])
        for position in g_exact.get("decode", {}):
            e, n = g_exact["decode"][position], g_native.get("decode", {}).get(position, {})
            if "graphed_tokens_per_s" in e and "graphed_tokens_per_s" in n:
                shown = cell(e["graphed_tokens_per_s"], n["graphed_tokens_per_s"], target)
            else:
                shown = "not captured: " + (e.get("not_captured") or n.get("not_captured") or "no result")
            lines.append(f"| decode step at position {position} | {graphed['sizes']['decode_batch']} | yes | {shown} "
                         f"| ≤ {target:.2f}× |")
    target = GPU_TARGETS["train_fwd_bwd"]
    train = (f"{cell(exact['train_fwd_bwd']['tokens_per_s'], native['train_fwd_bwd']['tokens_per_s'], target)}"
             if "tokens_per_s" in exact["train_fwd_bwd"] and "tokens_per_s" in native["train_fwd_bwd"]
             else "out of memory")
    lines.append(f"| training forward + backward | {s['train_batch']} x "
                 f"{s['train_prompt_len'] + s['train_response_len']:,} | no | {train} | ≤ {target:.2f}× |")
    if launches is not None and launches.get("status") == "passed":
        said = []
        for row in launches["rows"]:
            busy = (f" (GPU busy {row['gpu_busy_fraction']:.0%} of the step's wall time)"
                    if "gpu_busy_fraction" in row else "")
            said.append(f"{row['backend']} {row['kernel_launches_per_decode_step']:,}{busy}")
        lines.append("\nkernel launches per decode step: " + ", ".join(said))
    return "\n".join(lines)


def _kernel_label(name: str) -> str:
    """A kernel's name short enough for a table: a Triton or library kernel's own name as it is; an aten kernel's
    family and the functor that says what it does (``elementwise_kernel: direct_copy_kernel_cuda``); a CUTLASS
    kernel's configuration."""
    if not name.startswith("void "):
        return name if len(name) <= 70 else name[:67] + "..."
    if "cutlass::Kernel2<" in name:
        return name.split("cutlass::Kernel2<")[1].split(">")[0]
    family, inside = name[len("void "):].split("<", 1) if "<" in name else (name[len("void "):], "")
    for pattern in (r"binary_internal::(\w+)<([\w:]+)", r"(\w+Functor\w*)<([\w:]+)", r"(\w+_kernel_cuda)()",
                    r"(\w+Ops)<([\w:]+)", r"(index_put\w*|\w+_kernel_impl)()"):
        what = re.search(pattern, inside)
        if what:
            argument = what.group(2).replace("c10::", "")
            return f"{family.split('::')[-1]}: {what.group(1)}" + (f"<{argument}>" if argument else "")
    return family.split("::")[-1]


def profile_table(profiles: dict, top: int = 5) -> str:
    """Markdown: per backend and item of a ``profiles`` record, the wall time, the GPU-busy time and fraction, the
    launches, then its ``top`` kernels by GPU time (calls, milliseconds, share of the busy time)."""
    lines = ["| backend | item | wall ms | GPU busy ms | busy / wall | launches | top kernels: calls, ms, share |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in profiles["rows"]:
        for item in ("decode_step", "train_fwd_bwd"):
            x = row[item]
            if "error" in x:
                lines.append(f"| {row['backend']} | {item} | {x['error']} | | | | |")
                continue
            kernels = "<br>".join(f"`{_kernel_label(k['kernel'])}` {k['calls']}, {k['us'] / 1e3:.1f}, "
                                  f"{k['share']:.0%}" for k in x["top"][:top])
            lines.append(f"| {row['backend']} | {item} | {x['wall_us'] / 1e3:.1f} | {x['busy_us'] / 1e3:.1f} | "
                         f"{x['busy_fraction']:.0%} | {x['launches']:,} | {kernels} |")
    return "\n".join(lines)


def tiles_table(tiles: dict) -> str:
    """Markdown: the ``tiles`` part's survey, one row per candidate tile: whether it gives the current tiles' bits
    for every weight and keeps a row's bits whatever the row count, then its time summed over one forward's linear
    calls at the decode and the prefill row count, as a ratio to ``F.linear``'s (``native_summed_us``); then the
    tile ``linear`` chose at the decode row count per weight (a decode tile there means its check on the device
    passed). A candidate that did not compile says so."""
    def shape(tile: list) -> str:  # BLOCK_M x BLOCK_N x BLOCK_K
        return " x ".join(map(str, tile[:3]))

    small, large = tiles["sizes"]["rows"]
    native = tiles["native_summed_us"]
    lines = [f"| tile (BLOCK_M x BLOCK_N x BLOCK_K) | same bits as current | rows invariant | {small} rows: exact / "
             f"native | {large:,} rows: exact / native |", "|---|---|---|---:|---:|"]
    for name, candidate in tiles["candidates"].items():
        tile = candidate["tiles"]
        label = (f"{name} ({shape(tile)}, {tile[3]} warps, {tile[4]} stages)" if tile
                 else f"{name} (the dtype's `_MATMUL_TILES`)")
        measured = candidate["weights"].values()
        errors = [e["error"] for e in measured if "error" in e]
        if errors:
            lines.append(f"| {label} | did not run: {errors[0]} | | | |")
            continue
        same, invariant = (all(e[key] for e in measured) for key in ("same_bits_as_current", "rows_invariant"))
        ratios = [f"{candidate[f'summed_us_{m}_rows'] / native[str(m)]:.2f}×" if f"summed_us_{m}_rows" in candidate
                  else "-" for m in (small, large)]
        lines.append(f"| {label} | {'yes' if same else 'NO'} | {'yes' if invariant else 'NO'} | "
                     f"{ratios[0]} | {ratios[1]} |")
    chosen = ", ".join(f"{weight} {shape(tile)}" for weight, tile in tiles["linear_tiles_at_decode"].items())
    lines.append(f"\nlinear's tiles at {small} rows: {chosen}")
    return "\n".join(lines)


def rollout_table(rollout: dict) -> str:
    """Markdown: the ``rollout`` part's ``generate`` tokens/s per backend, eager and with ``cuda_graphs=True``, the
    graphed rollout's speed-up and whether its tokens and log-probs equal the eager one's bit for bit; then exact's
    time over native's in each mode. A mode that failed shows its error."""

    def rate(mode: dict | None) -> str:
        if mode is None:
            return "-"
        return mode["error"] if "error" in mode else f"{mode['tokens_per_s']:,.0f}"

    lines = ["| backend | eager tokens/s | graphed tokens/s | graphed / eager | graphed == eager |",
             "|---|---:|---:|---:|---|"]
    for row in rollout["rows"]:
        eager, graphed = row.get("eager"), row.get("graphed")
        speedup = (f"{graphed['tokens_per_s'] / eager['tokens_per_s']:.2f}×"
                   if eager and graphed and "tokens_per_s" in eager and "tokens_per_s" in graphed else "-")
        equal = {True: "yes, bit for bit", False: "NO", None: "-"}[row.get("graphed_equals_eager")]
        lines.append(f"| {row['backend']} | {rate(eager)} | {rate(graphed)} | {speedup} | {equal} |")
    exact, native = _by_backend(rollout["rows"])
    said = [f"{mode} {native[mode]['tokens_per_s'] / exact[mode]['tokens_per_s']:.2f}×" for mode in ("eager", "graphed")
            if "tokens_per_s" in exact.get(mode, {}) and "tokens_per_s" in native.get(mode, {})]
    if said:
        lines.append("\nexact / native time per token: " + ", ".join(said))
    return "\n".join(lines)


def tables(parts: dict, top: int = 4) -> str:
    """Markdown: every table a record's ``parts`` can give, in the benchmarks page's order -- the price (``speed``,
    with ``graphed`` and ``launches``), the ``profiles``, the ``tiles`` survey, the ``rollout`` -- each where its part
    ran (passed or failed); a part that did not run is named with its status instead."""

    renders: dict[str, Callable[[], str]] = {  # each part that gives a table, in the page's order
        "speed": lambda: price_table(parts["speed"], parts.get("graphed"), parts.get("launches")),
        "profiles": lambda: profile_table(parts["profiles"], top=top),
        "tiles": lambda: f"tiles:\n\n{tiles_table(parts['tiles'])}",
        "rollout": lambda: f"rollout:\n\n{rollout_table(parts['rollout'])}",
    }
    status = {name: parts.get(name, {}).get("status", "not run") for name in renders}
    shown = [render() for name, render in renders.items() if status[name] in ("passed", "failed")]
    missing = [f"{name} {status[name]}" for name in renders if status[name] not in ("passed", "failed")]
    if missing:
        shown.append("no table for: " + ", ".join(missing))
    return "\n\n".join(shown)


# --------------------------------------------------------------------------- the record
def record(path: Path, part: str, result: dict) -> None:
    """Merge one part's result into the JSON at ``path`` (written whole each time: a later part that is cut short
    leaves the earlier ones in place)."""
    data = json.loads(path.read_text()) if path.exists() else {"parts": {}}
    data["parts"][part] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def machine(device: torch.device, rehearse: bool) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "rehearsal": rehearse,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m benchmarks.gpu_real`` / ``vexact bench gpu_real``."""
    parser.add_argument("--part", choices=tuple(PARTS), help="the part to run")
    parser.add_argument("--out", type=Path, required=True, help="the JSON the part's result is merged into")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --rehearse")
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes: the code path, not a measurement")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="with --rehearse: the exact rows run the Triton kernels in Triton's interpreter on the "
                             "CPU (the code a GPU compiles; slow) instead of the exact CPU kernels")
    parser.add_argument("--timed-out", metavar="PART", choices=tuple(PARTS),
                        help="record that PART ran out of its time limit (gpu_check.sh calls this)")
    parser.add_argument("--limit-s", type=int, default=None, help="with --timed-out: the limit it had")
    parser.add_argument("--tables", action="store_true", help="print the tables of the record at --out and stop")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.tables:
        try:
            parts = json.loads(args.out.read_text())["parts"]
        except (OSError, ValueError, KeyError) as err:
            print(f"error: --out {args.out}: not a gpu_real record ({_one_line(err)})", file=sys.stderr)
            return 2
        print(tables(parts))
        return 0
    if args.timed_out:
        record(args.out, args.timed_out, {"status": "timed out", "limit_s": args.limit_s})
        return 0
    if args.part is None:
        parser.error("--part or --timed-out is required")
    try:
        device = resolve_device(args.device, "--device")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.rehearse:
        print("error: without a GPU only --rehearse runs (tiny sizes, not a measurement)", file=sys.stderr)
        return 2
    if args.triton_interpreter and not args.rehearse:
        print("error: --triton-interpreter is a rehearsal mode (add --rehearse)", file=sys.stderr)
        return 2
    sizes = {**SIZES[args.part], **(REHEARSAL[args.part] if args.rehearse else {}),
             "exact_backend": "triton" if args.triton_interpreter else "exact"}
    start = time.perf_counter()
    extra = {"out_dir": args.out.parent} if args.part == "rl_run" else {}
    try:
        result = PARTS[args.part](device, args.rehearse, sizes, **extra)
    except torch.OutOfMemoryError as err:
        result = {"status": "failed", "out_of_memory": str(err).splitlines()[0]}
    result = {**result, "seconds": round(time.perf_counter() - start, 3), "machine": machine(device, args.rehearse)}
    record(args.out, args.part, result)
    print(f"{args.part}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else "")
          + f", {result['seconds']:.1f} s", flush=True)
    return 0 if result["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
