"""Every metric key vexact writes, as data: name, definition, unit and who writes it.

One registry, so the documentation's metric reference is generated from it (``tools.docs_gen``) and a test
(``tests/docs/test_docs.py``) fails when a run, ``vexact measure`` or ``vexact compare`` writes a key that is not here.
A key that depends on a setting is one entry with a ``<placeholder>``: ``<lo>-<hi>`` is a token-probability bucket
(``vexact.rl.metrics.bucket_name``), ``<option>`` one of verl's rejection options (``RS_OPTIONS``, defined here and
validated against by ``vexact.rl.corrections``), ``<k>`` the top-k size of the full-vocabulary overlap and ``<method>``
a registered ``correction.method``.

Writers: ``run`` is ``metrics.jsonl`` of ``vexact run`` (one line per step), ``measure`` and ``compare`` the
``metrics`` object of those commands' ``--json`` report (and their printed tables), ``live`` a row of
``vexact.live.LiveMonitor``'s ``metrics.jsonl`` (compare's metrics once per step of the user's trainer; its
structured fields ``outcome``, ``gates``, ``by_position``, ``map`` are not metrics).

Adding a metric: add an entry here in the group it belongs to; the reference page and the test pick it up.
Code that reads or writes a key by name uses the constants below (``K3_KL``, ...), not a bare string, so a renamed
key is one change and a typo is a NameError; each constant is a registered key (``tests/config/test_metric_names.py``).
Renaming a key: the constant takes the new name and ``RENAMED_METRICS`` maps the old one to it (old files read under
the new name; the logged stream carries the old name too for a deprecation period).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's rejection-sampling options (``rollout_rs``): each names its ``rollout_corr/rollout_rs_<option>_*`` keys,
so the list lives here, in the base layer, and ``vexact.rl.corrections`` takes it from here."""

RAW_RATIO_QUANTILES = (0.01, 0.5, 0.99)
"""The quantiles of the raw token ratio written as ``mismatch/ratio_p<q>`` (``raw_ratio_quantile_key``)."""


def raw_ratio_quantile_key(q: float) -> str:
    """``mismatch/ratio_p01`` for q = 0.01: the key of one of ``RAW_RATIO_QUANTILES``."""
    return f"mismatch/ratio_p{round(q * 100):02d}"


def raw_ratio_affected_key(method: str) -> str:
    """``mismatch/ratio_affected_frac/<method>`` for one ``correction.method``."""
    return f"mismatch/ratio_affected_frac/{method}"


def full_vocab_overlap_key(top_k: int | str) -> str:
    """``mismatch/full_vocab_top5_overlap_mean`` for top_k = 5: the full-vocabulary top-k overlap's key."""
    return f"mismatch/full_vocab_top{top_k}_overlap_mean"

