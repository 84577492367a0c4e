"""TRL: ``vexact.live`` inside a ``GRPOTrainer``, one row per generation batch.

    from trl import GRPOConfig, GRPOTrainer
    from vexact.integrations.trl import LiveMismatchMixin, hf_generate_rollout
    from vexact.live import Gates, LiveMonitor

    class MonitoredGRPOTrainer(LiveMismatchMixin, GRPOTrainer):  # or mix into your own GRPOTrainer subclass
        pass

    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                   rollout_func=hf_generate_rollout,  # or GRPOConfig(use_vllm=True), or your engine
                                   live_monitor=LiveMonitor("out/vexact", gates=Gates(max_k3=1e-3)))
    trainer.train()

(``LiveGRPOTrainer`` below is that class, ready made.)

What is compared (TRL 1.x, ``GRPOTrainer._generate_and_score_completions``; checked against TRL 1.16):

* **rollout side** -- ``sampling_per_token_logps``: the log-prob of each sampled token as the *generation engine*
  reported it. TRL has it only when the engine reports one: vLLM (``use_vllm=True``; TRL asks vLLM for
  ``processed_logprobs``, after temperature) or a ``rollout_func`` returning ``logprobs`` (``hf_generate_rollout``
  below: transformers' ``generate``; SGLang; your own server). TRL's built-in transformers ``generate`` path keeps
  none, so there the mixin refuses to start: there is no rollout side to compare.
* **training side** -- ``old_per_token_logps``: the trainer model's full-sequence forward over the same
  prompt + completion tokens at the weights that generated them, divided by the same temperature. TRL computes it
  itself with vLLM importance-sampling correction on (the default) or when generation and optimisation steps are
  misaligned; otherwise the mixin computes it with TRL's own ``_get_per_token_logps_and_entropies`` (one extra
  no-grad forward per generation batch, text-only models). This is TRL's π_old, the quantity its
  ``vllm_importance_sampling_*`` correction and ``sampling/sampling_logp_difference/*`` metrics use -- not the
  loss's ``per_token_logps``, which carry gradients and move with every optimiser step.
* **mask** -- ``completion_mask`` times ``tool_mask`` (tool-output tokens of multi-turn rollouts are not sampled:
  TRL puts 0.0 in their rollout log-probs and masks them out of the loss), as TRL's loss masks them.

Step: the row's ``step`` is the trainer's ``global_step`` (its optimiser step) when the batch was generated, so a run
resumed from a checkpoint (``train(resume_from_checkpoint=...)`` with ``LiveMonitor(..., resume=True)``) continues
metrics.jsonl at the checkpoint's step: the rows before it are kept, the rows from it on are written again. With
several generation batches per optimiser step (``steps_per_generation x num_iterations`` below
``gradient_accumulation_steps``; never under TRL's defaults) it is ``global_step x G + j``, ``G`` the most batches one
optimiser step can generate and ``j`` the batch's index within its step; ``trl/global_step`` is in every row.
A monitor built with ``sample_fraction`` < 1 or ``every`` > 1 (``LiveMonitor(..., sample_fraction=0.1)``: TRL runs
without TRL's importance-sampling correction, so nothing recomputes the log-probs, as in verl's bypass mode) compares
its sample only (``LiveMonitor.step_sampled``): the mixin's extra forward covers the sampled rows instead of the
whole batch, and a step the monitor skips costs none; where TRL computed ``old_per_token_logps`` itself the sample
reads them.
Only training batches are monitored (not evaluation), and only on the main process: with several processes a row
covers process 0's share of the batch. With ``on_gate_failure="raise"`` a failed gate stops ``trainer.train()``
with ``vexact.live.GateFailed`` after the row is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..live import LiveMonitor
from ..metric_keys import TRL_GLOBAL_STEP

__all__ = ["LiveMismatchMixin", "batch_sides", "dump_batch", "hf_generate_rollout"]  # and LiveGRPOTrainer, built on
# first use (``__getattr__``)

DUMP_KEYS = ("rollout_log_probs", "old_log_probs", "response_mask", "responses")
"""``dump_batch``'s tensor names: verl's batch keys, the defaults of ``vexact compare`` on one tensor file."""


class LiveMismatchMixin:
    """Put before ``GRPOTrainer`` (or your subclass of it) in the bases; adds the keyword ``live_monitor``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuses bases that put TRL's ``GRPOTrainer`` first: its ``__init__`` would never reach the mixin's, and
        the first sign would be TRL's "unexpected keyword argument 'live_monitor'"."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        grpo = next((i for i, base in enumerate(mro) if base.__name__ == "GRPOTrainer"
                     and base.__module__.split(".")[0] == "trl"), None)
        if grpo is not None and grpo < mro.index(LiveMismatchMixin):
            raise ValueError(f"{cls.__name__}: LiveMismatchMixin must come before GRPOTrainer (or your subclass of it) "
                             f"in the bases, e.g. class {cls.__name__}(LiveMismatchMixin, GRPOTrainer)")

    def __init__(self, *args: Any, live_monitor: LiveMonitor, **kwargs: Any):
        from trl import GRPOTrainer

        if not isinstance(self, GRPOTrainer):
            raise ValueError(f"LiveMismatchMixin hooks TRL's GRPOTrainer, and {type(self).__name__} is not one: mix it "
                             "into GRPOTrainer or a subclass of it")
        if not isinstance(live_monitor, LiveMonitor):
            raise ValueError(f"live_monitor must be a vexact.live.LiveMonitor, got {type(live_monitor).__name__}")
        super().__init__(*args, **kwargs)
        if not (self.use_vllm or self.rollout_func is not None):
            raise ValueError("vexact live monitoring needs the generation engine's log-probs, and TRL's transformers "
                             "generate path keeps none: use vLLM (GRPOConfig(use_vllm=True)) or a rollout_func that "
                             "returns 'logprobs'")
        self.live_monitor = live_monitor
        self._live_last: tuple[int, int] | None = None  # (global_step, index within it) of the last row

    def _live_step(self) -> int:
        """This batch's row step: ``global_step x G + j`` (see the module doc; ``G`` is 1 under TRL's defaults, so
        the step is ``global_step``). A function of the trainer's state, so a resumed trainer continues the rows."""
        accumulation = int(self.args.gradient_accumulation_steps)
        generate_every = int(self.args.steps_per_generation) * int(self.num_iterations)
        per_step = max(1, math.ceil(accumulation / generate_every))
        global_step = int(self.state.global_step)
        index = self._live_last[1] + 1 if self._live_last and self._live_last[0] == global_step else 0
        self._live_last = (global_step, index)
        return global_step * per_step + min(index, per_step - 1)  # a repeat is refused by the monitor, named

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self.accelerator.is_main_process:
            step, extra = self._live_step(), {TRL_GLOBAL_STEP: int(self.state.global_step)}
            if self.live_monitor.sampling:  # the trainer's side of the monitor's sample only
                rollout, mask = _rollout_side(output)
                self.live_monitor.step_sampled(step, rollout, lambda rows: _training_side(self, output, rows), mask,
                                               extra=extra)
            else:
                rollout, train, mask = batch_sides(self, output)
                self.live_monitor.step(step, rollout, train, mask, extra=extra)
        return output


