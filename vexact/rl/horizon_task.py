"""A task whose response horizon is a knob and whose answer does not get harder with it (issue O).

The longer ``sum`` trace is no horizon knob: a longer input makes the *answer* harder, so reward falls with T and
one cannot tell a longer horizon from a harder problem. ``scratch`` separates the two:

    prompt    b:314=                       three random digits
    response  aabacaaab...ab=8<eos>        a scratchpad of L tokens, then '=', the digit sum, EOS

The scratchpad's length ``L`` is the task's ``min_len .. max_len`` (set both to fix it), so the response horizon
is T = L + 3 or 4 tokens while the answer (the sum of three digits) is the same problem at every L. Its tokens
carry entropy like reasoning tokens do, rather than being deterministic filler: each is drawn independently from
``SCRATCH_ALPHABET`` with probabilities ``SCRATCH_PROBS`` (entropy ``scratch_entropy()`` ≈ 0.80 nats per token),
and the warm start imitates those random draws. The reward reads only the text after the response's last '='
(plus EOS), like ``sum``: the scratchpad is free, so the length stays the policy's choice (the warm start teaches
L) and a drifting policy can shorten, lengthen or ramble.

Registered in ``vexact.rl.tasks`` (``_TASKS``), so configs name it ``task.name: scratch``.
"""

from __future__ import annotations

import math
import random

from .tasks import Problem, Task

__all__ = ["ANSWER_DIGITS", "SCRATCH_ALPHABET", "SCRATCH_PROBS", "ScratchpadTask", "horizon_overrides",
           "scratch_entropy"]

SCRATCH_ALPHABET = "abc"
SCRATCH_PROBS = (0.7, 0.2, 0.1)
"""Skewed rather than uniform: ≈ 0.80 nats per token, near-peaked tokens with a tail, as sampled reasoning is."""
ANSWER_DIGITS = 3
"""The answer's input: three digits, whatever the scratchpad length."""


def scratch_entropy() -> float:
    """Entropy (nats) of one scratchpad token under the task's distribution."""
    return -sum(p * math.log(p) for p in SCRATCH_PROBS)


class ScratchpadTask(Task):
    """A free scratchpad of ``L`` random tokens (``min_len <= L <= max_len``), then '=' and the digit sum of three
    prompt digits (a trace task: the reward checks only what follows the last '=')."""

    name = "scratch"
    tag = "b"

    def problem(self, digits: str, scratch: str) -> Problem:
        if len(digits) != ANSWER_DIGITS or not digits.isdigit():
            raise ValueError(f"expected {ANSWER_DIGITS} digits, got {digits!r}")
        if set(scratch) - set(SCRATCH_ALPHABET):
            raise ValueError(f"scratchpad tokens must come from {SCRATCH_ALPHABET!r}, got {scratch!r}")
        answer = str(sum(map(int, digits)))
        return Problem(self._prompt(digits), answer, f"{scratch}={answer}")

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(ANSWER_DIGITS))
        length = rng.randint(self.min_len, self.max_len)
        scratch = "".join(rng.choices(SCRATCH_ALPHABET, weights=SCRATCH_PROBS, k=length))
        return self.problem(digits, scratch)

    def final_answer(self, text: str) -> str:
        return text.rpartition("=")[2] if "=" in text else "\0"  # no '=': no answer given

    def max_answer_len(self) -> int:
        return self.max_len + 1 + len(str(9 * ANSWER_DIGITS))

    def max_input_len(self) -> int:
        return ANSWER_DIGITS


def horizon_overrides(length: int) -> dict[str, int]:
    """Config overrides for a fixed scratchpad length ``L``: the task's lengths, room for the response (L + 8
    tokens: '=', the answer, EOS and slack for a policy that writes a little longer) and the model's context."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"a scratchpad length must be a positive integer, got {length!r}")
    return {"task.min_len": length, "task.max_len": length, "rollout.max_new_tokens": length + 8,
            "model.max_seq_len": length + 16}
