"""Controlled mismatch: re-introduce per-token TIM of a chosen kind and size, rollout path only.

The training path always stays exact; the injector only changes what the *rollout* path samples
from and/or records. Like sampling, every random draw is keyed by (seed, sequence, position), so
injection is batch-invariant and deterministic, and an injection of magnitude 0 is a bitwise no-op
(no hook is installed at all).

The output is a value: ``Injector.plan(step)`` returns a ``RolloutPlan`` -- the kernel ops, the weight dtype
and the logits hook the rollout path uses at that step -- and the trainer passes them to ``generate``; no
model's backend is switched. What each mode does is its own class in ``vexact.rl.inject_modes`` (the registry
``INJECT_MODES``); this module applies what every mode shares and never branches on a mode's name:

* the **schedule**: nothing before ``onset_step``, then a linear ramp over ``ramp_steps`` to the full value;
* the **scope** of a logits perturbation (``Injector.scoped``): every token (``all``), only vocabulary entries
  whose clean probability is below ``prob_threshold`` (``low_prob``), or a random ``fraction`` of positions;
* the **calibration** of a knob to a target mismatch (``calibrate``), searched as the mode's ``knob_search`` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from vexact_kernels import get_ops

from ..engine.generation import LogitsHook
from ..engine.model import KernelOps, RouteHook, resolve_dtype
from ..engine.sampling import counter_uniform
from ..registry import PluginCodeError, a_type, call_entry, entry_code
from .config_schema import InjectSection, RunConfig
from .inject_modes import INJECT_MODES, InjectMode, RolloutPath, _exact_probs, precision_ops, round_to

__all__ = ["Calibration", "Injector", "RolloutPlan", "calibrate", "checked_logits_hook", "precision_ops", "round_to"]

_SCOPE_SALT = 0x3C6EF372


@dataclass(frozen=True)
class RolloutPlan:
    """What the rollout path runs at one step: the kernel ops, the dtype of the weights, the logits hook and (MoE
    models) the route hook. ``generate(model_in_dtype, ..., ops=plan.ops, logits_hook=plan.logits_hook,
    routing_hook=plan.routing_hook)``."""

    value: float  # effective knob after onset/ramp (0 when inactive)
    ops: KernelOps  # kernel op module (precision mode: one whose outputs at the chosen sites are rounded)
    dtype: torch.dtype  # dtype of the weights the rollout path runs with
    logits_hook: LogitsHook | None = None
    active: bool = False  # the injector changed the rollout path at this step
    matches_training: bool = False  # ops and dtype are the training path's and nothing is injected
    routing_hook: RouteHook | None = None  # changes the MoE router's choices (routing_flip)


class Injector:
    """Builds the per-step ``RolloutPlan`` from the ``inject`` config section and the mode it names.

    ``rollout_backend`` / ``rollout_dtype``: the rollout path when nothing is injected (the ``rollout``
    section; None = the training path's); ``training_backend`` / ``training_dtype``: the training path."""

    def __init__(self, cfg: InjectSection, seed: int, training_backend: str = "exact",
                 training_dtype: torch.dtype | str = torch.float32, rollout_backend: str | None = None,
                 rollout_dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.seed = seed
        self.mode: InjectMode = INJECT_MODES[cfg.mode]
        self.value = cfg.value  # replaced by calibration when cfg.target is set
        self.device = torch.device(device)
        self.training_backend = training_backend
        self.training_dtype = resolve_dtype(training_dtype)
        self.rollout_backend = rollout_backend or training_backend
        self.rollout_dtype = resolve_dtype(rollout_dtype or training_dtype)
        self.rollout_ops = get_ops(self.rollout_backend, self.device)
        self.path = self._checked_path(
            call_entry(INJECT_MODES.what, self.mode.name, "rollout_path", self.mode.rollout_path, self))

    @classmethod
    def for_run(cls, cfg: RunConfig, device: torch.device | str = "cpu") -> Injector:
        """The injector of a run: its ``inject`` section over the ``rollout`` and training paths."""
        return cls(cfg.inject, cfg.seed, cfg.backend, cfg.dtype, cfg.rollout.backend, cfg.rollout.dtype, device)

    @property
    def enabled(self) -> bool:
        return self.mode.injects

    def value_at(self, step: int) -> float:
        """The knob after the onset/ramp schedule (0 before onset; on the ramp, the mode's ``ramped`` knob)."""
        c = self.cfg
        if not self.enabled or step < c.onset_step:
            return 0.0
        if c.ramp_steps and step - c.onset_step < c.ramp_steps:
            return self.mode.ramped(self.value, (step - c.onset_step + 1) / c.ramp_steps)
        return self.value

    def plan(self, step: int) -> RolloutPlan:
        """The rollout path at ``step``."""
        if not self.enabled or step < self.cfg.onset_step:
            return self._knob_plan(0.0, None)
        if self.path is not None:
            return RolloutPlan(1.0, self.path.ops, self.path.dtype, self.path.logits_hook, active=True)
        return self.plan_for_value(self.value_at(step), step)

    def plan_for_value(self, value: float, step: int) -> RolloutPlan:
        """The rollout path of a knob mode at knob ``value`` (calibration tries several)."""
        return self._knob_plan(value, self.logits_hook(value, step), self.mode.routing_hook(self, value, step))

    def _knob_plan(self, value: float, hook: LogitsHook | None, routing_hook: RouteHook | None = None
                   ) -> RolloutPlan:
        same_path = self.rollout_backend == self.training_backend and self.rollout_dtype == self.training_dtype
        untouched = hook is None and routing_hook is None
        return RolloutPlan(value, self.rollout_ops, self.rollout_dtype, hook, active=not untouched,
                           matches_training=same_path and untouched, routing_hook=routing_hook)

    def logits_hook(self, value: float, step: int) -> LogitsHook | None:
        """The mode's hook at knob ``value``; None when it would change nothing. The hook is the mode's own, each
        call's result checked (``checked_logits_hook``)."""
        hook = call_entry(INJECT_MODES.what, self.mode.name, "logits_hook", self.mode.logits_hook, self, value, step)
        if hook is not None and not callable(hook):
            raise PluginCodeError(f"{entry_code(INJECT_MODES.what, self.mode.name, 'logits_hook')} returned "
                                  f"{a_type(hook)}: expected a hook(z, seq, pos) or None")
        return None if hook is None else checked_logits_hook(self.mode.name, "logits_hook", hook)

    def _checked_path(self, path: RolloutPath | None) -> RolloutPath | None:
        """A path mode's ``rollout_path`` result, its hook's results checked; None for knob modes."""
        if path is None:
            return None
        if not isinstance(path, RolloutPath):
            raise PluginCodeError(f"{entry_code(INJECT_MODES.what, self.mode.name, 'rollout_path')} returned "
                                  f"{a_type(path)}: expected a RolloutPath or None")
        if path.logits_hook is None:
            return path
        return replace(path, logits_hook=checked_logits_hook(self.mode.name, "rollout_path", path.logits_hook))

    def scoped(self, clean: Tensor, changed: Tensor, seq: Tensor, pos: Tensor, step: int) -> Tensor:
        """``changed`` where ``inject.scope`` applies at ``step``, ``clean`` elsewhere (for perturbing modes)."""
        c = self.cfg
        if c.scope == "all":
            return changed
        if c.scope == "low_prob":
            return torch.where(_exact_probs(clean) < c.prob_threshold, changed, clean)
        chosen = counter_uniform((self.seed * 1_000_003 + step) ^ _SCOPE_SALT, seq, pos, 1) < c.fraction
        return torch.where(chosen, changed, clean)


def checked_logits_hook(mode: str, function: str, hook: LogitsHook) -> LogitsHook:
    """``hook`` (of injection mode ``mode``, made by its ``function``), called through ``call_entry`` and its result
    checked at every call: a pair ``(sample_from, record)`` of tensors, each of the logits' shape, dtype and device,
    else one ``PluginCodeError`` naming the mode. Metadata only: a decode step reads no value back from the device.
    The tensors pass on unchanged, so a mode's bits are those of its own hook."""
    function = f"{function}'s hook"  # errors name the hook, made by the mode's ``function``
    code = entry_code(INJECT_MODES.what, mode, function)

    def checked(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        out = call_entry(INJECT_MODES.what, mode, function, hook, z, seq, pos)
        expected = (f"expected a pair (sample_from, record) of logits, each a tensor of shape {tuple(z.shape)}, "
                    f"{z.dtype} on {z.device} (the logits' own)")
        if not (isinstance(out, tuple) and len(out) == 2):
            got = f"a {len(out)}-tuple" if isinstance(out, tuple) else a_type(out)
            raise PluginCodeError(f"{code} returned {got}: {expected}")
        for which, t in zip(("sample_from", "record"), out):
            if not isinstance(t, Tensor):
                raise PluginCodeError(f"{code} returned {a_type(t)} as {which}: {expected}")
            if t.shape != z.shape or t.dtype != z.dtype or t.device != z.device:
                raise PluginCodeError(f"{code} returned {which} of shape {tuple(t.shape)}, {t.dtype} on "
                                      f"{t.device}: {expected}")
        return out

    return checked


@dataclass
class Calibration:
    value: float  # the calibrated knob
    achieved: float  # the metric at that knob on the calibration batch
    target: float
    evaluations: list[tuple[float, float]]  # (knob, metric) in the order tried
    tolerance: float = 0.0  # relative: the search stops within it

    @property
    def reached(self) -> bool:
        """Whether ``achieved`` is within ``tolerance`` of ``target`` (else the knob is only the closest tried)."""
        return abs(self.achieved - self.target) <= self.tolerance * self.target


def calibrate(measure: Callable[[float], float], mode: str | InjectMode, target: float, tolerance: float,
              sign: float = 1.0, vocab_size: int = 2, max_evals: int = 40) -> Calibration:
    """Find the knob whose measured mismatch metric is ``target`` (within ``tolerance``, relative).

    ``measure(knob)`` runs the calibration batch. The search is the mode's ``knob_search``: it assumes the metric
    grows with the perturbation (σ for noise modes, |ε| for logit_scale in direction ``sign``, 1 - p for top_p,
    fewer kept tokens for top_k: integers, bisection over k). Returns the best knob tried.
    """
    search = (INJECT_MODES[mode] if isinstance(mode, str) else mode).knob_search(sign, vocab_size)
    tried: list[tuple[float, float]] = []

    def run(knob: float) -> float:
        metric = measure(knob)
        tried.append((knob, metric))
        return metric

    def close(metric: float) -> bool:
        return abs(metric - target) <= tolerance * target

    if search.integer:
        lo, hi = search.low, search.high  # metric(lo) is the largest, metric(hi) == 0
        while hi - lo > 1 and len(tried) < max_evals:
            mid = (lo + hi) // 2
            if close(m := run(float(mid))):
                break
            lo, hi = (mid, hi) if m > target else (lo, mid)
        if lo == search.low and float(lo) not in [k for k, _ in tried] and len(tried) < max_evals \
                and not any(close(m) for _, m in tried):
            run(float(lo))  # the largest metric the knob gives: the bisection never measures its lower end
    else:
        to_knob, upper = search.to_knob, search.upper
        lo, hi = 0.0, min(0.1, upper)
        while not close(m := run(to_knob(hi))) and m < target and hi < upper and len(tried) < max_evals:
            lo, hi = hi, min(hi * 2.0, upper)
        while not close(m) and len(tried) < max_evals:
            mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2.0
            m = run(to_knob(mid))
            lo, hi = (lo, mid) if m > target else (mid, hi)
    best = min(tried, key=lambda kv: abs(kv[1] - target))
    return Calibration(best[0], best[1], target, tried, tolerance)
