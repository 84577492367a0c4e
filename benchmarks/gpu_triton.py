"""The Triton kernels on a real GPU: the zero-mismatch guarantee, compiled, and its price against native.

    python -m benchmarks.gpu_triton --out runs/bench/gpu_triton.json      # needs CUDA (exits 2 without it)

Three parts, each printed and recorded in ``--out``:

1. **Exactness, compiled.** The ``vexact check`` procedure (``vexact.real.check.run_check``: random ragged prompts,
   generation at batch arrangements all/1/3, rescoring at micro-batches all/1/5) on a CUDA model, for the Triton
   backend and, for contrast, native (cuBLAS, SDPA), fp32 and bf16, for each of ``--check-presets`` (default the
   dense ``small`` and the mixture-of-experts ``small_moe``, whose rows also give the routing flip rate). Triton
   must give 0 mismatched tokens (and, MoE, 0 routing flips).
2. **Speed.** One decode step (KV-cache generation, per token) and one training forward+backward
   (``token_logprobs`` of full sequences), Triton against native, at the ``small`` and ``llama100m`` presets' shapes:
   medians of ``--reps`` timed repeats after warm-up, CUDA-synchronised, in one process (so the ratio is measured
   under one set of conditions).
3. The environment: GPU, torch, triton.

``--device cpu`` (with tiny sizes) runs the same code in the Triton interpreter: a rehearsal of the script, not a
measurement (``benchmarks/gpu_check.sh`` with ``VEXACT_GPU_CHECK_REHEARSE=1``). ``--out`` is written after each
part, so a run cut short keeps what it measured.

The op-level contracts run separately on the same machine: ``python -m pytest tests/kernels/test_triton_kernels.py``
(with CUDA present it runs on CUDA tensors with the compiled kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vexact.engine.generation import generate
from vexact.engine.model import ModelConfig, Transformer
from vexact.engine.presets import MODEL_PRESETS
from vexact.engine.scoring import token_logprobs
from vexact.real.check import METRIC_KEYS, CheckSettings, mismatched, run_check


def check_settings(preset: str, dtype: str, **sizes: int) -> CheckSettings:
    """``vexact check --preset PRESET``'s settings (the preset's model sizes that ``CheckSettings`` has), with
    ``sizes`` (num_prompts, max_prompt_len, max_new_tokens) overriding the check's defaults."""
    shape = {k: v for k, v in MODEL_PRESETS[preset].items() if k in CheckSettings.__dataclass_fields__}
    return CheckSettings(**shape, **sizes, dtype=dtype)


