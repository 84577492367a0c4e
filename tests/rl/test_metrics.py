"""Metric functions on tiny inputs with hand-computed expected values (Python floats, stated in each test)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from vexact.rl.metrics import (
    DEFAULT_BUCKETS,
    LOG_RATIO_BOUND,
    bucket_name,
    is_weight_stats,
    k3_terms,
    mismatch_metrics,
    mismatch_summary,
    quantile_linear,
    ratio_stats,
    sequence_stats,
)


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --------------------------------------------------------------------------------------------- mismatch_metrics
# Two non-empty sequences and one empty one. Every value is a binary fraction, exact in float32, so the
# expected values below are exact too (up to the float64 rounding of exp/log).
#   seq 0: train [-0.5, -1.0]        roll [-0.75, -1.0]       r = [0.25, 0.0]      Σr = 0.25
#   seq 1: empty
#   seq 2: train [-2.0, -0.25, -3.0] roll [-1.0, -0.25, -3.5] r = [-1.0, 0.0, 0.5] Σr = -0.5
TRAIN = [f32(-0.5, -1.0), f32(), f32(-2.0, -0.25, -3.0)]
ROLL = [f32(-0.75, -1.0), f32(), f32(-1.0, -0.25, -3.5)]
R = [0.25, 0.0, -1.0, 0.0, 0.5]
P_TRAIN = [math.exp(-0.5), math.exp(-1.0), math.exp(-2.0), math.exp(-0.25), math.exp(-3.0)]
P_ROLL = [math.exp(-0.75), math.exp(-1.0), math.exp(-1.0), math.exp(-0.25), math.exp(-3.5)]


@pytest.fixture(scope="module")
def m() -> dict[str, float]:
    return mismatch_metrics(TRAIN, ROLL)


def test_token_level_divergences(m):
    assert m["mismatch/tokens"] == 5
    assert m["rollout_corr/kl"] == pytest.approx(-sum(R) / 5)  # = 0.05
    assert m["rollout_corr/kl"] == pytest.approx(0.05)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(r) - r - 1 for r in R) / 5)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * r) for r in R) / 5 - 1)


def test_sequence_level_chi2_counts_empty_sequences_as_verl(m):
    # ρ_seq² = exp(2Σr): exp(0.5) and exp(-1.0); the empty sequence is a third term with ratio 1 (verl averages
    # over all rows, and its masked sum over no tokens is 0).
    assert m["rollout_corr/chi2_seq"] == pytest.approx((math.exp(0.5) + 1.0 + math.exp(-1.0)) / 3 - 1)


def test_log_ppl_metrics(m):
    # training log ppl per sequence: 0.75, 0 (empty: verl's masked mean over no tokens) and 5.25/3; rollout:
    # 0.875, 0 and 4.75/3. Every per-sequence mean runs over all three rows, as verl's.
    assert m["rollout_corr/training_log_ppl"] == pytest.approx((0.75 + 5.25 / 3) / 3)
    assert m["rollout_corr/rollout_log_ppl"] == pytest.approx((0.875 + 4.75 / 3) / 3)
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(0.75) + 1.0 + math.exp(5.25 / 3)) / 3)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx((math.exp(0.875) + 1.0 + math.exp(4.75 / 3)) / 3)
    # d_i = training_log_ppl_i - rollout_log_ppl_i = -Σr/T: -0.125, 0 and +1/6.
    d = [-0.125, 0.0, 1 / 6]
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(d) / 3)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(math.exp(x) for x in d) / 3)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(1 / 6)
    assert m["rollout_corr/log_ppl_diff_min"] == pytest.approx(-0.125)
    # verl's per-token-mean form vs Beyond Precision's sequence-sum form.
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx((0.125 + 1 / 6) / 3)
    assert m["mismatch/log_ppl_abs_diff_sum"] == pytest.approx((0.25 + 0.5) / 3)


def test_probability_differences(m):
    diffs = [abs(a - b) for a, b in zip(P_TRAIN, P_ROLL)]
    assert m["training/rollout_probs_diff_max"] == pytest.approx(math.exp(-1.0) - math.exp(-2.0))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(max(diffs))
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(sum(diffs) / 5)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(statistics.stdev(diffs))  # ddof 1, as verl
    assert m["training/rollout_probs_diff_valid"] == 1
    mean_t, mean_r = sum(P_TRAIN) / 5, sum(P_ROLL) / 5
    cov = sum((a - mean_t) * (b - mean_r) for a, b in zip(P_TRAIN, P_ROLL))
    norm = math.sqrt(sum((a - mean_t) ** 2 for a in P_TRAIN) * sum((b - mean_r) ** 2 for b in P_ROLL))
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(cov / norm)


def test_abs_dlogp_and_equality(m):
    assert m["mismatch/bitwise_equal_frac"] == 2 / 5
    assert m["mismatch/abs_dlogp_mean"] == pytest.approx(1.75 / 5)
    assert m["mismatch/abs_dlogp_max"] == 1.0
    # sorted |r| = [0, 0, 0.25, 0.5, 1.0]; position 0.99·4 = 3.96 -> 0.5 + 0.96·0.5
    assert m["mismatch/abs_dlogp_p99"] == pytest.approx(0.98)


def test_buckets_of_the_example(m):
    # p_train: 0.607, 0.368, 0.135, 0.779, 0.0498 -> buckets 0.5-0.9, 0.1-0.5, 0.1-0.5, 0.5-0.9, 0.01-0.1
    counts = {"0-0.01": 0, "0.01-0.1": 1, "0.1-0.5": 2, "0.5-0.9": 2, "0.9-1": 0}
    for name, count in counts.items():
        assert m[f"mismatch/tokens_bucket/{name}"] == count
    assert m["mismatch/abs_dlogp_bucket/0.01-0.1"] == pytest.approx(0.5)
    assert m["mismatch/abs_dlogp_bucket/0.1-0.5"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["mismatch/abs_dlogp_bucket/0.5-0.9"] == pytest.approx((0.25 + 0.0) / 2)
    assert "mismatch/abs_dlogp_bucket/0-0.01" not in m  # empty buckets: count only, no NaN mean
    assert "mismatch/abs_dlogp_bucket/0.9-1" not in m


def test_exact_key_set(m):
    expected = {
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
        "rollout_corr/training_log_ppl", "rollout_corr/rollout_log_ppl", "rollout_corr/log_ppl_diff",
        "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min", "rollout_corr/log_ppl_abs_diff",
        "mismatch/log_ppl_abs_diff_sum", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_std", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl",
        "rollout_corr/ppl_ratio", "training/rollout_probs_diff_valid", "training/rollout_actor_probs_pearson_corr",
        "mismatch/tokens", "mismatch/bitwise_equal_frac",
        "mismatch/abs_dlogp_mean", "mismatch/abs_dlogp_max", "mismatch/abs_dlogp_p99",
        "mismatch/tokens_bucket/0-0.01", "mismatch/tokens_bucket/0.01-0.1", "mismatch/tokens_bucket/0.1-0.5",
        "mismatch/tokens_bucket/0.5-0.9", "mismatch/tokens_bucket/0.9-1",
        "mismatch/abs_dlogp_bucket/0.01-0.1", "mismatch/abs_dlogp_bucket/0.1-0.5",
        "mismatch/abs_dlogp_bucket/0.5-0.9",
    }
    assert set(m) == expected
    assert all(math.isfinite(v) for v in m.values())


def test_sign_conventions():
    # Training path more confident than rollout (r > 0): k1 KL(μ‖π) estimate is negative, log_ppl_diff < 0.
    out = mismatch_metrics([f32(-0.5)], [f32(-1.0)])
    assert out["rollout_corr/kl"] == -0.5
    assert out["rollout_corr/log_ppl_diff"] == -0.5
    assert out["rollout_corr/training_log_ppl"] == 0.5
    assert out["rollout_corr/rollout_log_ppl"] == 1.0


def test_zero_mismatch_is_exactly_zero():
    gen = torch.Generator().manual_seed(0)
    train = [-torch.rand(n, generator=gen) * 6 for n in (7, 0, 1, 33)]
    roll = [t.clone() for t in train]
    out = mismatch_metrics(train, roll)
    zero_keys = [
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
        "rollout_corr/log_ppl_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
        "rollout_corr/log_ppl_abs_diff", "mismatch/log_ppl_abs_diff_sum", "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std", "mismatch/abs_dlogp_mean",
        "mismatch/abs_dlogp_max", "mismatch/abs_dlogp_p99",
    ]
    for key in zero_keys:
        assert out[key] == 0.0, key
    for key in (k for k in out if k.startswith("mismatch/abs_dlogp_bucket/")):
        assert out[key] == 0.0, key
    assert out["mismatch/bitwise_equal_frac"] == 1.0
    assert out["mismatch/tokens"] == 41
    assert out["rollout_corr/training_log_ppl"] == out["rollout_corr/rollout_log_ppl"]
    assert sum(v for k, v in out.items() if k.startswith("mismatch/tokens_bucket/")) == 41


def test_one_ulp_difference_is_not_bitwise_equal():
    train = f32(-0.3, -1.7, -2.2, -0.01)
    roll = train.clone()
    roll[2] = torch.nextafter(train[2], torch.tensor(-math.inf))
    assert roll[2] != train[2]
    out = mismatch_metrics([train], [roll])
    assert out["mismatch/bitwise_equal_frac"] == 3 / 4
    # float32 -> float64 and the subtraction are exact: the max |r| is that ulp.
    ulp = float(train[2]) - float(roll[2])
    assert 0.0 < ulp < 1e-6
    assert out["mismatch/abs_dlogp_max"] == ulp


def test_bucket_assignment_on_hand_built_probabilities():
    # float64 log-probs so that p = exp(log p) is the probability we wrote (checked where it matters).
    assert math.exp(math.log(0.5)) == 0.5 and math.exp(math.log(0.9)) == 0.9
    probs = [0.001, 0.05, 0.0999, 0.3, 0.5, 0.9, 0.95, 1.0]
    dlogp = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]  # |r| per token, distinct powers of two
    train = torch.tensor([math.log(p) for p in probs], dtype=torch.float64)
    roll = train - torch.tensor(dlogp, dtype=torch.float64)
    out = mismatch_metrics([train], [roll])
    # 0.5 is a lower edge (bucket [0.5, 0.9)); 0.9 starts the last bucket; 1.0 is in the closed last bucket.
    expected = {
        "0-0.01": [1.0],
        "0.01-0.1": [2.0, 4.0],
        "0.1-0.5": [8.0],
        "0.5-0.9": [16.0],
        "0.9-1": [32.0, 64.0, 128.0],
    }
    for name, members in expected.items():
        assert out[f"mismatch/tokens_bucket/{name}"] == len(members)
        assert out[f"mismatch/abs_dlogp_bucket/{name}"] == pytest.approx(sum(members) / len(members))


def test_custom_buckets_and_tokens_outside_them():
    train = torch.tensor([math.log(0.2), math.log(0.6), 0.0], dtype=torch.float64)
    roll = train - torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    out = mismatch_metrics([train], [roll], probs_buckets=(0.5, 0.75, 1.0))
    assert out["mismatch/tokens_bucket/0.5-0.75"] == 1
    assert out["mismatch/tokens_bucket/0.75-1"] == 1
    assert out["mismatch/abs_dlogp_bucket/0.5-0.75"] == 0.25
    assert out["mismatch/abs_dlogp_bucket/0.75-1"] == 0.125
    # p = 0.2 is below the first edge: it is counted in no bucket.
    assert {k for k in out if "bucket" in k} == {
        "mismatch/tokens_bucket/0.5-0.75", "mismatch/tokens_bucket/0.75-1",
        "mismatch/abs_dlogp_bucket/0.5-0.75", "mismatch/abs_dlogp_bucket/0.75-1",
    }
    assert out["mismatch/tokens"] == 3


def test_bucket_names():
    edges = DEFAULT_BUCKETS
    names = [bucket_name(lo, hi) for lo, hi in zip(edges, edges[1:])]
    assert names == ["0-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "0.9-1"]


def test_chi2_clamps_log_ratio_at_20():
    # One sequence with r = [15, 15]: tokens stay under the bound, the sequence sum 30 is clamped to 20.
    out = mismatch_metrics([torch.tensor([0.0, 0.0], dtype=torch.float64)],
                           [torch.tensor([-15.0, -15.0], dtype=torch.float64)])
    assert out["rollout_corr/chi2_token"] == pytest.approx(math.exp(30) - 1)
    assert out["rollout_corr/chi2_seq"] == pytest.approx(math.exp(40) - 1)
    assert out["rollout_corr/k3_kl"] == pytest.approx(math.exp(15) - 16)  # k3 is not clamped
    # Token r = 30 is clamped too (verl's formula); r = -30 gives ρ² = exp(-40).
    out = mismatch_metrics([f32(0.0, -30.0)], [f32(-30.0, 0.0)])
    assert out["rollout_corr/chi2_token"] == pytest.approx((math.exp(40) + math.exp(-40)) / 2 - 1)
    assert out["rollout_corr/chi2_seq"] == 0.0  # Σr = 0 -> ρ_seq = 1


def test_mixed_dtypes_compare_values():
    # bf16 rollout vs fp32 training: equal where the fp32 value is representable in bf16.
    train = f32(-0.5, -0.1)
    roll = train.to(torch.bfloat16)
    out = mismatch_metrics([train], [roll])
    assert out["mismatch/bitwise_equal_frac"] == 0.5


def test_mismatch_metrics_errors():
    with pytest.raises(ValueError, match="2 training sequences but 1 rollout"):
        mismatch_metrics([f32(-1.0), f32(-1.0)], [f32(-1.0)])
    with pytest.raises(ValueError, match="sequence 1"):
        mismatch_metrics([f32(-1.0), f32(-1.0, -2.0)], [f32(-1.0), f32(-1.0)])
    with pytest.raises(ValueError, match="sequence 0.*1-D"):
        mismatch_metrics([torch.zeros(2, 2)], [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="no tokens to compare"):
        mismatch_metrics([f32(), f32()], [f32(), f32()])
    with pytest.raises(ValueError, match="no tokens to compare"):
        mismatch_metrics([], [])
    with pytest.raises(ValueError, match="strictly increasing"):
        mismatch_metrics([f32(-1.0)], [f32(-1.0)], probs_buckets=(0.0, 0.5, 0.5, 1.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        mismatch_metrics([f32(-1.0)], [f32(-1.0)], probs_buckets=(1.0,))
    # what is not a sequence of float tensors: one error naming the side (were TypeErrors and AttributeErrors)
    for train, roll, says in ((None, [f32(-1.0)], "logp_train must be a sequence of 1-D log-prob tensors, got "
                                                  "NoneType"),
                              ([f32(-1.0)], 3, "logp_roll must be a sequence of 1-D log-prob tensors, got int"),
                              ([f32(-1.0)], [f32(-1.0).numpy()], r"logp_roll\[0\] must be a floating-point torch "
                                                                 "tensor of log-probs, got ndarray"),
                              ([torch.tensor([-1])], [f32(-1.0)], r"logp_train\[0\] .* got torch.int64")):
        with pytest.raises(ValueError, match=says):
            mismatch_metrics(train, roll)


def test_mismatch_summary_takes_training_then_rollout_like_mismatch_metrics():
    train, roll = f32(-0.5, -1.0), f32(-0.75, -1.0)
    out = mismatch_summary(train, roll)
    per_sequence = mismatch_metrics([train], [roll])
    assert out["kl"] == per_sequence["rollout_corr/kl"] and out["k3_kl"] == per_sequence["rollout_corr/k3_kl"]
    assert out == {"tokens": 2, "bitwise_equal": 1, "bitwise_equal_frac": 0.5, "abs_dlogp_mean": 0.125,
                   "abs_dlogp_max": 0.25, "kl": -0.125, "k3_kl": pytest.approx((math.exp(0.25) - 1.25) / 2)}


# --------------------------------------------------------------------------------------------- quantile_linear
def test_quantile_linear_hand_values():
    assert quantile_linear(torch.tensor([0.0, 1.0]), 0.99) == pytest.approx(0.99)
    assert quantile_linear(torch.tensor([3.0]), 0.99) == 3.0
    assert quantile_linear(torch.arange(101.0).flip(0), 0.99) == pytest.approx(99.0)
    assert quantile_linear(torch.tensor([4.0, 1.0, 2.0]), 0.0) == 1.0
    assert quantile_linear(torch.tensor([4.0, 1.0, 2.0]), 1.0) == 4.0
    assert quantile_linear(torch.tensor([4.0, 1.0, 2.0]), 0.75) == pytest.approx(3.0)  # h = 1.5 -> (2 + 4) / 2


def test_quantile_linear_agrees_with_torch_quantile():
    x = torch.rand(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert quantile_linear(x, q) == pytest.approx(float(torch.quantile(x, q)), rel=1e-12, abs=1e-15)


def test_quantile_linear_errors():
    with pytest.raises(ValueError):
        quantile_linear(torch.tensor([]), 0.5)
    with pytest.raises(ValueError):
        quantile_linear(torch.tensor([1.0]), 1.5)


# --------------------------------------------------------------------------------------------- is_weight_stats
def test_is_weight_stats_hand_values():
    out = is_weight_stats(torch.tensor([0.5, 1.0, 2.0, 0.5]))
    assert out["correction/weight_mean"] == 1.0
    assert out["correction/weight_std"] == pytest.approx(math.sqrt((0.25 + 0 + 1 + 0.25) / 4))
    assert out["correction/weight_min"] == 0.5
    assert out["correction/weight_max"] == 2.0
    # (Σw)² / (N Σw²) = 16 / (4 · 5.5)
    assert out["correction/weight_eff_sample_size"] == pytest.approx(16 / 22)
    assert set(out) == {f"correction/weight_{s}" for s in ("mean", "std", "min", "max", "eff_sample_size")}


def test_is_weight_stats_edge_cases():
    assert is_weight_stats(torch.full((5,), 0.7))["correction/weight_eff_sample_size"] == pytest.approx(1.0)
    assert is_weight_stats(torch.ones(3, 2))["correction/weight_eff_sample_size"] == 1.0
    # One weight carries everything: ESS = 1/N.
    assert is_weight_stats(torch.tensor([0.0, 0.0, 0.0, 3.0]))["correction/weight_eff_sample_size"] == 0.25
    assert is_weight_stats(torch.zeros(4))["correction/weight_eff_sample_size"] == 0.0
    out = is_weight_stats(torch.tensor([2.0]), prefix="rollout_corr/tis")
    assert out == {"rollout_corr/tis_mean": 2.0, "rollout_corr/tis_std": 0.0, "rollout_corr/tis_min": 2.0,
                   "rollout_corr/tis_max": 2.0, "rollout_corr/tis_eff_sample_size": 1.0}
    with pytest.raises(ValueError):
        is_weight_stats(torch.tensor([]))


# --------------------------------------------------------------------------------------------- sequence_stats
def test_sequence_stats_list_and_tensor():
    out = sequence_stats([1.0, 0.0, 0.0, 1.0, 1.0], "reward")
    assert out["reward/mean"] == pytest.approx(0.6)
    assert out["reward/std"] == pytest.approx(math.sqrt(0.24))  # population: mean of squared deviations
    assert out["reward/max"] == 1.0
    assert out["reward/min"] == 0.0
    out = sequence_stats(torch.tensor([3, 5, 10]), "response_length")
    assert out == {"response_length/mean": 6.0, "response_length/std": pytest.approx(math.sqrt(26 / 3)),
                   "response_length/max": 10.0, "response_length/min": 3.0}
    assert sequence_stats([4.0], "x")["x/std"] == 0.0
    with pytest.raises(ValueError):
        sequence_stats([], "reward")


# --------------------------------------------------------------------------------------------- ratio_stats
def test_ratio_stats_hand_values():
    # clip_low 0.2, clip_high 0.28 -> band [0.8, 1.28]
    ratio = f32(1.0, 1.5, 0.5, 1.5, 0.5, 2.0, 0.6, 1.25)
    adv = f32(1.0, 1.0, 1.0, -1.0, -1.0, 0.0, -2.0, 1.0)
    # t1: A > 0, ρ > 1.28 -> high.  t4, t6: A < 0, ρ < 0.8 -> low.  t2 (A > 0, ρ low), t3 (A < 0, ρ high),
    # t5 (A = 0) and t0, t7 (inside) -> not clipped.
    out = ratio_stats(ratio, 0.2, 0.28, adv)
    assert out["actor/pg_clipfrac"] == 3 / 8
    assert out["actor/pg_clipfrac_high"] == 1 / 8
    assert out["actor/pg_clipfrac_low"] == 2 / 8
    assert out["actor/ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.5 + 0.5 + 2.0 + 0.6 + 1.25) / 8)
    assert out["actor/ratio_max"] == 2.0
    assert out["actor/ratio_min"] == 0.5
    assert set(out) == {"actor/pg_clipfrac", "actor/pg_clipfrac_high", "actor/pg_clipfrac_low",
                        "actor/ratio_mean", "actor/ratio_max", "actor/ratio_min"}


def test_ratio_stats_bounds_match_the_clipped_objective():
    # A ratio exactly on the float32 bound is not clipped; one ulp beyond it is, as with torch.clamp in the loss.
    high = torch.tensor(1.0 + 0.28, dtype=torch.float32)
    low = torch.tensor(1.0 - 0.2, dtype=torch.float32)
    ratio = torch.stack([high, torch.nextafter(high, torch.tensor(2.0)), low, torch.nextafter(low, torch.tensor(0.0))])
    adv = f32(1.0, 1.0, -1.0, -1.0)
    out = ratio_stats(ratio, 0.2, 0.28, adv)
    assert out["actor/pg_clipfrac_high"] == 1 / 4
    assert out["actor/pg_clipfrac_low"] == 1 / 4
    # Same decision as "the clipped branch of max(-Aρ, -A·clip(ρ)) is strictly larger":
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - 0.2, 1.0 + 0.28)
    assert out["actor/pg_clipfrac"] == float((clipped > unclipped).float().mean())


def test_ratio_stats_errors():
    with pytest.raises(ValueError, match="shape"):
        ratio_stats(f32(1.0, 1.0), 0.2, 0.2, f32(1.0))
    with pytest.raises(ValueError):
        ratio_stats(f32(), 0.2, 0.2, f32())


def _chi2(bound: float) -> dict[str, float]:
    train, roll = [torch.tensor([0.0, -1.0], dtype=torch.float64)], [torch.tensor([-30.0, -1.0], dtype=torch.float64)]
    return mismatch_metrics(train, roll, log_ratio_bound=bound)


def test_log_ratio_bound_reaches_the_chi2_metrics():
    default = mismatch_metrics([torch.tensor([0.0, -1.0], dtype=torch.float64)],
                               [torch.tensor([-30.0, -1.0], dtype=torch.float64)])
    assert default == _chi2(LOG_RATIO_BOUND)  # the default is the config's default
    five = _chi2(5.0)
    assert five["rollout_corr/chi2_token"] == pytest.approx((math.exp(10.0) + 1.0) / 2 - 1.0, rel=1e-12)
    assert five["rollout_corr/chi2_seq"] == pytest.approx(math.exp(10.0) - 1.0, rel=1e-12)
    assert five["rollout_corr/chi2_token"] != default["rollout_corr/chi2_token"]  # counter-case: the bound bites


def test_k3_is_never_below_zero_for_tiny_log_ratios():
    """Tokens on which a rollout engine and a trainer differ by about 1e-9 in log-prob (near-certain ones): there
    e^r - r - 1 in float64 rounded to -1.1e-16 for about one r in eight, and its mean came out below 0 (a negative
    k3, which --map then refused); expm1(r) - r is never below 0."""
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(4096, dtype=torch.float64, generator=gen) - 0.5) * 2e-9
    assert float((torch.exp(r) - r - 1).mean()) < 0  # the cancellation the test guards against
    assert bool((k3_terms(r) >= 0).all()) and float(k3_terms(r).mean()) > 0
    train = -torch.rand(4096, dtype=torch.float64, generator=gen)
    assert mismatch_metrics([train], [train - r])["rollout_corr/k3_kl"] >= 0
    assert mismatch_summary(train, train - r)["k3_kl"] >= 0


def test_k3_terms_agree_with_the_textbook_formula_away_from_zero():
    """Within 1e-9 relative: e^r - r - 1 loses about 1e-16 / k3 of it to cancellation (2e-10 at r = 1e-3)."""
    r = torch.tensor([-5.0, -1.0, -0.25, -1e-3, 1e-3, 0.0625, 0.5, 3.0], dtype=torch.float64)
    assert torch.allclose(k3_terms(r), torch.exp(r) - r - 1, rtol=1e-9, atol=0)


def test_a_log_prob_rounded_above_zero_counts_in_the_top_bucket():
    """vexact compare admits log-probs up to +1e-3 (rounding); p = e^logp > 1 fell in no bucket."""
    train = torch.tensor([5e-4, -1.0], dtype=torch.float64)
    roll = torch.tensor([-5e-4, -1.0], dtype=torch.float64)
    out = mismatch_metrics([train], [roll])
    assert out["mismatch/tokens_bucket/0.9-1"] == 1
    assert out["mismatch/abs_dlogp_bucket/0.9-1"] == pytest.approx(1e-3, rel=1e-12)
    assert sum(out[f"mismatch/tokens_bucket/{bucket_name(lo, hi)}"]
               for lo, hi in zip(DEFAULT_BUCKETS, DEFAULT_BUCKETS[1:])) == 2