# --- the keys code names, as constants (a module writing or reading a key by name uses these) -------------------------
K3_KL = "rollout_corr/k3_kl"
LAG_K3_KL = "mismatch/lag_k3_kl"
TIM_K3_KL = "mismatch/tim_k3_kl"
KL = "rollout_corr/kl"
LOG_PPL_ABS_DIFF = "rollout_corr/log_ppl_abs_diff"
ABS_DLOGP_MEAN = "mismatch/abs_dlogp_mean"
ABS_DLOGP_MAX = "mismatch/abs_dlogp_max"
BITWISE_EQUAL_FRAC = "mismatch/bitwise_equal_frac"
REWARD_MEAN = "reward/mean"
RESPONSE_LENGTH_MEAN = "response_length/mean"
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_GREEDY_ACCURACY = "eval/greedy_accuracy"
GRAD_NORM = "actor/grad_norm"
ENTROPY = "actor/entropy"
LR = "actor/lr"
TAIL_MASS_MEAN = "tail/mass_mean"
TAIL_MASS_MAX = "tail/mass_max"
TAIL_TOKEN_FRAC = "tail/token_frac"
TAIL_RESPONSE_FRAC = "tail/response_frac"
PG_CLIPFRAC = "actor/pg_clipfrac"
PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high"
PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low"
RATIO_MAX = "actor/ratio_max"
RATIO_MEAN = "actor/ratio_mean"
RATIO_MIN = "actor/ratio_min"
PG_LOSS = "actor/pg_loss"
KL_LOSS = "actor/kl_loss"
PPO_KL = "actor/ppo_kl"
GRAD_NORM_MAX = "actor/grad_norm_max"
REWARD_ACCURACY = "reward/accuracy"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
EVAL_ACCURACY = "eval/accuracy"
EVAL_GREEDY_REWARD_MEAN = "eval/greedy_reward_mean"
EVAL_RESPONSE_LENGTH_MEAN = "eval/response_length_mean"
ABS_DLOGP_P99 = "mismatch/abs_dlogp_p99"
RAW_RATIO_MIN = "mismatch/ratio_min"
RAW_RATIO_MAX = "mismatch/ratio_max"
MISMATCH_TOKENS = "mismatch/tokens"
FULL_VOCAB_ARGMAX_FLIP_FRAC = "mismatch/full_vocab_argmax_flip_frac"
FULL_VOCAB_KL_MAX = "mismatch/full_vocab_kl_max"
FULL_VOCAB_KL_MEAN = "mismatch/full_vocab_kl_mean"
FULL_VOCAB_POSITIONS = "mismatch/full_vocab_positions"
FULL_VOCAB_TV_MAX = "mismatch/full_vocab_tv_max"
FULL_VOCAB_TV_MEAN = "mismatch/full_vocab_tv_mean"
FIRST_MINIBATCH_RATIO_EXACT = "mismatch/first_minibatch_ratio_exact"
CHI2_SEQ = "rollout_corr/chi2_seq"
CHI2_TOKEN = "rollout_corr/chi2_token"
LOG_PPL_ABS_DIFF_SUM = "mismatch/log_ppl_abs_diff_sum"
LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
LOG_PPL_DIFF_MAX = "rollout_corr/log_ppl_diff_max"
LOG_PPL_DIFF_MIN = "rollout_corr/log_ppl_diff_min"
PPL_RATIO = "rollout_corr/ppl_ratio"
ROLLOUT_LOG_PPL = "rollout_corr/rollout_log_ppl"
ROLLOUT_PPL = "rollout_corr/rollout_ppl"
TRAINING_LOG_PPL = "rollout_corr/training_log_ppl"
TRAINING_PPL = "rollout_corr/training_ppl"
ROLLOUT_ACTOR_PROBS_PEARSON_CORR = "training/rollout_actor_probs_pearson_corr"
ROLLOUT_PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
ROLLOUT_PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
ROLLOUT_PROBS_DIFF_STD = "training/rollout_probs_diff_std"
ROLLOUT_PROBS_DIFF_VALID = "training/rollout_probs_diff_valid"
INJECT_ACTIVE = "inject/active"
INJECT_VALUE = "inject/value"
LR_SCHEDULE_TRIGGERED = "lr_schedule/triggered"
TIMING_EVAL = "timing/eval"
TIMING_GRAD_REDUCE = "timing/grad_reduce"
TIMING_OLD_LOGPROBS = "timing/old_logprobs"
TIMING_MONITOR = "timing/monitor"
MONITOR_SAMPLED_SEQUENCES = "monitor/sampled_sequences"
MONITOR_SAMPLE_FRACTION = "monitor/sample_fraction"
TIMING_ROLLOUT = "timing/rollout"
TIMING_STEP = "timing/step"
TIMING_UPDATE = "timing/update"
TIMING_WEIGHT_SYNC = "timing/weight_sync"
LIVE_GATES_FAILED = "live/gates_failed"
LIVE_MEAN_RESPONSE_LENGTH = "live/mean_response_length"
LIVE_NONFINITE = "live/nonfinite"
LIVE_SEQUENCES = "live/sequences"
LIVE_SAMPLED_SEQUENCES = "live/sampled_sequences"
LIVE_SAMPLE_FRACTION = "live/sample_fraction"
TRL_GLOBAL_STEP = "trl/global_step"
ROUTING_FLIP_RATE = "routing/flip_rate"
ROUTING_TOKEN_FLIP_FRAC = "routing/token_flip_frac"

_CONSTANT_NAMES = tuple(name for name, value in dict(globals()).items()
                        if name.isupper() and not name.startswith("_") and isinstance(value, str))
CONSTANTS = tuple(globals()[name] for name in _CONSTANT_NAMES)
"""Every constant above (each must be a registered key; ``tests/config/test_metric_names.py``)."""

__all__ = ["CONSTANTS", "GROUPS", "KEYS", "MINIBATCH_REDUCTIONS", "RAW_RATIO_QUANTILES", "RENAMED_METRICS",
           "RS_OPTIONS", "WRITERS", "MetricKey", "current_names", "find", "raw_ratio_affected_key",
           "raw_ratio_quantile_key", "unregistered", "with_deprecated_names",
           *_CONSTANT_NAMES]

RUN = ("run",)
ALL = ("run", "measure", "compare", "live")
WRITERS = ALL
LIVE = ("live",)


MINIBATCH_REDUCTIONS = ("max", "min", "mean", "token_mean", "step")
"""How a key the update writes once per PPO mini-batch (every epoch's) becomes the step's value
(``MetricKey.minibatches``; ``vexact.rl.metrics.reduce_minibatch_stats``): ``max`` / ``min`` the largest / smallest
of the mini-batches' values, ``mean`` their plain mean (a loss, a norm), ``token_mean`` their mean weighted by the
tokens each value is a mean over (the token mean over every mini-batch's tokens), ``step`` none: the value is
computed once over the step's whole batch (the rollout correction's statistics,
``Objective.step_correction_metrics``)."""


