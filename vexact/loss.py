"""GRPO-family advantages and the PPO clipped surrogate loss.

Everything here is a plain function of tensors, so it can be tested on hand-built numbers.
Notation: ``logp`` = current training-path log-probs (with grad), ``old_logp`` = the
behaviour log-probs the ratio is taken against (rollout-recorded or recomputed),
ratio = exp(logp - old_logp) per token.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ADVANTAGE_EPS = 1e-6


def compute_advantages(rewards: Tensor, group_size: int, kind: Literal["grpo", "rloo", "reinforce"],
                       std_normalize: bool = True) -> Tensor:
    """One advantage per sequence; ``rewards`` [N] with each prompt's ``group_size`` samples adjacent.

    - ``grpo``: (r - group mean), divided by (group std + eps) if ``std_normalize``.
    - ``rloo``: r - mean of the *other* samples of the group (leave-one-out baseline).
    - ``reinforce``: r - batch mean (a single baseline for the whole batch).
    ``std_normalize`` divides by the std of the same scope (group, or batch for reinforce);
    std is the unbiased sample std, as in verl's GRPO.
    """
    rewards = rewards.double()
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if kind == "reinforce":
        centred = rewards - rewards.mean()
        scale = rewards.std() if rewards.numel() > 1 else rewards.new_tensor(0.0)
        out = centred / (scale + ADVANTAGE_EPS) if std_normalize else centred
        return out.float()
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if kind == "grpo":
        centred = groups - mean
    elif kind == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        centred = (groups - mean) * group_size / (group_size - 1)
    else:
        raise ValueError(f"unknown advantage kind {kind!r}")
    if std_normalize:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        centred = centred / (std + ADVANTAGE_EPS)
    return centred.reshape(-1).float()


def ppo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float,
                   clip_high: float, ratio_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate (DAPO clip-higher): max(-A·ρ, -A·clip(ρ, 1-clip_low, 1+clip_high)).

    ρ = exp(logp - old_logp), times ``ratio_weight`` (detached) when given: the bypass-mode rollout correction
    puts its weight inside the ratio (``vexact/corrections.py``). All inputs are flat per-token tensors;
    returns (loss per token, ratio per token)."""
    ratio = torch.exp(logp - old_logp)
    if ratio_weight is not None:
        ratio = ratio * ratio_weight
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio


def aggregate(per_token: Tensor, lengths: list[int], mode: Literal["token_mean", "seq_mean"]) -> Tensor:
    """Reduce a flat per-token loss: mean over all tokens, or mean over sequences of their token mean."""
    if mode == "token_mean":
        return per_token.sum() / max(per_token.numel(), 1)
    if mode == "seq_mean":
        parts = [p.mean() for p in per_token.split(lengths) if p.numel()]
        return torch.stack(parts).mean() if parts else per_token.sum() * 0.0
    raise ValueError(f"unknown loss aggregation {mode!r}")


def k3_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(ref - logp) - (ref - logp) - 1 (≥ 0)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0
