"""Rollout corrections on hand-built ratios: each method's weights, masks and metrics, and the zero-mismatch no-op."""

from __future__ import annotations

import math

import pytest
import torch

from vexact.registry import PluginCodeError
from vexact.rl.config import ConfigError, config_from_dict
from vexact.rl.config_schema import CorrectionSection
from vexact.rl.corrections import (
    CORRECTION_METHODS,
    PRESETS,
    CorrectionMethod,
    RejectOption,
    plan_for,
    register_correction_method,
    rollout_correction,
)
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
    assert m["correction/truncated_token_frac"] == 1 / 5
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # raw 3.0 > 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # raw 0.25 < 1/2
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.25 / 5)
    ws = torch.tensor([1.0, 2.0, 0.25, 1.5, 0.5], dtype=torch.float64)
    ess = 1.0 / float((ws / (ws.mean() + 1e-8)).square().mean())  # verl's form: 1 / E[(w / (E[w] + eps))²]
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-8)
    assert m["correction/weight_eff_sample_size"] == pytest.approx(float(ws.sum() ** 2 / (5 * ws.square().sum())))
    assert m["correction/rejected_token_frac"] == 0.0
    # per-row mean weights: (1 + 2 + 0.25) / 3 and (1.5 + 0.5) / 2; std over rows with ddof 1, as torch.std
    rows = torch.tensor([3.25 / 3, 1.0], dtype=torch.float64)
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx(float(rows.mean()))
    assert m["rollout_corr/rollout_is_seq_std"] == pytest.approx(float(rows.std(correction=1)))
    assert not any(k.startswith("rollout_corr/rollout_rs") for k in m)  # no rejection configured


def test_seq_tis_uses_the_product_per_sequence():
    train = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0], dtype=torch.float64).log()  # ρ_seq = 8 and 0.5
    c = rollout_correction(train, torch.zeros(5, dtype=torch.float64), LENGTHS,
                           CorrectionSection(method="seq_tis", threshold=3.0))
    assert c.weights.tolist() == pytest.approx([3.0, 3.0, 3.0, 0.5, 0.5], rel=1e-12)
    assert c.metrics["correction/truncated_token_frac"] == 3 / 5  # the three tokens of the truncated seq
    assert c.metrics["rollout_corr/rollout_is_max"] == pytest.approx(8.0)  # verl: the raw sequence ratio
    assert c.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)  # counted over sequences
    assert c.metrics["rollout_corr/rollout_is_mean"] == pytest.approx(10.0 / 5)  # token mean of applied weights


def test_sequence_ratio_clamps_only_the_sum():
    """verl clamps Σ_t r_t to ±20, not each r_t: +100 and -100 cancel to a ratio of exactly 1."""
    train = torch.tensor([100.0, -100.0], dtype=torch.float64)
    c = rollout_correction(train, torch.zeros(2, dtype=torch.float64), [2],
                           CorrectionSection(rollout_is="sequence", rollout_is_threshold=2.0))
    assert c.weights.tolist() == [1.0, 1.0]
    assert c.metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.0)


def test_token_mis_masks_tokens_above_threshold():
    w, keep, m = _correct("token_mis", threshold=2.0)
    assert keep == [True, False, True, True, True]
    assert w == pytest.approx([1.0, 0.0, 0.25, 1.5, 0.5], rel=1e-12)  # kept tokens keep ρ, masked get 0
    assert m["correction/rejected_token_frac"] == 1 / 5
    assert m["correction/rejected_seq_frac"] == 0.0  # no sequence lost every token
    # verl: the fraction of sequences with any masked token
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # verl's IS stats run over all tokens, the rejected one counting with its truncated weight 2.0
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.25 / 5)


def test_seq_mis_rejects_whole_sequences():
    train = torch.tensor([2.0, 2.0, 2.0, 0.5, 1.0], dtype=torch.float64).log()
    c = rollout_correction(train, torch.zeros(5, dtype=torch.float64), LENGTHS,
                           CorrectionSection(method="seq_mis", threshold=2.0))
    assert c.keep.tolist() == [False, False, False, True, True]
    assert c.weights.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.5], rel=1e-12)
    assert c.metrics["correction/rejected_seq_frac"] == 0.5
    assert c.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert c.metrics["rollout_corr/rollout_rs_seq_sum_k1_seq_max"] == pytest.approx(math.log(2.0))  # -log 0.5


