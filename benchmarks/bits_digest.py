"""The exact path's bits at the benchmark shapes, as digests: did a change that claims "no bit changes" change any?

    vexact bench bits_digest --out runs/bench/bits-before.json          # on the commit before the change
    vexact bench bits_digest --against runs/bench/bits-before.json      # on the change: exit 1 where a digest differs
    VEXACT_CPU_EXACT_PATH=canonical vexact bench bits_digest ...        # the same in another guard mode

For each shape, dtype and thread count, the exact backend generates the shape's end-to-end rollout (its prompts,
new tokens, sampling seed 0: ``end_to_end``'s), scores it as training does and back-propagates the mean log-prob.
The digest of each is a SHA-256 of raw bits -- the rollout's tokens, the log-probs and every parameter's gradient
(by name) -- so -0.0 against +0.0 counts as a change, where ``torch.equal`` would not. ``--layers`` cuts each model
to its first layers (a quicker check of the same kernels). Digests are of this host: compare two commits on one
machine, in one guard mode; the record holds the machine and the mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import torch

from vexact import Transformer, generate
from vexact.engine.scoring import token_logprobs
from vexact.rl.validate import read_text_file

from .common import DTYPES, cli_main, machine_info, parse_list, parse_threads, shapes
from .end_to_end import prompts_of

PARTS = ("tokens", "logprobs", "gradients")
"""What is digested per (shape, dtype, threads): the rollout's tokens, the training log-probs, the gradients."""
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float64: torch.int64}


def raw_bits(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (floats as their integer bits: -0.0 and +0.0 differ)."""
    t = t.detach().contiguous()
    if t.dtype in _INT_OF:
        t = t.view(_INT_OF[t.dtype])
    return t.numpy().tobytes()


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(raw_bits(t))
    return h.hexdigest()


def digest_case(shape_name: str, dtype_name: str, threads: int | None, layers: int | None) -> dict:
    """One (shape, dtype, threads) case: the digest of each of ``PARTS``."""
    shape = shapes()[shape_name]
    if layers is not None:
        shape = dataclasses.replace(shape, model=dataclasses.replace(
            shape.model, num_layers=min(layers, shape.model.num_layers)))
    if threads is not None:
        torch.set_num_threads(threads)
    model = Transformer(shape.model, backend="exact", dtype=DTYPES[dtype_name], init_seed=0)
    prompts = prompts_of(shape)
    tokens = generate(model, prompts, max_new_tokens=shape.new_tokens, temperature=1.0, seed=0).tokens
    model.zero_grad(set_to_none=True)
    logprobs = torch.cat(token_logprobs(model, prompts, tokens))
    (-logprobs.mean()).backward()
    grads = [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None]
    return {"shape": shape_name, "dtype": dtype_name, "threads": threads, "layers": shape.model.num_layers,
            "tokens": _digest([torch.tensor([t for row in tokens for t in row])]),
            "logprobs": _digest([logprobs]), "gradients": _digest(grads)}


def differences(record: dict, before: dict) -> list[str]:
    """Each case and part whose digest differs from ``before``'s (cases only one record has are listed too)."""
    def cases(r: dict) -> dict:
        return {(c["shape"], c["dtype"], c["threads"], c["layers"]): c for c in r["results"]}
    now, then = cases(record), cases(before)
    modes = record["machine"]["exact_path"], before.get("machine", {}).get("exact_path")
    found = [f"guard mode: {modes[0]} here, {modes[1]} in the earlier record"] if modes[0] != modes[1] else []
    found += [f"{key}: only in {'this run' if key in now else 'the earlier record'}"
             for key in sorted(set(now) ^ set(then))]
    for key in sorted(set(now) & set(then)):
        found += [f"{key}: {part} differ" for part in PARTS if now[key][part] != then[key][part]]
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="default,llama100m", help="comma list of shapes (default, llama100m, tiny)")
    p.add_argument("--dtype", default="all", help="float32, bfloat16 or all")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    p.add_argument("--layers", type=int, default=None, help="keep only each model's first LAYERS layers")
    p.add_argument("--against", type=Path, default=None,
                   help="an earlier record of this benchmark: exit 1 where a digest differs")
    p.add_argument("--device", default="cpu", choices=("cpu",), help="cpu")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default runs/bench/bits_digest-cpu.json)")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    shape_names = parse_list(args.shape, list(shapes()), "shape")
    dtype_names = parse_list(args.dtype, list(DTYPES), "dtype")
    thread_counts = parse_threads(args.threads)
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    before = None
    if args.against is not None:
        text = read_text_file(args.against, f"--against file '{args.against}'")  # missing, a directory, binary
        try:
            before = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--against {args.against}: not a readable JSON record ({err})") from None
        if not isinstance(before, dict) or before.get("benchmark") != "bits_digest":
            raise ValueError(f"--against {args.against}: not a bits_digest record")
    record = {"benchmark": "bits_digest", "machine": machine_info(device),
              "settings": {"shapes": shape_names, "dtypes": dtype_names, "threads": thread_counts,
                           "layers": args.layers},
              "results": [digest_case(s, d, t, args.layers)
                          for s in shape_names for d in dtype_names for t in thread_counts]}
    if before is not None:
        record["against"] = {"file": str(args.against), "differences": differences(record, before)}
    return record


def print_results(record: dict) -> None:
    print(f"exact-path digests ({record['machine']['exact_path']} guard mode):")
    for case in record["results"]:
        print(f"  {case['shape']:>10} {case['dtype']:>9} {case['threads']} thr {case['layers']:>2} layers  "
              + "  ".join(f"{part} {case[part][:12]}" for part in PARTS))
    if "against" in record:
        found = record["against"]["differences"]
        print(f"against {record['against']['file']}: " + ("the same bits" if not found else f"{len(found)} differ"))
        for line in found:
            print(f"  {line}")


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.bits_digest") -> int:
    """Command-line entry point: 0 (with ``--against``: the same bits), 1 where a digest differs, 2 bad input."""
    outcome: dict = {}

    def measured(args: argparse.Namespace, device: torch.device) -> dict:
        outcome["record"] = measure(args, device)
        return outcome["record"]
    code = cli_main(argv, prog, __doc__.split("\n")[0], "bits_digest", add_arguments, measured, print_results)
    if code == 0 and outcome["record"].get("against", {}).get("differences"):
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
