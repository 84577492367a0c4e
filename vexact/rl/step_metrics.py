"""A step's metrics stage: its line of metrics.jsonl, from the values the earlier stages produced.

The mismatch is between the two paths at the same (pre-update) weights: the training path's log-probs are the
pre-update scoring's when one was made (``vexact.rl.scoring``), else the update's first pass (made at the pre-update
weights); with ``monitor.*`` sampling, those of the sample's sequences only, and none on a step the monitor skips.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..metric_keys import (
    GRAD_NORM,
    GRAD_NORM_MAX,
    INJECT_ACTIVE,
    INJECT_VALUE,
    LR,
    MONITOR_SAMPLE_FRACTION,
    MONITOR_SAMPLED_SEQUENCES,
)
from .collect import RolloutBatch
from .config_schema import CorrectionSection
from .corrections import Correction, step_correction_metrics
from .inject import RolloutPlan
from .metrics import lag_split_metrics, reduce_minibatch_stats, rollout_batch_metrics, routing_metrics
from .raw_ratios import sequence_ratio_metrics
from .scoring import PreUpdate

__all__ = ["UpdateRecord", "step_metrics", "update_metrics"]


@dataclass
class UpdateRecord:
    """What the update left for the step's line: per PPO mini-batch of every epoch, in order, its stats (the loss's,
    and ``actor/grad_norm``) and the tokens of its token-mean stats (``MinibatchLoss.counts``); the first epoch's
    mini-batches' sequences and corrections (each sequence once); the seconds spent summing gradients."""

    stats: list[dict[str, float]]
    counts: list[dict[str, int]]
    corrections: list[tuple[list[int], Correction]]
    grad_reduce_seconds: float


def update_metrics(update: UpdateRecord, train_logp: list[Tensor] | None, roll_logp: list[Tensor],
                   correction: CorrectionSection) -> dict[str, float]:
    """The update's ``actor/*`` and correction metrics of the step: each key of the mini-batches' stats reduced as
    the metric registry says (``reduce_minibatch_stats``), the rollout correction's statistics over the step's whole
    batch (``step_correction_metrics``, on ``train_logp``: every sequence's pre-update training-path log-probs; with
    one mini-batch, its own statistics are the whole batch's), and ``actor/grad_norm_max``."""
    out = reduce_minibatch_stats(update.stats, update.counts)
    if len(update.corrections) > 1:
        if train_logp is None:
            raise ValueError("the step's correction statistics need every sequence's pre-update log-probs")
        out.update(step_correction_metrics(train_logp, roll_logp, update.corrections, correction))
    out[GRAD_NORM_MAX] = max(part[GRAD_NORM] for part in update.stats)
    return out


def step_metrics(step: int, batch: RolloutBatch, scored: PreUpdate, first_pass: list[Tensor], update: UpdateRecord,
                 *, lr: float, injected: RolloutPlan | None, policy_lag: int, correction: CorrectionSection) -> dict:
    """The step's metrics (timings aside): reward and length, mismatch and raw ratios, the lag split
    (``policy_lag`` > 0), the monitor's sample, the vocabulary tail, MoE routing, the LR, the injection
    (``injected``: the step's plan when injection is on, else None) and the ``update``'s stats (``update_metrics``).
    ``first_pass``: each sequence's log-probs from the update's first pass."""
    log_ratio_bound = correction.log_ratio_bound
    train_logp = scored.anchors.pre_update if scored.anchors.pre_update is not None else first_pass
    roll_logp, behaviour_logp, rows = batch.logprobs, scored.behaviour, scored.rows
    if scored.sampling:  # the sample's sequences only; none on a step the monitor skips
        roll_logp = None if rows is None else [batch.logprobs[i] for i in rows]
        train_logp = None if rows is None else scored.sample
        if train_logp is None and rows is not None:  # bypass, one pass: the update's first pass, at θ_old
            train_logp = [first_pass[i] for i in rows]
    metrics: dict = {"step": step}
    metrics.update(rollout_batch_metrics(batch.rewards, batch.lengths, batch.finished, train_logp, roll_logp,
                                         log_ratio_bound=log_ratio_bound))
    if roll_logp is not None:
        metrics.update(sequence_ratio_metrics(train_logp, roll_logp))
        if policy_lag:  # on a step the policy is not lagged yet, the behaviour policy is the current one
            metrics.update(lag_split_metrics(train_logp, train_logp if behaviour_logp is None else behaviour_logp,
                                             roll_logp))
    if scored.sampling:
        metrics[MONITOR_SAMPLED_SEQUENCES] = 0 if rows is None else len(rows)
        metrics[MONITOR_SAMPLE_FRACTION] = 0.0 if rows is None else len(rows) / len(batch.responses)
    metrics.update(batch.tail_metrics())  # task.distractors > 0: the rollout distribution's tail (vocab_tail)
    if scored.routing is not None:  # MoE: how often the rollout's routing differs from the training router's own
        metrics.update(routing_metrics(batch.routing, scored.routing))
    metrics[LR] = lr
    if injected is not None:
        metrics[INJECT_VALUE] = injected.value
        metrics[INJECT_ACTIVE] = float(injected.active)
    metrics.update(update_metrics(update, scored.anchors.pre_update, batch.logprobs, correction))
    return metrics