def test_icepop_zeroes_weights_outside_the_band_and_keeps_the_tokens():
    w, keep, m = _correct("icepop")  # default band [0.5, 5.0]: 0.25 is out, 3.0 in
    assert all(keep)  # verl: IcePop zeroes the weight; the token stays in the loss's denominator
    assert w == pytest.approx([1.0, 3.0, 0.0, 1.5, 0.5], rel=1e-12)
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(6.0 / 5)  # the zero counts
    assert m["correction/zeroed_token_frac"] == 1 / 5
    w, _, _ = _correct("icepop", band=(0.6, 2.0))
    assert w == pytest.approx([1.0, 0.0, 0.0, 1.5, 0.0], rel=1e-12)


def test_geo_rs_rejects_on_the_geometric_mean():
    # seq 0: geometric mean (0.75)^(1/3) ≈ 0.909; seq 1: sqrt(0.75) ≈ 0.866
    w, keep, m = _correct("geo_rs", band=(0.9, 1.1))
    assert keep == [True, True, True, False, False]
    assert w == [1.0, 1.0, 1.0, 0.0, 0.0]  # rejection only: no importance weight on the kept tokens
    assert m["correction/rejected_seq_frac"] == 0.5
    _, keep, _ = _correct("geo_rs")  # default band [0.999, 1.001] rejects both
    assert not any(keep)


def test_batch_normalize_gives_mean_one_and_logs_the_factor():
    w, keep, m = _correct("token_tis", threshold=2.0, batch_normalize=True)
    assert sum(w) / len(w) == pytest.approx(1.0, rel=1e-12)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(5.25 / 5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.25 / 5)  # verl logs it before normalising
    assert m["correction/weight_mean"] == pytest.approx(1.0, rel=1e-12)  # vexact: what the loss applied


def test_verl_vocabulary_and_presets_resolve_to_one_plan():
    assert plan_for(CorrectionSection(method="token_tis", threshold=3.0)) == plan_for(CorrectionSection(
        rollout_is="token", rollout_is_threshold=3.0, rollout_is_batch_normalize=False, loss_type="ppo_clip_is"))
    icepop = plan_for(CorrectionSection(preset="decoupled_token_icepop"))
    assert (icepop.rollout_is, icepop.is_lower, icepop.is_upper, icepop.bypass_mode) == ("token", 0.5, 5.0, False)
    k3 = plan_for(CorrectionSection(preset="bypass_ppo_clip_k3_rs", rollout_rs_threshold=0.05))  # key overrides
    assert k3.reject == (RejectOption("seq_mean_k3", None, 0.05),) and k3.loss_type == "ppo_clip"
    rs = plan_for(CorrectionSection(rollout_rs="token_k1, seq_max_k2,token_k1", rollout_rs_threshold="0.5_2,0.1"))
    assert rs.reject == (RejectOption("token_k1", 0.5, 2.0), RejectOption("seq_max_k2", None, 0.1))
    assert plan_for(CorrectionSection(rollout_rs="seq_sum_k1", rollout_rs_threshold=4)).reject == (
        RejectOption("seq_sum_k1", 0.25, 4.0),)  # one number U on a k1 option: ratio bounds [1/U, U]
    assert set(PRESETS) >= {"decoupled_token_is", "decoupled_geo_rs", "bypass_pg_is", "bypass_ppo_clip"}


