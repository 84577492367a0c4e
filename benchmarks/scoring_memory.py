"""Peak memory of the training path's scoring pass: ``token_logprobs`` + backward, measured in a fresh process.

Peak memory is a process-wide high-water mark, so each case runs in its own child process: it builds the model,
reads its peak resident set (``resource.getrusage``: ``ru_maxrss``), runs ``token_logprobs`` over ``batch``
sequences of ``tokens`` response tokens with grad and the backward of their sum, and reports how far the peak rose.
The default case is the one measured when this was built: 4 x 1,000 response tokens, Qwen3's vocabulary (151,936),
one layer 64 wide, the exact backend, fp32, CPU. What the growth would be if the logits of the whole batch were held
at once is printed beside it (``logits_bytes``: tokens x vocabulary x 4 bytes).

``--warm`` also runs the pass a second time and reports its peak over the resident set before it: what the pass
itself holds, without the first pass's one-time costs (the exact kernels' host-guard probes of each new GEMM
class, whose inputs are vocabulary-sized for the LM head: the largest, the weight gradient's views probe, 0.44 GiB
at its peak, transient).

Measured on a 2-CPU AMD EPYC (torch 2.13.0+cpu, default glibc malloc), ``python -m benchmarks.scoring_memory
--warm``: the default case grew the peak by 0.64 GiB, its second pass 0.28 GiB over the resident set. ``--tokens
2000``: 0.89 GiB, second pass 0.73 GiB. ``--vocab 262144`` (Gemma 3's): 0.89 GiB, second pass
0.72 GiB. (Before, 0.81 / 0.61, 1.23 / 1.03 and 1.09 / 0.89 GiB: the exact attention's backward held dP, dS and
their difference, each a [rows x keys] buffer, beside its probabilities -- which grow with the square of a sequence's
length; the LM head's weight-gradient probes ran beside a group's [256 x vocabulary] output gradient; and the head's
backward recomputed its logits in passes as wide as the forward's. 1.14 / 0.62 GiB for the default case while the
guard held its vocabulary-wide probes' inputs and references for the process.) ``tests/engine/test_head_chunks.py``
finds 16 x 250 tokens growing it by 147 MB more than 4 x 250 at Qwen3's vocabulary, 8% of their extra logits.

Run:  python -m benchmarks.scoring_memory [--vocab 151936] [--tokens 1000] [--batch 4] [--dtype float32] [--warm]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time

PROMPT_LEN = 8
"""Prompt tokens per sequence: the scoring pass reads the prompt and predicts every response token."""


def measure(vocab: int, tokens: int, batch: int, hidden: int, layers: int, dtype: str, backend: str,
            threads: int, warm: bool = False) -> dict:
    """One case in this process (call it in a fresh one): the peak-memory growth of scoring + backward; ``warm``:
    also that of a second pass (Linux: ``/proc/self/clear_refs``)."""
    import torch

    from vexact import ModelConfig, Transformer
    from vexact.engine.scoring import token_logprobs

    torch.set_num_threads(threads)
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                         intermediate_size=hidden * 2, max_seq_len=PROMPT_LEN + tokens)
    model = Transformer(config, backend=backend, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
    responses = [torch.randint(0, vocab, (tokens,), generator=gen).tolist() for _ in range(batch)]
    def scoring_pass() -> None:
        logp = token_logprobs(model, prompts, responses)
        torch.cat(logp).sum().backward()
        model.zero_grad(set_to_none=True)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    start = time.perf_counter()
    scoring_pass()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {"vocab": vocab, "tokens": tokens, "batch": batch, "hidden": hidden, "layers": layers, "dtype": dtype,
              "backend": backend, "threads": threads, "peak_before_bytes": before, "peak_after_bytes": after,
              "growth_bytes": after - before, "logits_bytes": batch * tokens * vocab * 4, "seconds": seconds,
              "second_pass_growth_bytes": None}
    if warm:  # the same pass again, its peak over the resident set before it (the first pass's one-time costs,
        # such as the exact kernels' host-guard probes of new GEMM classes, already paid)
        resident = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set (Linux)
            f.write("5")
        scoring_pass()
        record["second_pass_growth_bytes"] = _status_bytes("VmHWM") - resident
    return record


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory field (kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def run_case(vocab: int, tokens: int, batch: int, hidden: int = 64, layers: int = 1, dtype: str = "float32",
             backend: str = "exact", threads: int = 1, warm: bool = False) -> dict:
    """``measure`` in a fresh Python process (its own high-water mark); the child's record."""
    return run_cases([dict(vocab=vocab, tokens=tokens, batch=batch, hidden=hidden, layers=layers, dtype=dtype,
                           backend=backend, threads=threads, warm=warm)])[0]


