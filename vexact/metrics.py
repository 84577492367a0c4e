"""Mismatch metrics between rollout and training log-probs of the same tokens.

Names follow ``shared/REFERENCE.md`` (verl's ``rollout_corr/`` family) plus vexact's own.
Inputs are flat float tensors of per-token log-probs; r = logp_train - logp_roll.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mismatch_summary(logp_roll: Tensor, logp_train: Tensor) -> dict[str, float]:
    """Token-level mismatch stats: counts, bitwise-equal fraction, |Δlogp| mean/max, k1 and k3 KL."""
    roll, train = logp_roll.detach().double(), logp_train.detach().double()
    if roll.shape != train.shape:
        raise ValueError(f"log-prob shapes differ: rollout {tuple(roll.shape)} vs training {tuple(train.shape)}")
    n = roll.numel()
    if n == 0:
        return {"tokens": 0, "bitwise_equal": 0, "bitwise_equal_frac": float("nan"), "abs_dlogp_mean": float("nan"),
                "abs_dlogp_max": float("nan"), "kl": float("nan"), "k3_kl": float("nan")}
    r = train - roll
    equal = int((logp_roll.detach() == logp_train.detach()).sum())
    return {
        "tokens": n,
        "bitwise_equal": equal,
        "bitwise_equal_frac": equal / n,
        "abs_dlogp_mean": float(r.abs().mean()),
        "abs_dlogp_max": float(r.abs().max()),
        "kl": float((roll - train).mean()),
        "k3_kl": float((torch.exp(r) - r - 1).mean()),
    }
