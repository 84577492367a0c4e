"""The objective: the loss of a step's PPO mini-batches, with rollout corrections.

The plain functions (``ppo_token_loss``, ``aggregate``, ``k3_penalty``) take tensors, so they can be tested on
hand-built numbers. The choices are registered entries: the loss aggregations of ``algorithm.loss_agg`` and the
bypass losses of ``correction.loss_type`` (here, in ``LOSS_AGGREGATIONS`` / ``BYPASS_LOSSES``;
``register_loss_aggregation``, ``register_bypass_loss`` add one). The loss takes the step's advantages
(``vexact.rl.advantages.compute_advantages``, re-exported here) and the anchors of the PPO ratio, scored before the
update (``vexact.rl.scoring``: where the "old log-probs" come from, ``Anchors``). ``Objective`` composes them for
one run's ``algorithm`` and ``correction`` sections and owns the decisions about them:

* when the first mini-batch's ratio must be exactly 1 (exact training kernels, and the anchor from the exact
  training path or from a rollout path identical to it): a violation stops the run;
* how a correction (``vexact.rl.corrections``) enters the loss: its weight replaces the mismatch factor inside
  the ratio (bypass) or scales the clipped loss from outside (recompute, "decoupled"); rejected tokens leave
  numerator and denominator;
* router replay (``algorithm.router_replay``, MoE models): the gradient pass's forward uses the experts the
  rollout chose (``RolloutBatch.routing``), passed in as a value (``score_tokens(..., routing=)``).

Notation: ``logp`` = current training-path log-probs (with grad), ``old_logp`` = the behaviour log-probs the
ratio is taken against, ratio = exp(logp - old_logp) per token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.model import Transformer
from ..engine.scoring import score_tokens
from ..metric_keys import ENTROPY, FIRST_MINIBATCH_RATIO_EXACT, KL_LOSS, PG_LOSS, PPO_KL
from .advantages import ADVANTAGE_EPS, compute_advantages
from .collect import RolloutBatch
from .config_schema import AlgorithmSection, CorrectionSection
from .corrections import Correction, plan_for, rollout_correction
from .inject import RolloutPlan
from .metrics import LOG_RATIO_BOUND, ratio_stats
from .registries import BYPASS_LOSSES, LOSS_AGGREGATIONS
from .scoring import Anchors, Scorer, replayed

__all__ = ["ADVANTAGE_EPS", "Anchors", "MinibatchLoss", "Objective", "RunStopped", "aggregate", "compute_advantages",
           "k3_penalty", "ppo_token_loss", "register_bypass_loss", "register_loss_aggregation"]


def ppo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float,
                   clip_high: float, ratio_weight: Tensor | None = None,
                   log_ratio_bound: float = LOG_RATIO_BOUND) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate (DAPO clip-higher): max(-A·ρ, -A·clip(ρ, 1-clip_low, 1+clip_high)).

    ρ = exp(clamp(logp - old_logp, ±log_ratio_bound)), as verl's ``compute_policy_loss_vanilla`` (±20): an
    unclamped ratio overflows to inf past a log-ratio of ~88.7 (float32), and the clipped branch's zero gradient
    times inf is NaN. Times ``ratio_weight`` (detached) when given: the bypass-mode rollout correction puts its
    weight inside the ratio (``vexact/rl/corrections.py``). All inputs are flat per-token tensors; returns (loss
    per token, ratio per token)."""
    ratio = torch.exp((logp - old_logp).clamp(-log_ratio_bound, log_ratio_bound))
    if ratio_weight is not None:
        ratio = ratio * ratio_weight
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio


LossAggregation = Callable[[Tensor, list[int]], Tensor]
"""``(per_token, lengths) -> loss``: how ``algorithm.loss_agg`` reduces a flat per-token loss."""


def register_loss_aggregation(name: str, fn: LossAggregation, replace: bool = False) -> LossAggregation:
    """Register a loss aggregation under ``name`` (``algorithm.loss_agg: NAME``); its docstring is its
    documentation. A name already taken is an error unless ``replace``."""
    if not callable(fn):
        raise TypeError(f"register_loss_aggregation needs a function (per_token, lengths) -> loss, got {fn!r}")
    return LOSS_AGGREGATIONS.add(name, fn, replace=replace)


