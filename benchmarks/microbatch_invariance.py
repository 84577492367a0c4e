"""The price of ``algorithm.grad_unit`` (gradients independent of ``micro_batch_size``), on one RL step.

    python -m benchmarks.microbatch_invariance --reps 7

``Trainer.step`` of ``experiments/zero_mismatch.yaml`` (cached warm start, ``threads: 1``) for a few settings of
``algorithm.micro_batch_size`` / ``algorithm.grad_unit``, every repetition from the same weights and optimizer
state, the settings alternating within each repetition (so a slow moment on a shared host hits them all). Prints
the median seconds of the whole step, of its update part (``timing/update``: the gradient pass, reduction and
AdamW) and the step's CPU time (``time.process_time``, steadier than wall time on a loaded host), the ratios to
the shipped setting (``micro_batch_size`` null, ``grad_unit`` null), and whether the weights after the step are
that setting's, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from rich.console import Console

from vexact.metric_keys import TIMING_STEP, TIMING_UPDATE
from vexact.rl.config import load_config
from vexact.rl.trainer import Trainer
from vexact.rl.warmstart import warm_start

from .common import EXPERIMENT

# (micro_batch_size, grad_unit); zero_mismatch's mini-batch is 128 sequences in 4 leaves of 32
SETTINGS = ((None, None), (None, 32), (8, None), (8, 8), (1, None), (None, 1))


def _label(micro: int | None, unit: int | None) -> str:
    return f"micro_batch_size {_yaml(micro)}, grad_unit {_yaml(unit)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cache-dir", default=None, help="warm-start cache (default: the config's)")
    args = parser.parse_args(argv)
    extra = ["threads=1", "logging.live=false"] + ([f"warm_start.cache_dir={args.cache_dir}"] if args.cache_dir
                                                   else [])
    trainers = {s: Trainer(load_config(EXPERIMENT, [*extra, f"algorithm.micro_batch_size={_yaml(s[0])}",
                                                    f"algorithm.grad_unit={_yaml(s[1])}"]), Console(quiet=True))
                for s in SETTINGS}
    first = trainers[SETTINGS[0]]
    warm_start(first.master, first.cfg, first.task, log=lambda _: None)
    start = copy.deepcopy(first.master.state_dict())
    opt_start = copy.deepcopy(first.optimizer.state_dict())
    step_s: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    cpu_s: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    update_s: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.reps + 1):  # the first repetition warms up and is dropped
        for s in SETTINGS:
            trainers[s].load_policy(start, opt_start)
            cpu = time.process_time()
            metrics = trainers[s].step(0)
            cpu_s[s].append(time.process_time() - cpu)
            step_s[s].append(metrics[TIMING_STEP])
            update_s[s].append(metrics[TIMING_UPDATE])
    base = SETTINGS[0]
    weights = {s: list(trainers[s].master.parameters()) for s in SETTINGS}  # after the last step
    same = {s: all(torch.equal(a, b) for a, b in zip(weights[s], weights[base])) for s in SETTINGS}
    med = {s: [statistics.median(x[s][1:]) for x in (step_s, update_s, cpu_s)] for s in SETTINGS}
    print(f"threads {torch.get_num_threads()}, {args.reps} repetitions, medians; ratio to the first row")
    print("| setting | step s | update s | step CPU s | update ratio | step CPU ratio | weights = first row's |")
    print("|---|---|---|---|---|---|---|")
    for s in SETTINGS:
        print(f"| {_label(*s)} | {med[s][0]:.3f} | {med[s][1]:.3f} | {med[s][2]:.3f} | "
              f"{med[s][1] / med[base][1]:.2f}x | {med[s][2] / med[base][2]:.2f}x | {'yes' if same[s] else 'no'} |")


def _yaml(value: int | None) -> str:
    return "null" if value is None else str(value)


if __name__ == "__main__":
    main()
