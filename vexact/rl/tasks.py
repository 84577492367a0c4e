"""Procedurally generated tasks with verifiable rewards (no downloads).

The RL loop needs problems it can score exactly and cheaply, at a difficulty it can turn up or down. Every task
here draws a random instance, knows the one right answer, and rewards a response by checking it: no reward model,
no data set, nothing to download. The difficulty knob is the input length ``L`` in ``[min_len, max_len]``.

All tasks share one character vocabulary (``CharTokenizer``, 22 ids), so one model can switch task. A prompt is
``<tag>:<input>=``; the model answers after ``=`` and ends its answer with EOS:

    task     tag  prompt example  answer  input
    reverse  <    <:12345=        54321   L random digits; answer = them reversed
    add      +    +:12+345=       357     two numbers, the longer with L digits, the other with 1..L; answer = sum
    sort     >    >:31452=        12345   L random digits; answer = them in ascending order
    count    #    #:abcab=        2       L letters from {a, b, c}; answer = how many are 'a'
    sum      a    a:3141=         3:4:8:9=9  L random digits; a trace of running sums, then '=' and the total

Responses are sampled token by token until EOS or ``max_new_tokens``, so a response can be longer (or shorter)
than the answer; ``max_answer_tokens`` gives the longest answer + EOS so a caller can check that ``max_new_tokens``
can hold it. **EOS ends a response, and a correct answer must end with it**: a response that ran out of tokens
before EOS scores 0.0 even when its text is the answer (otherwise the policy is never pushed to stop). Anything
after the first EOS is ignored.

**Trace tasks** (``sum``) answer after a worked trace: the supervised target is the whole worked response, but
the reward reads only the *final answer*, the text after the response's last ``=``; the trace itself is free.
So the response length is the policy's choice, up to ``max_new_tokens``: it varies with the input and can grow
(a drifting policy writes longer traces, or rambles to the limit and loses the reward for the missing EOS).

Reward is 1.0 for an exact match followed by EOS and 0.0 otherwise. With ``partial_credit=True`` a non-exact
response instead earns ``matches / (max(len(answer), len(response)) + missing_eos)``: the fraction of character
positions that agree, where a missing EOS counts as one more missed position. So only an exact, terminated answer
reaches 1.0. A PAD or BOS inside a response never matches a character.

Problem streams are deterministic and independent of global RNG state (``random.Random`` per call, seeds built
from integers arithmetically, never ``hash()``): ``training_problems(task, n, run_seed, step)`` for RL/warm-start
step ``step``, and ``held_out_problems(task, n)`` for evaluation, drawn from a fixed seed (``HELD_OUT_SEED``) that
no training ``(run_seed, step)`` can produce. Both streams sample the same distribution, so for short lengths,
where the problem space is small, individual held-out problems can also occur in training.
"""

from __future__ import annotations

import inspect
import numbers
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..engine.devices import cuda_device_count, device_kind, resolve_device
from ..engine.model import check_fits
from ..registry import PluginCodeError, call_entry, entry_code
from .registries import TASKS, register_run_check
from .validate import ConfigError, show_repr, show_value
from .vocab import BOS_ID, CHAR_VOCAB_SIZE, CHARS, EOS_ID, PAD_ID, CharTokenizer, tokenizer_for

if TYPE_CHECKING:
    from .config_schema import RunConfig

__all__ = [
    "BOS_ID",
    "CHAR_VOCAB_SIZE",
    "EOS_ID",
    "HELD_OUT_SEED",
    "PAD_ID",
    "TASKS",
    "check_lengths",
    "check_memory",
    "task_free_span",
    "task_has_free_span",
    "task_reward",
    "task_warm_start_problems",
    "AddTask",
    "CharTokenizer",
    "CountTask",
    "Problem",
    "ReverseTask",
    "SortTask",
    "SumTask",
    "Task",
    "encode_prompt",
    "encode_target",
    "held_out_problems",
    "make_task",
    "task_of",
    "register_task",
    "max_answer_tokens",
    "max_prompt_tokens",
    "sample_problems",
    "training_problems",
    "training_seed",
]

