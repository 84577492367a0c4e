"""Controlled mismatch: re-introduce per-token TIM of a chosen kind and size, rollout path only.

The training path always stays exact; the injector only changes what the *rollout* path samples
from and/or records. Like sampling, every random draw is keyed by (seed, sequence, position), so
injection is batch-invariant and deterministic, and an injection of magnitude 0 is a bitwise no-op
(no hook is installed at all).

The output is a value: ``Injector.plan(step)`` returns a ``RolloutPlan`` -- the kernel ops, the weight dtype
and the logits hook the rollout path uses at that step -- and the trainer passes them to ``generate``; no
model's backend is switched. A new mode is a change to this module (plus its name in ``InjectSection.mode``
and its tests), not to the trainer.

Modes (``inject.mode``), knob = ``inject.value``:
- ``logit_noise``: rollout logits z + σ·N(0, 1) (unbiased drift).
- ``logit_scale``: z · (1 + ε): sharper for ε > 0, flatter for ε < 0 (systematic bias).
- ``precision``: the rollout forward rounds chosen activations (``sites``: linear outputs, attention
  outputs, norm outputs, logits) to bf16 / fp16 / fp8-e4m3, like a low-precision engine.
- ``kernel``: the rollout path runs another backend/dtype (e.g. native ops, bf16) -- natural TIM.
- ``logprob_only``: sampling stays exact, the *recorded* log-probs come from z + σ·N: isolates the
  importance-ratio channel from the sampling-distribution channel.
- ``top_p`` / ``top_k``: the rollout samples from a truncated distribution (and records its
  log-probs) while training scores the full one.
Scope: every token (``all``), only vocabulary entries whose clean probability is below
``prob_threshold`` (``low_prob``), or a random ``fraction`` of positions. Schedule: nothing before
``onset_step``, then a linear ramp over ``ramp_steps`` to the full value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from vexact_kernels import OP_NAMES, get_ops

from ..engine.model import KernelOps, resolve_dtype
from ..engine.rollout import LogitsHook
from ..engine.sampling import counter_normal, counter_uniform
from .config import InjectSection, RunConfig

_SCOPE_SALT = 0x3C6EF372
_NOISE_SALT = 0x6A09E667


@dataclass(frozen=True)
class RolloutPlan:
    """What the rollout path runs at one step: the kernel ops, the dtype of the weights, and the
    logits hook. ``generate(model_in_dtype, ..., ops=plan.ops, logits_hook=plan.logits_hook)``."""

    value: float  # effective knob after onset/ramp (0 when inactive)
    ops: KernelOps  # kernel op module (precision mode: one whose outputs at the chosen sites are rounded)
    dtype: torch.dtype  # dtype of the weights the rollout path runs with
    logits_hook: LogitsHook | None = None
    active: bool = False  # the injector changed the rollout path at this step
    matches_training: bool = False  # ops and dtype are the training path's and nothing is injected


def round_to(x: Tensor, fmt: str) -> Tensor:
    """Round to a lower-precision format and back (emulation), saturating instead of overflowing."""
    if fmt == "bfloat16":
        return x.to(torch.bfloat16).to(x.dtype)
    if fmt == "float16":
        return x.clamp(-65504.0, 65504.0).to(torch.float16).to(x.dtype)
    if fmt == "fp8_e4m3":
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)
    raise ValueError(f"unknown precision format {fmt!r}")


def precision_ops(base: KernelOps, fmt: str, sites: list[str]) -> SimpleNamespace:
    """Kernel ops whose outputs at the chosen sites are rounded to ``fmt`` (rollout only)."""

    def rounded(fn: Callable) -> Callable:
        return lambda *args, **kwargs: round_to(fn(*args, **kwargs), fmt)

    ops = {name: getattr(base, name) for name in OP_NAMES}
    for site, op in (("linear", "linear"), ("attention", "attention"), ("norm", "rms_norm")):
        if site in sites:
            ops[op] = rounded(ops[op])
    return SimpleNamespace(**ops)


def _exact_probs(logits: Tensor) -> Tensor:
    """Row-wise softmax through the exact kernels, so masks never depend on the batch."""
    return get_ops("exact", logits.device).log_softmax(logits).exp()


class Injector:
    """Builds the per-step ``RolloutPlan`` from the ``inject`` config section.

    ``rollout_backend`` / ``rollout_dtype``: the rollout path when nothing is injected (the ``rollout``
    section; None = the training path's); ``training_backend`` / ``training_dtype``: the training path."""

    def __init__(self, cfg: InjectSection, seed: int, training_backend: str = "exact",
                 training_dtype: torch.dtype | str = torch.float32, rollout_backend: str | None = None,
                 rollout_dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.seed = seed
        self.value = cfg.value  # replaced by calibration when cfg.target is set
        self.device = torch.device(device)
        self.training_backend = training_backend
        self.training_dtype = resolve_dtype(training_dtype)
        self.rollout_backend = rollout_backend or training_backend
        self.rollout_dtype = resolve_dtype(rollout_dtype or training_dtype)
        self.rollout_ops = get_ops(self.rollout_backend, self.device)
        if cfg.mode == "precision":
            self.precision_ops = precision_ops(self.rollout_ops, cfg.precision, list(cfg.sites))

    @classmethod
    def for_run(cls, cfg: RunConfig, device: torch.device | str = "cpu") -> Injector:
        """The injector of a run: its ``inject`` section over the ``rollout`` and training paths."""
        return cls(cfg.inject, cfg.seed, cfg.backend, cfg.dtype, cfg.rollout.backend, cfg.rollout.dtype, device)

    @property
    def enabled(self) -> bool:
        return self.cfg.mode != "none"

    def value_at(self, step: int) -> float:
        """The knob after the onset/ramp schedule (0 before onset)."""
        c = self.cfg
        if not self.enabled or step < c.onset_step:
            return 0.0
        if c.ramp_steps and step - c.onset_step < c.ramp_steps:
            return self.value * (step - c.onset_step + 1) / c.ramp_steps
        return self.value

    def plan(self, step: int) -> RolloutPlan:
        """The rollout path at ``step``."""
        c = self.cfg
        if not self.enabled or step < c.onset_step:
            return self._knob_plan(0.0, None)
        if c.mode == "kernel":
            dtype = resolve_dtype(c.kernel_dtype or self.training_dtype)
            return RolloutPlan(1.0, get_ops(c.kernel_backend, self.device), dtype, active=True)
        if c.mode == "precision":
            hook = self._precision_logits_hook() if "logits" in c.sites else None
            return RolloutPlan(1.0, self.precision_ops, self.rollout_dtype, hook, active=True)
        return self.plan_for_value(self.value_at(step), step)

    def plan_for_value(self, value: float, step: int) -> RolloutPlan:
        """The rollout path of a knob mode at knob ``value`` (calibration tries several)."""
        return self._knob_plan(value, self.logits_hook(value, step))

    def _knob_plan(self, value: float, hook: LogitsHook | None) -> RolloutPlan:
        same_path = self.rollout_backend == self.training_backend and self.rollout_dtype == self.training_dtype
        return RolloutPlan(value, self.rollout_ops, self.rollout_dtype, hook, active=hook is not None,
                           matches_training=same_path and hook is None)

    # ------------------------------------------------------------------ logits hooks
    def logits_hook(self, value: float, step: int) -> LogitsHook | None:
        """The hook for a knob mode at knob ``value``; None when it would change nothing."""
        mode = self.cfg.mode
        if mode == "top_p":
            return None if value >= 1.0 else self._truncate_hook(top_p=value)
        if mode == "top_k":
            return None if value <= 0 else self._truncate_hook(top_k=int(round(value)))
        if value == 0.0:
            return None
        noise_seed = (self.seed * 1_000_003 + step) ^ _NOISE_SALT

        def perturb(z: Tensor, seq: Tensor, pos: Tensor) -> Tensor:
            if mode == "logit_scale":
                changed = z * (1.0 + value)
            else:  # logit_noise, logprob_only
                changed = (z.double() + value * counter_normal(noise_seed, seq, pos, z.shape[-1])).float()
            return self._scoped(z, changed, seq, pos, step)

        if mode == "logprob_only":
            return lambda z, seq, pos: (z, perturb(z, seq, pos))

        def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
            changed = perturb(z, seq, pos)
            return changed, changed

        return hook

    def _scoped(self, clean: Tensor, changed: Tensor, seq: Tensor, pos: Tensor, step: int) -> Tensor:
        c = self.cfg
        if c.scope == "all":
            return changed
        if c.scope == "low_prob":
            return torch.where(_exact_probs(clean) < c.prob_threshold, changed, clean)
        chosen = counter_uniform((self.seed * 1_000_003 + step) ^ _SCOPE_SALT, seq, pos, 1) < c.fraction
        return torch.where(chosen, changed, clean)

    def _precision_logits_hook(self) -> LogitsHook:
        fmt = self.cfg.precision

        def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
            rounded = round_to(z, fmt)
            return rounded, rounded

        return hook

    @staticmethod
    def _truncate_hook(top_p: float | None = None, top_k: int | None = None) -> LogitsHook:
        def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
            order = torch.sort(z, dim=-1, descending=True, stable=True)
            keep_sorted = torch.ones_like(z, dtype=torch.bool)
            if top_k is not None:
                keep_sorted[:, top_k:] = False
            if top_p is not None:
                probs = _exact_probs(order.values).double()
                mass_before = torch.cumsum(probs, dim=-1) - probs
                keep_sorted &= mass_before < top_p  # the smallest prefix reaching top_p (top-1 always kept)
            keep = torch.zeros_like(keep_sorted).scatter(-1, order.indices, keep_sorted)
            truncated = z.masked_fill(~keep, -math.inf)
            return truncated, truncated

        return hook


@dataclass
class Calibration:
    value: float  # the calibrated knob
    achieved: float  # the metric at that knob on the calibration batch
    target: float
    evaluations: list[tuple[float, float]]  # (knob, metric) in the order tried


def calibrate(measure: Callable[[float], float], mode: str, target: float, tolerance: float,
              sign: float = 1.0, vocab_size: int = 2, max_evals: int = 40) -> Calibration:
    """Find the knob whose measured mismatch metric is ``target`` (within ``tolerance``, relative).

    ``measure(knob)`` runs the calibration batch. The search assumes the metric grows with the
    perturbation: σ for noise modes, |ε| for logit_scale (direction ``sign``), 1 - p for top_p,
    fewer kept tokens for top_k (integers, bisection over k). Returns the best knob tried.
    """
    tried: list[tuple[float, float]] = []

    def run(knob: float) -> float:
        metric = measure(knob)
        tried.append((knob, metric))
        return metric

    def close(metric: float) -> bool:
        return abs(metric - target) <= tolerance * target

    if mode == "top_k":
        lo, hi = 1, vocab_size  # metric(lo) is the largest, metric(hi) == 0
        while hi - lo > 1 and len(tried) < max_evals:
            mid = (lo + hi) // 2
            if close(m := run(float(mid))):
                break
            lo, hi = (mid, hi) if m > target else (lo, mid)
    else:
        to_knob = {"top_p": lambda u: 1.0 - u, "logit_scale": lambda u: sign * u}.get(mode, lambda u: u)
        upper = {"top_p": 1.0 - 1e-6, "logit_scale": 0.999 if sign < 0 else 1e3}.get(mode, 1e3)
        lo, hi = 0.0, min(0.1, upper)
        while not close(m := run(to_knob(hi))) and m < target and hi < upper and len(tried) < max_evals:
            lo, hi = hi, min(hi * 2.0, upper)
        while not close(m) and len(tried) < max_evals:
            mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2.0
            m = run(to_knob(mid))
            lo, hi = (lo, mid) if m > target else (mid, hi)
    best = min(tried, key=lambda kv: abs(kv[1] - target))
    return Calibration(best[0], best[1], target, tried)
