"""TRL: ``vexact.live`` inside a ``GRPOTrainer``, one row per generation batch.

    from trl import GRPOConfig, GRPOTrainer
    from vexact.integrations.trl import LiveMismatchMixin
    from vexact.live import Gates, LiveMonitor

    class MonitoredGRPOTrainer(LiveMismatchMixin, GRPOTrainer):  # or mix into your own GRPOTrainer subclass
        pass

    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_vllm=True),
                                   train_dataset=..., live_monitor=LiveMonitor("out/vexact", gates=Gates(max_k3=1e-3)))
    trainer.train()

(``LiveGRPOTrainer`` below is that class, ready made.)

What is compared (TRL 1.x, ``GRPOTrainer._generate_and_score_completions``; checked against TRL 1.16):

* **rollout side** -- ``sampling_per_token_logps``: the log-prob of each sampled token as the *generation engine*
  reported it. TRL has it only when the engine reports one: vLLM (``use_vllm=True``; TRL asks vLLM for
  ``processed_logprobs``, after temperature) or a ``rollout_func`` returning ``logprobs`` (SGLang, your own
  server). TRL's built-in transformers ``generate`` path keeps none, so there the mixin refuses to start: there is
  no rollout side to compare.
* **training side** -- ``old_per_token_logps``: the trainer model's full-sequence forward over the same
  prompt + completion tokens at the weights that generated them, divided by the same temperature. TRL computes it
  itself with vLLM importance-sampling correction on (the default) or when generation and optimisation steps are
  misaligned; otherwise the mixin computes it with TRL's own ``_get_per_token_logps_and_entropies`` (one extra
  no-grad forward per generation batch, text-only models). This is TRL's π_old, the quantity its
  ``vllm_importance_sampling_*`` correction and ``sampling/sampling_logp_difference/*`` metrics use -- not the
  loss's ``per_token_logps``, which carry gradients and move with every optimiser step.
* **mask** -- ``completion_mask`` times ``tool_mask`` (tool-output tokens of multi-turn rollouts are not sampled:
  TRL puts 0.0 in their rollout log-probs and masks them out of the loss), as TRL's loss masks them.

Step: the row's ``step`` counts generation batches (0, 1, 2, ...); ``trl/global_step`` is the trainer's optimiser
step when the batch was generated. With TRL's defaults (one generation per optimiser step) the two are equal.
Only training batches are monitored (not evaluation), and only on the main process: with several processes a row
covers process 0's share of the batch. With ``on_gate_failure="raise"`` a failed gate stops ``trainer.train()``
with ``vexact.live.GateFailed`` after the row is written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..live import LiveMonitor
from ..metric_keys import TRL_GLOBAL_STEP

__all__ = ["LiveMismatchMixin", "batch_sides"]  # and LiveGRPOTrainer, built on first use (``__getattr__``)


class LiveMismatchMixin:
    """Put before ``GRPOTrainer`` (or your subclass of it) in the bases; adds the keyword ``live_monitor``."""

    def __init__(self, *args: Any, live_monitor: LiveMonitor, **kwargs: Any):
        if not isinstance(live_monitor, LiveMonitor):
            raise ValueError(f"live_monitor must be a vexact.live.LiveMonitor, got {type(live_monitor).__name__}")
        super().__init__(*args, **kwargs)
        if not (self.use_vllm or self.rollout_func is not None):
            raise ValueError("vexact live monitoring needs the generation engine's log-probs, and TRL's transformers "
                             "generate path keeps none: use vLLM (GRPOConfig(use_vllm=True)) or a rollout_func that "
                             "returns 'logprobs'")
        self.live_monitor = live_monitor
        self._live_batches = 0

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self.accelerator.is_main_process:
            rollout, train, mask = batch_sides(self, output)
            self.live_monitor.step(self._live_batches, rollout, train, mask,
                                   extra={TRL_GLOBAL_STEP: int(self.state.global_step)})
            self._live_batches += 1
        return output


def batch_sides(trainer: Any, output: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """(rollout, training, mask) [B, C] of one ``_generate_and_score_completions`` output (see the module doc)."""
    rollout = output.get("sampling_per_token_logps")
    if rollout is None:
        raise ValueError("this GRPOTrainer batch has no 'sampling_per_token_logps' (the generation engine's "
                         "log-probs): use vLLM or a rollout_func that returns 'logprobs'")
    mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        mask = mask * output["tool_mask"]
    train = output.get("old_per_token_logps")
    if train is None:
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            train, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, prompt_completion_ids, attention_mask, output["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size)
    return rollout, train, mask


def _trainer_class() -> type:
    from trl import GRPOTrainer

    return type("LiveGRPOTrainer", (LiveMismatchMixin, GRPOTrainer), {"__module__": __name__, "__doc__": (
        "``GRPOTrainer`` with ``LiveMismatchMixin``: pass ``live_monitor=LiveMonitor(...)``.")})


def __getattr__(name: str) -> Any:
    """``LiveGRPOTrainer`` is built on first use, so importing this module does not import TRL."""
    if name == "LiveGRPOTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
