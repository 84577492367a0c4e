"""A task whose response horizon is a knob and whose answer does not get harder with it.

The longer ``sum`` trace is no horizon knob: a longer input makes the *answer* harder, so reward falls with T and
one cannot tell a longer horizon from a harder problem. ``horizon`` separates the two:

    prompt    b:314=                      three random digits
    response  8:aabacaaab...ab<eos>       the digit sum, ':', then a scratchpad of L tokens and EOS

The scratchpad's length ``L`` is the task's ``min_len .. max_len`` (set both to fix it), so the response horizon
is T = L + 3 or 4 tokens while the answer (the sum of three digits) is the same problem, in the same context, at
every L. (Measured first with the scratchpad *before* the answer: after a 300-step warm start the policy wrote
the format perfectly at L = 16 but summed the digits right in 5% of samples, against 63% at L = 4 -- the random
tokens in between made the answer harder, which is what a horizon knob must not do.) The scratchpad tokens carry
entropy like reasoning tokens do, rather than being deterministic filler: each is drawn independently from
``SCRATCH_ALPHABET`` with probabilities ``SCRATCH_PROBS`` (entropy ``scratch_entropy()`` ≈ 0.80 nats per token),
and the warm start imitates those random draws. The reward is 1.0 for the right sum before the first ':' and an
EOS anywhere after it, so the scratchpad is free but the response must end: a policy that drifts into rambling
past ``max_new_tokens`` loses the reward, like a real one that never stops.

Under RL the free scratchpad shortens (at L = 160 the mean response fell from 154 to 8 tokens within 70 steps),
so the measured horizon T of a run is far below L. ``task.hold_length: true`` (``HorizonSettings``) also asks for
a scratchpad of at least ``min_len`` tokens before the reward pays, so T stays L + 3 or 4 for the whole run: the
long-horizon points of the map need it.

Registers itself in ``TASKS`` when imported (the ``vexact.rl`` package imports it: ``vexact.rl.BUILTINS``),
so configs name it ``task.name: horizon``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from .tasks import Problem, Task, register_task

__all__ = ["ANSWER_DIGITS", "SCRATCH_ALPHABET", "SCRATCH_PROBS", "HorizonSettings", "ScratchpadTask",
           "horizon_overrides", "scratch_entropy"]

SCRATCH_ALPHABET = "abc"
SCRATCH_PROBS = (0.7, 0.2, 0.1)
"""Skewed rather than uniform: ≈ 0.80 nats per token, near-peaked tokens with a tail, as sampled reasoning is."""
ANSWER_DIGITS = 3
"""The answer's input: three digits, whatever the scratchpad length."""


def scratch_entropy() -> float:
    """Entropy (nats) of one scratchpad token under the task's distribution."""
    return -sum(p * math.log(p) for p in SCRATCH_PROBS)


@dataclass
class HorizonSettings:
    """The ``horizon`` task's setting, in the ``task`` section; it needs ``task.name: horizon``."""

    requires_owner: ClassVar[bool] = True
    reward_only: ClassVar[bool] = True
    """Read by the reward alone: the warm start imitates the same targets whatever it says (its cache key skips it)."""
    # task horizon only: the reward also asks for a scratchpad of at least task.min_len tokens, so RL cannot
    # shorten the response horizon below L; false = the scratchpad's length is free
    hold_length: bool = False


class ScratchpadTask(Task):
    """The digit sum of three prompt digits, ':', then a free scratchpad of ``L`` random tokens
    (``min_len <= L <= max_len``) and EOS; the reward checks only the text before the first ':' (and EOS), and with
    ``task.hold_length`` that the scratchpad has at least ``min_len`` tokens."""

    name = "horizon"
    tag = "b"
    settings = HorizonSettings
    hold_length = False

    def use_settings(self, section: Any) -> None:
        """Reads ``task.hold_length`` from the run config's ``task`` section."""
        self.hold_length = section.hold_length

    def problem(self, digits: str, scratch: str) -> Problem:
        if len(digits) != ANSWER_DIGITS or not digits.isdigit():
            raise ValueError(f"expected {ANSWER_DIGITS} digits, got {digits!r}")
        if set(scratch) - set(SCRATCH_ALPHABET):
            raise ValueError(f"scratchpad tokens must come from {SCRATCH_ALPHABET!r}, got {scratch!r}")
        answer = str(sum(map(int, digits)))
        return Problem(self._prompt(digits), answer, f"{answer}:{scratch}")

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(ANSWER_DIGITS))
        length = rng.randint(self.min_len, self.max_len)
        scratch = "".join(rng.choices(SCRATCH_ALPHABET, weights=SCRATCH_PROBS, k=length))
        return self.problem(digits, scratch)

    def final_answer(self, text: str) -> str:
        answer, colon, scratch = text.partition(":")
        if not colon:
            return "\0"  # no ':': not the task's format
        if self.hold_length and len(scratch) < self.min_len:
            return "\0"  # a scratchpad cut short earns nothing when the length is held
        return answer

    def free_span(self, problem: Problem) -> tuple[int, int]:
        """The scratchpad: the target tokens after the answer and ':' and before EOS."""
        start = problem.target.index(":") + 1
        return start, len(problem.target)

    def max_answer_len(self) -> int:
        return self.max_len + 1 + len(str(9 * ANSWER_DIGITS))

    def max_input_len(self) -> int:
        return ANSWER_DIGITS


register_task(ScratchpadTask)


def horizon_overrides(length: int) -> dict[str, int]:
    """Config overrides for a fixed scratchpad length ``L``: the task's lengths, room for the response (L + 8
    tokens: the answer, ':', EOS and slack for a policy that writes a little longer) and the model's context."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"a scratchpad length must be a positive integer, got {length!r}")
    return {"task.min_len": length, "task.max_len": length, "rollout.max_new_tokens": length + 8,
            "model.max_seq_len": length + 16}
