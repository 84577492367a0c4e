"""What ``vexact.live.LiveMonitor.step`` costs a training step: seconds per call on padded float32 batches.

    python -m benchmarks.live                      # 64 x 1024 and 256 x 4096 tokens, 5 steps each, 1 torch thread

Each batch is seeded: training log-probs -5·U, rollout log-probs the same plus N(0, 1e-3) noise (clamped at 0), a
full mask. The monitor writes metrics.jsonl only (no live views) to a temporary directory. Printed: a Markdown table
of the batch shape, its tokens and the median seconds per ``step`` call (reading the mask, the metrics, the gates,
one fsynced JSON line).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from vexact.live import LiveMonitor

SHAPES = ((64, 1024), (256, 4096))


def seconds_per_step(batch: int, length: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(batch, length, generator=g) * 5
    roll = (train + 1e-3 * torch.randn(batch, length, generator=g)).clamp(max=0.0)
    mask = torch.ones(batch, length, dtype=torch.long)
    times = []
    with tempfile.TemporaryDirectory() as out, LiveMonitor(out) as monitor:
        for step in range(steps):
            start = time.perf_counter()
            monitor.step(step, roll, train, mask)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| batch (B x T) | tokens | seconds per step (median) |")
    print("|---|---|---|")
    for batch, length in SHAPES:
        print(f"| {batch} x {length} | {batch * length:,} | {seconds_per_step(batch, length, args.steps):.3f} |")


if __name__ == "__main__":
    main()