def test_rejection_options_combine_by_and():
    # token_k2 keeps (log ρ)²/2 <= 0.2: rejects ρ = 3.0 (0.60), 0.25 (0.96) and 0.5 (0.24); seq_max_k3 <= 0.5
    # rejects the first sequence (max k3 = 3 - 1 - log 3 ≈ 0.90) and keeps the second (max k3 ≈ 0.19 at ρ = 0.5)
    train = torch.tensor(RHO, dtype=torch.float64).log()
    c = rollout_correction(train, torch.zeros(5, dtype=torch.float64), LENGTHS,
                           CorrectionSection(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.2,0.5"))
    assert c.keep.tolist() == [False, False, False, True, False]
    m = c.metrics
    assert m["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_max_k3_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_max_k3_max"] == pytest.approx(2.0 - math.log(3.0))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert not c.reweights and c.weights.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_bypass_loss_types():
    """ppo_clip ignores the IS weights (verl: the ratio π_θ/μ is the correction), reinforce is -A·w·log π_θ,
    ppo_clip_is puts w inside the ratio; decoupled multiplies the clipped loss by w."""
    from vexact.rl.config_schema import AlgorithmSection
    from vexact.rl.objective import Objective

    train = torch.tensor(RHO, dtype=torch.float64).log()
    logp = train + 0.1
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    roll = torch.zeros(5, dtype=torch.float64)
    plain, _ = ppo_token_loss(logp, roll, adv, 0.2, 0.28)
    for loss_type, old_logprobs in (("ppo_clip", "rollout"), ("reinforce", "rollout"), ("ppo_clip_is", "rollout"),
                                    (None, "recompute")):
        cfg = CorrectionSection(rollout_is="token", rollout_is_threshold="0.5_5.0", loss_type=loss_type)
        objective = Objective(AlgorithmSection(old_logprobs=old_logprobs), cfg, 1.0, exact_training=True)
        c = rollout_correction(train, roll, LENGTHS, cfg)
        anchor = roll if old_logprobs == "rollout" else train
        per_token, _ = objective._pg_loss(logp, anchor, adv, train, c)
        if loss_type == "ppo_clip":
            expected = plain
        elif loss_type == "reinforce":
            expected = -adv * c.weights * logp
        elif loss_type == "ppo_clip_is":
            inside, _ = ppo_token_loss(logp, train, adv, 0.2, 0.28, ratio_weight=c.weights)
            expected = torch.where(c.weights > 0, inside, torch.zeros_like(inside))
        else:
            expected = ppo_token_loss(logp, train, adv, 0.2, 0.28)[0] * c.weights
        assert torch.equal(per_token, expected), loss_type
    assert c.weights[2] == 0.0  # the IcePop-zeroed token: no loss, but it stays in the token-mean's denominator


def _bypass_loss_of(cfg: CorrectionSection, logp: torch.Tensor, roll: torch.Tensor, adv: list[float],
                    entropy: torch.Tensor | None = None, reference: torch.Tensor | None = None, **alg):
    """``Objective.loss_of`` in bypass mode on one flat batch of LENGTHS sequences (advantage per sequence; the
    entropy per token, 0.5 by default; the KL reference's log-probs, if any)."""
    from types import SimpleNamespace

    from vexact.rl.config_schema import AlgorithmSection
    from vexact.rl.objective import Anchors, Objective

    objective = Objective(AlgorithmSection(old_logprobs="rollout", **alg), cfg, 1.0, exact_training=False)
    logps = [t.detach().clone().requires_grad_(True) for t in logp.split(LENGTHS)]
    rolls = list(roll.split(LENGTHS))
    entropy = torch.full_like(logp, 0.5) if entropy is None else entropy
    entropies = [t.detach().clone().requires_grad_(True) for t in entropy.split(LENGTHS)]
    refs = None if reference is None else list(reference.split(LENGTHS))
    batch = SimpleNamespace(responses=[[0] * n for n in LENGTHS], logprobs=rolls)
    out = objective.loss_of(batch, [0, 1], logps, entropies, torch.tensor(adv, dtype=logp.dtype),
                            Anchors(rolls, None, refs), False)
    return out, logps, entropies


@pytest.mark.parametrize("cfg", [CorrectionSection(loss_type="reinforce"), CorrectionSection(preset="bypass_pg_geo_rs",
                                                                                              rollout_rs_threshold=2.0)],
                         ids=["loss_type_alone", "bypass_pg_geo_rs"])
def test_reinforce_without_is_weights_is_plain_reinforce(cfg):
    """``loss_type: reinforce`` with no ``rollout_is`` (the key alone, or verl's rejection-only presets) is verl's
    ``compute_policy_loss_reinforce`` with ``rollout_is_weights=None``: -A·log π_θ, no clip. It trained with the
    PPO-clip loss, because the bypass loss was chosen only when the correction reweighted."""
    roll = torch.tensor(RHO, dtype=torch.float64).log() - 1.0
    logp = roll + 0.5  # ρ = e^0.5 > 1 + clip_high: PPO would clip every token (A > 0) and give no gradient
    out, logps, _ = _bypass_loss_of(cfg, logp, roll, [1.0, 2.0])
    adv = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    assert torch.equal(out.loss, (-adv * logp).sum() / 5)
    (out.loss).backward()
    assert torch.equal(torch.cat([t.grad for t in logps]), -adv / 5)


@pytest.mark.parametrize("method", [m for m in CORRECTION_METHODS.names() if m != "none"])
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
    # lengths summing right with a negative one failed inside torch; integer log-probs gave integer weights
    with pytest.raises(ValueError, match=r"lengths must be token counts \(ints >= 0\), got \[4, -1\]"):
        rollout_correction(torch.zeros(3), torch.zeros(3), [4, -1], CorrectionSection(method="token_tis"))
    with pytest.raises(ValueError, match="logp_train must be a floating-point tensor of log-probs, got torch.int64"):
        rollout_correction(torch.tensor([-1, -2]), torch.tensor([-2.0, -2.0]), [2],
                           CorrectionSection(method="token_tis"))
    with pytest.raises(ConfigError, match="correction.band"):
        config_from_dict({"correction": {"method": "token_tis", "band": [0.5, 2.0]}})
    with pytest.raises(ConfigError, match="lower < upper"):
        config_from_dict({"correction": {"method": "icepop", "band": [2.0, 0.5]}})
    with pytest.raises(ConfigError, match="correction.threshold"):
        config_from_dict({"correction": {"method": "token_tis", "threshold": 0.5}})
    with pytest.raises(ConfigError, match="correction.method"):
        config_from_dict({"correction": {"method": "tis"}})
    with pytest.raises(ConfigError, match="correction.method.*one vocabulary"):
        config_from_dict({"correction": {"method": "icepop", "rollout_is": "token"}})
    with pytest.raises(ConfigError, match="correction.rollout_is_threshold.*lower_upper"):
        config_from_dict({"correction": {"rollout_is": "token", "rollout_is_threshold": "a_b"}})
    for infinite in ("inf", "0.5_inf", "1e400"):  # sequence level: log(1 / inf) mid-run, after the check passed
        with pytest.raises(ConfigError, match=r"correction.rollout_is_threshold.*must be finite"):
            config_from_dict({"correction": {"rollout_is": "sequence", "rollout_is_threshold": infinite}})
    with pytest.raises(ConfigError, match="correction.rollout_rs.*token_k9"):
        config_from_dict({"correction": {"rollout_rs": "token_k9", "rollout_rs_threshold": 1.0}})
    with pytest.raises(ConfigError, match="correction.rollout_rs_threshold.*needs"):
        config_from_dict({"correction": {"rollout_rs": "token_k1"}})
    with pytest.raises(ConfigError, match="correction.rollout_rs_threshold.*3 values for 2"):
        config_from_dict({"correction": {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "1,2,3"}})
    with pytest.raises(ConfigError, match="correction.rollout_rs_threshold.*seq_mean_k3"):
        config_from_dict({"correction": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.1_0.2"}})
    with pytest.raises(ConfigError, match="correction.preset.*unknown preset"):
        config_from_dict({"correction": {"preset": "tis"}})
    with pytest.raises(ConfigError, match="correction.preset.*old_logprobs: recompute"):
        config_from_dict({"correction": {"preset": "decoupled_token_is"}})  # the default anchor is bypass
    with pytest.raises(ConfigError, match="correction.loss_type.*bypass"):
        config_from_dict({"correction": {"loss_type": "reinforce"}, "algorithm": {"old_logprobs": "recompute"}})
    config_from_dict({"correction": {"preset": "decoupled_token_is"}, "algorithm": {"old_logprobs": "recompute"}})


ZERO_CASES = ([CorrectionSection(method=m) for m in CORRECTION_METHODS.names() if m != "none"]
              + [CorrectionSection(preset=p) for p in sorted(PRESETS) if p != "disabled"]
              + [CorrectionSection(rollout_is=level, rollout_rs=rs, rollout_rs_threshold=threshold)
                 for level in ("token", "sequence")
                 for rs, threshold in (("token_k1,token_k2,token_k3", "0.8_1.25,0.02,0.02"),
                                       ("seq_sum_k1,seq_sum_k2,seq_sum_k3", "0.5_2.0,0.1,0.1"),
                                       ("seq_mean_k1,seq_mean_k2,seq_mean_k3", "0.9_1.1,0.01,0.01"),
                                       ("seq_max_k2,seq_max_k3", "0.05,0.05"))])
ZERO_CASES = [c for c in ZERO_CASES if plan_for(c).active]  # bypass_ppo_clip corrects nothing: no statistics


@pytest.mark.parametrize("cfg", ZERO_CASES, ids=lambda c: c.method if c.method != "none" else c.preset or c.rollout_rs)
def test_zero_mismatch_gives_every_dispersion_statistic_exactly_zero(cfg):
    """ρ ≡ 1 bit for bit: every rollout_corr/* std and deviation is 0.0, not ~sqrt(1e-8 / N) (what dividing by
    count + 1e-8 in float64 gives: 3.3e-6 at 934 tokens). verl's pipeline passes an integer response mask, so its
    count + 1e-8 is float32 and equals the count; vexact computes it so (tests/integrations/test_verl_parity.py
    compares)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [500, 1, 299, 134]  # 934 tokens, no empty row (verl counts an empty row's mean as 0: not a no-op)
    roll = -torch.rand(sum(lengths), generator=gen) * 3
    c = rollout_correction(roll.clone(), roll, lengths, cfg)
    spread = {k: v for k, v in c.metrics.items()
              if k.startswith("rollout_corr/") and (k.endswith("_std") or k.endswith("_deviation"))}
    assert spread, "no dispersion statistic logged: the check would pass vacuously"
    assert {k: v for k, v in spread.items() if v != 0.0} == {}
    means = {k: v for k, v in c.metrics.items() if k.startswith("rollout_corr/rollout_is") and k.endswith("mean")}
    assert all(v == 1.0 for v in means.values()), means


def test_old_logprobs_is_the_one_key_and_verls_bypass_mode_is_read_into_it():
    """Where the old log-probs come from is ``algorithm.old_logprobs`` alone; verl's ``correction.bypass_mode`` (file,
    ``--set``) is read into it with a FutureWarning naming the key, its null is "not given" (configs saved before
    the rename hold it), and the config stores only the canonical key."""
    import warnings

    from vexact.map.naming import correction_from_config
    from vexact.rl.config_spellings import RENAMED_KEYS

    assert RENAMED_KEYS["correction.bypass_mode"].new == "algorithm.old_logprobs"
    for bypass, old in ((True, "rollout"), (False, "recompute")):
        with pytest.warns(FutureWarning, match="'correction.bypass_mode' is deprecated; use 'algorithm.old_logprobs'"):
            cfg = config_from_dict({"correction": {"bypass_mode": bypass}})
        assert cfg.algorithm.old_logprobs == old and "bypass_mode" not in cfg.to_dict()["correction"]
        with pytest.warns(FutureWarning, match="deprecated"):
            assert config_from_dict({}, [f"correction.bypass_mode={str(bypass).lower()}"]).algorithm.old_logprobs == old
        with pytest.warns(FutureWarning):  # both keys, agreeing: accepted
            assert config_from_dict({"correction": {"bypass_mode": bypass},
                                     "algorithm": {"old_logprobs": old}}).algorithm.old_logprobs == old
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a saved config.yaml from before the rename: null, no warning
        assert config_from_dict({"correction": {"bypass_mode": None}}) == config_from_dict({})
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="correction.bypass_mode.*keep only"):
        config_from_dict({"correction": {"bypass_mode": True}, "algorithm": {"old_logprobs": "recompute"}})
    with pytest.raises(ConfigError, match="'correction.bypass_mode': expected true or false .or null., got 'yes'"):
        config_from_dict({"correction": {"bypass_mode": "yes"}})
    with pytest.raises(ConfigError, match="'correction.bypass_mode': expected true or false.*got 1.*--set"):
        config_from_dict({}, ["correction.bypass_mode=1"])
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="same key"):
        config_from_dict({}, ["correction.bypass_mode=false", "algorithm.old_logprobs=recompute"])
    with pytest.warns(FutureWarning):  # a preset's mode is held to the canonical key, spelled either way
        config_from_dict({"correction": {"preset": "decoupled_token_is", "bypass_mode": False}})
    # the map names a run from either spelling the same way; verl's own block keeps verl's key
    with pytest.warns(FutureWarning):
        assert correction_from_config({"correction": {"bypass_mode": False}}) == "recompute"
    assert correction_from_config({"algorithm": {"old_logprobs": "recompute"}, "correction": {"bypass_mode": None}}
                                  ) == "recompute"
    assert correction_from_config({"algorithm": {"rollout_correction": {"bypass_mode": True}}}) == "bypass"
    assert correction_from_config({"algorithm": {"rollout_correction": {"rollout_is": "token"}}}) == "token_tis"
    with pytest.raises(ValueError, match="bypass_mode must be true or false"):
        correction_from_config({"algorithm": {"rollout_correction": {"bypass_mode": "yes"}}})


def test_rejected_tokens_leave_the_entropy_and_kl_terms():
    """A rejected token leaves every term of the loss: the entropy bonus and the KL penalty too, each aggregated by
    ``loss_agg`` over the kept tokens (verl's agg_loss on the rejection-rewritten response_mask). The entropy
    bonus was the token mean over every token, rejected ones included, so a step whose tokens were all rejected
    still had a gradient."""
    roll = torch.tensor(RHO, dtype=torch.float64).log() - 1.0
    logp = roll + torch.tensor([0.4, 0.4, 0.4, 0.0, 0.0], dtype=torch.float64)  # ρ_seq = e^1.2 > 2, then 1
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.8], dtype=torch.float64)
    reference = roll - 0.25
    alg = {"entropy_coef": 0.1, "kl_coef": 0.05, "loss_agg": "seq_mean"}
    out, logps, entropies = _bypass_loss_of(CorrectionSection(method="seq_mis"), logp, roll, [1.0, -1.0], entropy,
                                            reference, **alg)
    assert out.stats["correction/rejected_seq_frac"] == 0.5  # the first sequence
    out.loss.backward()
    # seq_mean over the one kept sequence of two tokens: each kept token's entropy weighs 0.1 / 2
    assert torch.equal(torch.cat([t.grad for t in entropies]),
                       torch.tensor([0.0, 0.0, 0.0, -0.05, -0.05], dtype=torch.float64))
    assert torch.equal(logps[0].grad, torch.zeros(3, dtype=torch.float64))
    kl_kept = torch.exp(-0.25 - logp[3:] + roll[3:]) - (-0.25 - logp[3:] + roll[3:]) - 1.0
    assert out.stats["actor/kl_loss"] == pytest.approx(float(kl_kept.mean()), rel=1e-12)
    assert float(out.loss.detach()) == pytest.approx(out.stats["actor/pg_loss"] + 0.05 * float(kl_kept.mean())
                                            - 0.1 * 0.6, rel=1e-12)  # actor/pg_loss: the policy-gradient term alone

    # every token rejected: the loss is 0 and nothing has a gradient, the entropy bonus included
    out, logps, entropies = _bypass_loss_of(CorrectionSection(method="seq_mis"), roll + 1.0, roll, [1.0, -1.0],
                                            entropy, reference, **alg)
    assert out.stats["correction/rejected_token_frac"] == 1.0
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (*logps, *entropies))


def test_reinforce_reports_no_clipping():
    """The bypass REINFORCE loss never clips (every token keeps its gradient), so its actor/pg_clipfrac* are 0; they
    counted the tokens a PPO clip would have clipped. The ratio statistics stay."""
    roll = torch.tensor(RHO, dtype=torch.float64).log() - 1.0
    logp = roll + 0.5  # ρ = e^0.5 = 1.65 > 1 + clip_high on every token, A > 0
    for cfg in (CorrectionSection(preset="bypass_pg_is"), CorrectionSection(loss_type="reinforce")):
        out, logps, _ = _bypass_loss_of(cfg, logp, roll, [1.0, 1.0])
        assert (out.stats["actor/pg_clipfrac"], out.stats["actor/pg_clipfrac_high"],
                out.stats["actor/pg_clipfrac_low"]) == (0.0, 0.0, 0.0), cfg
        assert out.stats["actor/ratio_min"] == pytest.approx(math.exp(0.5), rel=1e-12)
        out.loss.backward()
        assert all(bool((t.grad != 0).all()) for t in logps)  # nothing was clipped
    out, _, _ = _bypass_loss_of(CorrectionSection(loss_type="ppo_clip"), logp, roll, [1.0, 1.0])
    assert out.stats["actor/pg_clipfrac_high"] == 1.0  # the PPO clip does clip them


def test_weight_ess_is_zero_when_every_kept_weight_is_zero_as_documented():
    """IcePop zeroing every token logs correction/weight_eff_sample_size 0.0; its definition said (0, 1]."""
    from vexact.metric_keys import KEYS

    c = rollout_correction(torch.zeros(2), torch.full((2,), -3.0), [2], CorrectionSection(method="icepop"))
    assert c.metrics["correction/weight_eff_sample_size"] == 0.0  # ρ = e^3 = 20 > 5 on both tokens
    (key,) = [k for k in KEYS if k.name == "correction/weight_eff_sample_size"]
    assert "[0, 1]" in key.definition and "0 when every kept weight is 0" in key.definition


def test_batch_norm_factor_is_written_only_with_batch_normalisation_as_documented():
    """rollout_corr/rollout_is_batch_norm_factor was documented "(1 when off)" but is not written when batch
    normalisation is off; with it on, it is 1 when every weight is zeroed (nothing to divide by)."""
    from vexact.metric_keys import KEYS

    key = "rollout_corr/rollout_is_batch_norm_factor"
    roll, logp = torch.full((2,), -3.0), torch.zeros(2)  # ρ = e^3 = 20 > 5: IcePop zeroes both tokens
    assert key not in rollout_correction(logp, roll, [2], CorrectionSection(method="icepop")).metrics
    on = rollout_correction(logp, roll, [2], CorrectionSection(method="icepop", batch_normalize=True))
    assert on.metrics[key] == 1.0
    (entry,) = [k for k in KEYS if k.name == key]
    assert "when off" not in entry.definition and "written only with `correction.batch_normalize`" in entry.definition


@pytest.mark.parametrize("returned, problem", [
    ({"rollout_is": "tokens", "rollout_is_threshold": 2.0}, "returned rollout_is: 'tokens': expected one of"),
    ({"rollout_is": "token", "rollout_is_treshold": 1.5}, "returned the key 'rollout_is_treshold': expected verl keys"),
    ({"rollout_is": "token", "rollout_is_batch_normalize": "no"},
     "returned rollout_is_batch_normalize: 'no': expected a boolean"),
    ([("rollout_is", "token")], "returned [('rollout_is', 'token')]: expected a dict of verl keys"),
    (None, "returned None: expected a dict"),
])
def test_an_outside_methods_verl_keys_are_held_to_the_configs_checks(returned, problem):
    """What a method's ``to_verl`` returns passes the checks the config puts on verl's keys: a misspelt value or
    key, or a string for a bool, is one error naming the method and the key, not another plan than the one meant."""
    register_correction_method(CorrectionMethod("outside_m", "x", "x", lambda cfg: returned))
    try:
        with pytest.raises(ConfigError) as err:
            config_from_dict({"correction": {"method": "outside_m"}})
        assert err.value.key == "correction.method"
        assert err.value.problem.startswith("correction method 'outside_m' (to_verl) ")
        assert problem in err.value.problem
        with pytest.raises(PluginCodeError, match="correction method 'outside_m' \\(to_verl\\) returned"):
            plan_for(CorrectionSection(method="outside_m"))
    finally:
        CORRECTION_METHODS.remove("outside_m")


def test_an_outside_methods_good_keys_make_the_plan_a_builtin_would():
    register_correction_method(CorrectionMethod("outside_ok", "x", "x",
                                                lambda cfg: {"rollout_is": "token", "rollout_is_threshold": 2}))
    try:
        config_from_dict({"correction": {"method": "outside_ok"}})
        assert plan_for(CorrectionSection(method="outside_ok")) == plan_for(CorrectionSection(method="token_tis"))
    finally:
        CORRECTION_METHODS.remove("outside_ok")


def test_a_broken_method_is_refused_by_the_config_even_when_another_is_selected():
    """Every run logs ``mismatch/ratio_affected_frac/<method>`` of every registered method, resolving each one's
    default plan at each step: a method whose ``to_verl`` fails is refused when the config is validated, naming it
    and the key it would have filled, not a TypeError at the first step of a run that never selected it."""
    register_correction_method(CorrectionMethod("outside_broken", "x", "x", lambda cfg: None))
    try:
        for method in ("none", "token_tis"):
            with pytest.raises(ConfigError) as err:
                config_from_dict({"correction": {"method": method}})
            assert err.value.key == "correction.method"
            assert err.value.problem.startswith("correction method 'outside_broken' (to_verl) returned None")
            assert "mismatch/ratio_affected_frac/outside_broken" in err.value.problem
    finally:
        CORRECTION_METHODS.remove("outside_broken")
    config_from_dict({"correction": {"method": "none"}})


@pytest.mark.parametrize("band", [(0.999, 1.001), (0.5, 2.0), (0.8, 1.25), (0.9, 1.1), (0.75, 1.5), (0.3, 3.0)])
def test_geo_rs_keeps_both_edges_of_its_band(band):
    """The band [a, b] is inclusive: a sequence whose mean log-ratio is exactly log a or log b is kept, one a step
    outside is rejected; the cut is log a / log b itself, not log(1/b), log(1/a) (which rounding may move a step:
    [0.999, 1.001] rejected 1.001, [0.5, 2.0] kept 2.0 only by luck)."""
    cfg = CorrectionSection(method="geo_rs", band=band)
    for edge, outward in ((band[0], -math.inf), (band[1], math.inf)):
        r = math.log(edge)
        for log_ratio, kept in ((r, True), (math.nextafter(r, outward), False)):
            c = rollout_correction(torch.tensor([log_ratio], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                                   [1], cfg)
            assert c.keep.tolist() == [kept], (band, edge, log_ratio)


@pytest.mark.parametrize("method", ["token_mis", "seq_mis"])
@pytest.mark.parametrize("threshold", [2.0, 3.0, 1.1, 7.0, 1.001])
def test_mis_keeps_a_ratio_of_exactly_c(method, threshold):
    r = math.log(threshold)
    for log_ratio, kept in ((r, True), (math.nextafter(r, math.inf), False)):
        c = rollout_correction(torch.tensor([log_ratio], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), [1],
                               CorrectionSection(method=method, threshold=threshold))
        assert c.keep.tolist() == [kept], (threshold, log_ratio)


def test_seq_mis_judges_the_sequence_ratio_with_only_the_sum_clamped():
    """seq_mis rejects sequences with ρ_seq = exp(clamp(Σ_t r_t, ±B)) > C, the ratio its IS half truncates: r = [+25,
    −22] has ρ_seq = e³ > 2 and is rejected (clamping each r_t first gave Σ = −2 and kept it)."""
    train = torch.tensor([-1.0, -30.0], dtype=torch.float64)
    roll = torch.tensor([-26.0, -8.0], dtype=torch.float64)
    c = rollout_correction(train, roll, [2], CorrectionSection(method="seq_mis"))
    assert c.keep.tolist() == [False, False]
    assert c.metrics["rollout_corr/rollout_rs_seq_sum_k1_max"] == pytest.approx(-3.0, rel=1e-12)
    tis = rollout_correction(train, roll, [2], CorrectionSection(method="seq_tis"))
    assert tis.truncated.tolist() == [True, True]  # the same ratio, above C
    # a sum beyond ±B is clamped, as the IS weight's: exp(clamp(Σ r)) = e^20; and a big r_t that the sum cancels is kept
    big = rollout_correction(torch.tensor([30.0, -29.5], dtype=torch.float64), torch.zeros(2, dtype=torch.float64), [2],
                             CorrectionSection(method="seq_mis"))
    assert big.keep.tolist() == [True, True]  # ρ_seq = e^0.5 < 2
    # verl's own seq_sum_k1 keeps verl's per-token clamp
    verl = rollout_correction(train, roll, [2],
                              CorrectionSection(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_inf"))
    assert verl.keep.tolist() == [True, True]
