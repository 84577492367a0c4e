"""A task where the response length is what RL learns (the length surge, reproduced).

In reasoning RL the mean response length *surges* ("Beyond Precision", paper 003: 1,000 -> 3,000-4,000 tokens in a
few steps) because longer reasoning earns more reward. ``sum``'s trace earns nothing over a direct answer, so on it
the length never moved. ``surge`` gives the long response the advantage. The answer is the parity of ``L`` bits:

    prompt   c:10110=
    direct   =1<eos>               3 tokens, the answer in one go: about a coin flip for long inputs
    worked   11011=1<eos>          the running parities, one token per input bit, then '=' and the answer

Both are the same problem, and the reward reads only the digit after the response's last ``=`` (plus EOS), as for
``sum``: the response form is the policy's own choice. Parity is the textbook function a transformer does not
compute in one step but computes step by step: each trace token is the previous one XOR the bit at a fixed
offset in the prompt (fixed when ``min_len = max_len``). So the worked trace is right far more often than the
direct answer, at a length of ``L + 3`` tokens against 3. (A sum mod 10 instead of mod 2 -- ``BASE`` -- was tried
first: after the same warm start the trace was at chance, 9%, so it gave the trace no advantage.)

The warm start imitates the worked trace for its first half (the skill), then the trace on a fraction
``warm_start.trace_fraction`` of its examples and the direct answer on the rest (the choice), so the starting
policy can trace but answers directly most of the time and is short; RL then finds that the trace pays, and the
mean length grows several-fold: the surge. Where the trace earns nothing more than the direct answer, the length
does not surge (the tests' counter-case).

``mixed_targets`` is the warm start's mixture; which examples get the trace is a fixed function of their index,
so the warm start stays deterministic with no random draw. The task registers itself in ``TASKS`` when imported
(the ``vexact.rl`` package imports it: ``vexact.rl.BUILTINS``), with its setting
``warm_start.trace_fraction`` (``SurgeWarmStart``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .tasks import Problem, Task, _DigitStringTask, register_task
from .validate import bounds

__all__ = ["SurgeTask", "SurgeWarmStart", "direct_problem", "is_trace", "mixed_targets"]


BASE = 2
"""The input's digits are ``0 .. BASE - 1`` and the answer is their sum mod ``BASE``: 2 is parity, the textbook
function a transformer cannot compute in one step but computes step by step (one XOR per token)."""


@dataclass
class SurgeWarmStart:
    """The ``surge`` task's setting, in the ``warm_start`` section; it needs ``task.name: surge``."""

    section: ClassVar[str] = "warm_start"
    requires_owner: ClassVar[bool] = True
    # task surge only: after an all-trace first half, imitate the worked trace on this fraction of examples and
    # the direct answer on the rest (vexact.rl.surge_task); None = the task's one target
    trace_fraction: float | None = field(default=None, metadata=bounds(min=0, max=1))


class SurgeTask(_DigitStringTask):
    """The sum mod ``BASE`` of ``L`` digits, answered directly (``=S``) or after the running sums mod ``BASE`` (one
    digit per input digit, then ``=S``); the reward checks only what follows the last ``=``. ``Problem.worked`` is
    the worked trace; ``direct_problem`` gives the direct form."""

    name = "surge"
    tag = "c"
    settings = SurgeWarmStart

    def warm_start_problems(self, problems: list[Problem], warm_start: Any, first_index: int,
                            total: int) -> list[Problem]:
        """The worked trace or the direct answer, mixed by ``warm_start.trace_fraction`` (``mixed_targets``)."""
        if warm_start.trace_fraction is None:
            return problems
        return mixed_targets(self, problems, warm_start.trace_fraction, first_index, total)

    def answer(self, digits: str) -> str:
        return str(sum(map(int, digits)) % BASE)

    def problem(self, digits: str) -> Problem:
        if not digits or set(digits) - set(_ALPHABET):
            raise ValueError(f"expected digits from {_ALPHABET!r}, got {digits!r}")
        running = "".join(str(sum(map(int, digits[: i + 1])) % BASE) for i in range(len(digits)))
        return Problem(self._prompt(digits), self.answer(digits), f"{running}={self.answer(digits)}")

    def sample(self, rng: random.Random) -> Problem:
        return self.problem("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(self.min_len, self.max_len))))

    def final_answer(self, text: str) -> str:
        return text.rpartition("=")[2] if "=" in text else "\0"  # no '=': no answer given

    def max_answer_len(self) -> int:
        return self.max_len + 2  # the trace, '=', one digit


register_task(SurgeTask)

_ALPHABET = "0123456789"[:BASE]


def direct_problem(problem: Problem) -> Problem:
    """The same problem with the direct answer (``=`` + answer) as its supervised target."""
    return Problem(problem.prompt, problem.answer, f"={problem.answer}")


def is_trace(index: int, trace_fraction: float, total: int | None = None) -> bool:
    """Whether example ``index`` (0, 1, 2, ... over the whole warm start of ``total`` examples) imitates the worked
    trace. The first half of the warm start (``index < total // 2``) is all traces, so the policy learns the skill;
    the second half mixes, so it learns to *choose* the trace with probability ``trace_fraction``: there example
    ``index`` is a trace exactly when ``floor((index + 1) * f)`` steps past ``floor(index * f)``, so any ``n``
    consecutive examples hold ``n * f`` traces to within one. ``total`` None: no all-trace half."""
    if total is not None and index < total // 2:
        return True
    return math.floor((index + 1) * trace_fraction) > math.floor(index * trace_fraction)


def mixed_targets(task: Task, problems: list[Problem], trace_fraction: float, first_index: int,
                  total: int | None = None) -> list[Problem]:
    """``problems`` with the direct answer as target except on the trace examples (``is_trace``), the ``i``-th
    problem being example ``first_index + i`` of ``total``. Only ``surge`` has the two forms; any other task is
    refused."""
    if not isinstance(task, SurgeTask):
        raise ValueError(f"warm_start.trace_fraction needs task.name: {SurgeTask.name} (a task with a direct and a "
                         f"worked answer), got task {task.name!r}")
    if not 0.0 <= trace_fraction <= 1.0:
        raise ValueError(f"warm_start.trace_fraction must be in [0, 1], got {trace_fraction!r}")
    return [p if is_trace(first_index + i, trace_fraction, total) else direct_problem(p)
            for i, p in enumerate(problems)]
