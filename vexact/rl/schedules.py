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

Each kind is one class registered in ``LR_SCHEDULES`` (``register_lr_schedule`` adds one), with its own settings
(a dataclass whose fields become ``lr_schedule.*`` keys: ``step``'s ``step_size`` and ``gamma``): the config's
choices of ``lr_schedule.kind`` and the docs' table read the registry, and ``LRSchedule`` never branches on a
kind's name.

A trigger seen after step s changes the LR from step s + 1 on (step s's update already happened). The trainer
calls ``observe(step, metrics)`` after every step; it returns ``lr_schedule/*`` metrics to log and remembers the
trigger step and its reason for ``summary.json``. ``state_dict`` holds everything needed to resume bit-identically.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from ..metric_keys import K3_KL, LOG_PPL_ABS_DIFF, LR_SCHEDULE_TRIGGERED, RESPONSE_LENGTH_MEAN
from ..registry import PluginCodeError, call_entry, entry_code
from .collapse import surge_index, trailing_mean
from .config_schema import CollapseSection, LRScheduleSection
from .registries import LR_SCHEDULES
from .validate import bounds, show_repr

if TYPE_CHECKING:
    from .config_schema import OptimizerSection

class ScheduleKind:
    """One ``lr_schedule.kind``: ``decay(s, step)``, the multiplier on the base LR before warmup, a finite real
    number >= 0 (anything else is a ``PluginCodeError`` naming the kind; ``LRSchedule`` raises ``min_lr_ratio``'s
    floor under it), of schedule ``s`` (an ``LRSchedule``: its config ``s.cfg``, ``s.total_steps``,
    ``s.warmup_steps``, trigger state).

    A triggered kind (``triggered``) watches one metric per step (``metric(s)``) and says when it fires
    (``fired(s, key)``: the reason, or None); its decay then halves the LR every ``decay_period`` steps.
    ``settings``: a dataclass of the kind's own options, mounted as ``lr_schedule.<field>`` keys.
    ``spans_run``: ``decay`` reads ``s.total_steps``, which is the run's ``steps`` unless ``lr_schedule.total_steps``
    is set; such a run's ``steps`` may not change on resume (``follows_run_steps``)."""

    name: ClassVar[str] = ""
    triggered: ClassVar[bool] = False
    settings: ClassVar[type | None] = None
    spans_run: ClassVar[bool] = False

    def decay(self, s: LRSchedule, step: int) -> float:
        return 1.0

    def metric(self, s: LRSchedule) -> str:
        raise NotImplementedError

    def fired(self, s: LRSchedule, key: str) -> str | None:
        raise NotImplementedError


def register_lr_schedule(kind: ScheduleKind, replace: bool = False) -> ScheduleKind:
    """Register an LR schedule kind (a ``ScheduleKind`` instance) under its ``name``; a name already taken is an
    error unless ``replace``."""
    if not isinstance(kind, ScheduleKind):
        raise TypeError(f"register_lr_schedule needs a ScheduleKind instance, got {kind!r}")
    return LR_SCHEDULES.add(kind.name, kind, replace=replace)


class Constant(ScheduleKind):
    """``constant``: the base LR (after warmup)."""

    name = "constant"


@dataclass
class CosineSettings:
    """The ``cosine`` kind's setting (``lr_schedule`` section)."""

    total_steps: int | None = field(default=None, metadata=bounds(min=1))  # cosine horizon (None = run steps)


class Cosine(ScheduleKind):
    """``cosine``: from the base LR down to the floor over ``total_steps`` (default: the run's steps), after warmup."""

    name = "cosine"
    settings = CosineSettings
    spans_run = True

    def decay(self, s: LRSchedule, step: int) -> float:
        floor_ratio = s.cfg.min_lr_ratio
        span = max(s.total_steps - s.warmup_steps, 1)
        progress = min(max(step - s.warmup_steps, 0), span) / span
        return floor_ratio + (1.0 - floor_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepSettings:
    """The ``step`` kind's settings (``lr_schedule`` section)."""

    step_size: int = field(default=50, metadata=bounds(min=1))  # step: multiply by gamma every step_size steps
    gamma: float = field(default=0.5, metadata=bounds(gt=0, lt=1))  # step: factor every step_size steps


class Step(ScheduleKind):
    """``step``: x ``gamma`` every ``step_size`` steps, down to the floor."""

    name = "step"
    settings = StepSettings

    def decay(self, s: LRSchedule, step: int) -> float:
        return max(s.cfg.gamma ** (step // s.cfg.step_size), s.cfg.min_lr_ratio)


@dataclass
class TriggeredSettings:
    """The triggered kinds' settings (``lr_schedule`` section)."""

    decay_period: int | None = field(default=None, metadata=bounds(min=1))  # triggered: halve every N steps ...
    decay_period_factor: float = field(default=1.8, metadata=bounds(gt=0))  # ... or N = factor x trigger step


@dataclass
class MismatchTriggeredSettings(TriggeredSettings):
    """``mismatch_triggered``'s settings (``lr_schedule`` section): the decay's and its trigger's."""

    mismatch_metric: Literal[K3_KL, LOG_PPL_ABS_DIFF] = K3_KL  # the metric whose trailing mean is compared
    mismatch_threshold: float = field(default=0.1, metadata=bounds(gt=0))  # verl warns at |kl| > 0.1
    mismatch_window: int = field(default=5, metadata=bounds(min=1))  # trailing mean over N steps > threshold


class _Triggered(ScheduleKind):
    """Keep the LR until the trigger, then halve it at the multiples of ``decay_period`` after the trigger step."""

    triggered = True
    settings = TriggeredSettings

    def decay(self, s: LRSchedule, step: int) -> float:
        if s.trigger_step is None or step <= s.trigger_step:
            return 1.0
        period = s.decay_period
        halvings = step // period - s.trigger_step // period
        return max(0.5**halvings, s.cfg.min_lr_ratio)


class LengthTriggered(_Triggered):
    """``length_triggered``: fires at the length surge of the mean response length (``collapse.length_surge_*``)."""

    name = "length_triggered"

    def metric(self, s: LRSchedule) -> str:
        return RESPONSE_LENGTH_MEAN

    def fired(self, s: LRSchedule, key: str) -> str | None:
        values, window, ratio = s.observed, s.surge_window, s.surge_ratio
        j = surge_index(values, window, ratio)
        if j is None or j != len(values) - 1:
            return None
        baseline = sum(values[:window]) / window
        now = trailing_mean(values, window)[-1]
        return f"{key} trailing mean {now:.3g} > {ratio:g} x baseline {baseline:.3g} (window {window})"


class MismatchTriggered(_Triggered):
    """``mismatch_triggered``: fires when the trailing mean of ``mismatch_metric`` over ``mismatch_window`` steps
    exceeds ``mismatch_threshold``."""

    name = "mismatch_triggered"
    settings = MismatchTriggeredSettings

    def metric(self, s: LRSchedule) -> str:
        return s.cfg.mismatch_metric

    def fired(self, s: LRSchedule, key: str) -> str | None:
        c, values = s.cfg, s.observed
        if len(values) < c.mismatch_window:
            return None
        now = trailing_mean(values, c.mismatch_window)[-1]
        if now > c.mismatch_threshold:
            return f"{key} trailing mean {now:.3g} > threshold {c.mismatch_threshold:g} (window {c.mismatch_window})"
        return None


for _kind in (Constant(), Cosine(), Step(), LengthTriggered(), MismatchTriggered()):
    register_lr_schedule(_kind)


def follows_run_steps(sched: LRScheduleSection) -> bool:
    """Whether the LR at every step depends on the run's ``steps``: a kind that spans the run (``cosine``) without
    ``lr_schedule.total_steps``. Such a run's ``steps`` cannot change on resume, nor a sweep point's be extended:
    the steps already taken followed the old horizon, so the result would be no run from the start."""
    return LR_SCHEDULES[sched.kind].spans_run and getattr(sched, "total_steps", None) is None


def steps_change_problem(sched: LRScheduleSection, old: int, new: int) -> str | None:
    """Why a run with schedule ``sched`` may not resume with ``steps`` changed from ``old`` to ``new``
    (``follows_run_steps``), or None when it may."""
    if old == new or not follows_run_steps(sched):
        return None
    return (f"{old} -> {new}, but lr_schedule.kind {sched.kind} spans the run's steps (lr_schedule.total_steps is "
            f"unset): the LR of every step depends on steps, and the steps already taken followed a horizon of {old}")


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
        self.kind = LR_SCHEDULES[self.cfg.kind]
        self.total_steps = self.cfg.total_steps or total_steps
        self.observed: list[float] = []  # the trigger metric, one finite value per observed step
        self.trigger_step: int | None = None
        self.trigger_reason: str | None = None
        self.decay_period: int | None = None

    @property
    def triggered_kind(self) -> bool:
        return self.kind.triggered

    def lr(self, step: int) -> float:
        warm = (step + 1) / self.warmup_steps if self.warmup_steps and step < self.warmup_steps else 1.0
        return self.base_lr * warm * self.decay(step)

    def decay(self, step: int) -> float:
        """The kind's ``decay`` at ``step``, floored at ``min_lr_ratio`` (the documented floor min_lr_ratio x base,
        as a multiplier, so warmup still ramps from base/warmup). The built-ins never go below it themselves, so
        the floor leaves their bits as they were. A decay that is no finite real number >= 0 (a negative one would
        ascend the gradient) is a ``PluginCodeError`` naming the kind."""
        name = self.cfg.kind
        value = call_entry(LR_SCHEDULES.what, name, "decay", self.kind.decay, self, step)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PluginCodeError(f"{entry_code(LR_SCHEDULES.what, name, 'decay')} returned {show_repr(value)} (a "
                                  f"{type(value).__name__}): expected a finite real number >= 0")
        if not math.isfinite(value) or value < 0:
            raise PluginCodeError(f"{entry_code(LR_SCHEDULES.what, name, 'decay')} returned {show_repr(value)} at "
                                  f"step {step}: expected a finite real number >= 0")
        return float(max(value, self.cfg.min_lr_ratio))

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """Feed one step's metrics; returns ``lr_schedule/*`` metrics for that step's log line."""
        if not self.triggered_kind:
            return {}
        if self.trigger_step is None:
            key = self.kind.metric(self)
            value = metrics.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.observed.append(float(value))
                reason = self.kind.fired(self, key)
                if reason is not None:
                    self.trigger_step = step
                    self.trigger_reason = reason
                    self.decay_period = self.cfg.decay_period or max(
                        1, round(self.cfg.decay_period_factor * step))
        return {LR_SCHEDULE_TRIGGERED: float(self.trigger_step is not None)}

    def retract(self, step: int, metrics: dict, keys: Callable[[str], bool]) -> None:
        """Take back what ``observe(step, metrics)`` (the last step observed) took from the keys ``keys`` accepts: the
        value and a trigger it fired (an extended run's off-schedule final evaluation, which a run of the new length
        from the start never observed)."""
        if not self.triggered_kind or self.trigger_step not in (None, step):  # fired earlier: nothing observed
            return
        key = self.kind.metric(self)
        value = metrics.get(key)
        if keys(key) and isinstance(value, (int, float)) and math.isfinite(value):
            self.observed.pop()
            self.trigger_step = self.trigger_reason = self.decay_period = None

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