def run_cases(cases: list[dict], side_by_side: int | None = None) -> list[dict]:
    """``run_case`` of each case (``run_case``'s keyword arguments), their records in order. Up to ``side_by_side``
    children run at once (default: as many as the CPUs hold at each case's thread count): a peak is each child's own
    high-water mark and their ``seconds`` share the CPUs, but a child beside another has peaked higher than alone
    (0.95 against 0.89 GiB, once): a case near its bound runs with ``side_by_side=1``."""
    cases = [_with_defaults(case) for case in cases]
    threads = max((case["threads"] for case in cases), default=1)
    limit = side_by_side or max(1, (os.cpu_count() or 1) // threads)
    records: list[dict | None] = [None] * len(cases)
    running: list[tuple[int, subprocess.Popen]] = []

    def finish(index: int, child: subprocess.Popen) -> None:
        out, err = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"scoring_memory child failed ({child.returncode}): {err.strip()[-2000:]}")
        records[index] = json.loads(out.strip().splitlines()[-1])

    try:
        for index, case in enumerate(cases):
            if len(running) >= limit:
                finish(*running.pop(0))
            running.append((index, subprocess.Popen(_child_args(case), stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True)))
        while running:
            finish(*running.pop(0))
    finally:  # a failed child ends the others too
        for _, child in running:
            child.kill()
            child.communicate()
    return records  # type: ignore[return-value]


def _with_defaults(case: dict) -> dict:
    """``case`` (``run_case``'s keyword arguments) with ``run_case``'s defaults for what it leaves out: one list of
    defaults, ``run_case``'s signature."""
    bound = inspect.signature(run_case).bind(**case)
    bound.apply_defaults()
    return dict(bound.arguments)


def _child_args(case: dict) -> list[str]:
    """The command line of one case's child process (``case``: every argument of ``run_case``, each an option of the
    same name; ``warm`` a flag)."""
    options = [arg for key, value in case.items() if key != "warm" for arg in (f"--{key}", str(value))]
    # this module under the name it was imported by: benchmarks (a checkout) or vexact_benchmarks (installed)
    return [sys.executable, "-m", __spec__.name, "--child", *options] + (["--warm"] if case["warm"] else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=1000, help="response tokens per sequence")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--backend", default="exact")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm", action="store_true", help="also measure a second pass (Linux)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    case = dict(vocab=args.vocab, tokens=args.tokens, batch=args.batch, hidden=args.hidden, layers=args.layers,
                dtype=args.dtype, backend=args.backend, threads=args.threads, warm=args.warm)
    if args.child:
        print(json.dumps(measure(**case)))
        return 0
    record = run_case(**case)
    gib = 1 << 30
    print(json.dumps(record))
    print(f"{args.batch} x {args.tokens} tokens, vocab {args.vocab}, {args.layers} layer(s) x {args.hidden}, "
          f"{args.backend} {args.dtype}: peak memory grew by {record['growth_bytes'] / gib:.2f} GiB in "
          f"{record['seconds']:.1f} s (all logits at once: {record['logits_bytes'] / gib:.2f} GiB)")
    if record["second_pass_growth_bytes"] is not None:
        print(f"second pass: peak {record['second_pass_growth_bytes'] / gib:.2f} GiB over the resident set before it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
