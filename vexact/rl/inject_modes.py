"""The injection modes as data: each mode's name, what ``inject.value`` means for it (its knob) or which keys
choose its mismatch instead, and the range its value must lie in.

One table, so the config's ``inject.mode`` choices, the "needs a value" / "value unused" checks and the value
ranges derive from it (``vexact.rl.config``); the rollout hooks themselves are ``vexact.rl.inject``'s.
Below the config in the import order: it imports nothing of vexact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class InjectModeSpec:
    """One ``inject.mode``. ``knob``: what ``inject.value`` is (None: the mode has no magnitude); ``source_keys``:
    the keys that choose its mismatch when it has no knob; ``value_problem(value)``: why a value is out of range
    (None when it is fine); ``calibratable``: ``inject.target`` can search its knob."""

    name: str
    knob: str | None = None
    source_keys: tuple[str, ...] = ()
    value_problem: Callable[[float], str | None] | None = None
    calibratable: bool = False


def _sigma(mode: str) -> Callable[[float], str | None]:
    return lambda v: f"{mode} needs value (sigma) >= 0, got {v}" if v < 0 else None


INJECT_MODES: dict[str, InjectModeSpec] = {m.name: m for m in (
    InjectModeSpec("none"),
    InjectModeSpec("logit_noise", "sigma of the noise added to the logits", value_problem=_sigma("logit_noise"),
                   calibratable=True),
    InjectModeSpec("logit_scale", "epsilon: logits x (1 + epsilon)", calibratable=True,
                   value_problem=lambda v: (f"logit_scale needs value > -1 (logits x (1 + value)), got {v}"
                                            if v <= -1 else None)),
    InjectModeSpec("precision", source_keys=("inject.precision", "inject.sites")),
    InjectModeSpec("kernel", source_keys=("inject.kernel_backend", "inject.kernel_dtype")),
    InjectModeSpec("logprob_only", "sigma of the noise added to the rollout's log-probs",
                   value_problem=_sigma("logprob_only"), calibratable=True),
    InjectModeSpec("top_p", "the nucleus p", calibratable=True),  # 0 < p <= 1 unless calibrated: InjectSection
    InjectModeSpec("top_k", "k", calibratable=True,
                   value_problem=lambda v: (f"top_k needs a whole number >= 0 (0 = off), got {v}"
                                            if v < 0 or v != int(v) else None)),
)}
"""``inject.mode`` name -> its spec, in the order the documentation lists them."""

INJECT_MODE_NAMES = tuple(INJECT_MODES)
KNOB_MODES = {name: m.knob for name, m in INJECT_MODES.items() if m.knob is not None}
"""The modes whose magnitude is ``inject.value`` -> what the value is."""
SOURCE_KEYS = {name: m.source_keys for name, m in INJECT_MODES.items() if m.source_keys}
"""The modes without a magnitude -> the keys that choose their mismatch instead."""