def exactness(presets: list[str], dtypes: list[str], device: str, **sizes: int) -> list[dict]:
    rows = []
    for preset in presets:
        for dtype in dtypes:
            for row in run_check(check_settings(preset, dtype, **sizes), backends=("triton", "native"), device=device):
                row["preset"] = preset
                row["mismatched"] = mismatched(row)
                rows.append(row)
                flip_rate = row["routing_flip_rate"]
                flips = "" if flip_rate is None else f", routing flip rate {flip_rate:.2e}"
                print(f"{preset:>9} {row['backend']:>7} {dtype:>9}: {row['tokens']} tokens, {row['mismatched']} "
                      f"mismatched, max |dlogp| {row['metrics'][METRIC_KEYS['abs_dlogp_max']]:.2e}{flips}  "
                      f"({row['seconds']} s)", flush=True)
    return rows


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued kernels (a no-op on the CPU), so a timer reads the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, reps: int, device: str | torch.device) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call, device-synchronised."""
    fn()  # warm-up: compiles the kernels for these shapes
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed(presets: list[str], dtypes: list[str], reps: int, batch: int, prompt_len: int, new_tokens: int,
          device: str = "cuda") -> list[dict]:
    rows = []
    for preset in presets:
        shape = {k: v for k, v in MODEL_PRESETS[preset].items() if k in ModelConfig.__dataclass_fields__}
        cfg = ModelConfig(**{**shape, "max_seq_len": prompt_len + new_tokens})
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
        responses = torch.randint(0, cfg.vocab_size, (batch, new_tokens), generator=g).tolist()
        for dtype in dtypes:
            seconds = {}
            for backend in ("triton", "native"):
                model = Transformer(cfg, backend=backend, dtype=dtype, device=device, init_seed=0)

                def decode(model=model, prompts=prompts):
                    with torch.no_grad():
                        generate(model, prompts, max_new_tokens=new_tokens, seed=0)

                def train(model=model, prompts=prompts, responses=responses):
                    model.zero_grad(set_to_none=True)
                    logps = token_logprobs(model, prompts, responses)
                    torch.stack([lp.sum() for lp in logps]).sum().backward()

                seconds[backend] = {"decode_step": median_seconds(decode, reps, device) / new_tokens,
                                    "train_fwd_bwd": median_seconds(train, reps, device)}
            for part in ("decode_step", "train_fwd_bwd"):
                row = {"preset": preset, "dtype": dtype, "part": part, "batch": batch, "prompt_len": prompt_len,
                       "new_tokens": new_tokens, "triton_ms": 1e3 * seconds["triton"][part],
                       "native_ms": 1e3 * seconds["native"][part]}
                row["triton_over_native"] = row["triton_ms"] / row["native_ms"]
                rows.append(row)
                print(f"{preset:>9} {dtype:>9} {part:>13}: triton {row['triton_ms']:.3f} ms, native "
                      f"{row['native_ms']:.3f} ms, ratio {row['triton_over_native']:.2f}x", flush=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m benchmarks.gpu_triton`` / ``vexact bench gpu_triton``."""
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma list (default float32,bfloat16)")
    parser.add_argument("--check-presets", default="small,small_moe",
                        help="model presets of the exactness check (default small,small_moe)")
    parser.add_argument("--num-prompts", type=int, default=CheckSettings.num_prompts, help="exactness: prompts")
    parser.add_argument("--max-prompt-len", type=int, default=CheckSettings.max_prompt_len,
                        help="exactness: longest prompt")
    parser.add_argument("--max-new-tokens", type=int, default=CheckSettings.max_new_tokens,
                        help="exactness: tokens generated per prompt")
    parser.add_argument("--presets", default="small,llama100m", help="model presets timed (default small,llama100m)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu runs the Triton interpreter: a rehearsal with tiny sizes only")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: benchmarks.gpu_triton needs a CUDA GPU (torch.cuda.is_available() is False; --device cpu "
              "rehearses it in the Triton interpreter)", file=sys.stderr)
        return 2
    check_presets = [p.strip() for p in args.check_presets.split(",") if p.strip()]
    unknown = [p for p in check_presets + args.presets.split(",") if p.strip() and p.strip() not in MODEL_PRESETS]
    if unknown:
        print(f"error: unknown model preset(s) {', '.join(unknown)}; expected some of {', '.join(MODEL_PRESETS)}",
              file=sys.stderr)
        return 2
    from vexact_kernels import TRITON_PIP, triton_installed

    if not triton_installed():
        print(f"error: benchmarks.gpu_triton needs the triton package, which is not installed: {TRITON_PIP}",
              file=sys.stderr)
        return 2
    import triton

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (--device cpu: Triton interpreter)"
    env = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    print(json.dumps(env), flush=True)
    result: dict = {"environment": env}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str))

    sizes = dict(num_prompts=args.num_prompts, max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens)
    result["exactness"] = exactness(check_presets, dtypes, args.device, **sizes)
    save()
    if not args.skip_speed:
        presets = [p.strip() for p in args.presets.split(",") if p.strip()]
        result["speed"] = speed(presets, dtypes, args.reps, args.batch, args.prompt_len, args.new_tokens, args.device)
        save()
    failed = [r for r in result["exactness"]
              if r["backend"] == "triton" and (r["mismatched"] or r["routing_flip_rate"])]
    if failed:
        print("FAIL: triton rollout != training on " + ", ".join(f"{r['preset']} {r['dtype']}" for r in failed),
              file=sys.stderr)
        return 1
    where = "compiled, on CUDA" if args.device == "cuda" else "Triton interpreter, on CPU: a rehearsal"
    print(f"PASS: triton rollout log-probs == training log-probs bit for bit ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
