"""Rollout corrections on hand-built ratios: each method's weights, masks and metrics, and the zero-mismatch no-op."""

from __future__ import annotations

import math

import pytest
import torch

from vexact.rl.config import ConfigError, CorrectionSection, config_from_dict
from vexact.rl.corrections import METHODS, rollout_correction
from vexact.rl.objective import ppo_token_loss

# Two sequences: 3 tokens then 2 tokens. Token ratios ρ_t chosen by hand; logp_roll = 0 so logp_train = log ρ.
RHO = [1.0, 3.0, 0.25, 1.5, 0.5]
LENGTHS = [3, 2]
RHO_SEQ = [1.0 * 3.0 * 0.25, 1.5 * 0.5]  # 0.75, 0.75


def _correct(method: str, **kw) -> tuple[list[float], list[bool], dict]:
    train = torch.tensor(RHO, dtype=torch.float64).log()
    roll = torch.zeros(5, dtype=torch.float64)
    c = rollout_correction(train, roll, LENGTHS, CorrectionSection(method=method, **kw))
    return c.weights.tolist(), c.keep.tolist(), c.metrics


def test_token_tis_truncates_each_token_at_threshold():
    w, keep, m = _correct("token_tis", threshold=2.0)
    assert w == pytest.approx([1.0, 2.0, 0.25, 1.5, 0.5], rel=1e-12)
    assert all(keep)
    assert m["rollout_corr/rollout_is_truncated_frac"] == 1 / 5
    assert m["rollout_corr/rollout_is_ratio_frac_high"] == 1 / 5  # 3.0 > 2
    assert m["rollout_corr/rollout_is_ratio_frac_low"] == 1 / 5  # 0.25 < 1/2
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    ws = torch.tensor([1.0, 2.0, 0.25, 1.5, 0.5], dtype=torch.float64)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(float(ws.sum() ** 2 / (5 * ws.square().sum())))
    assert m["rollout_corr/rollout_rs_masked_token_frac"] == 0.0


def test_seq_tis_uses_the_product_per_sequence():
    train = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0], dtype=torch.float64).log()  # ρ_seq = 8 and 0.5
    c = rollout_correction(train, torch.zeros(5, dtype=torch.float64), LENGTHS,
                           CorrectionSection(method="seq_tis", threshold=3.0))
    assert c.weights.tolist() == pytest.approx([3.0, 3.0, 3.0, 0.5, 0.5], rel=1e-12)
    assert c.metrics["rollout_corr/rollout_is_truncated_frac"] == 3 / 5  # the three tokens of the truncated seq
    assert c.metrics["rollout_corr/rollout_is_seq_ratio_max"] == pytest.approx(8.0)


def test_token_mis_masks_tokens_above_threshold():
    w, keep, m = _correct("token_mis", threshold=2.0)
    assert keep == [True, False, True, True, True]
    assert w == pytest.approx([1.0, 0.0, 0.25, 1.5, 0.5], rel=1e-12)  # kept tokens keep ρ, masked get 0
    assert m["rollout_corr/rollout_rs_masked_token_frac"] == 1 / 5
    assert m["rollout_corr/rollout_rs_rejected_seq_frac"] == 0.0


def test_seq_mis_rejects_whole_sequences():
    train = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0], dtype=torch.float64).log()
    c = rollout_correction(train, torch.zeros(5, dtype=torch.float64), LENGTHS,
                           CorrectionSection(method="seq_mis", threshold=2.0))
    assert c.keep.tolist() == [False, False, False, True, True]
    assert c.weights.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.5], rel=1e-12)
    assert c.metrics["rollout_corr/rollout_rs_rejected_seq_frac"] == 0.5
    assert c.metrics["rollout_corr/rollout_rs_masked_token_frac"] == 3 / 5


def test_icepop_zeroes_tokens_outside_the_band():
    _, keep, _ = _correct("icepop")  # default band [0.5, 5.0]: 0.25 is out, 3.0 in
    assert keep == [True, True, False, True, True]
    _, keep, _ = _correct("icepop", band=(0.6, 2.0))
    assert keep == [True, False, False, True, False]


