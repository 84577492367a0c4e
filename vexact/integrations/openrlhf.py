"""OpenRLHF: vexact's report of the vLLM rollout's log-probs against the trainer's, from a dump or live.

OpenRLHF 0.11.2's layout, which ``tests/integrations/test_openrlhf_parity.py`` checks statement by statement against
its installed source (``pip install --no-deps openrlhf==0.11.2``, as .ci/run does). First read at commit 3c3be623
(2026-08-13, between v0.10.4 and v0.11.0); the layout is the same back to v0.8.9, where ``rollout_log_probs``
arrived, but for the switch below (``ENABLE_SWITCHES``: its name in each release) and the correction's loss.

In ``BasePPOTrainer.train_step`` (``openrlhf/trainer/ppo_trainer.py``; the async trainer's ``TrainingActor``
inherits it), ``experiences = self.experience_maker.make_experience_batch(rollout_samples)`` is a list of
``Experience`` (``openrlhf/trainer/ppo_utils/experience.py``), one per micro-batch, each holding:

* ``sequences`` [B, T] -- prompt + response token ids, right-padded with the pad token
  (``Experience.concat_experiences``: ``zero_pad_sequences(side="right")``);
* ``action_mask`` [B, A] -- 1 where the column scores a sampled token: 0 over the prompt, over tool or environment
  feedback in agent rollouts (``openrlhf/utils/agent.py``: only ``action_ranges`` are 1) and over padding. A new
  sample has A = T - 1 (``samples_generator.py``, ``_process_response_into_experience``: ``action_mask[1:]``);
* ``rollout_log_probs`` [B, A] float32 -- vLLM's log-prob of each sampled token (``logprobs=1``, the engine built
  with ``logprobs_mode="processed_logprobs"``: after temperature), 0.0 at prompt and feedback positions; None
  unless ``--algo.advantage.is_correction_level`` is ``token`` or ``seq`` (default ``off``), the only switch that
  makes OpenRLHF ask vLLM for log-probs (it also turns the correction on);
* ``action_log_probs`` [B, A] float32 -- the actor's no-grad recomputation of the same tokens at the weights that
  sampled them (``PolicyModelActor.forward`` -> ``Actor.forward``, ``openrlhf/models/actor.py``: float32 logits
  divided by ``--rollout.temperature``, ``log_probs[:, :-1][:, -A:] * action_mask``); the PPO loss's
  ``old_log_probs``.

So column j of a row scores token ``sequences[:, T - A + j]``, as ``Actor.forward`` aligns them. The correction
(``openrlhf/models/loss.py``, ``PolicyLoss``) weighs the loss by the ratio exp(action_log_probs -
rollout_log_probs), clamped or masked: the ratio ``vexact compare`` reports raw as ``mismatch/ratio_*``;
docs/reference/verl_trl.md maps the correction onto ``correction.*``.

``experience_sides`` gives the three [N, A_max] tensors of all micro-batches (right-padded to the widest, as
OpenRLHF pads, mask 0 on the padding) and the scored token ids; ``dump_experiences`` saves them for ``vexact compare
FILE`` + ``COMPARE_FLAGS`` (OpenRLHF's own field names); ``observe_experiences`` passes them to a ``LiveMonitor``.
Nothing here imports OpenRLHF: any objects with these attributes will do (duck typing, as the verl and TRL hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..live import LiveMonitor
from ..real.dump_files import TENSOR_TOKENS_KEY

__all__ = ["COMPARE_FLAGS", "DUMP_KEYS", "dump_experiences", "experience_sides", "observe_experiences"]

ROLLOUT_KEY, TRAIN_KEY, MASK_KEY = "rollout_log_probs", "action_log_probs", "action_mask"  # Experience's fields
DUMP_KEYS = (ROLLOUT_KEY, TRAIN_KEY, MASK_KEY, TENSOR_TOKENS_KEY)
"""The dump's tensors: OpenRLHF's three [N, A] fields and the scored token ids under compare's default token key."""
COMPARE_FLAGS = ("--rollout-key", ROLLOUT_KEY, "--train-key", TRAIN_KEY, "--mask-key", MASK_KEY)
"""What ``vexact compare`` needs after a dump's path to read it (the docs' command is checked against this)."""
LEVEL_FLAG, LEVEL_OFF, LEVEL_ON = "--algo.advantage.is_correction_level", "off", "token"
"""OpenRLHF 0.11.2's switch: its default ``off`` asks vLLM for no log-probs; ``token`` (or ``seq``) does."""
ENABLE_FLAG = "--algo.advantage.is_correction_enable"
"""The store_true switch of OpenRLHF 0.10.2 to 0.11.1, which 0.11.2 replaced with ``LEVEL_FLAG``."""
OLD_ENABLE_FLAG = "--enable_vllm_is_correction"
"""The switch up to OpenRLHF 0.10.1."""
ENABLE_SWITCHES = ((f"{LEVEL_FLAG} {LEVEL_ON}", "0.11.2 on"), (ENABLE_FLAG, "0.10.2 to 0.11.1"),
                   (OLD_ENABLE_FLAG, "up to 0.10.1"))