def _token_mean(per_token: Tensor, lengths: list[int]) -> Tensor:
    """``token_mean``: the mean over all tokens of the batch."""
    return per_token.sum() / max(per_token.numel(), 1)


def _seq_mean(per_token: Tensor, lengths: list[int]) -> Tensor:
    """``seq_mean``: the mean over sequences of their token mean."""
    parts = [p.mean() for p in per_token.split(lengths) if p.numel()]
    return torch.stack(parts).mean() if parts else per_token.sum() * 0.0


register_loss_aggregation("token_mean", _token_mean)
register_loss_aggregation("seq_mean", _seq_mean)


def aggregate(per_token: Tensor, lengths: list[int], mode: str) -> Tensor:
    """Reduce a flat per-token loss by the aggregation ``mode`` (a name in ``LOSS_AGGREGATIONS``): mean over all
    tokens (``token_mean``), or mean over sequences of their token mean (``seq_mean``)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return LOSS_AGGREGATIONS[mode](per_token, lengths)


def k3_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(ref - logp) - (ref - logp) - 1 (≥ 0)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


class RunStopped(Exception):
    """A clean, recorded end of a run (non-finite values, exactness violation)."""


@dataclass
class MinibatchLoss:
    loss: Tensor  # scalar, with grad
    logprobs: list[Tensor]  # this pass's training-path log-probs per sequence, detached
    stats: dict[str, float]
    counts: dict[str, int] = field(default_factory=dict)  # a token-mean stat's tokens (reduce_minibatch_stats)
    correction: Correction | None = None  # the rollout correction the loss applied (None: none)


class Objective:
    """The loss of one run: ``minibatch_loss`` (or ``policy_forward`` then ``loss_of``) per PPO mini-batch, on the
    step's advantages and ``Anchors``."""

    def __init__(self, alg: AlgorithmSection, correction: CorrectionSection, temperature: float,
                 exact_training: bool):
        self.alg = alg
        self.correction = correction
        self.plan = plan_for(correction)
        self.temperature = temperature
        self.exact_training = exact_training  # the training path runs bit-deterministic kernels
        self.scorer = Scorer(alg, temperature, self.plan.active)  # this process's (a run's: ``Scorer.for_run``)

    def anchors(self, model: Transformer, batch: RolloutBatch, reference: Callable[[], Transformer],
                rescore_all: bool = True) -> Anchors:
        """The anchors of one process's step (``Scorer.anchors``; ``reference`` builds the KL reference, called
        when ``kl_coef`` > 0)."""
        return self.scorer.anchors(model, batch, reference() if self.alg.kl_coef > 0 else None, rescore_all)

    def expects_exact(self, plan: RolloutPlan, lagged: bool = False) -> bool:
        """Whether the first mini-batch's ratio must be exactly 1: the anchor comes from the exact training path,
        recomputed, or recorded by a rollout path identical to it from the current weights (``lagged``: the rollout
        sampled an older policy, ``rollout.policy_lag``, so its log-probs are not the current policy's)."""
        return self.exact_training and (self.alg.old_logprobs == "recompute" or (plan.matches_training and not lagged))

    def minibatch_loss(self, model: Transformer, batch: RolloutBatch, idx: list[int], advantages: Tensor,
                       anchors: Anchors, check_exact: bool) -> MinibatchLoss:
        """The loss of sequences ``idx`` (training path with grad) and its ``actor/*`` / ``rollout_corr/*`` stats.

        Raises RunStopped on non-finite log-probs or loss, or (``check_exact``) when the ratio is not exactly 1."""
        logp_list, entropy_list = self.policy_forward(model, batch, idx, self.alg.micro_batch_size)
        return self.loss_of(batch, idx, logp_list, entropy_list, advantages, anchors, check_exact)

    @property
    def gradient_micro_batch(self) -> int | None:
        """Sequences per forward of the gradient pass: ``micro_batch_size``, or None (each call forwarded whole)
        when ``grad_unit`` is set, since a gradient unit must be one graph for its bits not to depend on the
        micro-batching (``unit_size``)."""
        return None if self.alg.grad_unit is not None else self.alg.micro_batch_size

    def unit_size(self, leaf_size: int) -> int:
        """Sequences per gradient unit of a leaf of ``leaf_size``: ``grad_unit``, else the whole leaf.

        A unit's gradient is one backward through one forward (or, off, through the leaf's micro-batches). The
        exact kernels' weight gradients reduce over every token of a forward (fixed chunks and trees over the
        token rows), so a sequence's contribution is rounded differently in a bigger or differently padded
        batch: the bits follow the grouping, which ``grad_unit`` fixes and ``micro_batch_size`` then leaves alone."""
        return self.alg.grad_unit or leaf_size

    def policy_forward(self, model: Transformer, batch: RolloutBatch, idx: list[int], micro_batch_size: int | None
                       ) -> tuple[list[Tensor], list[Tensor]]:
        """Training-path log-probs and entropies of sequences ``idx``, with grad (one tensor per sequence), in
        forwards of ``micro_batch_size`` sequences (None = one forward)."""
        prompts = [batch.prompts[i] for i in idx]
        responses = [batch.responses[i] for i in idx]
        logp_list, entropy_list = score_tokens(model, prompts, responses, self.temperature, micro_batch_size,
                                               with_entropy=True, routing=self.replayed(batch, idx))
        assert entropy_list is not None
        return logp_list, entropy_list

    def replayed(self, batch: RolloutBatch, idx: list[int] | range) -> list[Tensor] | None:
        """The rollout's routing of sequences ``idx`` under ``algorithm.router_replay``, else None
        (``scoring.replayed``)."""
        return replayed(batch, idx, self.alg.router_replay)

    def loss_of(self, batch: RolloutBatch, idx: list[int], logp_list: list[Tensor], entropy_list: list[Tensor],
                advantages: Tensor, anchors: Anchors, check_exact: bool) -> MinibatchLoss:
        """The loss of sequences ``idx`` given their training-path log-probs and entropies (``policy_forward``).

        The gradient flows into whichever of those tensors carry grad: data-parallel ranks pass one leaf's with
        grad and the others detached, and get that leaf's share of the mini-batch gradient (every term is a sum
        over tokens, scaled by mini-batch constants)."""
        alg = self.alg
        lengths = [len(batch.responses[i]) for i in idx]
        logp = torch.cat(logp_list)
        old = torch.cat([anchors.old[i] for i in idx]).to(logp.device)
        adv = torch.cat([advantages[i].expand(length) for i, length in zip(idx, lengths)]).to(logp.device)
        detached = [lp.detach() for lp in logp_list]
        if not torch.isfinite(logp).all():
            raise RunStopped("non-finite training log-probs (logits)")
        stats: dict[str, float] = {}
        counts: dict[str, int] = {}  # the tokens each token-mean stat is over (the step's reduction weighs by them)
        if check_exact:
            exact = torch.equal(logp.detach(), old)
            stats[FIRST_MINIBATCH_RATIO_EXACT] = float(exact)
            if not exact:
                raise RunStopped("exactness violated: first mini-batch ratio != 1 although the old log-probs "
                                 "come from the exact training path")
        correction, pre = None, None
        if self.plan.active:
            # ρ compares the training path at the pre-update weights with the rollout path. Without a
            # separate scoring pass (one bypass pass), this pass *is* at the pre-update weights.
            pre = logp.detach() if anchors.pre_update is None else torch.cat([anchors.pre_update[i] for i in idx])
            roll = torch.cat([batch.logprobs[i] for i in idx]).to(logp.device)
            correction = rollout_correction(pre, roll, lengths, self.correction)
            stats.update(correction.metrics)
        per_token, ratio = self._pg_loss(logp, old, adv, pre, correction)
        entropy = torch.cat(entropy_list)
        stats[ENTROPY] = float(entropy.detach().mean())  # the policy's, over every response token (its definition)
        counts[ENTROPY] = entropy.numel()
        kl = None
        if alg.kl_coef > 0 and anchors.reference is not None:
            kl = k3_penalty(logp, torch.cat([anchors.reference[i] for i in idx]))
        if correction is not None and correction.rejects_any:
            # rejected tokens leave every term of the loss (policy gradient, KL, entropy), numerator and
            # denominator, as verl's rejection rewrites response_mask
            keep = correction.keep
            lengths = [int(k.sum()) for k in keep.split(lengths)]
            per_token, ratio, adv, entropy = per_token[keep], ratio[keep], adv[keep], entropy[keep]
            logp, old = logp[keep], old[keep]
            kl = None if kl is None else kl[keep]
        pg_loss = aggregate(per_token, lengths, alg.loss_agg)
        loss = pg_loss
        if kl is not None:  # added per token, so the loss is the aggregate of pg + coef·kl (linear: verl's sum)
            loss = aggregate(per_token + alg.kl_coef * kl, lengths, alg.loss_agg)
            stats[KL_LOSS] = float(aggregate(kl.detach(), lengths, alg.loss_agg))
        if alg.entropy_coef > 0:  # verl's agg_loss of the entropy over the same tokens, by loss_agg
            loss = loss - alg.entropy_coef * aggregate(entropy, lengths, alg.loss_agg)
        if not torch.isfinite(loss):
            raise RunStopped(f"non-finite loss ({float(loss.detach())})")
        stats[PG_LOSS] = float(pg_loss.detach())
        if ratio.numel():
            token_stats = ratio_stats(ratio.detach(), alg.clip_low, alg.clip_high, adv, clips=self.clips)
            stats.update(token_stats)
            # verl's actor/ppo_kl: token mean of -(log π_θ - log π_old), the log-ratio clamped to
            # ±correction.log_ratio_bound (verl's SAFETY_BOUND, 20 by default)
            bound = self.correction.log_ratio_bound
            stats[PPO_KL] = float((old - logp.detach()).clamp(-bound, bound).mean())
            counts.update(dict.fromkeys((*token_stats, PPO_KL), ratio.numel()))  # the loss's (kept) tokens
        return MinibatchLoss(loss, detached, stats, counts, correction)

    @property
    def clips(self) -> bool:
        """Whether the loss clips its ratio: PPO does, a bypass loss registered with ``clips=False`` (REINFORCE)
        does not."""
        return self.alg.old_logprobs == "recompute" or self.plan.loss_type not in UNCLIPPED_BYPASS_LOSSES

    def _pg_loss(self, logp: Tensor, old: Tensor, adv: Tensor, pre: Tensor | None,
                 correction: Correction | None) -> tuple[Tensor, Tensor]:
        """Per-token policy-gradient loss and ratio, with the correction's IS weights where the mode uses them
        (``vexact/rl/corrections.py``: decoupled -> times w; bypass -> by ``loss_type``, with or without a
        correction, as verl's ``compute_policy_loss_bypass_mode``)."""
        alg, bound = self.alg, self.correction.log_ratio_bound
        weights = correction.weights if correction is not None and correction.reweights else None
        if alg.old_logprobs == "recompute":  # decoupled: the weight scales the clipped loss from outside
            per_token, ratio = ppo_token_loss(logp, old, adv, alg.clip_low, alg.clip_high, log_ratio_bound=bound)
            return (per_token, ratio) if weights is None else (per_token * weights, ratio)
        return BYPASS_LOSSES[self.plan.loss_type](alg, logp, old, adv, pre, weights, bound)

    def score(self, model: Transformer, batch: RolloutBatch, replay: bool = True) -> list[Tensor]:
        """The training path's log-probs of the batch's responses, no grad (``Scorer``)."""
        return self.scorer(model, batch, replay)


