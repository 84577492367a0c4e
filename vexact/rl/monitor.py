"""Which sequences of a step are rescored for the mismatch metrics (``monitor.sample_fraction`` / ``monitor.every``).

In bypass mode (``algorithm.old_logprobs: rollout``) the ratio's anchor is the rollout's log-probs, so the training
path's log-probs at the pre-update weights are needed only to measure the mismatch (and, with several mini-batches
or epochs, nothing else computes them). A run, ``vexact.live.LiveMonitor`` and the TRL / verl hooks rescore a
deterministic sample of each step's sequences instead of all of them: ``sample_rows`` is the one rule they share.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_sampling", "sample_rows", "sample_size"]

_SAMPLE_SALT = 0x5EED_0F  # the sample's stream is not the rollout's or the mini-batch order's


def check_sampling(sample_fraction: object, every: object, where: str = "") -> None:
    """One ValueError naming the argument when ``sample_fraction`` is not a number in (0, 1] or ``every`` not an
    integer >= 1 (``where``: a prefix for the names, such as ``monitor.``)."""
    if (isinstance(sample_fraction, bool) or not isinstance(sample_fraction, (int, float))
            or not math.isfinite(sample_fraction) or not 0 < sample_fraction <= 1):
        raise ValueError(f"{where}sample_fraction must be a number in (0, 1] (the fraction of each step's sequences "
                         f"rescored), got {sample_fraction!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{where}every must be an integer >= 1 (rescore every that many steps), got {every!r}")


def sample_size(n: int, sample_fraction: float) -> int:
    """Sequences rescored of a step of ``n``: ``sample_fraction`` x n rounded to the nearest, at least one (none of
    an empty step)."""
    return min(n, max(1, round(sample_fraction * n))) if n else 0


def sample_rows(n: int, sample_fraction: float, every: int, seed: int, step: int) -> list[int] | None:
    """The rows (ascending) of a step of ``n`` sequences to rescore, or None when ``step`` is not a multiple of
    ``every`` (no rescoring, no mismatch metrics that step). Whole sequences, ``sample_size`` of them, drawn
    without replacement from a generator seeded by (``seed``, ``step``) alone: the same call gives the same rows in
    any process. ``sample_fraction`` 1 is every row, ``list(range(n))``."""
    check_sampling(sample_fraction, every)
    if step % every:
        return None
    k = sample_size(n, sample_fraction)
    if k == n:
        return list(range(n))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + _SAMPLE_SALT) & 0x7FFFFFFFFFFF)
    return sorted(torch.randperm(n, generator=gen)[:k].tolist())