_SEED_BITS = 64
_SEED_MASK = (1 << _SEED_BITS) - 1
_TRAINING_STREAM = 1
_HELD_OUT_STREAM = 2
HELD_OUT_SEED = _HELD_OUT_STREAM << (2 * _SEED_BITS)
"""Seed of the evaluation set. Training seeds are ``(1 << 128) | run_seed << 64 | step`` (64-bit fields), which
lie in ``[2**128, 2**129)``, so they never equal this one (``2 << 128``) whatever the run seed and step."""


@dataclass(frozen=True)
class Problem:
    """One task instance: the prompt (ending with ``=``, after which the model answers) and the right answer.
    ``worked``: for trace tasks, the whole worked response (trace + ``=`` + answer) the warm start imitates."""

    prompt: str
    answer: str
    worked: str | None = None

    @property
    def target(self) -> str:
        """The response text that earns reward 1.0 (without EOS): the worked solution, else the answer."""
        return self.answer if self.worked is None else self.worked


class Task(ABC):
    """A family of problems with a difficulty knob (input length in ``[min_len, max_len]``) and a verifier.

    ``settings``: a dataclass of the task's own options, mounted as config keys while the task is registered (in
    ``task``, or the section its ``section`` class variable names: ``surge``'s ``warm_start.trace_fraction``)."""

    name: str = ""
    tag: str = ""
    settings: type | None = None

    def __init__(self, min_len: int, max_len: int, partial_credit: bool = False):
        _check_lengths(min_len, max_len)
        self.min_len = min_len
        self.max_len = max_len
        self.partial_credit = partial_credit
        self.tokenizer = CharTokenizer()

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem using only ``rng``."""

    @abstractmethod
    def max_answer_len(self) -> int:
        """Longest possible target (``Problem.target``: the answer, or the worked solution of a trace task), in
        characters (EOS not included)."""

    @abstractmethod
    def max_input_len(self) -> int:
        """Longest possible input between ``<tag>:`` and ``=``, in characters."""

    def _prompt(self, body: str) -> str:
        return f"{self.tag}:{body}="

    def final_answer(self, text: str) -> str:
        """The part of a response's text the reward checks: all of it (trace tasks override this)."""
        return text

    def free_span(self, problem: Problem) -> tuple[int, int] | None:
        """Target token positions ``[start, end)`` the reward does not read (a free scratchpad), or None. The
        warm start can down-weight them (``warm_start.free_weight``)."""
        return None

    def use_settings(self, section: Any) -> None:
        """Reads the task's own settings (``settings``, mounted in the run config's ``task`` section): none here."""
        return None

    def warm_start_problems(self, problems: list[Problem], warm_start: Any, first_index: int,
                            total: int) -> list[Problem]:
        """The supervised warm start's examples, examples ``first_index ..`` of ``total``: ``problems`` as drawn,
        unless the task's settings in the ``warm_start`` section (``warm_start``) choose other targets."""
        return problems

    def reward(self, problem: Problem, response_ids: Iterable[int]) -> float:
        """1.0 for the exact answer followed by EOS, else 0.0 (or the partial credit described in the module
        docstring). Tokens after the first EOS are ignored."""
        ids = [int(i) for i in response_ids]
        terminated = EOS_ID in ids
        if terminated:
            ids = ids[: ids.index(EOS_ID)]
        if any(CHAR_VOCAB_SIZE <= i < self.tokenizer.vocab_size for i in ids):
            return 0.0  # a distractor (vexact.rl.vocab_tail) is no character: a response using one is malformed
        # PAD/BOS inside a response become "\0", which matches no answer character.
        text = "".join("\0" if i in (PAD_ID, BOS_ID) else self.tokenizer._char(i) for i in ids)
        text = _call_task(self, "final_answer", text)
        if not isinstance(text, str):
            raise PluginCodeError(f"{_task_code(self, 'final_answer')} returned {show_repr(text)}, not a str")
        if terminated and text == problem.answer:
            return 1.0
        if not self.partial_credit:
            return 0.0
        matches = sum(a == r for a, r in zip(problem.answer, text))
        positions = max(len(problem.answer), len(text)) + (0 if terminated else 1)
        return matches / positions

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(min_len={self.min_len}, max_len={self.max_len}, "
                f"partial_credit={self.partial_credit})")