def test_geo_rs_rejects_on_the_geometric_mean():
    # seq 0: geometric mean (0.75)^(1/3) ≈ 0.909; seq 1: sqrt(0.75) ≈ 0.866
    w, keep, m = _correct("geo_rs", band=(0.9, 1.1))
    assert keep == [True, True, True, False, False]
    assert w == [1.0, 1.0, 1.0, 0.0, 0.0]  # rejection only: no importance weight on the kept tokens
    assert m["rollout_corr/rollout_rs_rejected_seq_frac"] == 0.5
    _, keep, _ = _correct("geo_rs")  # default band [0.999, 1.001] rejects both
    assert not any(keep)


def test_batch_normalize_gives_mean_one_over_kept_tokens():
    w, keep, m = _correct("token_tis", threshold=2.0, batch_normalize=True)
    assert sum(w) / len(w) == pytest.approx(1.0, rel=1e-12)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, rel=1e-12)
    w, keep, _ = _correct("token_mis", threshold=2.0, batch_normalize=True)
    kept = [x for x, k in zip(w, keep) if k]
    assert sum(kept) / len(kept) == pytest.approx(1.0, rel=1e-12) and w[1] == 0.0


def test_safety_clamp_bounds_extreme_log_ratios():
    train = torch.tensor([100.0, -100.0], dtype=torch.float64)
    c = rollout_correction(train, torch.zeros(2, dtype=torch.float64), [2], CorrectionSection(method="icepop",
                                                                                               band=(0.0, 1e30)))
    assert c.weights.tolist() == pytest.approx([math.exp(20.0), math.exp(-20.0)], rel=1e-12)
    assert c.metrics["rollout_corr/rollout_is_seq_ratio_max"] == pytest.approx(1.0)  # 20 + (-20), clamped ±20


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_mismatch_every_correction_is_exact_no_op(method, dtype):
    """ρ ≡ 1 bit for bit ⇒ weights exactly 1, nothing rejected, and the loss and its gradient are bitwise those
    of no correction, in both the decoupled (weight outside) and bypass (weight inside the ratio) forms."""
    if method == "geo_rs":
        kwargs = {"band": (0.999, 1.001)}
    else:
        kwargs = {}
    gen = torch.Generator().manual_seed(0)
    lengths = [500, 1, 0, 299]  # > 256 tokens: a bf16 running sum of ones would no longer be exact
    roll = -torch.rand(800, generator=gen).to(dtype) * 3
    c = rollout_correction(roll.clone(), roll, lengths, CorrectionSection(method=method, batch_normalize=True,
                                                                          **kwargs))
    assert torch.equal(c.weights, torch.ones_like(roll)) and bool(c.keep.all())
    adv = torch.randn(800, generator=gen).to(dtype)
    logp = (roll + 0.01 * torch.randn(800, generator=gen).to(dtype)).requires_grad_()
    plain, _ = ppo_token_loss(logp, roll, adv, 0.2, 0.28)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    bypass, _ = ppo_token_loss(logp, roll.clone(), adv, 0.2, 0.28, ratio_weight=c.weights)
    (g_bypass,) = torch.autograd.grad(bypass.sum(), logp)
    decoupled = ppo_token_loss(logp, roll, adv, 0.2, 0.28)[0] * c.weights
    (g_decoupled,) = torch.autograd.grad(decoupled.sum(), logp)
    for loss, grad in ((bypass, g_bypass), (decoupled, g_decoupled)):
        assert torch.equal(loss, plain) and torch.equal(grad, g_plain)


def test_bad_inputs_and_config_errors():
    with pytest.raises(ValueError, match="lengths sum to 4"):
        rollout_correction(torch.zeros(5), torch.zeros(5), [4], CorrectionSection(method="token_tis"))
    with pytest.raises(ValueError, match="one shape"):
        rollout_correction(torch.zeros(5), torch.zeros(4), [5], CorrectionSection(method="token_tis"))
    with pytest.raises(ConfigError, match="correction.band"):
        config_from_dict({"correction": {"method": "token_tis", "band": [0.5, 2.0]}})
    with pytest.raises(ConfigError, match="lower < upper"):
        config_from_dict({"correction": {"method": "icepop", "band": [2.0, 0.5]}})
    with pytest.raises(ConfigError, match="correction.threshold"):
        config_from_dict({"correction": {"method": "token_tis", "threshold": 0.5}})
    with pytest.raises(ConfigError, match="correction.method"):
        config_from_dict({"correction": {"method": "tis"}})
