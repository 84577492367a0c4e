"""Rollout corrections: importance weights and rejection masks on the rollout/training ratio.

For each generated token t the rollout path μ recorded ``logp_roll(t)``, and the training path π at the same
(pre-update) weights gives ``logp_train(t)``. The mismatch ratio is

    ρ_t = exp(clamp(logp_train - logp_roll, ±bound))        (bound = 20, verl's safety bound)
    ρ_seq = exp(clamp(Σ_t log ρ_t, ±bound))                  ρ_geo = exp(mean_t log ρ_t)

A correction turns ρ into a per-token **weight** w_t ≥ 0 and a **keep** mask (rejected tokens leave the loss,
numerator and denominator). The methods peers ship, with ``C = correction.threshold`` and ``[a, b] = band``:

=============  ========================================  ===================================================
method         weight w_t                                rejected (keep = False)
=============  ========================================  ===================================================
token_tis      min(ρ_t, C)                               nothing
seq_tis        min(ρ_seq, C), same for all tokens        nothing
token_mis      ρ_t                                       tokens with ρ_t > C
seq_mis        ρ_seq                                     whole sequences with ρ_seq > C
icepop         ρ_t                                       tokens with ρ_t outside [a, b]   (default [0.5, 5])
geo_rs         none (rejection only)                     whole sequences with ρ_geo outside [a, b]
=============  ========================================  ===================================================

How the weight enters the loss depends on where the PPO ratio's anchor ("old log-probs") comes from:

* ``algorithm.old_logprobs: recompute`` (decoupled PPO, three policies): the ratio is π_θ/π_old and the weight
  multiplies the clipped per-token loss from outside, as in verl's decoupled mode.
* ``algorithm.old_logprobs: rollout`` (bypass): the ratio π_θ/μ factorises as (π_θ/π_old)·ρ_t. The correction
  replaces the mismatch factor ρ_t by w_t inside the ratio, so the clip acts on the corrected ratio:
  ratio = exp(logp - logp_train)·w_t. (MIS and IcePop keep w_t = ρ_t, so their kept tokens see the plain
  bypass ratio; seq_tis and seq_mis put the sequence's ρ_seq in place of each token's ρ_t.)
* ``geo_rs`` only rejects (``Correction.reweights`` is False): the kept tokens get the uncorrected loss of
  either mode, as verl's geometric rejection sampling without IS weights.

``batch_normalize`` divides the weights by their mean over the kept tokens (over kept sequences for seq_tis),
so the average weight is 1.

With zero mismatch (logp_train == logp_roll bit for bit) every ρ is exactly 1.0, every weight is exactly 1.0 and
nothing is rejected, so each correction is an exact no-op: the trainer's loss is bitwise that of no correction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import CorrectionSection
from .metrics import is_weight_stats

METHODS = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_rs")
DEFAULT_BANDS = {"icepop": (0.5, 5.0), "geo_rs": (0.999, 1.001)}
"""Default [a, b] per band method: IcePop's published band, and verl's typical geometric threshold 1.001."""

PREFIX = "rollout_corr/"


@dataclass
class Correction:
    """Per-token weights (0 where rejected) and keep mask for a flat batch of tokens, plus metrics."""

    weights: Tensor
    keep: Tensor
    metrics: dict[str, float]
    reweights: bool = True  # False: rejection only -- the loss uses no weight, just drops the rejected tokens

    @property
    def rejects_any(self) -> bool:
        return not bool(self.keep.all())


def band_for(cfg: CorrectionSection) -> tuple[float, float]:
    """The [a, b] band a band method uses: the configured one or the method's default."""
    if cfg.band is not None:
        return float(cfg.band[0]), float(cfg.band[1])
    return DEFAULT_BANDS[cfg.method]


