"""verl: ``vexact.live`` on the batch a ``RayPPOTrainer`` step holds (verl 0.9.1's names).

In verl's PPO/GRPO loop (``RayPPOTrainer.fit``) the driver's ``batch`` (a ``DataProto``; its tensors in
``batch.batch``) holds, after ``_compute_old_log_prob``:

* ``rollout_log_probs`` [B, T] -- the rollout engine's (vLLM / SGLang) log-prob of each sampled token, present when
  ``actor_rollout_ref.rollout.calculate_log_probs=True``;
* ``old_log_probs`` [B, T] -- the actor's recomputation of the same tokens at the same weights (FSDP / Megatron
  forward): the training side; ``_compute_old_log_prob`` returns it in a ``DataProto`` of its own, which ``fit``
  then unions into ``batch``;
* ``response_mask`` [B, T] -- which positions hold response tokens (verl: the last T columns of
  ``attention_mask``; integer 0/1).

These are the keys ``vexact compare`` reads by default from a one-file dump (``dump_files.ONE_FILE_KEYS`` and
``dump_files.MASK_KEY``): ``observe_batch`` passes the same three tensors to ``LiveMonitor.step``, so a live row and
``vexact compare`` on a dump of that batch agree exactly.

The recipe (verl cannot run on a CPU-only machine; ``tests/integrations/test_live.py`` runs ``observe_batch`` on such
a batch)::

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from vexact.integrations.verl import observe_batch
    from vexact.live import Gates, LiveMonitor

    class MonitoredRayPPOTrainer(RayPPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.live_monitor = LiveMonitor("outputs/vexact_live", gates=Gates(max_k3=1e-3),
                                            backends=("jsonl", "wandb"), resume=True)

        def _compute_old_log_prob(self, batch):
            old_log_prob, mfu = super()._compute_old_log_prob(batch)
            observe_batch(self.live_monitor, batch, self.global_steps, old_log_prob=old_log_prob)
            return old_log_prob, mfu

and build ``MonitoredRayPPOTrainer`` where your entry point (a copy of ``verl.trainer.main_ppo``'s ``TaskRunner``)
builds ``RayPPOTrainer``. ``fit`` runs on the driver only, so there is one writer; ``resume=True`` lets a run
resumed from a verl checkpoint continue the same metrics.jsonl (the rows from the resumed step on are replaced).
In bypass mode (``algorithm.rollout_correction.bypass_mode=True``) verl skips ``_compute_old_log_prob`` and sets
``old_log_probs`` to ``rollout_log_probs`` itself: there is no training-side recomputation to compare with, and
``observe_batch`` refuses a batch whose two sides are one tensor rather than report a mismatch of zero. To measure
the mismatch there anyway, pay for a sample: give the monitor ``sample_fraction`` (and ``every``) and
``observe_batch`` a ``score_fn``; ``actor_logprobs(trainer, batch)`` is one that runs verl's own recompute
(``_compute_old_log_prob``) on the sampled rows only (``DataProto.select_idxs``, padded to the actor's world size
as verl pads). Call it before the update changes the weights::

    class MonitoredRayPPOTrainer(RayPPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.live_monitor = LiveMonitor("outputs/vexact_live", sample_fraction=0.1, every=1, resume=True)

        def _update_actor(self, batch):
            observe_batch(self.live_monitor, batch, self.global_steps, score_fn=actor_logprobs(self, batch))
            return super()._update_actor(batch)

The row is ``LiveMonitor.step_sampled``'s: the sample's metrics, ``live/sampled_sequences`` and
``live/sample_fraction``; a step ``every`` skips writes nothing and scores nothing. A sampling monitor thins the
first recipe's rows the same way (``every=10``: one step in ten; ``sample_fraction``: those rows of the actor's
recompute), though there the recompute is verl's own and costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from torch import Tensor

from ..engine.inputs import tensor_from_numpy
from ..live import LiveMonitor
from ..real.dump_files import ATTENTION_MASK_KEY, MASK_KEY, ONE_FILE_KEYS

__all__ = ["actor_logprobs", "observe_batch", "verl_sides"]

ROLLOUT_KEY, TRAIN_KEY = ONE_FILE_KEYS  # verl's batch keys: rollout engine, actor recompute


def _tensors(batch: Any) -> Any:
    """The tensor mapping of a ``DataProto`` (``.batch``, a TensorDict) or of a plain mapping."""
    inner = getattr(batch, "batch", batch)
    if not (isinstance(inner, Mapping) or hasattr(inner, "keys")):
        raise ValueError(f"expected a verl DataProto or a mapping of tensors, got {type(batch).__name__}")
    return inner


def _tensor(tensors: Any, key: str, where: str = "batch") -> Tensor:
    """``tensors[key]`` as a [B, T] tensor (a numpy array as a tensor on its memory, so bypass mode's one array is
    still one); anything else is one ValueError naming the key (not an AttributeError from inside)."""
    value = tensors[key]
    if isinstance(value, np.ndarray):
        value = tensor_from_numpy(value, f"{where}[{key!r}]")
    if not isinstance(value, Tensor) or value.dim() != 2:
        what = f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{where}[{key!r}] must be a [B, T] tensor (or numpy array), as in verl's batch; got {what}")
    return value


def _rollout_side(tensors: Any) -> tuple[Tensor, Tensor]:
    """(rollout log-probs, response mask) [B, T] of verl's batch tensors."""
    keys = set(tensors.keys())
    if ROLLOUT_KEY not in keys:
        raise ValueError(f"the batch has no {ROLLOUT_KEY!r} (the rollout engine's log-probs): set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True")
    rollout = _tensor(tensors, ROLLOUT_KEY)
    if MASK_KEY in keys:
        return rollout, tensors[MASK_KEY]
    if ATTENTION_MASK_KEY in keys:  # verl's compute_response_mask: the last T columns
        return rollout, _tensor(tensors, ATTENTION_MASK_KEY)[:, -rollout.shape[1]:]
    raise ValueError(f"the batch has neither {MASK_KEY!r} nor {ATTENTION_MASK_KEY!r}")


