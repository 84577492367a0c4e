"""Mismatch metrics between rollout and training log-probs of the same tokens, plus small stat helpers.

Notation (the names peers use): for every generated token t, ``logp_train(t)`` is its log-prob under the
**training** path π (full-sequence forward) and ``logp_roll(t)`` its log-prob under the **rollout** path μ
(incremental decoding), same weights, same tokens. The per-token log-ratio is

    r_t = logp_train(t) - logp_roll(t),      ρ_t = exp(r_t) = π/μ,      ρ_seq = Π_t ρ_t = exp(Σ_t r_t).

In a zero-mismatch harness r_t ≡ 0 bit for bit, and every divergence below is exactly 0.0.

Which metric answers which question (keys are a contract; ``rollout_corr/*`` and ``training/*`` follow verl):

* *Are the two paths identical?*  ``mismatch/bitwise_equal_frac`` (1.0 means yes, token by token).
* *How large is the per-token disagreement?*  ``mismatch/abs_dlogp_{mean,max,p99}`` on |r|, and
  ``training/rollout_probs_diff_{max,mean,std}`` on |p_train - p_roll| (probability scale).
* *Where is it worst?*  ``mismatch/abs_dlogp_bucket/<lo>-<hi>`` — mean |r| by training-path token probability.
* *How far apart are the distributions?*  ``rollout_corr/kl`` (k1 estimate of KL(μ‖π), can be negative) and
  ``rollout_corr/k3_kl`` (k3 estimate, ≥ 0).
* *How noisy would importance-sampling correction be?*  ``rollout_corr/chi2_token`` / ``rollout_corr/chi2_seq``
  (χ² = E_μ[ρ²] - 1 = variance of the IS weight), and ``is_weight_stats`` for weights actually applied.
* *Does one path find the responses systematically less likely?*  ``rollout_corr/log_ppl_diff*``.

Every function here is a plain reduction: known inputs -> known outputs, computed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..metric_keys import (
    ABS_DLOGP_MAX,
    ABS_DLOGP_MEAN,
    ABS_DLOGP_P99,
    BITWISE_EQUAL_FRAC,
    CHI2_SEQ,
    CHI2_TOKEN,
    FULL_VOCAB_ARGMAX_FLIP_FRAC,
    FULL_VOCAB_KL_MAX,
    FULL_VOCAB_KL_MEAN,
    FULL_VOCAB_POSITIONS,
    FULL_VOCAB_TV_MAX,
    FULL_VOCAB_TV_MEAN,
    K3_KL,
    KL,
    LAG_K3_KL,
    LOG_PPL_ABS_DIFF,
    LOG_PPL_ABS_DIFF_SUM,
    LOG_PPL_DIFF,
    LOG_PPL_DIFF_MAX,
    LOG_PPL_DIFF_MIN,
    MISMATCH_TOKENS,
    PG_CLIPFRAC,
    PG_CLIPFRAC_HIGH,
    PG_CLIPFRAC_LOW,
    PPL_RATIO,
    RATIO_MAX,
    RATIO_MEAN,
    RATIO_MIN,
    RESPONSE_LENGTH_CLIP_RATIO,
    REWARD_ACCURACY,
    ROLLOUT_ACTOR_PROBS_PEARSON_CORR,
    ROLLOUT_LOG_PPL,
    ROLLOUT_PPL,
    ROLLOUT_PROBS_DIFF_MAX,
    ROLLOUT_PROBS_DIFF_MEAN,
    ROLLOUT_PROBS_DIFF_STD,
    ROLLOUT_PROBS_DIFF_VALID,
    ROUTING_FLIP_RATE,
    ROUTING_TOKEN_FLIP_FRAC,
    TIM_K3_KL,
    TRAINING_LOG_PPL,
    TRAINING_PPL,
    full_vocab_overlap_key,
)
from ..metric_keys import find as find_metric_key

DEFAULT_BUCKETS: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
"""Edges of the token-probability buckets for ``mismatch/abs_dlogp_bucket/*`` (probability under the training path)."""

BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}
"""The integer type each float dtype is reinterpreted as to read its bits (bitwise comparisons, bit reports)."""


def float_bits(value: Tensor) -> str:
    """Hex of a one-element float tensor's bits as stored: ``0x3f800000`` for float32 1.0, ``0x3f80`` for
    bfloat16 1.0, ``0x3ff0000000000000`` for float64 1.0 (4, 8 or 16 hex digits by the dtype's width)."""
    if value.dtype not in BITS_VIEW:
        raise ValueError(f"float_bits: unsupported dtype {value.dtype}")
    width = torch.finfo(value.dtype).bits
    raw = int(value.detach().reshape(1).cpu().view(BITS_VIEW[value.dtype])[0]) & ((1 << width) - 1)
    return f"0x{raw:0{width // 4}x}"


LOG_RATIO_BOUND = 20.0
"""Default of ``correction.log_ratio_bound``: |log ρ| is clamped to this before exponentiating in the χ² metrics,
the IS weights and ``actor/ppo_kl`` (verl's SAFETY_BOUND): ρ ≤ exp(20) ≈ 4.9e8."""


def k3_terms(r: Tensor) -> Tensor:
    """Per-token k3 estimates of KL, e^r - r - 1 for log-ratios ``r`` (float64, r = logp_train - logp_roll), computed
    as expm1(r) - r: the same value without e^r - 1's cancellation near r = 0, so never below 0 (e^r - r - 1
    rounded to -1.1e-16 for about one r in eight below 1e-7, the 1-ulp differences of near-certain tokens)."""
    return torch.expm1(r).sub_(r)


def mismatch_summary(logp_train: Tensor, logp_roll: Tensor) -> dict[str, float]:
    """Token-level mismatch stats of flat log-probs: counts, bitwise-equal fraction, |Δlogp| mean/max, k1 and k3 KL.

    Arguments in the order of every function here: training path first, rollout path second."""
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
        "k3_kl": float(k3_terms(r).mean()),
    }


def bucket_name(lo: float, hi: float) -> str:
    """Key fragment for the probability bucket [lo, hi): ``0-0.01``, ``0.01-0.1``, ..., ``0.9-1`` (``%g`` format)."""
    return f"{lo:g}-{hi:g}"


def require_log_prob_tensor(side: str, value: object, index: int | None = None, form: str = "") -> None:
    """One ValueError naming ``side`` (and ``index``: which of its sequences) unless ``value`` is a floating-point
    torch tensor (``form``: its shape, as the message should say it)."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, Tensor) else type(value).__name__
        where = side if index is None else f"{side}[{index}]"
        raise ValueError(f"{where} must be a floating-point {form}torch tensor of log-probs, got {got}")


def mismatch_metrics(logp_train: Sequence[Tensor], logp_roll: Sequence[Tensor],
                     probs_buckets: Sequence[float] = DEFAULT_BUCKETS,
                     log_ratio_bound: float = LOG_RATIO_BOUND) -> dict[str, float]:
    """Training-vs-rollout mismatch metrics over a batch of sequences.

    ``logp_train[i]`` and ``logp_roll[i]`` are 1-D float tensors of equal length holding the per-token log-probs
    of sequence i's generated tokens under the training and the rollout path. Empty sequences are allowed: they
    add no tokens, and count in the per-sequence means as verl counts them (log-perplexities 0, ratio 1, d_i = 0:
    verl's masked mean over no tokens is 0). Under a verl name every key has verl 0.9.1's definition, except that
    means divide by the count where verl divides by count + 1e-8 (so zero mismatch gives exactly 0.0; the relative
    difference is below 1e-8/N). All arithmetic is float64 (after the bitwise
    comparison, which uses the inputs as given). Non-finite inputs are not rejected; they propagate.

    With r_t = logp_train - logp_roll, T_i the length of sequence i, "token mean" the mean over all N tokens of the
    batch and "sequence mean" the mean over all S sequences (empty ones included, see above):

    Token-level (``rollout_corr/``, verl's formulas)
      ``kl``          = token mean of (logp_roll - logp_train) = -mean(r)   (k1 estimate of KL(μ‖π); may be < 0)
      ``k3_kl``       = token mean of (exp(r) - r - 1), as expm1(r) - r      (k3 estimate, ≥ 0; not clamped)
      ``chi2_token``  = token mean of ρ_t² - 1, ρ_t = exp(clamp(r_t, ±B)), B = ``log_ratio_bound`` (run:
                        ``correction.log_ratio_bound``, default ``LOG_RATIO_BOUND`` = 20)

    Sequence-level (``rollout_corr/``)
      ``chi2_seq``    = sequence mean of ρ_i² - 1, ρ_i = exp(clamp(Σ_t r_t, ±B)). The clamp (verl's safety
                        bound) keeps exp finite; it only bites when a ratio exceeds e^B.
      ``training_log_ppl`` = sequence mean of (-(1/T_i) Σ_t logp_train)   (per-token log-perplexity)
      ``rollout_log_ppl``  = sequence mean of (-(1/T_i) Σ_t logp_roll)
      ``training_ppl`` / ``rollout_ppl`` = sequence mean of exp(log-perplexity_i) (per-sequence perplexities)
      ``ppl_ratio``        = sequence mean of exp(d_i) = training_ppl_i / rollout_ppl_i
      ``log_ppl_diff``     = sequence mean of d_i with d_i = training_log_ppl_i - rollout_log_ppl_i
                             = (1/T_i) Σ_t (logp_roll - logp_train); > 0 means the training path finds the
                             response less likely than the rollout path did. ``log_ppl_diff_max`` / ``_min``:
                             max / min of d_i over sequences.
      ``log_ppl_abs_diff`` = sequence mean of |d_i| = |mean_t logp_train - mean_t logp_roll|  — verl's
                             **per-token-mean** form (comparable across response lengths).
      ``log_ppl_abs_diff_sum`` = sequence mean of |Σ_t logp_train - Σ_t logp_roll| — the **sequence-sum** form
                             of "Beyond Precision" (Zhang et al.), eq. 8 (log ppl = -Σ log p); grows with
                             response length.

    Probability scale (``training/``, verl's debug metrics): over tokens, |exp(logp_train) - exp(logp_roll)|:
      ``rollout_probs_diff_max``, ``rollout_probs_diff_mean``, ``rollout_probs_diff_std`` (sample std, ddof 1,
      as verl's torch.std: NaN for a single token); ``rollout_probs_diff_valid`` = 1 (there were tokens);
      ``rollout_actor_probs_pearson_corr`` = Pearson's r between exp(logp_train) and exp(logp_roll) over tokens
      (torch.corrcoef; NaN for one token or a constant vector).

    vexact's own (``mismatch/``)
      ``tokens``             = N
      ``bitwise_equal_frac`` = fraction of tokens with ``logp_train == logp_roll`` on the original tensors
                               (no cast; a 1-ulp difference counts as unequal; note -0.0 == 0.0 under ==).
      ``abs_dlogp_mean`` / ``abs_dlogp_max`` = mean / max of |r| over tokens.
      ``abs_dlogp_p99``      = 99th percentile of |r|, linear interpolation between order statistics
                               (torch.quantile's / numpy's default: position 0.99·(N-1) in the sorted values).
      ``tokens_bucket/<lo>-<hi>``    = number of tokens whose training-path probability p = min(exp(logp_train), 1)
                                       lies in [lo, hi); the last bucket is closed, [lo, hi], so p = 1 counts
                                       (and a log-prob a rounding put above 0, which ``vexact compare`` admits).
                                       Always emitted (possibly 0).
      ``abs_dlogp_bucket/<lo>-<hi>`` = mean |r| over those tokens; emitted only for non-empty buckets (no NaN
                                       in the logs). Bucket names come from ``bucket_name``. Tokens with p
                                       outside [edges[0], edges[-1]] fall in no bucket (impossible with the
                                       default edges 0..1).

    Raises ValueError if either side is not a sequence of floating-point tensors, the lists differ in length, a pair
    differs in shape or is not 1-D (the message names the sequence index), the bucket edges are not at least two
    strictly increasing numbers, or there are no tokens.
    """
    for side, sequences in (("logp_train", logp_train), ("logp_roll", logp_roll)):
        if not isinstance(sequences, (Sequence, Tensor)) or isinstance(sequences, str):
            raise ValueError(f"{side} must be a sequence of 1-D log-prob tensors, got {type(sequences).__name__}")
    if len(logp_train) != len(logp_roll):
        raise ValueError(f"got {len(logp_train)} training sequences but {len(logp_roll)} rollout sequences")
    edges = [float(e) for e in probs_buckets]
    if len(edges) < 2 or any(not b > a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"probs_buckets must be at least two strictly increasing edges, got {tuple(probs_buckets)}")
    for i, (lt, lr) in enumerate(zip(logp_train, logp_roll)):
        require_log_prob_tensor("logp_train", lt, i)
        require_log_prob_tensor("logp_roll", lr, i)
        if lt.dim() != 1 or lr.dim() != 1:
            raise ValueError(f"sequence {i}: log-probs must be 1-D, got training {tuple(lt.shape)} "
                             f"and rollout {tuple(lr.shape)}")
        if lt.shape != lr.shape:
            raise ValueError(f"sequence {i}: training log-probs have shape {tuple(lt.shape)} but rollout "
                             f"log-probs have shape {tuple(lr.shape)}")
    lengths = [int(lt.numel()) for lt in logp_train]
    n = sum(lengths)
    if n == 0:
        raise ValueError("no tokens to compare")

    train_raw = torch.cat([lt.detach().cpu().flatten() for lt in logp_train])
    roll_raw = torch.cat([lr.detach().cpu().flatten() for lr in logp_roll])
    equal = int((train_raw == roll_raw).sum())  # before any cast: exact equality of the values as produced
    train, roll = train_raw.double(), roll_raw.double()
    r = train - roll
    abs_r = r.abs()

    # Per-sequence reductions over all sequences, empty ones included as verl includes them (a masked mean over no
    # tokens is 0, so an empty row has log-ppl 0, ratio 1). One slice at a time, each sum kept as a Python float:
    # a tensor object per sequence would cost ~1 KB each on big batches.
    seq_train_sum, seq_roll_sum, seq_r_sum = [], [], []
    start = 0
    for length_i in lengths:
        stop = start + length_i
        seq_train_sum.append(float(train[start:stop].sum()))
        seq_roll_sum.append(float(roll[start:stop].sum()))
        seq_r_sum.append(float(r[start:stop].sum()))
        start = stop
    train_sum, roll_sum, r_sum = (torch.tensor(v, dtype=torch.float64) for v in (seq_train_sum, seq_roll_sum,
                                                                                 seq_r_sum))
    del seq_train_sum, seq_roll_sum, seq_r_sum
    length = torch.tensor(lengths, dtype=torch.float64).clamp(min=1.0)
    train_log_ppl = -train_sum / length
    roll_log_ppl = -roll_sum / length
    log_ppl_diff = train_log_ppl - roll_log_ppl

    rho_seq_sq = torch.exp(2.0 * r_sum.clamp(-log_ratio_bound, log_ratio_bound))

    # Token-level reductions one at a time, in place where possible, each temporary dropped before the next: the
    # same elementwise operations (so the same bits) as the one-expression forms in the docstring, at a peak of a
    # few float64 copies of the N tokens (``vexact compare`` feeds dumps of millions of tokens through here).
    kl = float((roll - train).mean())
    k3 = float(k3_terms(r).mean())
    rho_token_sq = r.clamp(-log_ratio_bound, log_ratio_bound).exp_().square_()
    chi2_token = float(rho_token_sq.mean() - 1.0)
    del rho_token_sq, r
    p = torch.exp(train)  # the training-path probability of each token, for the buckets below
    p_roll = torch.exp(roll)
    # verl's debug metrics: ddof-1 std (NaN for a single token) and Pearson's r of the two probability vectors
    pearson = float(torch.corrcoef(torch.stack([p, p_roll]))[0, 1]) if n > 1 else float("nan")
    probs_diff = (p - p_roll).abs_()
    probs_diff_stats = (float(probs_diff.max()), float(probs_diff.mean()),
                        float(probs_diff.std(correction=1)) if n > 1 else float("nan"))
    del probs_diff, p_roll, train, roll, train_raw, roll_raw

    out: dict[str, float] = {
        KL: kl,
        K3_KL: k3,
        CHI2_TOKEN: chi2_token,
        CHI2_SEQ: float(rho_seq_sq.mean() - 1.0),
        TRAINING_LOG_PPL: float(train_log_ppl.mean()),
        ROLLOUT_LOG_PPL: float(roll_log_ppl.mean()),
        TRAINING_PPL: float(torch.exp(train_log_ppl).mean()),
        ROLLOUT_PPL: float(torch.exp(roll_log_ppl).mean()),
        PPL_RATIO: float(torch.exp(log_ppl_diff).mean()),
        LOG_PPL_DIFF: float(log_ppl_diff.mean()),
        LOG_PPL_DIFF_MAX: float(log_ppl_diff.max()),
        LOG_PPL_DIFF_MIN: float(log_ppl_diff.min()),
        LOG_PPL_ABS_DIFF: float(log_ppl_diff.abs().mean()),
        LOG_PPL_ABS_DIFF_SUM: float((train_sum - roll_sum).abs().mean()),
        ROLLOUT_PROBS_DIFF_MAX: probs_diff_stats[0],
        ROLLOUT_PROBS_DIFF_MEAN: probs_diff_stats[1],
        ROLLOUT_PROBS_DIFF_STD: probs_diff_stats[2],
        ROLLOUT_PROBS_DIFF_VALID: 1,
        ROLLOUT_ACTOR_PROBS_PEARSON_CORR: pearson,
        MISMATCH_TOKENS: n,
        BITWISE_EQUAL_FRAC: equal / n,
        ABS_DLOGP_MEAN: float(abs_r.mean()),
        ABS_DLOGP_MAX: float(abs_r.max()),
        ABS_DLOGP_P99: quantile_linear(abs_r, 0.99),
    }

    p.clamp_(max=1.0)  # a probability: a log-prob rounded above 0 counts in the top bucket
    for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = k == len(edges) - 2
        in_bucket = (p >= lo) & ((p <= hi) if last else (p < hi))
        count = int(in_bucket.sum())
        name = bucket_name(lo, hi)
        out[f"mismatch/tokens_bucket/{name}"] = count
        if count:
            out[f"mismatch/abs_dlogp_bucket/{name}"] = float(abs_r[in_bucket].mean())
    return out


def quantile_linear(values: Tensor, q: float) -> float:
    """q-quantile of a non-empty tensor by linear interpolation between order statistics.

    Sorted values v_0 ≤ ... ≤ v_{n-1}; position h = q·(n-1); result v_⌊h⌋ + (h - ⌊h⌋)·(v_⌊h⌋+1 - v_⌊h⌋).
    This is the definition of ``torch.quantile(..., interpolation="linear")`` (and numpy's default), without
    torch.quantile's input-size limit.
    """
    return quantile_sorted(values.detach().flatten().double().sort().values, q)


def quantile_sorted(v: Tensor, q: float) -> float:
    """``quantile_linear`` of values already sorted ascending (1-D): several quantiles of one tensor, one sort."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if v.numel() == 0:
        raise ValueError("quantile of an empty tensor")
    h = q * (v.numel() - 1)
    lo = math.floor(h)
    hi = min(lo + 1, v.numel() - 1)
    a, b = float(v[lo]), float(v[hi])
    return a + (h - lo) * (b - a)


def is_weight_stats(weights: Tensor, prefix: str = "correction/weight") -> dict[str, float]:
    """Summary of importance-sampling weights w_1..w_N (any shape, flattened, float64).

    Keys: ``<prefix>_mean``, ``<prefix>_std`` (population, ddof 0), ``<prefix>_min``, ``<prefix>_max`` and
    ``<prefix>_eff_sample_size`` = (Σw)² / (N·Σw²) ∈ (0, 1] for non-negative weights not all 0 — the effective
    sample size as a fraction of N (1.0 when all weights are equal; verl warns below 0.3). Defined as 0.0 when all
    w are 0, so its range is [0, 1].
    Raises ValueError for an empty tensor.
    """
    w = weights.detach().flatten().double()
    if w.numel() == 0:
        raise ValueError("no importance weights")
    sum_sq = float(w.square().sum())
    ess = float(w.sum()) ** 2 / (w.numel() * sum_sq) if sum_sq > 0 else 0.0
    return {
        f"{prefix}_mean": float(w.mean()),
        f"{prefix}_std": float(w.std(correction=0)),
        f"{prefix}_min": float(w.min()),
        f"{prefix}_max": float(w.max()),
        f"{prefix}_eff_sample_size": ess,
    }


def sequence_stats(values: Sequence[float] | Tensor, prefix: str) -> dict[str, float]:
    """``<prefix>/mean``, ``<prefix>/std`` (population, ddof 0), ``<prefix>/max``, ``<prefix>/min`` of the values.

    For per-sequence quantities such as ``reward/*`` and ``response_length/*``. Computed in float64;
    raises ValueError when there are no values.
    """
    v = torch.as_tensor(values).detach().flatten().double()
    if v.numel() == 0:
        raise ValueError(f"no values for {prefix!r}")
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/std": float(v.std(correction=0)),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/min": float(v.min()),
    }


def ratio_stats(ratio: Tensor, clip_low: float, clip_high: float, advantages: Tensor,
                clips: bool = True) -> dict[str, float]:
    """PPO ratio and clipping statistics over tokens (flat tensors, already masked to valid tokens).

    The clipped surrogate max(-A·ρ, -A·clip(ρ, 1-clip_low, 1+clip_high)) takes the clipped branch (and drops the
    token's gradient) exactly when, as in verl's ``pg_clipfrac``,
      high: A > 0 and ρ > 1 + clip_high        low: A < 0 and ρ < 1 - clip_low
    Keys: ``actor/pg_clipfrac`` = fraction of tokens with high or low; ``actor/pg_clipfrac_high`` and
    ``actor/pg_clipfrac_low`` = fraction with each (not verl's dual-clip ``pg_clipfrac_lower``);
    ``actor/ratio_mean`` / ``_max`` / ``_min`` of ρ. Tokens with A = 0 or ρ on a bound are never counted.
    The comparisons are done in ``ratio``'s own dtype, as ``clamp`` in the loss does them, so the fractions match
    what the loss actually clipped. ``clips`` False: the loss has no clip (bypass ``reinforce``), so the fractions
    are 0. Raises ValueError on shape mismatch or no tokens.
    """
    if ratio.shape != advantages.shape:
        raise ValueError(f"ratio shape {tuple(ratio.shape)} != advantages shape {tuple(advantages.shape)}")
    n = ratio.numel()
    if n == 0:
        raise ValueError("no tokens for ratio stats")
    ratio, advantages = ratio.detach(), advantages.detach()
    high = (advantages > 0) & (ratio > 1.0 + clip_high) & clips
    low = (advantages < 0) & (ratio < 1.0 - clip_low) & clips
    ratio64 = ratio.double()
    return {
        PG_CLIPFRAC: int((high | low).sum()) / n,
        PG_CLIPFRAC_HIGH: int(high.sum()) / n,
        PG_CLIPFRAC_LOW: int(low.sum()) / n,
        RATIO_MEAN: float(ratio64.mean()),
        RATIO_MAX: float(ratio64.max()),
        RATIO_MIN: float(ratio64.min()),
    }


def reduce_minibatch_stats(parts: Sequence[dict[str, float]], counts: Sequence[dict[str, int]]) -> dict[str, float]:
    """The step's values of the stats the update wrote once per PPO mini-batch (every epoch's, in order), each key
    reduced as its registry entry says (``MetricKey.minibatches``, ``vexact.metric_keys.MINIBATCH_REDUCTIONS``):
    ``max`` / ``min`` / ``mean`` over the mini-batches that wrote it, ``token_mean`` weighted by ``counts`` (per part,
    the tokens each token-mean key of that part is a mean over), ``step`` the first part's value (the caller replaces
    it by the value over the step's whole batch when there were several mini-batches). A key written by one part
    keeps that part's value bit for bit. Raises ValueError for a key the registry gives no reduction."""
    values: dict[str, list[tuple[float, int]]] = {}
    for stats, count in zip(parts, counts, strict=True):
        for key, value in stats.items():
            values.setdefault(key, []).append((value, count.get(key, 0)))
    out: dict[str, float] = {}
    for key, vals in values.items():
        entry = find_metric_key(key)
        kind = None if entry is None else entry.minibatches
        if kind is None:
            raise ValueError(f"{key}: no reduction across mini-batches in the metric registry (vexact.metric_keys)")
        if len(vals) == 1 or kind == "step":
            out[key] = vals[0][0]
        elif kind == "max":
            out[key] = max(v for v, _ in vals)
        elif kind == "min":
            out[key] = min(v for v, _ in vals)
        elif kind == "mean":
            out[key] = sum(v for v, _ in vals) / len(vals)
        else:  # token_mean
            tokens = sum(n for _, n in vals)
            if tokens <= 0:
                raise ValueError(f"{key}: a token mean across mini-batches needs their token counts")
            out[key] = sum(v * n for v, n in vals) / tokens
    return out


def rollout_batch_metrics(rewards: Tensor, lengths: list[int], finished: list[bool],
                          logp_train: Sequence[Tensor] | None, logp_roll: Sequence[Tensor] | None,
                          log_ratio_bound: float = LOG_RATIO_BOUND) -> dict[str, float]:
    """A step's ``reward/*``, ``response_length/*`` and mismatch metrics (``mismatch_metrics``) of one batch.

    ``reward/accuracy`` is the fraction of full-credit (reward 1.0) responses; ``response_length/clip_ratio`` the
    fraction that hit the length limit without EOS. The log-probs may be of a sample of the batch's sequences
    (``monitor.sample_fraction``), or None (no mismatch metrics: a step the monitor skips)."""
    out = sequence_stats(rewards, "reward")
    out[REWARD_ACCURACY] = float((rewards == 1.0).float().mean())
    out.update(sequence_stats(torch.tensor(lengths, dtype=torch.float32), "response_length"))
    out[RESPONSE_LENGTH_CLIP_RATIO] = sum(not f for f in finished) / len(finished)
    if logp_train is not None and logp_roll is not None:
        out.update(mismatch_metrics(logp_train, logp_roll, log_ratio_bound=log_ratio_bound))
    return out


FULL_VOCAB_CHUNK = 1 << 22
"""Vocabulary entries (rows x V) handled at once by ``full_vocab_rows``: bounds its float64 temporaries (~32 MiB
each) whatever N is."""


def full_vocab_rows(logp_train_full: Tensor, logp_roll_full: Tensor, top_k: int = 5) -> dict[str, Tensor]:
    """Per-position comparison of two full next-token distributions; ``full_vocab_metrics`` averages these.

    ``logp_train_full`` / ``logp_roll_full``: [N, V] log-probabilities (log_softmax rows; -inf entries allowed,
    they are probability 0) of the same N positions under the training path π and the rollout path μ.
    Returns float64 / bool tensors of length N, position n being row n:

      ``kl``           = Σ_v μ_v (log μ_v - log π_v)       KL(μ‖π) = KL(rollout‖train), in float64; entries with
                         μ_v = 0 contribute 0 (0·log 0 = 0), an entry with μ_v > 0 = π_v gives +inf.
      ``tv``           = ½ Σ_v |μ_v - π_v|                 total variation distance, in [0, 1].
      ``argmax_flip``  = argmax_v μ_v ≠ argmax_v π_v       (ties: the lowest index, torch.argmax's rule).
      ``topk_overlap`` = |top_k(μ) ∩ top_k(π)| / k         in {0, 1/k, ..., 1}; top_k is the k largest entries,
                         ties broken by the lowest index (a stable descending sort), so the sets are well defined.

    Each row is first renormalised in float64 (log_softmax of the row: a shift by its log-sum-exp, which is 0 up to
    the input dtype's rounding), so that rounding does not enter KL and TV as a spurious difference; probabilities
    are exp of those float64 log-probs. Rows are processed in chunks of ``FULL_VOCAB_CHUNK`` entries, so memory
    stays bounded for large vocabularies; each row's values depend on that row only. NaN inputs propagate.
    Raises ValueError unless both are floating-point 2-D tensors of one shape, and 1 ≤ top_k ≤ V (an int).
    """
    require_log_prob_tensor("logp_train_full", logp_train_full, form="[N, V] ")
    require_log_prob_tensor("logp_roll_full", logp_roll_full, form="[N, V] ")
    train, roll = logp_train_full.detach(), logp_roll_full.detach()
    if train.dim() != 2 or roll.dim() != 2 or train.shape != roll.shape:
        raise ValueError(f"full-vocabulary log-probs must be two [N, V] tensors of one shape, got training "
                         f"{tuple(train.shape)} and rollout {tuple(roll.shape)}")
    vocab = train.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be an integer in [1, {vocab}] (the vocabulary size), got {top_k!r}")
    parts: dict[str, list[Tensor]] = {"kl": [], "tv": [], "argmax_flip": [], "topk_overlap": []}
    step = max(1, FULL_VOCAB_CHUNK // max(vocab, 1))
    for start in range(0, train.shape[0], step):
        lt, lr = train[start : start + step].cpu(), roll[start : start + step].cpu()
        # Renormalised in float64: a float32 log_softmax row sums to 1 only within ~1e-7, and that rounding would
        # otherwise enter the KL one to one (even making it negative); the shift leaves the order of entries alone.
        lt64, lr64 = torch.log_softmax(lt.double(), dim=-1), torch.log_softmax(lr.double(), dim=-1)
        pt, pr = lt64.exp(), lr64.exp()
        # 0 · (log 0 - x) is NaN in floating point but 0 in the KL sum: only entries with μ_v > 0 contribute.
        parts["kl"].append(torch.where(pr > 0, pr * (lr64 - lt64), torch.zeros((), dtype=torch.float64)).sum(-1))
        parts["tv"].append(0.5 * (pr - pt).abs().sum(-1))
        parts["argmax_flip"].append(lr.argmax(-1) != lt.argmax(-1))
        top_r = torch.sort(lr, dim=-1, descending=True, stable=True).indices[:, :top_k]
        top_t = torch.sort(lt, dim=-1, descending=True, stable=True).indices[:, :top_k]
        common = (top_r[:, :, None] == top_t[:, None, :]).any(-1).sum(-1)
        parts["topk_overlap"].append(common.double() / top_k)
    if not parts["kl"]:
        return {"kl": torch.zeros(0, dtype=torch.float64), "tv": torch.zeros(0, dtype=torch.float64),
                "argmax_flip": torch.zeros(0, dtype=torch.bool), "topk_overlap": torch.zeros(0, dtype=torch.float64)}
    return {key: torch.cat(values) for key, values in parts.items()}


def full_vocab_summary(rows: dict[str, Tensor], top_k: int) -> dict[str, float]:
    """The ``mismatch/full_vocab_*`` keys from ``full_vocab_rows``' per-position values (possibly concatenated over
    several calls, e.g. one per micro-batch), each position weighted equally:

      ``mismatch/full_vocab_positions``            = N, the positions compared
      ``mismatch/full_vocab_kl_mean`` / ``_kl_max`` = mean / max over positions of KL(rollout‖train)
      ``mismatch/full_vocab_tv_mean`` / ``_tv_max`` = mean / max of the total variation distance
      ``mismatch/full_vocab_argmax_flip_frac``      = fraction of positions whose most likely token differs
      ``mismatch/full_vocab_top{k}_overlap_mean``   = mean of |top_k(μ) ∩ top_k(π)| / k (1.0: same top-k sets)

    Raises ValueError when there are no positions."""
    n = int(rows["kl"].numel())
    if n == 0:
        raise ValueError("no positions for the full-vocabulary comparison")
    return {
        FULL_VOCAB_POSITIONS: n,
        FULL_VOCAB_KL_MEAN: float(rows["kl"].mean()),
        FULL_VOCAB_KL_MAX: float(rows["kl"].max()),
        FULL_VOCAB_TV_MEAN: float(rows["tv"].mean()),
        FULL_VOCAB_TV_MAX: float(rows["tv"].max()),
        FULL_VOCAB_ARGMAX_FLIP_FRAC: int(rows["argmax_flip"].sum()) / n,
        full_vocab_overlap_key(top_k): float(rows["topk_overlap"].mean()),
    }


def full_vocab_metrics(logp_train_full: Tensor, logp_roll_full: Tensor, top_k: int = 5) -> dict[str, float]:
    """Full-vocabulary mismatch between the training path π and the rollout path μ at N positions.

    Where the sampled token's log-prob (``mismatch_metrics``) sees one entry of each distribution, this compares
    whole rows. Inputs: [N, V] log-prob rows (log_softmax of the temperature-scaled logits; -inf = probability
    0; renormalised in float64 first), training path first, as everywhere in this module. Per position
    (``full_vocab_rows``): KL(μ‖π) =
    Σ_v μ_v (log μ_v - log π_v), total variation ½ Σ_v |μ_v - π_v|, whether the argmax differs, and the top-k
    overlap |top_k(μ) ∩ top_k(π)| / k (ties to the lowest index); averaged over positions with equal weight
    (``full_vocab_summary``), giving

      ``mismatch/full_vocab_positions``, ``mismatch/full_vocab_kl_mean``, ``mismatch/full_vocab_kl_max``,
      ``mismatch/full_vocab_tv_mean``, ``mismatch/full_vocab_tv_max``, ``mismatch/full_vocab_argmax_flip_frac``,
      ``mismatch/full_vocab_top{k}_overlap_mean`` (k = ``top_k``, e.g. ``..._top5_overlap_mean``).

    All float64; identical rows give exactly 0 KL, 0 TV, no flips and overlap 1. Raises ValueError on shapes
    that are not two equal [N, V], N = 0, or top_k outside [1, V].
    """
    return full_vocab_summary(full_vocab_rows(logp_train_full, logp_roll_full, top_k), top_k)


def routing_metrics(routing_roll: Sequence[Tensor], routing_train: Sequence[Tensor]) -> dict[str, float]:
    """``routing/*``: how often the rollout's MoE router decisions differ from the training path's.

    Per sequence, int [positions, n_moe_layers, k] expert ids in ascending order (``GenerateOutput.routing``,
    ``vexact.engine.scoring.token_routing``): a decision (position x layer) differs when its expert set does."""
    if len(routing_roll) != len(routing_train):
        raise ValueError(f"got routing for {len(routing_roll)} rollout sequences but {len(routing_train)} training "
                         "sequences")
    roll = torch.cat([r.reshape(-1, *r.shape[1:]) for r in routing_roll])
    train = torch.cat([t.reshape(-1, *t.shape[1:]) for t in routing_train]).to(roll.device)
    if roll.shape != train.shape:
        raise ValueError(f"rollout routing {tuple(roll.shape)} and training routing {tuple(train.shape)} differ in "
                         "shape")
    differs = (roll != train).any(dim=-1)  # [positions, layers]
    if not differs.numel():
        return {ROUTING_FLIP_RATE: 0.0, ROUTING_TOKEN_FLIP_FRAC: 0.0}
    return {ROUTING_FLIP_RATE: float(differs.double().mean()),
            ROUTING_TOKEN_FLIP_FRAC: float(differs.any(dim=-1).double().mean())}


def lag_split_metrics(logp_current: Sequence[Tensor], logp_behaviour: Sequence[Tensor],
                      logp_roll: Sequence[Tensor]) -> dict[str, float]:
    """Policy lag's drift and the training–inference mismatch (TIM), apart, for tokens sampled by a lagged policy.

    ``logp_current``: the training path's log-probs under the policy being trained; ``logp_behaviour``: the training
    path's under the (lagged) behaviour policy that sampled the tokens; ``logp_roll``: what the rollout recorded
    (the behaviour policy on the rollout path). Per token, r_total = r_lag + r_tim with

      ``mismatch/lag_k3_kl`` = token mean of e^a − a − 1, a = logp_current − logp_behaviour (off-policy drift)
      ``mismatch/tim_k3_kl`` = token mean of e^b − b − 1, b = logp_behaviour − logp_roll (TIM)

    and ``rollout_corr/k3_kl`` of ``mismatch_metrics(logp_current, logp_roll)`` is the total a user logs. For small
    log-ratios k3 ≈ r²/2, so the total ≈ lag + TIM + mean(a·b): the sum of the two where the drift and the mismatch
    of a token are uncorrelated. Each value is ``mismatch_metrics``' k3 (float64), so no TIM gives exactly 0."""
    return {LAG_K3_KL: mismatch_metrics(logp_current, logp_behaviour)[K3_KL],
            TIM_K3_KL: mismatch_metrics(logp_behaviour, logp_roll)[K3_KL]}