BypassLoss = Callable[[AlgorithmSection, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, float],
                      tuple[Tensor, Tensor]]
"""``(alg, logp, old, adv, pre, weights, log_ratio_bound) -> (loss per token, ratio per token)``: bypass mode's
loss (``correction.loss_type``), with the correction's IS ``weights``, or None without ``rollout_is`` (verl's
``rollout_is_weights=None``); ``old``: the rollout's log-probs, ``pre``: the training path's before the update
(given with ``weights``); ``log_ratio_bound``: ``correction.log_ratio_bound``, the clamp of the ratio's log."""


UNCLIPPED_BYPASS_LOSSES: set[str] = set()
"""The bypass losses registered with ``clips=False``, by name (the flag belongs to the registered name, not to the
function, which another name may also serve)."""

BYPASS_LOSS_ARGUMENTS = ("alg", "logp", "old", "adv", "pre", "weights", "log_ratio_bound")


def register_bypass_loss(name: str, fn: BypassLoss, replace: bool = False, clips: bool = True) -> BypassLoss:
    """Register a bypass-mode loss under ``name`` (``correction.loss_type: NAME``); its docstring is its
    documentation. A name already taken is an error unless ``replace``. ``clips``: whether the loss clips the
    ratio it returns (False: its ``actor/pg_clipfrac*`` are 0). ``fn`` must take the seven arguments of
    ``BypassLoss`` (checked here, not in the middle of a run)."""
    if not callable(fn):
        raise TypeError(f"register_bypass_loss needs a function {BypassLoss}, got {fn!r}")
    try:
        inspect.signature(fn).bind(*BYPASS_LOSS_ARGUMENTS)
    except TypeError:
        raise TypeError(f"register_bypass_loss({name!r}): {getattr(fn, '__name__', fn)!s} must take the arguments "
                        f"({', '.join(BYPASS_LOSS_ARGUMENTS)}), its signature is {inspect.signature(fn)}") from None
    except ValueError:  # a callable without a signature Python can read (a builtin): taken as it is
        pass
    registered = BYPASS_LOSSES.add(name, fn, replace=replace)
    (UNCLIPPED_BYPASS_LOSSES.discard if clips else UNCLIPPED_BYPASS_LOSSES.add)(name)
    return registered


