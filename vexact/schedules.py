"""Learning-rate schedules. A schedule sees the step and, after each step, its metrics
(so later schedules can react to response length or mismatch)."""

from __future__ import annotations

from .config import OptimizerSection


class LRSchedule:
    """Linear warmup from lr/warmup_steps to lr over ``warmup_steps`` steps, then constant."""

    def __init__(self, opt: OptimizerSection):
        self.base_lr = opt.lr
        self.warmup_steps = opt.warmup_steps

    def lr(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        return self.base_lr

    def observe(self, step: int, metrics: dict) -> None:
        """Hook for metric-triggered schedules; the constant schedule ignores it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