"""(what to pass, the OpenRLHF releases that take it), newest first: the switch that fills ``rollout_log_probs``."""


def _field(experience: Any, name: str, where: str) -> Tensor:
    """``experience.<name>`` as a 2-D tensor; a missing or unset field is one ValueError saying what to do."""
    if not hasattr(experience, name):
        raise ValueError(f"{where} has no {name!r}: expected OpenRLHF's Experience, got {type(experience).__name__}")
    value = getattr(experience, name)
    if value is None and name == ROLLOUT_KEY:
        switches = "; ".join(f"{switch} (OpenRLHF {releases})" for switch, releases in ENABLE_SWITCHES)
        raise ValueError(f"{where}.{ROLLOUT_KEY} is None: OpenRLHF asks vLLM for log-probs only with its rollout "
                         f"correction on: {switches}")
    if value is None:
        raise ValueError(f"{where}.{name} is None: call after make_experience_batch (the actor's forward fills it)")
    if not isinstance(value, Tensor) or value.dim() != 2:
        what = f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{where}.{name} must be a [B, T] tensor, as in OpenRLHF's Experience; got {what}")
    return value.detach().cpu()


def _one(experience: Any, where: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rollout, train, mask = (_field(experience, key, where) for key in (ROLLOUT_KEY, TRAIN_KEY, MASK_KEY))
    sequences = _field(experience, "sequences", where)
    for name, value in ((TRAIN_KEY, train), (MASK_KEY, mask)):
        if value.shape != rollout.shape:
            raise ValueError(f"{where}.{name} has shape {list(value.shape)} but {ROLLOUT_KEY} has "
                             f"{list(rollout.shape)}")
    if not ((mask == 0) | (mask == 1)).all():  # (checked before the cast to bool, which reads a 2 as True)
        raise ValueError(f"{where}.{MASK_KEY} holds values other than 0 and 1")
    width = rollout.shape[1]
    if sequences.shape[0] != rollout.shape[0] or not width < sequences.shape[1]:
        raise ValueError(f"{where}.sequences has shape {list(sequences.shape)}; with {list(rollout.shape)} "
                         "log-probs it needs the same rows and more columns (the log-probs score its last columns)")
    return rollout, train, mask, sequences[:, -width:]  # column j scores token T - A + j (Actor.forward's alignment)


def experience_sides(experiences: Any | Sequence[Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rollout, training, mask, token ids), each [N, A_max] on the CPU, from one ``Experience`` or the list
    ``make_experience_batch`` returns: the micro-batches' rows in order, right-padded with 0 (mask False) to the
    widest, as OpenRLHF pads. Row n of the dump is id n of ``vexact compare``'s report."""
    items = list(experiences) if isinstance(experiences, (list, tuple)) else [experiences]
    if not items:
        raise ValueError("no experiences: pass what make_experience_batch returned")
    parts = [_one(e, f"experiences[{i}]") for i, e in enumerate(items)]
    width = max(p[0].shape[1] for p in parts)

    def stacked(k: int, dtype: torch.dtype | None = None) -> Tensor:
        rows = [p[k] if dtype is None else p[k].to(dtype) for p in parts]
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in rows])

    return stacked(0), stacked(1), stacked(2, torch.bool), stacked(3, torch.long)


def dump_experiences(experiences: Any | Sequence[Any], path: str | Path) -> Path:
    """Save ``experience_sides(experiences)`` as a safetensors file under ``DUMP_KEYS`` (parent folders made), for
    ``vexact compare PATH`` followed by ``COMPARE_FLAGS``."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = experience_sides(experiences)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in zip(DUMP_KEYS, tensors)}, str(path))
    return path


def observe_experiences(monitor: LiveMonitor, experiences: Any | Sequence[Any], step: int) -> dict[str, Any] | None:
    """One ``monitor.step`` on ``experience_sides(experiences)`` at ``step`` (OpenRLHF's ``global_step``); returns
    the row. A monitor that samples (``sample_fraction`` < 1 or ``every`` > 1) gets ``step_sampled``'s row (None on
    a step it skips), the sample read from the actor's recomputation."""
    if not isinstance(monitor, LiveMonitor):
        raise ValueError(f"monitor must be a vexact.live.LiveMonitor, got {type(monitor).__name__}")
    rollout, train, mask, _ = experience_sides(experiences)
    if monitor.sampling:
        return monitor.step_sampled(step, rollout, lambda rows: train[rows], mask, train_side=TRAIN_KEY)
    return monitor.step(step, rollout, train, mask)