class _DigitStringTask(Task):
    """A task on a string of ``L`` random digits whose answer is a rearrangement of it."""

    def answer(self, digits: str) -> str:
        raise NotImplementedError

    def problem(self, digits: str) -> Problem:
        return Problem(self._prompt(digits), self.answer(digits))

    def sample(self, rng: random.Random) -> Problem:
        return self.problem(_digits(rng, rng.randint(self.min_len, self.max_len)))

    def max_answer_len(self) -> int:
        return self.max_len

    def max_input_len(self) -> int:
        return self.max_len


class ReverseTask(_DigitStringTask):
    """Reverse a string of ``L`` digits: ``<:12345=`` -> ``54321``."""

    name = "reverse"
    tag = "<"

    def answer(self, digits: str) -> str:
        return digits[::-1]


class SortTask(_DigitStringTask):
    """Sort a string of ``L`` digits ascending: ``>:31452=`` -> ``12345``."""

    name = "sort"
    tag = ">"

    def answer(self, digits: str) -> str:
        return "".join(sorted(digits))


class AddTask(Task):
    """Add two non-negative integers: ``+:12+345=`` -> ``357``. The longer operand has ``L`` digits, the other
    1..``L`` digits (random order), so the answer has at most ``max_len + 1`` digits."""

    name = "add"
    tag = "+"

    def problem(self, a: int, b: int) -> Problem:
        if a < 0 or b < 0:
            raise ValueError(f"operands must be non-negative, got {a} and {b}")
        return Problem(self._prompt(f"{a}+{b}"), str(a + b))

    def sample(self, rng: random.Random) -> Problem:
        n_long = rng.randint(self.min_len, self.max_len)
        n_short = rng.randint(1, n_long)
        a, b = _number(rng, n_long), _number(rng, n_short)
        if rng.random() < 0.5:
            a, b = b, a
        return self.problem(a, b)

    def max_answer_len(self) -> int:
        return self.max_len + 1

    def max_input_len(self) -> int:
        return 2 * self.max_len + 1


class CountTask(Task):
    """Count the ``a`` in ``L`` letters from {a, b, c}: ``#:abcab=`` -> ``2``."""

    name = "count"
    tag = "#"

    def problem(self, letters: str) -> Problem:
        if set(letters) - set("abc"):
            raise ValueError(f"letters must come from 'abc', got {letters!r}")
        return Problem(self._prompt(letters), str(letters.count("a")))

    def sample(self, rng: random.Random) -> Problem:
        return self.problem("".join(rng.choice("abc") for _ in range(rng.randint(self.min_len, self.max_len))))

    def max_answer_len(self) -> int:
        return len(str(self.max_len))

    def max_input_len(self) -> int:
        return self.max_len


class SumTask(_DigitStringTask):
    """Sum ``L`` digits, showing the running sums: ``a:3141=`` -> ``3:4:8:9=9`` (a trace task).

    The reward checks only the number after the response's last ``=`` (and EOS), so the trace is the policy's
    own business and the response length can vary and grow; the warm start imitates the worked trace."""

    name = "sum"
    tag = "a"

    def answer(self, digits: str) -> str:
        return str(sum(map(int, digits)))

    def problem(self, digits: str) -> Problem:
        running = ":".join(str(sum(map(int, digits[: i + 1]))) for i in range(len(digits)))
        return Problem(self._prompt(digits), self.answer(digits), f"{running}={self.answer(digits)}")

    def final_answer(self, text: str) -> str:
        return text.rpartition("=")[2] if "=" in text else "\0"  # no '=': no answer given

    def max_answer_len(self) -> int:
        # running sums of up to max_len digits (<= 9 each), ':' between them, '=', the total
        return _digits_of_multiples(9, self.max_len) + self.max_len - 1 + 1 + len(str(9 * self.max_len))


