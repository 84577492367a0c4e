"""A step's score stage: what the training path must score before the update changes the weights.

A ``Scorer``, built once per run, gives the training path's log-probs of a batch without grad. Data parallelism is a
wrapper of that one call (``ShardedScorer``, from ``Scorer.for_run``): each rank scores a block of the sequences
and the blocks are gathered, so every rank holds the whole batch's log-probs, the bits of one process (scoring is
batch-invariant). ``Scorer.before_update`` makes the step's decisions and scorings, in this order:

* the anchors of the PPO ratio (``Anchors``): the old log-probs come from the training path, recomputed before the
  update (``algorithm.old_logprobs: recompute``), or from the rollout (``rollout``, "bypass"); the pre-update
  scoring is also made when several passes or a rollout correction need it, and the KL reference is scored when
  ``algorithm.kl_coef`` > 0;
* under policy lag, the lagged behaviour policy on the training path (for ``rollout_corr/lag_k3_kl`` and
  ``rollout_corr/tim_k3_kl``);
* with ``monitor.*`` sampling, those log-probs of a sample of the sequences only (``vexact.rl.monitor``);
* for MoE models, the experts the training path's own router picks (the ``routing/*`` metrics).

Router replay (``algorithm.router_replay``): every training-path forward uses the experts the rollout chose
(``RolloutBatch.routing``), passed in as a value (``score_tokens(..., routing=)``; ``replayed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.model import Transformer
from ..engine.scoring import score_tokens, token_routing
from ..metric_keys import TIMING_MONITOR, TIMING_OLD_LOGPROBS
from .collect import RolloutBatch
from .config_schema import AlgorithmSection, MonitorSection, RunConfig
from .corrections import plan_for
from .data_parallel import DataParallel
from .monitor import sample_rows

__all__ = ["Anchors", "PreUpdate", "Scorer", "ShardedScorer", "replayed"]


@dataclass
class Anchors:
    """Per-sequence log-probs the loss is anchored on, fixed before the update."""

    old: list[Tensor]  # the PPO ratio's anchor
    pre_update: list[Tensor] | None  # training path at the pre-update weights, when scored before the update
    reference: list[Tensor] | None  # the KL reference policy (``kl_coef`` > 0)


@dataclass
class PreUpdate:
    """A step's training-path scorings before the update (``Scorer.before_update``)."""

    anchors: Anchors
    sampling: bool  # ``monitor.*``: the mismatch metrics are of a sample of the sequences
    rows: list[int] | None  # the sample's sequences (sampling; None: a step the monitor skips)
    sample: list[Tensor] | None  # the sample's current-policy log-probs (None: the update's first pass gives them)
    behaviour: list[Tensor] | None  # the lagged behaviour policy's (the batch's, or the sample's); None: on-policy
    routing: list[Tensor] | None  # the experts the training router picks (MoE), else None
    timings: dict[str, float] = field(default_factory=dict)


def replayed(batch: RolloutBatch, idx: list[int] | range, router_replay: bool) -> list[Tensor] | None:
    """The rollout's routing of sequences ``idx`` when ``router_replay`` is on (the training path then uses it), else
    None. A ValueError when replay is on and the batch recorded no routing."""
    if not router_replay:
        return None
    if batch.routing is None:
        raise ValueError("algorithm.router_replay is on, but the rollout batch recorded no routing (a dense "
                         "model records none): set model.num_experts > 0, or router_replay: false")
    return [batch.routing[i] for i in idx]


