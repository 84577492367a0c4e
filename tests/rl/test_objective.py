"""Advantages and the PPO loss on hand-built numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vexact.rl.config_schema import AlgorithmSection, CorrectionSection
from vexact.rl.metrics import LOG_RATIO_BOUND
from vexact.rl.objective import Anchors, Objective, aggregate, compute_advantages, k3_penalty, ppo_token_loss


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two groups of 3
    adv = compute_advantages(rewards, 3, "grpo", std_normalize=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    adv = compute_advantages(rewards, 3, "grpo", std_normalize=True)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    assert adv[:3].tolist() == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std], rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # an all-equal group carries no signal


def test_rloo_and_reinforce_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rloo = compute_advantages(rewards, 4, "rloo", std_normalize=False)
    assert rloo.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])  # r_i - mean(others)
    reinforce = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, "reinforce", std_normalize=False)
    assert reinforce.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages(rewards, 3, "grpo")


def test_ppo_clip_higher_hand_computed():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.9]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio = ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, ρ=1.5 > 1.28: clipped to 1.28 -> -1.28; A<0, ρ=0.5 < 0.8: max(0.5, 0.8) -> 0.8
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, 0.9], rel=1e-6)
    assert ratio.tolist() == pytest.approx([1.5, 0.5, 1.1, 0.9], rel=1e-6)


def test_ratio_one_gives_plain_policy_gradient():
    logp = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, ratio = ppo_token_loss(logp, logp.detach(), adv, 0.2, 0.28)
    assert torch.equal(ratio.detach(), torch.ones(3))
    loss.sum().backward()
    assert torch.equal(logp.grad, -adv)


def test_aggregation_modes():
    per_token = torch.tensor([1.0, 2.0, 3.0, 10.0])
    assert float(aggregate(per_token, [3, 1], "token_mean")) == 4.0
    assert float(aggregate(per_token, [3, 1], "seq_mean")) == 6.0  # mean(2, 10)


def test_k3_penalty_zero_at_equality_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3_penalty(a, a), torch.zeros(2))
    d = 0.3
    assert float(k3_penalty(torch.tensor([0.0]), torch.tensor([d]))) == pytest.approx(math.exp(d) - d - 1)


def _ppo_kl(bound: float) -> float:
    objective = Objective(AlgorithmSection(), CorrectionSection(log_ratio_bound=bound), 1.0, exact_training=False)
    logp = torch.tensor([-30.0, -1.0], requires_grad=True)
    old = torch.tensor([0.0, -1.0])
    batch = SimpleNamespace(responses=[[1, 2]], logprobs=[old])
    out = objective.loss_of(batch, [0], [logp], [torch.zeros(2)], torch.ones(1), Anchors([old], None, None), False)
    return out.stats["actor/ppo_kl"]


def test_log_ratio_bound_reaches_ppo_kl():
    assert _ppo_kl(LOG_RATIO_BOUND) == pytest.approx(20.0 / 2)
    assert _ppo_kl(5.0) == pytest.approx(5.0 / 2)