def _check_output(output: Any, keys: tuple[str, ...]) -> None:
    """One ValueError unless ``output`` is a ``_generate_and_score_completions`` output holding ``keys`` (the
    trainer's ``inputs``, a list of prompts, or a batch missing a key was an AttributeError or a bare KeyError)."""
    if not isinstance(output, Mapping):
        raise ValueError(f"expected the dict GRPOTrainer._generate_and_score_completions returns, got "
                         f"{type(output).__name__}")
    missing = [key for key in keys if key not in output]
    if missing:
        raise ValueError(f"this GRPOTrainer batch has no {', '.join(map(repr, missing))}: pass the dict "
                         "_generate_and_score_completions returns")


def _rollout_side(output: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """(rollout log-probs, mask) [B, C] of one ``_generate_and_score_completions`` output."""
    _check_output(output, ())
    rollout = output.get("sampling_per_token_logps")
    if rollout is None:
        raise ValueError("this GRPOTrainer batch has no 'sampling_per_token_logps' (the generation engine's "
                         "log-probs): use vLLM or a rollout_func that returns 'logprobs'")
    _check_output(output, ("completion_mask",))
    mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        mask = mask * output["tool_mask"]
    return rollout, mask


def _training_side(trainer: Any, output: dict[str, Any], rows: list[int] | None = None) -> Tensor:
    """The trainer's log-probs [B, C] (``rows``: of those rows only, [len(rows), C]): TRL's ``old_per_token_logps``
    when it computed them, else one no-grad forward of TRL's own ``_get_per_token_logps_and_entropies`` over the
    rows."""
    train = output.get("old_per_token_logps")
    if train is not None:
        return train if rows is None else train[rows]
    _check_output(output, ("prompt_ids", "prompt_mask", "completion_ids"))
    prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    if rows is not None:
        prompt_completion_ids, attention_mask = prompt_completion_ids[rows], attention_mask[rows]
    with torch.no_grad():
        train, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, prompt_completion_ids, attention_mask, output["completion_ids"].size(1),
            batch_size=trainer.args.per_device_train_batch_size)
    return train