def rollout_correction(logp_train: Tensor, logp_roll: Tensor, lengths: list[int],
                       cfg: CorrectionSection) -> Correction:
    """Weights, keep mask and ``rollout_corr/*`` metrics for one batch.

    ``logp_train`` and ``logp_roll``: flat per-token log-probs of the same tokens (training path at the
    pre-update weights, and the rollout path); ``lengths``: tokens per sequence, in order, summing to their
    length. Computed in float64; the weights come back in ``logp_train``'s dtype, detached.
    """
    if cfg.method not in METHODS:
        raise ValueError(f"unknown correction method {cfg.method!r}; expected one of {', '.join(METHODS)}")
    if logp_train.shape != logp_roll.shape or logp_train.dim() != 1:
        raise ValueError(f"need two flat log-prob tensors of one shape, got {tuple(logp_train.shape)} and "
                         f"{tuple(logp_roll.shape)}")
    if sum(lengths) != logp_train.numel():
        raise ValueError(f"lengths sum to {sum(lengths)} but there are {logp_train.numel()} tokens")
    bound = cfg.log_ratio_bound
    # float64 throughout, so sums and means of many weights stay exact enough (and exactly 1 for ρ ≡ 1)
    log_rho = (logp_train.detach().double() - logp_roll.detach().double()).clamp(-bound, bound)
    rho = torch.exp(log_rho)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    n_seq = len(lengths)
    counts = torch.tensor(lengths, dtype=log_rho.dtype).clamp(min=1)  # empty sequences: no division by 0
    log_rho_seq_sum = torch.zeros(n_seq, dtype=log_rho.dtype).index_add_(0, seq_id, log_rho)
    rho_seq = torch.exp(log_rho_seq_sum.clamp(-bound, bound))

    keep = torch.ones_like(rho, dtype=torch.bool)
    truncated = torch.zeros_like(keep)
    weights = rho
    method = cfg.method
    C = cfg.threshold
    if method == "token_tis":
        truncated = rho > C
        weights = rho.clamp(max=C)
    elif method == "seq_tis":
        truncated = (rho_seq > C)[seq_id]
        weights = rho_seq.clamp(max=C)[seq_id]
    elif method == "token_mis":
        keep = rho <= C
    elif method == "seq_mis":
        keep = (rho_seq <= C)[seq_id]
        weights = rho_seq[seq_id]
    elif method == "icepop":
        lo, hi = band_for(cfg)
        keep = (rho >= lo) & (rho <= hi)
    elif method == "geo_rs":
        lo, hi = band_for(cfg)
        rho_geo = torch.exp(log_rho_seq_sum / counts)
        keep = ((rho_geo >= lo) & (rho_geo <= hi))[seq_id]
        weights = torch.ones_like(rho)

    if cfg.batch_normalize and bool(keep.any()):
        if method == "seq_tis":  # one weight per sequence: normalise over sequences, not tokens
            per_seq = weights.new_zeros(n_seq).index_add_(0, seq_id, weights) / counts
            kept_seq = torch.tensor([n > 0 for n in lengths])
            weights = weights / per_seq[kept_seq].mean()
        else:
            weights = weights / weights[keep].mean()
    weights = torch.where(keep, weights, torch.zeros_like(weights))

    metrics = _metrics(rho, rho_seq, weights, keep, truncated, seq_id, lengths, C)
    return Correction(weights=weights.to(logp_train.dtype), keep=keep, metrics=metrics,
                      reweights=method != "geo_rs")


def _metrics(rho: Tensor, rho_seq: Tensor, weights: Tensor, keep: Tensor, truncated: Tensor, seq_id: Tensor,
             lengths: list[int], threshold: float) -> dict[str, float]:
    """verl-style ``rollout_corr/rollout_is_*`` weight stats plus what the correction did."""
    n = rho.numel()
    out: dict[str, float] = {}
    if n == 0:
        return out
    kept_weights = weights[keep]
    if kept_weights.numel():
        out.update(is_weight_stats(kept_weights, PREFIX + "rollout_is"))
    kept_per_seq = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, seq_id, keep.long())
    nonempty = torch.tensor([length > 0 for length in lengths])
    out.update({
        PREFIX + "rollout_is_ratio_frac_high": int((rho > threshold).sum()) / n,  # raw ρ_t above C
        PREFIX + "rollout_is_ratio_frac_low": int((rho < 1.0 / threshold).sum()) / n,  # raw ρ_t below 1/C
        PREFIX + "rollout_is_seq_ratio_max": float(rho_seq.max()) if rho_seq.numel() else float("nan"),
        PREFIX + "rollout_is_truncated_frac": int(truncated.sum()) / n,
        PREFIX + "rollout_rs_masked_token_frac": int((~keep).sum()) / n,
        PREFIX + "rollout_rs_rejected_seq_frac": int(((kept_per_seq == 0) & nonempty).sum()) / max(
            int(nonempty.sum()), 1),
    })
    return out