class Scorer:
    """The training path's scoring of a batch, no grad, on this process (``for_run``: a run's scorer).

    ``alg``: the ``algorithm`` section; ``correcting``: a rollout correction is on (it needs the pre-update
    log-probs); ``monitor``: the ``monitor`` section (default: every sequence, every step); ``seed``: the run's."""

    def __init__(self, alg: AlgorithmSection, temperature: float, correcting: bool = False,
                 monitor: MonitorSection | None = None, seed: int = 0):
        self.alg = alg
        self.temperature = temperature
        self.correcting = correcting
        self.monitor = monitor or MonitorSection()
        self.seed = seed

    @staticmethod
    def for_run(cfg: RunConfig, ranks: DataParallel) -> Scorer:
        """The scorer of a run on ``ranks``: this process's own, or one sharing the sequences over the ranks."""
        settings = (cfg.algorithm, cfg.rollout.temperature, plan_for(cfg.correction).active, cfg.monitor, cfg.seed)
        return Scorer(*settings) if ranks.world_size == 1 else ShardedScorer(*settings, ranks=ranks)

    def __call__(self, model: Transformer, batch: RolloutBatch, replay: bool = True) -> list[Tensor]:
        """The training path's log-probs of the batch's responses; ``replay`` False scores with the router's own
        routing even under ``algorithm.router_replay`` (calibration measures the source's mismatch, not what replay
        leaves of it)."""
        routing = replayed(batch, range(len(batch.responses)), self.alg.router_replay) if replay else None
        with torch.no_grad():
            return score_tokens(model, batch.prompts, batch.responses, self.temperature, self.alg.micro_batch_size,
                                routing=routing)[0]

    def routing(self, model: Transformer, batch: RolloutBatch) -> list[Tensor]:
        """The experts the training path's own router chooses for the batch (MoE models; no replay): what the
        rollout's routing is compared with (``routing/*`` metrics)."""
        return token_routing(model, batch.prompts, batch.responses, self.alg.micro_batch_size)

    def anchors(self, model: Transformer, batch: RolloutBatch, reference: Transformer | None,
                rescore_all: bool = True) -> Anchors:
        """Score what the update needs before it changes the weights: the pre-update log-probs where the ratio's
        anchor or a rollout correction needs them, and the KL ``reference``'s (None: no KL).

        ``rescore_all``: in bypass mode with several passes and no correction, the pre-update scoring serves only
        the mismatch metrics; False leaves it out (``monitor.sample_fraction``: the sample is scored instead)."""
        alg = self.alg
        one_pass = alg.mini_batches == 1 and alg.ppo_epochs == 1
        pre_update = None
        if alg.old_logprobs == "recompute" or (not one_pass and (rescore_all or self.correcting)):
            pre_update = self(model, batch)  # else the single update pass scores at θ_old (or the sample does)
        ref = self(reference, batch) if reference is not None else None
        return Anchors(pre_update if alg.old_logprobs == "recompute" else batch.logprobs, pre_update, ref)

    def before_update(self, model: Transformer, batch: RolloutBatch, reference: Transformer | None,
                      behaviour: Transformer | None, step: int) -> PreUpdate:
        """The scorings of ``step`` at the pre-update weights ``model``: the anchors (``reference``: the KL
        reference policy, or None), the lagged ``behaviour`` policy's log-probs (None: on-policy), the monitor's
        sample, and MoE routing."""
        timings: dict[str, float] = {}
        t = time.perf_counter()
        monitor = self.monitor
        sampling = monitor.sampling
        anchors = self.anchors(model, batch, reference, rescore_all=not sampling)
        behaviour_logp = None
        if behaviour is not None and not sampling:  # the lag's drift and the TIM apart
            behaviour_logp = self(behaviour, batch)
        timings[TIMING_OLD_LOGPROBS] = time.perf_counter() - t
        rows, sample = None, None
        if sampling:  # the pre-update log-probs the metrics need, of a sample of the sequences only
            t = time.perf_counter()
            rows = sample_rows(len(batch.responses), monitor.sample_fraction, monitor.every, self.seed, step)
            sample, behaviour_logp = self._rescore_sample(model, batch, anchors, rows, behaviour)
            timings[TIMING_MONITOR] = time.perf_counter() - t
        routing = None if batch.routing is None else self.routing(model, batch)
        return PreUpdate(anchors, sampling, rows, sample, behaviour_logp, routing, timings)

    def _rescore_sample(self, model: Transformer, batch: RolloutBatch, anchors: Anchors, rows: list[int] | None,
                        behaviour: Transformer | None) -> tuple[list[Tensor] | None, list[Tensor] | None]:
        """The pre-update training-path log-probs of the sequences ``rows`` (None: a step the monitor skips):
        (current policy's, or None where the update's single pass scores them for free; the behaviour policy's
        under policy lag, else None). Batch-invariant scoring: a sequence's log-probs are the bits a whole-batch
        scoring gives it."""
        if not rows:
            return None, None
        sample = batch.subset(rows)
        if anchors.pre_update is not None:
            current = [anchors.pre_update[i] for i in rows]
        elif self.alg.mini_batches == 1 and self.alg.ppo_epochs == 1:
            current = None
        else:
            current = self(model, sample)
        return current, None if behaviour is None else self(behaviour, sample)


class ShardedScorer(Scorer):
    """A ``Scorer`` over data-parallel ranks: each rank scores its block of the sequences, every rank gets all."""

    def __init__(self, alg: AlgorithmSection, temperature: float, correcting: bool = False,
                 monitor: MonitorSection | None = None, seed: int = 0, *, ranks: DataParallel):
        super().__init__(alg, temperature, correcting, monitor, seed)
        self.ranks = ranks

    def __call__(self, model: Transformer, batch: RolloutBatch, replay: bool = True) -> list[Tensor]:
        mine = self.ranks.block(len(batch.responses))  # empty on some ranks for a monitor sample under world size
        return self.ranks.gather(super().__call__(model, batch.subset(mine), replay) if len(mine) else [])

    def routing(self, model: Transformer, batch: RolloutBatch) -> list[Tensor]:
        mine = self.ranks.block(len(batch.responses))
        return self.ranks.gather(super().routing(model, batch.subset(mine)))