def _bypass_ppo_clip(alg: AlgorithmSection, logp: Tensor, old: Tensor, adv: Tensor, pre: Tensor | None,
                     weights: Tensor | None, log_ratio_bound: float) -> tuple[Tensor, Tensor]:
    """``ppo_clip`` (verl's bypass PPO): the ratio π_θ/μ is the correction; the weights are metrics only."""
    return ppo_token_loss(logp, old, adv, alg.clip_low, alg.clip_high, log_ratio_bound=log_ratio_bound)


def _bypass_ppo_clip_is(alg: AlgorithmSection, logp: Tensor, old: Tensor, adv: Tensor, pre: Tensor | None,
                        weights: Tensor | None, log_ratio_bound: float) -> tuple[Tensor, Tensor]:
    """``ppo_clip_is`` (vexact's): the weight replaces the mismatch factor π_old/μ inside the ratio; a zeroed
    weight (IcePop) leaves the token in the denominator with no loss. Without IS weights, ``ppo_clip``."""
    if weights is None or pre is None:  # nothing replaces the mismatch factor: the ratio π_θ/μ
        return ppo_token_loss(logp, old, adv, alg.clip_low, alg.clip_high, log_ratio_bound=log_ratio_bound)
    per_token, ratio = ppo_token_loss(logp, pre, adv, alg.clip_low, alg.clip_high, ratio_weight=weights,
                                      log_ratio_bound=log_ratio_bound)
    return torch.where(weights > 0, per_token, torch.zeros_like(per_token)), ratio


def _bypass_reinforce(alg: AlgorithmSection, logp: Tensor, old: Tensor, adv: Tensor, pre: Tensor | None,
                      weights: Tensor | None, log_ratio_bound: float) -> tuple[Tensor, Tensor]:
    """``reinforce`` (verl's bypass REINFORCE): -A · w · log π_θ (w = 1 without ``rollout_is``), no clip."""
    per_token = -adv * logp if weights is None else -adv * weights * logp
    return per_token, torch.exp((logp.detach() - old).clamp(-log_ratio_bound, log_ratio_bound))  # for its stats


register_bypass_loss("ppo_clip", _bypass_ppo_clip)
register_bypass_loss("ppo_clip_is", _bypass_ppo_clip_is)
register_bypass_loss("reinforce", _bypass_reinforce, clips=False)
