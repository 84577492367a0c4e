"""The raw importance ratios ρ_t = π_train / μ_roll before any clamp or mask, and what each shipped correction
would truncate or mask of them (``mismatch/ratio_*``).

verl's ``rollout_corr/rollout_is_*`` and TRL's ``sampling/importance_sampling_ratio/*`` describe the weights after
the configured correction truncated them (and only with a correction on); these keys describe the ratios the
corrections start from, so a run, ``vexact compare`` and the live monitor show how far the tail reaches and how much
of it each correction would cut, whichever one (if any) the trainer runs.

* ``mismatch/ratio_min``, ``mismatch/ratio_max``, ``mismatch/ratio_p<q>`` (``RAW_RATIO_QUANTILES``): over tokens,
  of ρ_t = exp(logp_train − logp_roll) in float64, unclamped (``metrics.quantile_sorted``: linear interpolation
  between order statistics, numpy's default);
* ``mismatch/ratio_affected_frac/<method>``: for each ``correction.method`` of the registry (``CORRECTION_METHODS``)
  but ``none``, at its default setting (``threshold`` 2, the method's own band), the fraction of tokens whose loss
  term it changes -- weight truncated (TIS), zeroed (IcePop) or token rejected (MIS, geo-RS) -- computed by the
  shipped ``rollout_correction`` itself, so the count is what the loss would do. A run's config is refused when a
  registered method's default plan does not resolve (a plugin's ``to_verl`` that fails), naming the method, so no
  step fails on a method the run does not even select and every run logs the same keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..metric_keys import (
    RAW_RATIO_MAX,
    RAW_RATIO_MIN,
    RAW_RATIO_QUANTILES,
    raw_ratio_affected_key,
    raw_ratio_quantile_key,
)
from .config_schema import CorrectionSection
from .corrections import rollout_correction
from .metrics import quantile_sorted
from .registries import CORRECTION_METHODS

NO_CORRECTION = "none"


def raw_ratio_metrics(logp_train: Tensor, logp_roll: Tensor, lengths: list[int]) -> dict[str, float]:
    """``mismatch/ratio_*`` of flat per-token log-probs (training path first, rollout second; ``lengths``: the tokens
    of each sequence, in order). Raises ValueError on shapes that do not match ``lengths`` or no tokens."""
    if logp_train.shape != logp_roll.shape or logp_train.dim() != 1 or sum(lengths) != logp_train.numel():
        raise ValueError(f"log-probs of {tuple(logp_train.shape)} (training) and {tuple(logp_roll.shape)} (rollout) "
                         f"do not match {len(lengths)} sequences of {sum(lengths)} tokens")
    if logp_train.numel() == 0:
        raise ValueError("no tokens to compare")
    train = logp_train.detach().cpu().double()
    roll = logp_roll.detach().cpu().double()
    ratio = torch.exp(train - roll).sort().values  # unclamped: an overflow to inf is what the raw ratio is
    out: dict[str, float] = {RAW_RATIO_MIN: float(ratio[0]), RAW_RATIO_MAX: float(ratio[-1])}
    for q in RAW_RATIO_QUANTILES:  # one sort for every quantile
        out[raw_ratio_quantile_key(q)] = quantile_sorted(ratio, q)
    del ratio
    for name in CORRECTION_METHODS.names():
        if name != NO_CORRECTION:
            out[raw_ratio_affected_key(name)] = affected_fraction(train, roll, lengths, name)
    return out


def sequence_ratio_metrics(logp_train: list[Tensor], logp_roll: list[Tensor]) -> dict[str, float]:
    """``raw_ratio_metrics`` of per-sequence log-probs (training path first, rollout second)."""
    return raw_ratio_metrics(torch.cat(list(logp_train)), torch.cat(list(logp_roll)),
                             [int(t.numel()) for t in logp_train])


def affected_fraction(logp_train: Tensor, logp_roll: Tensor, lengths: list[int], method: str) -> float:
    """The fraction of tokens whose loss term ``correction.method: <method>`` (default settings) changes: weight
    truncated, weight zeroed, or token rejected."""
    c = rollout_correction(logp_train, logp_roll, lengths, CorrectionSection(method=method))
    affected = ~c.keep
    if c.truncated is not None:
        affected |= c.truncated
    if c.reweights:
        affected |= c.weights == 0
    return int(affected.sum()) / affected.numel()
