"""Learning-rate schedules, including the mismatch-aware ones.

``lr(step)`` = base · warmup(step) · decay(step), never below the floor ``min_lr_ratio · base`` once decaying.
Warmup (``optimizer.warmup_steps``) ramps linearly from base/warmup to base and applies to every kind.

Kinds (``lr_schedule.kind``):

* ``constant``: decay = 1.
* ``cosine``: from base down to the floor over ``total_steps`` (default: the run's steps), after warmup.
* ``step``: × ``gamma`` every ``step_size`` steps, down to the floor.
* ``length_triggered`` ("Beyond Precision", Algorithm 1 and §4.2): keep the LR until the mean rollout response
  length surges — its trailing mean over N steps exceeds ratio × the mean of the first N steps, with N and ratio
  the collapse detector's ``collapse.length_surge_window`` / ``collapse.length_surge_ratio`` (one surge rule, one
  setting; ``collapse.surge_index`` computes it for both). From then on halve the LR at
  every step t that is a multiple of ``decay_period`` (Algorithm 1's ``t mod T_decay == 0``), down to the floor.
  ``decay_period`` null means ``round(decay_period_factor × trigger step)`` (paper: 1.8 × the surge step).
* ``mismatch_triggered`` (beyond the paper): the same decay, triggered when the trailing mean over
  ``mismatch_window`` steps of ``mismatch_metric`` (``rollout_corr/k3_kl`` or ``rollout_corr/log_ppl_abs_diff``)
  exceeds ``mismatch_threshold``.

A trigger seen after step s changes the LR from step s + 1 on (step s's update already happened). The trainer
calls ``observe(step, metrics)`` after every step; it returns ``lr_schedule/*`` metrics to log and remembers the
trigger step and its reason for ``summary.json``. ``state_dict`` holds everything needed to resume bit-identically.
"""

from __future__ import annotations

import math

from .collapse import surge_index, trailing_mean
from .config import CollapseSection, LRScheduleSection, OptimizerSection

LENGTH_METRIC = "response_length/mean"


class LRSchedule:
    """One schedule object per run: ``lr(step)`` before each update, ``observe(step, metrics)`` after it."""

    def __init__(self, opt: OptimizerSection, sched: LRScheduleSection | None = None, total_steps: int = 1,
                 collapse: CollapseSection | None = None):
        """``collapse``: where the length surge of ``length_triggered`` is set (default: its defaults)."""
        self.base_lr = opt.lr
        surge = collapse or CollapseSection()
        self.surge_window, self.surge_ratio = surge.length_surge_window, surge.length_surge_ratio
        self.warmup_steps = opt.warmup_steps
        self.cfg = sched or LRScheduleSection()
        self.total_steps = self.cfg.total_steps or total_steps
        self.floor = self.cfg.min_lr_ratio * self.base_lr
        self.observed: list[float] = []  # the trigger metric, one finite value per observed step
        self.trigger_step: int | None = None
        self.trigger_reason: str | None = None
        self.decay_period: int | None = None

    @property
    def triggered_kind(self) -> bool:
        return self.cfg.kind in ("length_triggered", "mismatch_triggered")

    def lr(self, step: int) -> float:
        warm = (step + 1) / self.warmup_steps if self.warmup_steps and step < self.warmup_steps else 1.0
        return self.base_lr * warm * self._decay(step)

    def _decay(self, step: int) -> float:
        """Multiplier on the base LR (floor applied), before warmup."""
        c, floor_ratio = self.cfg, self.cfg.min_lr_ratio
        if c.kind == "constant":
            return 1.0
        if c.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min(max(step - self.warmup_steps, 0), span) / span
            return floor_ratio + (1.0 - floor_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if c.kind == "step":
            return max(c.gamma ** (step // c.step_size), floor_ratio)
        # triggered: halvings at the multiples of the period after the trigger step, up to this step
        if self.trigger_step is None or step <= self.trigger_step:
            return 1.0
        period = self.decay_period
        halvings = step // period - self.trigger_step // period
        return max(0.5**halvings, floor_ratio)

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """Feed one step's metrics; returns ``lr_schedule/*`` metrics for that step's log line."""
        if not self.triggered_kind:
            return {}
        if self.trigger_step is None:
            key = LENGTH_METRIC if self.cfg.kind == "length_triggered" else self.cfg.mismatch_metric
            value = metrics.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.observed.append(float(value))
                reason = self._check_trigger(key)
                if reason is not None:
                    self.trigger_step = step
                    self.trigger_reason = reason
                    self.decay_period = self.cfg.decay_period or max(
                        1, round(self.cfg.decay_period_factor * step))
        return {"lr_schedule/triggered": float(self.trigger_step is not None)}

    def _check_trigger(self, key: str) -> str | None:
        c, values = self.cfg, self.observed
        if c.kind == "length_triggered":
            window, ratio = self.surge_window, self.surge_ratio
            j = surge_index(values, window, ratio)
            if j is None or j != len(values) - 1:
                return None
            baseline = sum(values[:window]) / window
            now = trailing_mean(values, window)[-1]
            return f"{key} trailing mean {now:.3g} > {ratio:g} x baseline {baseline:.3g} (window {window})"
        if len(values) < c.mismatch_window:
            return None
        now = trailing_mean(values, c.mismatch_window)[-1]
        if now > c.mismatch_threshold:
            return f"{key} trailing mean {now:.3g} > threshold {c.mismatch_threshold:g} (window {c.mismatch_window})"
        return None

    def summary(self) -> dict:
        """For ``summary.json``: the kind and, for triggered kinds, when and why it fired."""
        out: dict = {"kind": self.cfg.kind}
        if self.triggered_kind:
            out.update(trigger_step=self.trigger_step, trigger_reason=self.trigger_reason,
                       decay_period=self.decay_period)
        return out

    def state_dict(self) -> dict:
        return {"observed": list(self.observed), "trigger_step": self.trigger_step,
                "trigger_reason": self.trigger_reason, "decay_period": self.decay_period}

    def load_state_dict(self, state: dict) -> None:
        self.observed = [float(v) for v in state.get("observed", [])]
        self.trigger_step = state.get("trigger_step")
        self.trigger_reason = state.get("trigger_reason")
        self.decay_period = state.get("decay_period")