def batch_sides(trainer: Any, output: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """(rollout, training, mask) [B, C] of one ``_generate_and_score_completions`` output (see the module doc)."""
    rollout, mask = _rollout_side(output)
    return rollout, _training_side(trainer, output), mask


def dump_batch(trainer: Any, output: dict[str, Any], path: str | Path) -> Path:
    """Save one ``_generate_and_score_completions`` output for ``vexact compare PATH``: ``batch_sides``' tensors and
    the completion ids under verl's key names (``DUMP_KEYS``), as a safetensors file; the parent folders are made."""
    from safetensors.torch import save_file

    _check_output(output, ("completion_ids",))
    rollout, train, mask = batch_sides(trainer, output)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = (rollout.detach(), train.detach(), mask, output["completion_ids"])
    save_file({key: value.cpu().contiguous() for key, value in zip(DUMP_KEYS, tensors)}, str(path))
    return path


def hf_generate_rollout(prompts: list[Any], trainer: Any) -> dict[str, list[list[Any]]]:
    """A TRL ``rollout_func`` that samples with transformers' ``generate`` and returns each sampled token's log-prob:
    the rollout side TRL's own transformers path does not keep (``rollout_func=hf_generate_rollout``).

    It runs what TRL's transformers path runs -- TRL's prompt tokenisation (chat template included), its
    ``generation_config`` (temperature, top-p, top-k, min-p, repetition penalty, ``max_completion_length``), the
    prompts left-padded as one batch -- and reports log_softmax(raw logits / temperature) of every sampled token, as an
    engine reports log-probs after temperature; completions end at the first EOS (kept), as TRL cuts them. The
    training side TRL scores is that same distribution, so with top-p, top-k, min-p or a repetition penalty set the
    tokens are drawn from another one (as with vLLM). Text prompts only; it is a CPU-friendly reference engine (KV
    cache, one token at a time), not a fast one."""
    from trl.models.utils import unwrap_model_for_generation

    config = getattr(trainer, "generation_config", None)
    if config is None:
        raise ValueError("hf_generate_rollout needs the trainer's transformers generation_config, which a GRPOTrainer "
                         "with use_vllm=True does not build: leave use_vllm off with this rollout_func")
    prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
    if images is not None:
        raise ValueError("hf_generate_rollout handles text prompts only; this batch has images")
    prompt_ids = [[int(t) for t in ids] for ids in prompt_ids]
    width = max(len(ids) for ids in prompt_ids)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    device = trainer.accelerator.device
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=device)
    with (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                      gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                      generation_kwargs=trainer.generation_kwargs,
                                      gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
                                      ) as model, torch.no_grad()):
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                             output_logits=True, return_dict_in_generate=True)
    completions = out.sequences[:, width:].cpu()
    logits = torch.stack(out.logits, dim=1).float().cpu() / config.temperature  # [B, C, V], raw logits / T
    logps = torch.log_softmax(logits, -1).gather(-1, completions[..., None])[..., 0]
    eos = torch.tensor(sorted(set(trainer.eos_token_ids)))
    completion_ids, logprobs = [], []
    for tokens, values in zip(completions, logps):
        ends = torch.isin(tokens, eos).nonzero()
        n = int(ends[0, 0]) + 1 if ends.numel() else tokens.numel()
        completion_ids.append(tokens[:n].tolist())
        logprobs.append(values[:n].tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


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
