"""Where the exact path's per-op overhead comes from: aten calls of one RL step, counted per Python function.

    python -m benchmarks.op_count                      # experiments/zero_mismatch.yaml, fp32, top 15 functions
    vexact bench op_count --top 25 --rl-set distributed.leaves=1

On the small models this project trains, the exact backend's price over native is mostly per-op dispatch: its
tiles, trees and exactly rounded passes are many small aten calls (see docs/results/benchmarks_price_fp32.md). A
time profile says which aten ops are slow; this says which of vexact's own functions issue them. Every aten call of
one ``Trainer.step`` (rollout, scoring, loss, backward, AdamW) is counted under a ``TorchDispatchMode`` -- views
included, since each is a dispatch too -- and charged to the innermost frame in ``vexact/`` or ``kernels/`` that
issued it (a backward's calls land in the op's VJP). Counts, not times: they are the same on any machine and under
any load, so two commits can be compared exactly. The step runs once before counting, so host probes and caches
are already in place, and starts from the config's random init (no warm start: the counts barely depend on it).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import add_rl_step_arguments, cli_main, machine_info, set_malloc

ROOT = Path(__file__).resolve().parents[1]
OWN_CODE = (str(ROOT / "vexact") + "/", str(ROOT / "kernels") + "/")  # frames charged with the calls they issue
BACKENDS = ("exact", "native")


class _CountCalls(TorchDispatchMode):
    """Counts every aten call, by op name and by the innermost vexact / kernels frame that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_function: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.by_op[str(func.overloadpacket)] += 1
        self.by_function[_caller()] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """``path:function`` of the innermost frame in vexact/ or kernels/ (relative to the checkout), or ``other``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(OWN_CODE):
            return f"{Path(path).relative_to(ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def count_rl_step(backend: str, config: Path, overrides: list[str]) -> dict:
    """The aten calls of one ``Trainer.step`` of ``config`` with ``backend``: total, by op and by function."""
    from rich.console import Console

    from vexact.rl.config import load_config
    from vexact.rl.trainer import Trainer

    trainer = Trainer(load_config(config, [f"backend={backend}", "logging.live=false", *overrides]),
                      Console(quiet=True))
    trainer.step(0)  # probes, layouts and caches in place before counting
    counter = _CountCalls()
    with counter:
        trainer.step(1)
    return {"backend": backend, "aten_calls": sum(counter.by_op.values()),
            "by_function": dict(counter.by_function.most_common()), "by_op": dict(counter.by_op.most_common())}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rl_step_arguments(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--top", type=int, default=15, help="functions and ops printed per backend (default 15)")
    p.add_argument("--device", default="cpu", choices=("cpu",), help="cpu (the Trainer has no device option)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default runs/bench/op_count-cpu.json)")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Both backends' counts, one thread (counts do not depend on it; the step is just quicker)."""
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if not args.rl_config.is_file():
        raise ValueError(f"--rl-config {args.rl_config} not found")
    torch.set_num_threads(1)
    overrides = [f"dtype={args.dtype}", "threads=1", "warm_start.steps=0", *args.rl_set]
    return {"benchmark": "op_count", "machine": {**machine_info(device), "malloc": set_malloc("steady")},
            "settings": {"config": str(args.rl_config), "overrides": overrides, "top": args.top},
            "results": [count_rl_step(backend, args.rl_config, overrides) for backend in BACKENDS]}


def print_results(record: dict) -> None:
    top = record["settings"]["top"]
    counts = {r["backend"]: r for r in record["results"]}
    exact, native = counts["exact"]["aten_calls"], counts["native"]["aten_calls"]
    print(f"aten calls in one RL step ({record['settings']['config']}): exact {exact}, native {native} "
          f"({exact / native:.2f}x)")
    for r in record["results"]:
        print(f"\n{r['backend']}: the {top} functions issuing the most aten calls")
        for name, n in list(r["by_function"].items())[:top]:
            print(f"  {n:7d}  {name}")
        print(f"{r['backend']}: the {top} most called aten ops")
        for name, n in list(r["by_op"].items())[:top]:
            print(f"  {n:7d}  {name}")


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.op_count") -> int:
    """Command-line entry point; bad input exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "op_count", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