def _digits_of_multiples(m: int, n: int) -> int:
    """The digits in ``str(m), str(2 m), ..., str(n m)`` together, counted by digit length (``d`` digits: the ``k``
    with ``10**(d-1) <= k m < 10**d``), not by building the strings: O(log n) where the strings were O(n log n)
    time and memory (gigabytes at n = 10**7)."""
    total, d = 0, 1
    while True:
        first = -(-10 ** (d - 1) // m)  # the smallest k with k m >= 10**(d-1)
        if first > n:
            return total
        total += d * (min((10**d - 1) // m, n) - first + 1)
        d += 1


def register_task(cls: type[Task], replace: bool = False) -> type[Task]:
    """Register a ``Task`` subclass under its ``name``, so ``task.name: NAME`` selects it (also usable as a class
    decorator). Checked here, not at the first run: a concrete ``Task`` subclass with a non-empty ``name`` and a
    ``tag`` the shared vocabulary can spell. A name already taken is an error unless ``replace``."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"register_task needs a subclass of vexact.rl.tasks.Task, got {cls!r}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"task {cls.__name__} does not implement {missing}")
    if not isinstance(cls.tag, str) or not cls.tag or set(cls.tag) - set(CHARS):
        raise ValueError(f"task {cls.name!r} needs a tag of characters from the vocabulary {CHARS!r}, "
                         f"got {cls.tag!r}")
    return TASKS.add(cls.name, cls, replace=replace)


# the larger built-in tasks register themselves in their own modules (horizon_task, surge_task), after these
for _task in (ReverseTask, AddTask, SortTask, CountTask, SumTask):
    register_task(_task)


def _check_lengths(min_len: int, max_len: int) -> None:
    for label, value in (("min_len", min_len), ("max_len", max_len)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{label} must be an int, got {value!r}")
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len must be >= min_len ({min_len}), got {max_len}")


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _number(rng: random.Random, n_digits: int) -> int:
    """A uniform integer with exactly ``n_digits`` digits (0-9 for one digit)."""
    return rng.randint(0 if n_digits == 1 else 10 ** (n_digits - 1), 10**n_digits - 1)


def task_has_free_span(name: str) -> bool:
    """Whether task ``name`` overrides ``Task.free_span`` (has target tokens the reward does not read)."""
    return name in TASKS and TASKS[name].free_span is not Task.free_span


def make_task(name: str, min_len: int, max_len: int, partial_credit: bool = False, distractors: int = 0) -> Task:
    """The task called ``name`` (a name in ``TASKS``) with input lengths in ``[min_len, max_len]``;
    ``distractors`` > 0 gives it a vocabulary tail of that many tokens (``vexact.rl.vocab_tail``). Lengths that are
    no such range are a ValueError naming ``min_len`` or ``max_len``; the task's constructor is called through
    ``registry.call_entry``, so its own error (a plugin's, a ValueError too) is one ``PluginCodeError`` naming the
    task and its class."""
    if name not in TASKS:
        raise ValueError(TASKS.unknown(name))
    cls = TASKS[name]
    _check_lengths(min_len, max_len)  # the config's values, named as they are (not as the constructor's error)
    task = call_entry(TASKS.what, name, _task_method(cls, "__init__"), cls, min_len, max_len, partial_credit)
    if distractors:
        task.tokenizer = tokenizer_for(distractors)
    return task


def task_of(cfg: RunConfig) -> Task:
    """The task a run config names, with its lengths, vocabulary tail and the task's own settings."""
    task = make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len, cfg.task.partial_credit, cfg.task.distractors)
    _call_task(task, "use_settings", cfg.task)
    return task


def check_lengths(cfg: RunConfig) -> None:
    """Every problem of the task fits: longest prompt + ``rollout.max_new_tokens`` <= ``model.max_seq_len``, and
    ``rollout.max_new_tokens`` holds the longest answer + EOS. A ConfigError naming the key otherwise (checked when
    a config is loaded, and again by the Trainer for a RunConfig built in Python)."""
    try:
        task = task_of(cfg)
    except ValueError as e:
        raise ConfigError(str(e), "task") from e
    try:
        prompt, answer = max_prompt_tokens(task), max_answer_tokens(task)
    except ValueError as e:  # the task's own bounds (a plugin's code): the task is what is wrong
        raise ConfigError(str(e), "task.name") from e
    need = prompt + cfg.rollout.max_new_tokens
    if need > cfg.model.max_seq_len:
        raise ConfigError(f"{cfg.model.max_seq_len} is too short for the longest prompt ({prompt}) + "
                          f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) = {need}", "model.max_seq_len")
    if cfg.rollout.max_new_tokens < answer:
        raise ConfigError(f"{cfg.rollout.max_new_tokens} cannot hold the longest answer + EOS "
                          f"({answer} tokens)", "rollout.max_new_tokens")


RUN_BYTES_PER_PARAMETER = 16
"""Memory a run needs per parameter at least: the float32 master weights, their gradient and AdamW's two moments."""


def check_memory(cfg: RunConfig) -> None:
    """Before a run (or a sweep) allocates anything: its model's parameters, at ``RUN_BYTES_PER_PARAMETER`` (plus a
    bfloat16 compute copy), must fit in the memory available now where they will live (``engine.model.check_fits``):
    the host's for ``device: cpu``, the GPU's free memory for a CUDA device (where one is present: a config naming
    ``cuda`` on a machine without one is refused by ``engine.devices.resolve_device`` instead).
    Not part of loading a config, which stays valid on any machine (a report reads config.yaml anywhere)."""
    task = task_of(cfg)
    copy = 0 if cfg.dtype == "float32" else 2
    where: dict = {}
    if device_kind(cfg.device) == "cuda" and cuda_device_count():
        device = resolve_device(cfg.device)
        where = {"available": torch.cuda.mem_get_info(device)[0], "machine": f"GPU {device} has"}
    check_fits(cfg.model.to_model_config(task.tokenizer.vocab_size), RUN_BYTES_PER_PARAMETER + copy,
               f"a run's float32 weights, gradient and AdamW moments{' and bfloat16 copy' if copy else ''}",
               where="model", vocab=f"the vocabulary of task {cfg.task.name}", **where)



@register_run_check
def _check_task(cfg: RunConfig) -> None:
    """The task's run check: a free-span weight needs a task with a free span; every problem fits."""
    if cfg.warm_start.free_weight is not None and not task_has_free_span(cfg.task.name):
        raise ConfigError(f"free_weight needs a task with a free span the reward does not read (such as "
                          f"horizon's scratchpad), got task {cfg.task.name!r}", "warm_start.free_weight")
    check_lengths(cfg)


def encode_prompt(tokenizer: CharTokenizer, problem: Problem) -> list[int]:
    """``[BOS] + encode(prompt)``: what the model is conditioned on."""
    return [BOS_ID, *tokenizer.encode(problem.prompt)]


def encode_target(tokenizer: CharTokenizer, problem: Problem) -> list[int]:
    """``encode(target) + [EOS]``: the response that earns reward 1.0 (supervised warm-start target)."""
    return [*tokenizer.encode(problem.target), EOS_ID]


def max_answer_tokens(task: Task) -> int:
    """Upper bound on ``len(encode_target(...))``: the longest target + EOS. ``max_new_tokens`` must be at least
    this for every problem to be solvable. ValueError naming the task if its ``max_answer_len`` fails or is not an
    int >= 0."""
    return _length_bound(task, "max_answer_len") + 1


def max_prompt_tokens(task: Task) -> int:
    """Upper bound on ``len(encode_prompt(...))``: BOS + ``<tag>:`` + longest input + ``=``. ValueError naming the
    task if its ``max_input_len`` fails or is not an int >= 0."""
    return 1 + len(task.tag) + 1 + _length_bound(task, "max_input_len") + 1


def _task_method(cls: type[Task], method: str) -> str:
    """How errors name a task's method: ``echo_ext.EchoTask.sample`` (the class tells a plugin's task apart)."""
    return f"{cls.__module__}.{cls.__qualname__}.{method}"


def _task_code(task: Task, method: str) -> str:
    """How an error names a task's own code: ``task 'echo' (echo_ext.EchoTask.sample)``."""
    return entry_code(TASKS.what, task.name, _task_method(type(task), method))


def _call_task(task: Task, method: str, *args: Any) -> Any:
    """``task.method(*args)``: the one place vexact calls a task's own methods, through ``registry.call_entry``.
    The task may be a plugin's: an exception from its code is one ``PluginCodeError`` naming the task and the
    method (the CLI's one error line), chained to the original; an error already naming a task's method (the
    default ``reward`` calls ``final_answer``) passes unchanged."""
    return call_entry(TASKS.what, task.name, _task_method(type(task), method), getattr(task, method), *args)


def _length_bound(task: Task, method: str) -> int:
    value = _call_task(task, method)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PluginCodeError(f"{_task_code(task, method)} returned {repr(value)[:80]}: a length bound must be an "
                             f"int >= 0")
    return value


def task_reward(task: Task, problem: Problem, response_ids: Iterable[int]) -> float:
    """``task.reward(problem, response_ids)`` as a float. A reward that raises, or is no real number (a str, None,
    a list), is one ValueError naming the task and method. NaN and infinities pass: they are the task's verdict,
    which the run records (and the collapse check sees), not a type error."""
    value = _call_task(task, "reward", problem, response_ids)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise PluginCodeError(f"{_task_code(task, 'reward')} returned {show_repr(value)}, not a number (float)")
    return float(value)


def task_free_span(task: Task, problem: Problem, target_tokens: int) -> tuple[int, int] | None:
    """``task.free_span(problem)`` for a target of ``target_tokens`` tokens (EOS included): None, or ``(start,
    end)``, ints with ``0 <= start <= end <= target_tokens``, returned as the task gave it. Anything else, or an
    exception, is one ValueError naming the task and method (a span past the target was silently cut short)."""
    span = _call_task(task, "free_span", problem)
    if span is None:
        return None
    if not (isinstance(span, (tuple, list)) and len(span) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) for i in span)
            and 0 <= span[0] <= span[1] <= target_tokens):
        raise PluginCodeError(f"{_task_code(task, 'free_span')} returned {show_repr(span)} for the target "
                             f"{show_value(problem.target)}: expected None or (start, end), ints with 0 <= start <= "
                             f"end <= {target_tokens} (its tokens, EOS included)")
    return span


def task_warm_start_problems(task: Task, problems: list[Problem], warm_start: Any, first_index: int,
                             total: int) -> list[Problem]:
    """``task.warm_start_problems(...)``, checked: a list of as many Problems as it was given, each checked as a
    sampled one is (``_checked_problem``). Anything else, or an exception, is one ValueError naming the task and
    method."""
    chosen = _call_task(task, "warm_start_problems", problems, warm_start, first_index, total)
    if not isinstance(chosen, list) or len(chosen) != len(problems):
        raise PluginCodeError(f"{_task_code(task, 'warm_start_problems')} returned {show_repr(chosen)}: expected a "
                             f"list of {len(problems)} Problems (one per problem it was given)")
    prompt_tokens, answer_tokens = max_prompt_tokens(task), max_answer_tokens(task)
    return [_checked_problem(task, p, prompt_tokens, answer_tokens, "warm_start_problems") for p in chosen]


def _checked_problem(task: Task, problem: Any, prompt_tokens: int, answer_tokens: int,
                     method: str = "sample") -> Problem:
    """``problem`` if ``task.method`` (``sample``, ``warm_start_problems``) returned a Problem of strings the task's
    vocabulary spells, within the task's own bounds (``max_prompt_tokens``, ``max_answer_tokens``): the run was
    sized by them (``check_lengths``), so a longer prompt would fail in the model as if ``model.max_seq_len`` were
    wrong, and a longer target would be cut off by ``rollout.max_new_tokens`` and score 0 by construction."""
    where = _task_code(task, method)
    if not (isinstance(problem, Problem) and isinstance(problem.prompt, str) and isinstance(problem.answer, str)
            and isinstance(problem.worked, (str, type(None)))):
        raise PluginCodeError(f"{where} returned {show_value(problem)}, not a Problem of strings "
                             f"(vexact.rl.tasks.Problem)")
    try:
        prompt, target = encode_prompt(task.tokenizer, problem), encode_target(task.tokenizer, problem)
        task.tokenizer.encode(problem.answer)  # a trace task's answer is not its target
    except ValueError as e:
        raise PluginCodeError(f"{where} returned {show_value(problem)}: {e}") from None
    if len(prompt) > prompt_tokens:
        raise PluginCodeError(f"{where} returned the prompt {show_value(problem.prompt)}, {len(prompt)} tokens with "
                             f"BOS: more than the {prompt_tokens} (BOS, '<tag>:', input, '=') its max_input_len() "
                             f"allows")
    if len(target) > answer_tokens:
        raise PluginCodeError(f"{where} returned the target {show_value(problem.target)}, {len(target) - 1} "
                             f"characters: more than its max_answer_len() = {answer_tokens - 1}")
    return problem


def sample_problems(task: Task, n: int, seed: int) -> list[Problem]:
    """``n`` problems from ``random.Random(seed)``: the same ``(task, n, seed)`` always gives the same list, and the
    first ``k`` problems do not depend on ``n``. Global RNG state is neither read nor changed. Each problem is
    checked (``_checked_problem``): a task whose ``sample`` fails, returns no Problem, writes a character outside the
    vocabulary or exceeds its own ``max_input_len`` / ``max_answer_len`` is one ValueError naming the task."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    prompt_tokens, answer_tokens = max_prompt_tokens(task), max_answer_tokens(task)
    return [_checked_problem(task, _call_task(task, "sample", rng), prompt_tokens, answer_tokens) for _ in range(n)]


def training_seed(run_seed: int, step: int) -> int:
    """Seed of training step ``step`` of run ``run_seed``: ``(1 << 128) | run_seed << 64 | step`` with each field
    taken mod 2**64. Distinct for distinct pairs (in range), and never equal to ``HELD_OUT_SEED``. (Plain ints
    because ``random.Random`` seeds with ``abs(seed)``, so sign-based mixing would collide.)"""
    return (((_TRAINING_STREAM << _SEED_BITS) | (run_seed & _SEED_MASK)) << _SEED_BITS) | (step & _SEED_MASK)


def training_problems(task: Task, n: int, run_seed: int, step: int) -> list[Problem]:
    """The ``n`` problems of training step ``step`` in run ``run_seed`` (deterministic, see ``training_seed``)."""
    return sample_problems(task, n, training_seed(run_seed, step))


def held_out_problems(task: Task, n: int) -> list[Problem]:
    """The fixed evaluation set: ``sample_problems(task, n, HELD_OUT_SEED)``. The same for every run seed, so
    evaluations are comparable across runs; the seed is outside the training stream."""
    return sample_problems(task, n, HELD_OUT_SEED)
