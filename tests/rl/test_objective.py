"""Advantages and the PPO loss on hand-built numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vexact.rl.config_schema import AlgorithmSection, CorrectionSection
from vexact.rl.metrics import LOG_RATIO_BOUND
from vexact.rl.objective import (
    Anchors,
    Objective,
    RunStopped,
    aggregate,
    compute_advantages,
    k3_penalty,
    ppo_token_loss,
)


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


def test_ppo_ratio_is_clamped_as_verls():
    """The log-ratio is clamped to ±log_ratio_bound before exp, as verl's compute_policy_loss_vanilla (±20). A
    log-ratio past ~88.7 overflowed the float32 ratio to inf: the clipped branch's zero gradient times inf gave a NaN
    gradient (the run stopped on a non-finite gradient norm), and A = 0 gave a NaN loss."""
    logp = torch.tensor([-0.1, -0.1, -0.1], requires_grad=True)
    old = torch.tensor([-100.1, -0.1, 99.9])  # log-ratios 100, 0, -100
    loss, ratio = ppo_token_loss(logp, old, torch.tensor([1.0, 1.0, 1.0]), 0.2, 0.28)
    assert torch.equal(ratio.detach(), torch.exp(torch.tensor([20.0, 0.0, -20.0])))
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.tensor([0.0, -1.0, 0.0]))  # clipped, plain, clamped: no NaN
    loss, _ = ppo_token_loss(logp, old, torch.zeros(3), 0.2, 0.28)
    assert bool(torch.isfinite(loss).all())
    # inside the bound the clamp is the identity, bit for bit
    near = torch.tensor([19.5, -19.5, 1e-7])
    assert torch.equal(ppo_token_loss(near, torch.zeros(3), torch.ones(3), 0.2, 0.28)[1], torch.exp(near))

    # the bound is correction.log_ratio_bound, through the objective: no RunStopped, the ratio's log at the bound
    for bound in (LOG_RATIO_BOUND, 5.0):
        objective = Objective(AlgorithmSection(), CorrectionSection(log_ratio_bound=bound), 1.0, exact_training=False)
        logp = torch.tensor([-1.0, -1.0], requires_grad=True)
        rollout = torch.tensor([-101.0, -1.0])
        batch = SimpleNamespace(responses=[[1, 2]], logprobs=[rollout])
        for adv in (1.0, 0.0):
            out = objective.loss_of(batch, [0], [logp], [torch.zeros(2)], torch.tensor([adv]),
                                    Anchors([rollout], None, None), False)
            (grad,) = torch.autograd.grad(out.loss, logp)
            assert bool(torch.isfinite(grad).all()) and bool(torch.isfinite(out.loss))
            assert out.stats["actor/ratio_max"] == pytest.approx(math.exp(bound), rel=1e-6)


def test_a_non_finite_loss_stops_the_run_with_its_value_and_no_warning():
    """The RunStopped message read the loss with float() while it required grad: a UserWarning, an error under
    ``-W error``, instead of the recorded stop."""
    import warnings

    objective = Objective(AlgorithmSection(), CorrectionSection(), 1.0, exact_training=False)
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    batch = SimpleNamespace(responses=[[1, 2]], logprobs=[logp.detach()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RunStopped, match=r"non-finite loss \(nan\)"):
            objective.loss_of(batch, [0], [logp], [torch.zeros(2)], torch.tensor([float("nan")]),
                              Anchors([logp.detach()], None, None), False)


def test_a_bypass_losss_clip_flag_belongs_to_its_name_and_its_signature_is_checked_at_registration():
    """``clips=False`` under another name for ppo_clip's function left ppo_clip's own clip fractions at 0 (the flag
    was stored on the function); a loss with the old six-argument signature failed mid-run (a TypeError in the
    loss), a bound method at registration (no attribute to set): the flag is the name's, the signature is checked
    when the loss is registered, and a bound method of seven arguments registers."""
    from vexact.rl.objective import UNCLIPPED_BYPASS_LOSSES, _bypass_ppo_clip, register_bypass_loss
    from vexact.rl.registries import BYPASS_LOSSES

    class Loss:
        def loss(self, alg, logp, old, adv, pre, weights, log_ratio_bound):
            return _bypass_ppo_clip(alg, logp, old, adv, pre, weights, log_ratio_bound)

    def six(alg, logp, old, adv, pre, weights):
        return logp, logp

    try:
        register_bypass_loss("test_clip_alias", _bypass_ppo_clip, clips=False)
        assert "test_clip_alias" in UNCLIPPED_BYPASS_LOSSES and "ppo_clip" not in UNCLIPPED_BYPASS_LOSSES
        register_bypass_loss("test_method", Loss().loss)
        with pytest.raises(TypeError, match=r"^register_bypass_loss\('test_six'\): six must take the arguments \(alg, "
                                            r"logp, old, adv, pre, weights, log_ratio_bound\), its signature is "):
            register_bypass_loss("test_six", six)
        assert "test_six" not in BYPASS_LOSSES
    finally:
        for name in ("test_clip_alias", "test_method"):
            BYPASS_LOSSES.remove(name)
            UNCLIPPED_BYPASS_LOSSES.discard(name)
