"""What W-invariance costs: the fixed-tree gradient reduction against a plain all_reduce.

    python -m benchmarks.data_parallel                          # 1M-float gradient on 2 and 4 ranks, plus RL steps
    python -m benchmarks.data_parallel --numel 100000 --nproc 2 --reps 20 --no-steps

Two measurements, each a ratio taken in one run (the machine is shared and noisy):

- ``reduce``: ranks started by the same elastic launcher as ``vexact run --nproc`` (gloo on loopback) each hold a
  flat fp32 gradient of ``--numel`` floats; the median over ``--reps`` of ``DataParallel.sum_gradients`` with
  ``reduce: tree`` (all_to_all, a tree over ranks in rank order, all_gather) and with ``reduce: allreduce``.
- ``steps``: ``vexact run experiments/zero_mismatch.yaml --nproc N`` for ``--steps`` steps with
  ``distributed.leaves`` = 4, once per mode: the mean ``timing/step`` and ``timing/grad_reduce`` from
  metrics.jsonl (the first step, which warms up, is left out).

Writes the JSON record to ``--out`` (default runs/bench/data_parallel-cpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

from vexact.cli_base import check_writable
from vexact.metric_keys import TIMING_GRAD_REDUCE, TIMING_STEP
from vexact.records import METRICS_FILE
from vexact.records.runlog import read_metrics
from vexact.rl.data_parallel import DataParallel, ReduceMode, launch

from .common import EXPERIMENT

MODES = typing.get_args(ReduceMode)  # ("tree", "allreduce")


def _worker(numel: int, reps: int, out: str) -> None:
    """One rank of the reduce measurement (run by ``launch``): times both modes, interleaved."""
    timings: dict[str, list[float]] = {mode: [] for mode in MODES}
    group = DataParallel.from_environment()
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(group.rank))
    for rep in range(reps + 1):
        for mode in MODES:
            ranks = DataParallel(group.rank, group.world_size, mode)
            group.barrier()
            start = time.perf_counter()
            ranks.sum_gradients([gradient.clone()])
            if rep:  # the first repetition warms up the connections
                timings[mode].append(time.perf_counter() - start)
    if group.is_main:
        Path(out).write_text(json.dumps({m: statistics.median(t) for m, t in timings.items()}))
    group.barrier()
    group.close()


def measure_reduce(nproc: int, numel: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "reduce.json")
        # this module under the name it was imported by: benchmarks (a checkout) or vexact_benchmarks (installed)
        launch(nproc, ["-m", __spec__.name, "--worker", str(numel), str(reps), out], threads=1)
        medians = json.loads(Path(out).read_text())
    return {"nproc": nproc, "numel": numel, "reps": reps, "tree_s": medians["tree"],
            "allreduce_s": medians["allreduce"], "ratio": medians["tree"] / medians["allreduce"]}


def measure_steps(nproc: int, steps: int) -> dict:
    result: dict = {"nproc": nproc, "steps": steps, "config": "experiments/zero_mismatch.yaml, distributed.leaves=4"}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            run_dir = Path(tmp) / mode
            subprocess.run([sys.executable, "-m", "vexact", "run", str(EXPERIMENT), f"--nproc={nproc}",
                            f"--set=steps={steps}", "--set=distributed.leaves=4", f"--set=distributed.reduce={mode}",
                            "--set=threads=1", f"--set=output_dir={run_dir}", "--set=logging.eval_every=1000"],
                           check=True, capture_output=True)
            rows = read_metrics(run_dir / METRICS_FILE)[1:]
            result[f"{mode}_step_s"] = statistics.mean(m[TIMING_STEP] for m in rows)
            result[f"{mode}_reduce_s"] = statistics.mean(m[TIMING_GRAD_REDUCE] for m in rows)
    result["step_ratio"] = result["tree_step_s"] / result["allreduce_step_s"]
    result["reduce_ratio"] = result["tree_reduce_s"] / result["allreduce_reduce_s"]
    return result


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.data_parallel") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(int(argv[1]), int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", default="2,4", help="comma-separated rank counts, powers of two (default 2,4)")
    parser.add_argument("--numel", type=int, default=1_000_000, help="gradient size in floats (default 1M)")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per mode (default 30)")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run of the step measurement (default 6)")
    parser.add_argument("--no-steps", action="store_true", help="skip the RL-step measurement")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/data_parallel-cpu.json"),
                        help="JSON record (default runs/bench/data_parallel-cpu.json)")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        counts = [0]  # (refused below, naming the flag)
    if any(n < 2 or n & (n - 1) for n in counts) or args.numel < 1 or args.reps < 1 or args.steps < 2:
        print("error: --nproc takes powers of two >= 2; --numel, --reps >= 1; --steps >= 2", file=sys.stderr)
        return 2
    try:
        check_writable(args.out, "--out")  # before the measurements, not after them
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    record = {"benchmark": "data_parallel", "torch": torch.__version__, "reduce": [], "steps": []}
    print(f"{'ranks':>5} {'floats':>9} {'tree ms':>9} {'allreduce ms':>13} {'ratio':>6}")
    for n in counts:
        r = measure_reduce(n, args.numel, args.reps)
        record["reduce"].append(r)
        print(f"{n:>5} {args.numel:>9} {r['tree_s'] * 1e3:>9.3f} {r['allreduce_s'] * 1e3:>13.3f} {r['ratio']:>6.2f}")
    if not args.no_steps:
        print(f"\n{'ranks':>5} {'tree step s':>12} {'allreduce step s':>17} {'ratio':>6} {'tree reduce ms':>15} "
              f"{'allreduce reduce ms':>20} {'ratio':>6}")
        for n in counts:
            s = measure_steps(n, args.steps)
            record["steps"].append(s)
            print(f"{n:>5} {s['tree_step_s']:>12.3f} {s['allreduce_step_s']:>17.3f} {s['step_ratio']:>6.2f} "
                  f"{s['tree_reduce_s'] * 1e3:>15.2f} {s['allreduce_reduce_s'] * 1e3:>20.2f} {s['reduce_ratio']:>6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