@dataclass(frozen=True)
class MetricKey:
    """One metric key (or a family of keys, when ``name`` holds a ``<placeholder>``)."""

    name: str
    definition: str
    unit: str
    writers: tuple[str, ...]
    source: str  # the module that computes it, relative to the package (``rl/metrics.py``)
    verl: bool = False  # the key and its definition are verl's (see the verl/TRL names page)
    minibatches: str | None = None  # a key written per mini-batch: its reduction (``MINIBATCH_REDUCTIONS``)

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]


def _k(name: str, definition: str, unit: str, writers: tuple[str, ...], source: str, verl: bool = False,
       minibatches: str | None = None) -> MetricKey:
    if minibatches is not None and minibatches not in MINIBATCH_REDUCTIONS:
        raise ValueError(f"{name}: unknown mini-batch reduction {minibatches!r}")
    return MetricKey(name, definition, unit, writers, source, verl, minibatches)


_METRICS = "rl/metrics.py"
_TRAINER = "rl/trainer.py"
_STEP = "rl/step_metrics.py"  # the step's line, composed from the stages' values
_SCORING = "rl/scoring.py"
_CORR = "rl/corrections.py"
_TAIL = "rl/vocab_tail.py"
_RAW = "rl/raw_ratios.py"

KEYS: tuple[MetricKey, ...] = (
    # --- reward and length of the step's rollouts (rl/step_metrics.py via metrics.sequence_stats) ------------------
    *(_k(f"reward/{s}", f"{w} of the task reward over the step's responses", "reward", RUN, _STEP, True)
      for s, w in (("mean", "Mean"), ("std", "Standard deviation (ddof 0)"), ("max", "Maximum"), ("min", "Minimum"))),
    _k("reward/accuracy", "Fraction of the step's responses whose answer is exactly right", "fraction", RUN, _STEP),
    *(_k(f"response_length/{s}", f"{w} of the response length (EOS included) over the step's responses", "tokens",
         RUN, _STEP, True)
      for s, w in (("mean", "Mean"), ("std", "Standard deviation (ddof 0)"), ("max", "Maximum"), ("min", "Minimum"))),
    _k("response_length/clip_ratio", "Fraction of responses cut at `rollout.max_new_tokens` without EOS", "fraction",
       RUN, _STEP, True),
    # --- the update (rl/objective.py, rl/trainer.py) -------------------------------------------------------------
    _k("actor/entropy", "Token-mean entropy of the training-path distribution over the step's responses (over "
       "every response token of every pass of the update: each PPO epoch's mini-batches)", "nats",
       RUN, _TRAINER, True, "token_mean"),
    _k("actor/pg_loss", "Policy-gradient (clipped surrogate) loss, without the KL and entropy terms, mean over "
       "the step's mini-batches (every PPO epoch's)", "loss", RUN, _TRAINER, True, "mean"),
    _k("actor/grad_norm", "Gradient L2 norm before clipping, mean over the step's mini-batches (every PPO epoch's)",
       "norm", RUN, _TRAINER, True, "mean"),
    _k("actor/grad_norm_max", "Largest pre-clip gradient norm of the step's mini-batches (every PPO epoch's)", "norm",
       RUN, _TRAINER),
    _k("actor/lr", "Learning rate of the step (warm-up and `lr_schedule` applied)", "lr", RUN, _STEP, True),
    _k("actor/pg_clipfrac", "Fraction of tokens whose ratio was clipped (either side); 0 under a loss that does not "
       "clip (`correction.loss_type: reinforce`); over the loss's tokens of every PPO epoch's mini-batches, as are "
       "the other `actor/*` token statistics", "fraction", RUN, _TRAINER, True, "token_mean"),
    _k("actor/pg_clipfrac_low", "Fraction of tokens clipped at 1 − `clip_low` (0 without a clip, as above)",
       "fraction", RUN, _TRAINER, True, "token_mean"),
    _k("actor/pg_clipfrac_high", "Fraction of tokens clipped at 1 + `clip_high` (0 without a clip, as above)",
       "fraction", RUN, _TRAINER, True, "token_mean"),
    _k("actor/ratio_mean", "Token mean of the PPO ratio π_θ / π_old", "ratio", RUN, _TRAINER,
       minibatches="token_mean"),
    _k("actor/ratio_max", "Largest PPO ratio of the step (of every PPO epoch's mini-batches)", "ratio", RUN,
       _TRAINER, minibatches="max"),
    _k("actor/ratio_min", "Smallest PPO ratio of the step (of every PPO epoch's mini-batches)", "ratio", RUN,
       _TRAINER, minibatches="min"),
    _k("actor/ppo_kl", "verl's PPO KL: token mean of −clamp(log π_θ − log π_old, ±20)", "nats", RUN, _TRAINER, True,
       "token_mean"),
    _k("actor/kl_loss", "k3 penalty against the step-0 policy, aggregated as the loss (`algorithm.loss_agg`, "
       "rejected tokens left out), mean over the step's mini-batches (every PPO epoch's); written when "
       "`algorithm.kl_coef` > 0", "nats", RUN, _TRAINER, True, "mean"),
    # --- mismatch between rollout and training log-probs, r = logp_train − logp_roll (rl/metrics.py) -------------
    _k("rollout_corr/kl", "k1 KL(μ‖π): token mean of logp_roll − logp_train", "nats", ALL, _METRICS, True),
    _k("rollout_corr/k3_kl", "k3 KL: token mean of exp(r) − r − 1 (≥ 0; 0 exactly when every token agrees)",
       "nats", ALL, _METRICS, True),
    _k("rollout_corr/chi2_token", "χ² of the token ratio ρ = exp(r): mean(ρ²) − 1 (log ρ clamped to ±20, as verl)",
       "ratio", ALL, _METRICS, True),
    _k("rollout_corr/chi2_seq", "χ² of the sequence ratio: mean over sequences of ρ_seq² − 1, "
       "ρ_seq = exp(clamp(Σr, ±20))", "ratio", ALL, _METRICS, True),
    _k("rollout_corr/log_ppl_abs_diff", "verl's per-token-mean |log ppl_train − log ppl_roll|, mean over sequences",
       "nats", ALL, _METRICS, True),
    _k("rollout_corr/training_log_ppl", "Mean over sequences of the training path's per-token-mean −logp", "nats",
       ALL, _METRICS, True),
    _k("rollout_corr/rollout_log_ppl", "Mean over sequences of the rollout's per-token-mean −logp", "nats", ALL,
       _METRICS, True),
    _k("rollout_corr/log_ppl_diff", "Mean over sequences of d = log ppl_train − log ppl_roll (> 0: training finds the "
       "responses less likely)", "nats", ALL, _METRICS, True),
    _k("rollout_corr/log_ppl_diff_max", "Largest per-sequence d = log ppl_train − log ppl_roll", "nats", ALL, _METRICS,
       True),
    _k("rollout_corr/log_ppl_diff_min", "Smallest per-sequence d = log ppl_train − log ppl_roll", "nats", ALL, _METRICS,
       True),
    _k("rollout_corr/training_ppl", "Mean over sequences of the training path's perplexity", "perplexity", ALL,
       _METRICS, True),
    _k("rollout_corr/rollout_ppl", "Mean over sequences of the rollout's perplexity", "perplexity", ALL, _METRICS,
       True),
    _k("rollout_corr/ppl_ratio", "Mean over sequences of ppl_train / ppl_roll", "ratio", ALL, _METRICS, True),
    _k("training/rollout_probs_diff_max", "Largest |p_train − p_roll| of a sampled token", "probability", ALL,
       _METRICS, True),
    _k("training/rollout_probs_diff_mean", "Token mean of |p_train − p_roll|", "probability", ALL, _METRICS, True),
    _k("training/rollout_probs_diff_std", "Standard deviation (ddof 1) of |p_train − p_roll|", "probability", ALL,
       _METRICS, True),
    _k("training/rollout_probs_diff_valid", "1 when there were tokens to compare (verl's flag)", "flag",
       ALL, _METRICS, True),
    _k("training/rollout_actor_probs_pearson_corr", "Pearson correlation of p_train and p_roll over the tokens",
       "correlation", ALL, _METRICS, True),
    _k(LAG_K3_KL, "Policy lag's off-policy drift: k3 between the lagged behaviour policy and the "
       "current one, both on the training path (r = logp_train(current) − logp_train(behaviour)); written with "
       "`rollout.policy_lag` > 0, or by the live monitor given the behaviour policy's training log-probs", "nats",
       ("run", "live"), _METRICS),
    _k(TIM_K3_KL, "Training–inference mismatch alone under policy lag: k3 between the rollout's "
       "recorded log-probs and the behaviour policy's on the training path; `rollout_corr/k3_kl` is the total "
       "(rollout vs current)", "nats", ("run", "live"), _METRICS),
    _k(LOG_PPL_ABS_DIFF_SUM, "Sequence-sum form: mean over sequences of |Σ r| (paper 003, eq. 8)",
       "nats", ALL, _METRICS),
    _k("mismatch/bitwise_equal_frac", "Fraction of tokens whose two log-probs are bitwise equal", "fraction", ALL,
       _METRICS),
    _k("mismatch/abs_dlogp_mean", "Token mean of |r|", "nats", ALL, _METRICS),
    _k("mismatch/abs_dlogp_max", "Largest |r|", "nats", ALL, _METRICS),
    _k("mismatch/abs_dlogp_p99", "99th percentile of |r|", "nats", ALL, _METRICS),
    _k("mismatch/tokens", "Number of tokens compared", "count", ALL, _METRICS),
    # --- the raw token ratio ρ_t = exp(r) before any clamp or mask (rl/raw_ratios.py) ------------------------------
    _k(RAW_RATIO_MIN, "Smallest raw token ratio ρ_t = exp(r), unclamped (float64)", "ratio", ALL, _RAW),
    _k(RAW_RATIO_MAX, "Largest raw token ratio ρ_t = exp(r), unclamped (inf when r > 709)", "ratio", ALL, _RAW),
    *(_k(raw_ratio_quantile_key(q), f"{q:g}-quantile of the raw token ratio ρ_t = exp(r), unclamped (linear "
         "interpolation between order statistics, numpy's default)", "ratio", ALL, _RAW)
      for q in RAW_RATIO_QUANTILES),
    _k(raw_ratio_affected_key("<method>"), "Fraction of tokens whose loss term `correction.method: <method>` (each "
       "registered method but `none`, at its default threshold / band) would change: weight truncated (TIS), zeroed "
       "(IcePop) or token rejected (MIS, geo-RS); computed by the shipped correction on the raw ratios", "fraction",
       ALL, _RAW),
    _k("mismatch/abs_dlogp_bucket/<lo>-<hi>", "Mean |r| over tokens whose training-path probability lies in "
       "[lo, hi) (last bucket closed); written for non-empty buckets only", "nats", ALL, _METRICS),
    _k("mismatch/tokens_bucket/<lo>-<hi>", "Number of tokens whose training-path probability lies in [lo, hi)",
       "count", ALL, _METRICS),
    _k("mismatch/first_minibatch_ratio_exact", "1 when the first mini-batch's PPO ratio is exactly 1 on every token "
       "(exact backend, no injection: the run stops otherwise)", "flag", RUN, _TRAINER, minibatches="min"),
    # --- full-vocabulary comparison (rl/metrics.full_vocab_metrics; measure, compare with [B, T, V] inputs) -----
    _k("mismatch/full_vocab_positions", "Number of positions whose whole next-token distributions were compared",
       "count", ("measure", "compare"), _METRICS),
    _k("mismatch/full_vocab_kl_mean", "Mean over positions of KL(μ‖π) of the full distributions", "nats",
       ("measure", "compare"), _METRICS),
    _k("mismatch/full_vocab_kl_max", "Largest full-distribution KL(μ‖π) of a position", "nats",
       ("measure", "compare"), _METRICS),
    _k("mismatch/full_vocab_tv_mean", "Mean over positions of the total variation ½Σ|μ − π|", "probability",
       ("measure", "compare"), _METRICS),
    _k("mismatch/full_vocab_tv_max", "Largest total variation of a position", "probability",
       ("measure", "compare"), _METRICS),
    _k("mismatch/full_vocab_argmax_flip_frac", "Fraction of positions where argmax μ ≠ argmax π (ties: lowest index)",
       "fraction", ("measure", "compare"), _METRICS),
    _k(full_vocab_overlap_key("<k>"), "Mean over positions of |top_k(μ) ∩ top_k(π)| / k", "fraction",
       ("measure", "compare"), _METRICS),
    # --- verl's rollout-correction statistics (rl/corrections.py; with `correction.rollout_is`), over the step's ----
    # whole batch (each token once, whatever `algorithm.mini_batches` and `ppo_epochs`): minibatches="step" -------
    _k("rollout_corr/rollout_is_mean", "Token mean of the IS weights over all valid tokens, before batch "
       "normalisation", "weight", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_std", "Standard deviation of the IS weights over valid tokens", "weight", RUN, _CORR,
       True, "step"),
    _k("rollout_corr/rollout_is_max", "Largest IS weight (for `sequence`: the raw sequence ratio)", "weight", RUN,
       _CORR, True, "step"),
    _k("rollout_corr/rollout_is_min", "Smallest IS weight", "weight", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_eff_sample_size", "verl's effective sample size 1 / mean(w̃²) of the normalised "
       "weights (inf when every weight is 0)", "fraction", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_ratio_fraction_high", "Fraction of ratios above the upper threshold (sequences for "
       "`sequence`)", "fraction", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_ratio_fraction_low", "Fraction of ratios below the lower threshold", "fraction",
       RUN, _CORR, True, "step"),
    *(_k(f"rollout_corr/rollout_is_seq_{s}", f"{w} of the per-sequence mean weight", "weight", RUN, _CORR, True,
         "step")
      for s, w in (("mean", "Mean"), ("std", "Standard deviation (ddof 1)"), ("max", "Maximum"), ("min", "Minimum"),
                   ("max_deviation", "Largest |x − 1|"))),
    _k("rollout_corr/rollout_is_seq_fraction_high", "Fraction of sequences whose raw mean ratio is above the upper "
       "threshold", "fraction", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_seq_fraction_low", "Fraction of sequences whose raw mean ratio is below the lower "
       "threshold", "fraction", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_oob_ratio", "IcePop: fraction of tokens whose ratio is outside [a, b]", "fraction",
       RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_is_batch_norm_factor", "verl's batch-normalisation divisor of the weights, their mean "
       "as verl computes it; written only with `correction.batch_normalize` (verl: `rollout_is_batch_normalize`), "
       "and 1 when that mean is at most 1e-8 (every weight zeroed, e.g. by IcePop): the weights are then left as "
       "they are",
       "weight", RUN, _CORR, True, "step"),
    # --- verl's rejection-sampling statistics (with `correction.rollout_rs`), per option and combined -----------
    *(_k(f"rollout_corr/rollout_rs_<option>_{s}", f"Rejection option <option>: {w}", u, RUN, _CORR, True,
         "step")
      for s, w, u in (
          ("mean", "token mean of its statistic", "statistic"),
          ("std", "standard deviation of its statistic", "statistic"),
          ("max", "largest value of its statistic", "statistic"),
          ("min", "smallest value of its statistic", "statistic"),
          ("fraction_high", "fraction above the upper bound", "fraction"),
          ("fraction_low", "fraction below the lower bound (k1 options)", "fraction"),
          ("seq_mean", "mean of the per-sequence statistic", "statistic"),
          ("seq_std", "standard deviation (ddof 1) of the per-sequence statistic", "statistic"),
          ("seq_max", "largest per-sequence statistic", "statistic"),
          ("seq_min", "smallest per-sequence statistic", "statistic"),
          ("seq_max_deviation", "largest |per-sequence statistic|", "statistic"),
          ("seq_fraction_high", "fraction of sequences above the upper bound", "fraction"),
          ("seq_fraction_low", "fraction of sequences below the lower bound", "fraction"),
          ("masked_fraction", "fraction of tokens it masked", "fraction"),
          ("seq_masked_fraction", "fraction of sequences with a token it masked", "fraction"))),
    _k("rollout_corr/rollout_rs_masked_fraction", "Fraction of tokens masked by all rejection options together",
       "fraction", RUN, _CORR, True, "step"),
    _k("rollout_corr/rollout_rs_seq_masked_fraction", "Fraction of sequences with any token masked", "fraction", RUN,
       _CORR, True, "step"),
    # --- vexact's own view of what the loss applied (rl/corrections.py; with any correction) --------------------
    *(_k(f"correction/weight_{s}", f"{w} of the kept tokens' weights after normalisation", "weight", RUN, _CORR,
         minibatches="step")
      for s, w in (("mean", "Mean"), ("std", "Standard deviation (ddof 0)"), ("min", "Minimum"), ("max", "Maximum"))),
    _k("correction/weight_eff_sample_size", "(Σw)² / (N·Σw²) of the kept tokens' weights, in [0, 1]; 0 when every "
       "kept weight is 0 (IcePop zeroed them all)", "fraction", RUN, _CORR, minibatches="step"),
    _k("correction/truncated_token_frac", "Fraction of tokens whose weight was truncated (TIS)", "fraction", RUN,
       _CORR, minibatches="step"),
    _k("correction/zeroed_token_frac", "Fraction of kept tokens whose weight was zeroed (IcePop)", "fraction", RUN,
       _CORR, minibatches="step"),
    _k("correction/rejected_token_frac", "Fraction of tokens rejected (masked out of the loss)", "fraction", RUN,
       _CORR, minibatches="step"),
    _k("correction/rejected_seq_frac", "Fraction of non-empty sequences that lost every token", "fraction", RUN,
       _CORR, minibatches="step"),
    # --- vexact.live: the user's own trainer, once per step ---------------------------------------------------------
    _k("live/sequences", "Responses compared this step", "count", LIVE, "live.py"),
    _k("live/mean_response_length", "Mean response length (masked tokens per response) this step", "tokens", LIVE,
       "live.py"),
    _k("live/gates_failed", "Gates that failed this step (all of them when the metrics could not be computed)",
       "count", LIVE, "live.py"),
    _k("live/nonfinite", "NaN or infinite log-probs this step (written when there were any; no metrics then)",
       "count", LIVE, "live.py"),
    _k(LIVE_SAMPLED_SEQUENCES, "Responses whose training-side log-probs were scored this step, of a sampled "
       "step (`LiveMonitor(sample_fraction=, every=)`, `step_sampled`): the row's metrics are theirs", "count", LIVE,
       "live.py"),
    _k(LIVE_SAMPLE_FRACTION, "Fraction of the step's responses scored (`live/sampled_sequences` / the batch's "
       "responses), of a sampled step", "fraction", LIVE, "live.py"),
    _k("trl/global_step", "TRL's optimiser step when the batch was generated (the TRL hook's extra key; the row's "
       "`step` counts generation batches)", "step", LIVE, "integrations/trl.py"),
    # --- the vocabulary tail (rl/vocab_tail.py; written when `task.distractors` > 0) -------------------------------
    _k(TAIL_MASS_MEAN, "Token mean over generated tokens of the rollout distribution's probability of the "
       "distractor tokens (μ after injection and temperature)", "probability", RUN, _TAIL),
    _k(TAIL_MASS_MAX, "Largest distractor probability of the rollout distribution at one generated token",
       "probability", RUN, _TAIL),
    _k(TAIL_TOKEN_FRAC, "Fraction of generated tokens that are distractors", "fraction", RUN, _TAIL),
    _k(TAIL_RESPONSE_FRAC, "Fraction of responses holding a distractor (each earns reward 0)", "fraction", RUN,
       _TAIL),
    # --- MoE routing: rollout vs training path (rl/metrics.py; written for MoE models) ---------------------------
    _k(ROUTING_FLIP_RATE, "Fraction of router decisions (token x MoE layer, every position the forward reads) whose "
       "expert set differs between the rollout and the training path's own router (pre-update weights)", "fraction",
       RUN, _METRICS),
    _k(ROUTING_TOKEN_FLIP_FRAC, "Fraction of positions whose expert set differs between rollout and training in at "
       "least one MoE layer", "fraction", RUN, _METRICS),
    # --- injection, LR schedule ---------------------------------------------------------------------------------
    _k("inject/value", "The injection knob in effect this step (after `onset_step` / `ramp_steps`)", "knob", RUN,
       _STEP),
    _k("inject/active", "1 when the injector changed the rollout this step", "flag", RUN, _STEP),
    _k("lr_schedule/triggered", "1 once a triggered LR schedule (`length_triggered`, `mismatch_triggered`) fired",
       "flag", RUN, "rl/schedules.py"),
    # --- clean evaluation (every `logging.eval_every` steps, exact path) ------------------------------------------
    _k("eval/reward_mean", "Mean reward on the held-out prompts, sampled at the rollout temperature", "reward", RUN,
       _TRAINER),
    _k("eval/accuracy", "Fraction of held-out prompts answered exactly right (sampled)", "fraction", RUN, _TRAINER),
    _k("eval/greedy_reward_mean", "Mean reward on the held-out prompts, greedy decoding", "reward", RUN, _TRAINER),
    _k("eval/greedy_accuracy", "Fraction of held-out prompts answered exactly right (greedy)", "fraction", RUN,
       _TRAINER),
    _k("eval/response_length_mean", "Mean response length on the held-out prompts (sampled)", "tokens", RUN,
       _TRAINER),
    # --- sampled rescoring in bypass mode (rl/step_metrics.py; written when `monitor.sample_fraction` < 1 or
    # `monitor.every` > 1) -----------------------------------------------------------------------------------------
    _k(MONITOR_SAMPLED_SEQUENCES, "Sequences rescored on the training path for the mismatch metrics this step (0 on "
       "a step `monitor.every` skips: it logs no mismatch metric); the `rollout_corr/*`, `training/*` and "
       "`mismatch/*` metrics are theirs", "count", RUN, _STEP),
    _k(MONITOR_SAMPLE_FRACTION, "`monitor/sampled_sequences` / the step's sequences (0 on a skipped step)",
       "fraction", RUN, _STEP),
    # --- wall-clock timings (excluded from determinism checks) ----------------------------------------------------
    _k("timing/rollout", "Seconds spent generating the step's rollouts", "s", RUN, _TRAINER, True),
    _k("timing/old_logprobs", "Seconds spent on the old log-probs (recompute, or taken from the rollout; with "
       "`rollout.policy_lag` > 0 also scoring the behaviour policy on the training path)", "s", RUN,
       _SCORING, True),
    _k(TIMING_MONITOR, "Seconds spent rescoring the monitor's sample on the training path before the update "
       "(`monitor.sample_fraction` < 1 or `monitor.every` > 1; with `rollout.policy_lag` > 0 the behaviour policy's "
       "scoring of it too); not part of timing/old_logprobs", "s", RUN, _SCORING),
    _k("timing/update", "Seconds spent on the PPO update", "s", RUN, _TRAINER, True),
    _k("timing/grad_reduce", "Seconds of the update spent summing the gradient leaves into one gradient: this "
       "rank's tree sum, then the sum across ranks (on one process, the local tree sum alone: not 0)", "s", RUN,
       _TRAINER),
    _k("timing/step", "Seconds of the whole step", "s", RUN, _TRAINER, True),
    _k("timing/eval", "Seconds spent on the clean evaluation (evaluation steps only)", "s", RUN, _TRAINER, True),
    _k("timing/weight_sync", "Seconds of the rollout spent syncing the policy's weights to an outside engine "
       "(rollout.engine vllm; part of timing/rollout)", "s", RUN, "integrations/vllm_rollout.py"),
)
"""The registry: one entry per key (or per family of keys with a ``<placeholder>``)."""

RENAMED_METRICS: dict[str, str] = {
    "rollout_corr/lag_k3_kl": LAG_K3_KL,
    "rollout_corr/tim_k3_kl": TIM_K3_KL,
    "rollout_corr/log_ppl_abs_diff_sum": LOG_PPL_ABS_DIFF_SUM,
}
"""Old key -> its key now. vexact's own metrics once sat under verl's ``rollout_corr/`` prefix; they live under
``mismatch/`` (``rollout_corr/*`` and ``training/*`` hold verl's names only). For a deprecation period the logged
stream (``metrics.jsonl`` of ``vexact run`` and ``LiveMonitor``, and their TensorBoard / W&B views) carries the old
name beside the new one (``with_deprecated_names``), so dashboards built on it keep working; the reference page
lists the old names as deprecated. Readers of metrics.jsonl (``records.metrics_log.read_metrics``) see the new names
only, from old files too (``current_names``). A config value naming an old key (``collapse.metric``) still works,
with a FutureWarning."""


def current_names(row: dict) -> dict:
    """``row`` with every old key of ``RENAMED_METRICS`` under its key now (a row that has both, as the deprecation
    period writes them, keeps the new one: the two hold the same value)."""
    if not any(old in row for old in RENAMED_METRICS):
        return row
    out = {}
    for key, value in row.items():
        new = RENAMED_METRICS.get(key)
        if new is None:
            out[key] = value
        elif new not in row:
            out[new] = value
    return out


def with_deprecated_names(row: dict) -> dict:
    """``row`` plus, for each renamed key it holds, the same value under the old key (the deprecation period's
    copy for dashboards that read the old name)."""
    old = {o: row[n] for o, n in RENAMED_METRICS.items() if n in row}
    return {**row, **old} if old else row


GROUPS: dict[str, str] = {
    "reward": "Reward of the step's rollouts",
    "response_length": "Response length of the step's rollouts",
    "actor": "The PPO update",
    "rollout_corr": "Training–inference mismatch (verl's names and definitions)",
    "training": "Probability differences (verl's names and definitions)",
    "mismatch": "Training–inference mismatch (vexact's own)",
    "correction": "Rollout correction: what the loss applied (vexact's own)",
    "tail": "The vocabulary tail (`task.distractors`)",
    "routing": "Mixture-of-experts routing (`model.num_experts` > 0)",
    "monitor": "Sampled rescoring in bypass mode (`monitor.*`)",
    "inject": "Controlled mismatch",
    "lr_schedule": "LR schedule",
    "eval": "Clean evaluation",
    "timing": "Timings",
    "live": "vexact.live in your own trainer",
    "trl": "The TRL hook (vexact.integrations.trl)",
}
"""One heading per key prefix, in the order the reference page lists them."""

_NUMBER = r"[0-9][0-9.e+\-]*"


@cache
def _placeholders() -> dict[str, str]:
    return {"<lo>-<hi>": f"{_NUMBER}-{_NUMBER}", "<option>": "(?:" + "|".join(map(re.escape, RS_OPTIONS)) + ")",
            "<k>": "[0-9]+",
            "<method>": "[a-z0-9_]+"}


@cache
def _patterns() -> tuple[tuple[re.Pattern[str], MetricKey], ...]:
    out = []
    for key in KEYS:
        pattern = re.escape(key.name)
        for ph, rx in _placeholders().items():
            pattern = pattern.replace(re.escape(ph), rx)
        out.append((re.compile(pattern + r"\Z"), key))
    return tuple(out)


def find(name: str) -> MetricKey | None:
    """The registry entry a written key belongs to (a placeholder entry matches every instance), or None."""
    for pattern, key in _patterns():
        if pattern.match(name):
            return key
    return None


def unregistered(names: object) -> list[str]:
    """The names among ``names`` (an iterable of written keys; ``step`` is the row index, not a metric) that no
    registry entry covers, sorted."""
    return sorted(n for n in set(names) if n != "step" and find(n) is None)  # type: ignore[arg-type]
