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

These are the keys ``vexact compare`` reads by default from a one-file dump (``compare.ONE_FILE_KEYS`` and
``compare.MASK_KEY``): ``observe_batch`` passes the same three tensors to ``LiveMonitor.step``, so a live row and
``vexact compare`` on a dump of that batch agree exactly.

The recipe (verl cannot run on a CPU-only machine; ``tests/test_live.py`` runs ``observe_batch`` on such a batch)::

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
``observe_batch`` refuses a batch whose two sides are one tensor rather than report a mismatch of zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..live import LiveMonitor
from ..real.compare import ATTENTION_MASK_KEY, MASK_KEY, ONE_FILE_KEYS

__all__ = ["observe_batch", "verl_sides"]

ROLLOUT_KEY, TRAIN_KEY = ONE_FILE_KEYS  # verl's batch keys: rollout engine, actor recompute
RESPONSES_KEY = "responses"


def _tensors(batch: Any) -> Any:
    """The tensor mapping of a ``DataProto`` (``.batch``, a TensorDict) or of a plain mapping."""
    inner = getattr(batch, "batch", batch)
    if not (isinstance(inner, Mapping) or hasattr(inner, "keys")):
        raise ValueError(f"expected a verl DataProto or a mapping of tensors, got {type(batch).__name__}")
    return inner


def verl_sides(batch: Any, old_log_prob: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """(rollout, training, mask) [B, T] from verl's batch; ``old_log_prob``: what ``_compute_old_log_prob``
    returned (its ``old_log_probs`` is used), else the batch's own ``old_log_probs``."""
    tensors = _tensors(batch)
    keys = set(tensors.keys())
    if ROLLOUT_KEY not in keys:
        raise ValueError(f"the batch has no {ROLLOUT_KEY!r} (the rollout engine's log-probs): set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True")
    source = tensors if old_log_prob is None else _tensors(old_log_prob)
    if TRAIN_KEY not in set(source.keys()):
        raise ValueError(f"no {TRAIN_KEY!r} (the actor's recomputed log-probs) in the "
                         f"{'batch' if old_log_prob is None else 'old_log_prob output'}: call after "
                         "_compute_old_log_prob")
    rollout, train = tensors[ROLLOUT_KEY], source[TRAIN_KEY]
    if rollout is train or (rollout.data_ptr() == train.data_ptr() and rollout.shape == train.shape):
        raise ValueError(f"{TRAIN_KEY!r} is {ROLLOUT_KEY!r} itself (verl's bypass mode): there is no training-side "
                         "recomputation to compare with")
    if MASK_KEY in keys:
        mask = tensors[MASK_KEY]
    elif ATTENTION_MASK_KEY in keys:  # verl's compute_response_mask: the last T columns
        mask = tensors[ATTENTION_MASK_KEY][:, -rollout.shape[1]:]
    else:
        raise ValueError(f"the batch has neither {MASK_KEY!r} nor {ATTENTION_MASK_KEY!r}")
    return rollout, train, mask


def observe_batch(monitor: LiveMonitor, batch: Any, step: int, old_log_prob: Any = None) -> dict[str, Any]:
    """One ``monitor.step`` on verl's batch at ``step`` (verl's ``self.global_steps``); returns the row."""
    rollout, train, mask = verl_sides(batch, old_log_prob)
    return monitor.step(step, rollout, train, mask)