def verl_sides(batch: Any, old_log_prob: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """(rollout, training, mask) [B, T] from verl's batch; ``old_log_prob``: what ``_compute_old_log_prob``
    returned (its ``old_log_probs`` is used), else the batch's own ``old_log_probs``."""
    tensors = _tensors(batch)
    if ROLLOUT_KEY not in set(tensors.keys()):
        raise ValueError(f"the batch has no {ROLLOUT_KEY!r} (the rollout engine's log-probs): set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True")
    source = tensors if old_log_prob is None else _tensors(old_log_prob)
    if TRAIN_KEY not in set(source.keys()):
        raise ValueError(f"no {TRAIN_KEY!r} (the actor's recomputed log-probs) in the "
                         f"{'batch' if old_log_prob is None else 'old_log_prob output'}: call after "
                         "_compute_old_log_prob")
    raw_rollout, raw_train = tensors[ROLLOUT_KEY], source[TRAIN_KEY]
    one_array = raw_rollout is raw_train or (isinstance(raw_rollout, np.ndarray) and isinstance(raw_train, np.ndarray)
                                             and np.shares_memory(raw_rollout, raw_train))  # before any copy
    rollout = _tensor(tensors, ROLLOUT_KEY)
    train = _tensor(source, TRAIN_KEY, "batch" if old_log_prob is None else "old_log_prob")
    if one_array or (rollout.data_ptr() == train.data_ptr() and rollout.shape == train.shape):
        raise ValueError(f"{TRAIN_KEY!r} is {ROLLOUT_KEY!r} itself (verl's bypass mode): there is no training-side "
                         "recomputation to compare with")
    _, mask = _rollout_side(tensors)
    return rollout, train, mask


def observe_batch(monitor: LiveMonitor, batch: Any, step: int, old_log_prob: Any = None,
                  score_fn: Callable[[list[int]], Tensor] | None = None) -> dict[str, Any] | None:
    """One ``monitor.step`` on verl's batch at ``step`` (verl's ``self.global_steps``); returns the row.

    ``score_fn`` (bypass mode, where the batch's ``old_log_probs`` are the rollout's): ``rows -> [len(rows), T]``
    actor log-probs of the rows the monitor samples (``actor_logprobs``). With either side, a monitor that samples
    (``sample_fraction`` < 1 or ``every`` > 1) gets ``monitor.step_sampled``'s row: its sample's metrics, None on a
    step its ``every`` skips (with ``old_log_prob``, the sample's rows read from the actor's recompute); otherwise
    ``monitor.step``'s, of every row."""
    if not isinstance(monitor, LiveMonitor):
        raise ValueError(f"monitor must be a vexact.live.LiveMonitor, got {type(monitor).__name__}")
    if score_fn is None:
        rollout, train, mask = verl_sides(batch, old_log_prob)
        if monitor.sampling:  # the monitor's every and sample_fraction hold here too (TRL's mixin does the same)
            return monitor.step_sampled(step, rollout, lambda rows: train[rows], mask, train_side=TRAIN_KEY)
        return monitor.step(step, rollout, train, mask)
    if old_log_prob is not None:
        raise ValueError("give old_log_prob (the actor's recompute of every row) or score_fn (of a sample), not both")
    rollout, mask = _rollout_side(_tensors(batch))
    return monitor.step_sampled(step, rollout, score_fn, mask)


def actor_logprobs(trainer: Any, batch: Any) -> Callable[[list[int]], Tensor]:
    """A ``score_fn`` for ``observe_batch``: the actor's log-probs of the batch's rows ``rows`` at its current
    weights, by verl's own recompute (``trainer._compute_old_log_prob``) of ``batch.select_idxs(rows)``, padded to a
    multiple of the actor worker group's world size (``verl.protocol.pad_dataproto_to_divisor``) and unpadded."""

    def score(rows: list[int]) -> Tensor:
        from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

        sample = batch.select_idxs(rows)
        padded, pad = pad_dataproto_to_divisor(sample, trainer.actor_rollout_wg.world_size)
        old_log_prob, _ = trainer._compute_old_log_prob(padded)
        return _tensors(unpad_dataproto(old_log_prob, pad))[TRAIN_KEY]

    return score
