"""Synthetic tasks: tokenizer, answers, rewards, determinism of the problem streams."""

from __future__ import annotations

import random

import pytest
import torch

from vexact.rl.tasks import (
    BOS_ID,
    EOS_ID,
    HELD_OUT_SEED,
    PAD_ID,
    TASKS,
    AddTask,
    CharTokenizer,
    CountTask,
    Problem,
    ReverseTask,
    SortTask,
    SumTask,
    Task,
    encode_prompt,
    encode_target,
    held_out_problems,
    make_task,
    max_answer_tokens,
    max_prompt_tokens,
    sample_problems,
    training_problems,
    training_seed,
)

BUILTIN_TASKS = TASKS.names()  # at collection, before any test registers a task of its own

TOK = CharTokenizer()


def ids(text: str, eos: bool = True) -> list[int]:
    return TOK.encode(text) + ([EOS_ID] if eos else [])


def solve(prompt: str) -> str:
    """Independent reference solver, from the prompt text alone."""
    tag, body = prompt[0], prompt[2:-1]
    assert prompt[1] == ":" and prompt[-1] == "="
    if tag == "<":
        return body[::-1]
    if tag == ">":
        return "".join(sorted(body))
    if tag == "+":
        a, b = body.split("+")
        return str(int(a) + int(b))
    if tag == "a":
        return str(sum(int(d) for d in body))
    if tag == "b":  # horizon: the digit sum; the scratchpad after it is the length knob
        return str(sum(int(d) for d in body))
    if tag == "c":  # surge: the parity of the bits
        return str(sum(int(d) for d in body) % 2)
    assert tag == "#"
    return str(body.count("a"))


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_vocab_and_special_ids():
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.vocab_size == 22 == len(set(TOK.tokens))
    assert CharTokenizer().tokens == TOK.tokens  # one fixed vocabulary


def test_tokenizer_round_trip():
    text = "0123456789abc+=:<>#"
    encoded = TOK.encode(text)
    assert min(encoded) == 3 and len(encoded) == len(text)
    assert TOK.decode(encoded) == text


def test_decode_skips_pad_bos_and_stops_at_eos():
    seq = [BOS_ID, *TOK.encode("12"), PAD_ID, *TOK.encode("3"), EOS_ID, *TOK.encode("9")]
    assert TOK.decode(seq) == "123"
    assert TOK.decode(seq, stop_at_eos=False) == "1239"


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="'x'"):
        TOK.encode("12x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([TOK.vocab_size])


# ---------------------------------------------------------------- answers
def test_hand_built_answers():
    assert ReverseTask(1, 5).problem("123") == Problem("<:123=", "321")
    assert SortTask(1, 5).problem("3120") == Problem(">:3120=", "0123")
    assert AddTask(1, 5).problem(12, 34) == Problem("+:12+34=", "46")
    assert AddTask(1, 5).problem(95, 7).answer == "102"
    assert CountTask(1, 5).problem("abcab") == Problem("#:abcab=", "2")
    assert CountTask(1, 5).problem("bcb").answer == "0"


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_sampled_answers_are_right_and_lengths_respected(name):
    task = make_task(name, 3, 6)
    lengths = set()
    for p in sample_problems(task, 300, seed=0):
        assert p.answer == solve(p.prompt)
        body = p.prompt[2:-1]
        n = max(len(x) for x in body.split("+")) if name == "add" else len(body)
        if name == "horizon":
            n = len(p.worked.partition(":")[2])  # the knob is the scratchpad's length, the input is 3 digits
        lengths.add(n)
        assert len(encode_prompt(TOK, p)) <= max_prompt_tokens(task)
        assert len(encode_target(TOK, p)) <= max_answer_tokens(task)
    assert lengths == {3, 4, 5, 6}


def test_sum_trace_is_the_running_sums_and_the_reward_reads_only_the_final_answer():
    task = SumTask(1, 8)
    p = task.problem("3141")
    assert (p.prompt, p.answer, p.worked, p.target) == ("a:3141=", "9", "3:4:8:9=9", "3:4:8:9=9")
    assert encode_target(TOK, p) == ids("3:4:8:9=9")
    assert task.reward(p, ids("3:4:8:9=9")) == 1.0
    assert task.reward(p, ids("12:0:=:7=9")) == 1.0  # the trace is free
    assert task.reward(p, ids("=9")) == 1.0  # ... and may be skipped
    assert task.reward(p, ids("9")) == 0.0  # no '=': no answer
    assert task.reward(p, ids("3:4:8:9=9", eos=False)) == 0.0  # rambled to the limit
    assert task.reward(p, ids("3:4:8:9=8")) == 0.0
    partial = SumTask(1, 8, partial_credit=True)
    assert partial.reward(partial.problem("99"), ids("9:18=19")) == pytest.approx(0.5)  # final answer 19 vs 18
    # the longest worked response is the bound, and it is attained: 9:18:27:...:72=72
    longest = task.problem("9" * 8)
    assert len(encode_target(TOK, longest)) == max_answer_tokens(task) == 26


def _sum_bound_by_building_the_trace(max_len: int) -> int:
    """SumTask.max_answer_len as it was once computed: by writing out the longest trace's running sums."""
    sums = "".join(str(9 * (i + 1)) for i in range(max_len))
    return len(sums) + max_len - 1 + 1 + len(str(9 * max_len))


@pytest.mark.parametrize("lengths", [range(1, 1200), [9_999, 10_000, 10_001, 11_111, 11_112, 111_111, 111_112]])
def test_sum_answer_bound_is_the_length_of_the_longest_trace(lengths):
    for max_len in lengths:
        assert SumTask(1, max_len).max_answer_len() == _sum_bound_by_building_the_trace(max_len), max_len


def test_sum_answer_bound_does_not_write_the_trace_out():
    """The bound is arithmetic: at max_len 10**6 writing the trace took ~50 MB (1 GB and 4.5 s at 10**7)."""
    import tracemalloc

    task = SumTask(1, 10**6)
    tracemalloc.start()
    try:
        bound = task.max_answer_len()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bound == _sum_bound_by_building_the_trace(10**6)
    assert peak < 100_000


def test_add_operand_lengths():
    task = make_task("add", 2, 4)
    shorter = set()
    for p in sample_problems(task, 300, seed=1):
        a, b = p.prompt[2:-1].split("+")
        assert 2 <= max(len(a), len(b)) <= 4 and min(len(a), len(b)) >= 1
        assert a == str(int(a)) and b == str(int(b))  # no leading zeros
        shorter.add(min(len(a), len(b)))
    assert shorter == {1, 2, 3, 4}


def test_length_bounds():
    assert max_answer_tokens(make_task("reverse", 1, 8)) == 9
    assert max_answer_tokens(make_task("add", 1, 8)) == 10
    assert max_answer_tokens(make_task("count", 1, 12)) == 3
    assert max_prompt_tokens(make_task("sort", 1, 8)) == 12
    assert max_prompt_tokens(make_task("add", 1, 8)) == 21
    # the bounds are attained
    task = make_task("add", 3, 3)
    p = AddTask(3, 3).problem(999, 999)
    assert len(encode_prompt(TOK, p)) == max_prompt_tokens(task)
    assert len(encode_target(TOK, p)) == max_answer_tokens(task)


def test_encode_prompt_and_target():
    p = Problem("<:12=", "21")
    assert encode_prompt(TOK, p) == [BOS_ID, *TOK.encode("<:12=")]
    assert encode_target(TOK, p) == [*TOK.encode("21"), EOS_ID]


# ---------------------------------------------------------------- rewards
def test_exact_match_reward():
    task = make_task("reverse", 1, 5)
    p = task.problem("123")
    assert task.reward(p, ids("321")) == 1.0
    assert task.reward(p, encode_target(TOK, p)) == 1.0
    assert task.reward(p, ids("321") + ids("99", eos=False)) == 1.0  # after EOS is ignored
    assert task.reward(p, ids("321", eos=False)) == 0.0  # ran out of tokens before EOS
    assert task.reward(p, ids("322")) == 0.0
    assert task.reward(p, ids("3210")) == 0.0
    assert task.reward(p, ids("32")) == 0.0
    assert task.reward(p, [EOS_ID]) == 0.0
    assert task.reward(p, []) == 0.0
    assert task.reward(p, [*TOK.encode("3"), PAD_ID, *TOK.encode("21"), EOS_ID]) == 0.0


def test_partial_credit_values():
    task = make_task("reverse", 1, 5, partial_credit=True)
    p = task.problem("1234")  # answer "4321"
    assert task.reward(p, ids("4321")) == 1.0
    assert task.reward(p, ids("4391")) == pytest.approx(3 / 4)
    assert task.reward(p, ids("43")) == pytest.approx(2 / 4)
    assert task.reward(p, ids("432100")) == pytest.approx(4 / 6)
    assert task.reward(p, ids("4321", eos=False)) == pytest.approx(4 / 5)  # missing EOS costs one position
    assert task.reward(p, ids("4391", eos=False)) == pytest.approx(3 / 5)
    assert task.reward(p, ids("1234")) == 0.0
    assert task.reward(p, [EOS_ID]) == 0.0
    assert task.reward(p, [*TOK.encode("43"), BOS_ID, *TOK.encode("1"), EOS_ID]) == pytest.approx(3 / 4)


@pytest.mark.parametrize("partial", [False, True])
def test_rewards_in_unit_interval(partial):
    task = make_task("add", 1, 4, partial_credit=partial)
    rng = random.Random(0)
    for p in sample_problems(task, 50, seed=2):
        response = [rng.randrange(TOK.vocab_size) for _ in range(rng.randint(0, 8))]
        r = task.reward(p, response)
        assert 0.0 <= r <= 1.0
        exact = EOS_ID in response and response[: response.index(EOS_ID)] == TOK.encode(p.answer)
        assert (r == 1.0) == exact


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_sample_problems_deterministic(name):
    task = make_task(name, 2, 7)
    random.seed(123)
    first = sample_problems(task, 20, seed=5)
    random.seed(456)
    state = random.getstate()
    assert sample_problems(make_task(name, 2, 7), 20, seed=5) == first
    assert random.getstate() == state  # global RNG untouched
    assert sample_problems(task, 5, seed=5) == first[:5]
    assert sample_problems(task, 20, seed=6) != first


def test_training_problems_deterministic_and_step_dependent():
    task = make_task("sort", 4, 8)
    a = training_problems(task, 16, run_seed=0, step=3)
    assert training_problems(task, 16, run_seed=0, step=3) == a
    assert training_problems(task, 16, run_seed=0, step=4) != a
    assert training_problems(task, 16, run_seed=1, step=3) != a


def test_training_seed_is_injective_and_apart_from_held_out():
    seeds = {training_seed(r, s) for r in range(-3, 50) for s in range(50)}
    assert len(seeds) == 53 * 50
    assert HELD_OUT_SEED not in seeds
    # the classic collision of "run_seed * K + step" mixing does not happen
    assert training_seed(0, 1_000_003) != training_seed(1, 0)
    # random.Random(-x) == random.Random(x); negative run seeds must not alias positive ones
    assert training_seed(-1, 0) != training_seed(1, 0)


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_held_out_set_fixed_and_distinct_from_training(name):
    task = make_task(name, 4, 8)
    held = held_out_problems(task, 32)
    assert held == held_out_problems(make_task(name, 4, 8), 32)
    assert held != training_problems(task, 32, run_seed=0, step=0)


# ---------------------------------------------------------------- make_task
def test_make_task():
    assert BUILTIN_TASKS == ("reverse", "add", "sort", "count", "sum", "horizon", "surge")
    for name in BUILTIN_TASKS:
        task = make_task(name, 2, 3, partial_credit=True)
        assert task.name == name and (task.min_len, task.max_len, task.partial_credit) == (2, 3, True)
        assert task.tokenizer.vocab_size == TOK.vocab_size


def test_make_task_errors():
    with pytest.raises(ValueError, match="unknown task 'mul'.*reverse, add, sort, count"):
        make_task("mul", 1, 4)
    with pytest.raises(ValueError, match="min_len"):
        make_task("reverse", 0, 4)
    with pytest.raises(ValueError, match="max_len"):
        make_task("reverse", 5, 4)
    with pytest.raises(ValueError, match="min_len"):
        make_task("add", 1.5, 4)


class DigitsTask(Task):
    """An outside task's shape (``#:<digits>=``) whose methods the broken tasks below get wrong, one each."""

    name = "digits_outside"
    tag = "#"

    def digits(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))

    def sample(self, rng: random.Random) -> Problem:
        digits = self.digits(rng)
        return Problem(self._prompt(digits), digits)

    def max_answer_len(self) -> int:
        return self.max_len

    def max_input_len(self) -> int:
        return self.max_len


class _Raises(DigitsTask):
    def sample(self, rng):
        raise RuntimeError("boom in sample")


class _Tuple(DigitsTask):
    def sample(self, rng):
        return "#:1=", "1"


class _OffVocabulary(DigitsTask):
    def sample(self, rng):
        digits = self.digits(rng)
        return Problem(self._prompt(digits), digits + "x")


class _LongAnswer(DigitsTask):
    def sample(self, rng):
        digits = self.digits(rng)
        return Problem(self._prompt(digits), digits * 5)


class _LongPrompt(DigitsTask):
    def sample(self, rng):
        return Problem(self._prompt("1" * (self.max_len + 1)), "1")


def _code(cls: type, method: str) -> str:
    return f"task 'digits_outside' ({cls.__module__}.{cls.__qualname__}.{method})"


@pytest.mark.parametrize("cls, problem", [
    (_Raises, "raised RuntimeError: boom in sample"),
    (_Tuple, "returned ('#:1=', '1'), not a Problem of strings"),
    (_OffVocabulary, "returned Problem(prompt='#:"),
    (_LongAnswer, "returned the target '"),
    (_LongPrompt, "returned the prompt '#:1111='"),
], ids=["raises", "tuple", "off_vocabulary", "long_answer", "long_prompt"])
def test_a_tasks_bad_sample_is_one_error_naming_the_task(cls, problem):
    """A plugin task's sample that fails, returns no Problem, spells outside the vocabulary or exceeds its own
    declared bounds was a deep traceback, a Transformer max_seq_len error, or a run with reward 0 by construction
    (an answer longer than max_answer_len, cut off by rollout.max_new_tokens): now one ValueError naming it."""
    with pytest.raises(ValueError) as e:
        sample_problems(cls(2, 3), 4, seed=0)
    message = str(e.value)
    assert message.startswith(f"{_code(cls, 'sample')} {problem}"), message
    if cls is _OffVocabulary:
        assert message.endswith("character 'x' is not in the vocabulary '0123456789abc+=:<>#'")
    if cls is _LongAnswer:
        assert message.endswith("characters: more than its max_answer_len() = 3")
    if cls is _LongPrompt:
        assert message.endswith("8 tokens with BOS: more than the 7 (BOS, '<tag>:', input, '=') its max_input_len() "
                                "allows")
    assert len(sample_problems(DigitsTask(2, 3), 4, seed=0)) == 4  # counter-case: the task done right


def _with_bounds(answer: object, prompt: object) -> type[Task]:
    class Bounds(DigitsTask):
        def max_answer_len(self):
            return answer

        def max_input_len(self):
            return prompt

    return Bounds


@pytest.mark.parametrize("answer, prompt, method, shown", [
    (None, 3, "max_answer_len", "None"), ("3", 3, "max_answer_len", "'3'"), (-5, 3, "max_answer_len", "-5"),
    (2.5, 3, "max_answer_len", "2.5"), (True, 3, "max_answer_len", "True"), (3, "3", "max_input_len", "'3'"),
    (3, -1, "max_input_len", "-1"),
])
def test_a_tasks_length_bound_must_be_a_non_negative_int(answer, prompt, method, shown):
    """The bounds size the run (check_lengths): None or "3" was a TypeError, -5 or 2.5 were accepted."""
    from vexact.rl.config import config_from_dict
    from vexact.rl.validate import ConfigError

    cls = _with_bounds(answer, prompt)
    with pytest.raises(ValueError) as e:
        max_answer_tokens(cls(2, 3)), max_prompt_tokens(cls(2, 3))
    assert str(e.value) == f"{_code(cls, method)} returned {shown}: a length bound must be an int >= 0"
    TASKS.add(cls.name, cls)
    try:
        with pytest.raises(ConfigError) as e:  # at config load: one error at the key naming the task
            config_from_dict({"task": {"name": cls.name, "min_len": 2, "max_len": 3}})
        assert e.value.key == "task.name" and e.value.problem.startswith(_code(cls, method))
    finally:
        TASKS.remove(cls.name)


def test_a_raising_length_bound_names_the_task():
    class Raises(DigitsTask):
        def max_input_len(self):
            raise KeyError("width")

    with pytest.raises(ValueError, match=r"\.Raises\.max_input_len\) raised KeyError: 'width'$"):
        max_prompt_tokens(Raises(2, 3))


def test_the_cli_prints_a_bad_task_as_one_error_line(tmp_path, capsys):
    """``vexact run`` on a task whose sample fails: exit code 2 and one error line, no traceback."""
    import yaml

    from vexact.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "bad_task", "steps": 1, "threads": 1, "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny", "max_seq_len": 24}, "task": {"name": _Raises.name, "min_len": 2, "max_len": 3,
                                                                  "eval_prompts": 4},
        "warm_start": {"steps": 0}, "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
        "distributed": {"leaves": 1}, "logging": {"live": False}}))
    TASKS.add(_Raises.name, _Raises)
    try:
        assert main(["run", str(config)]) == 2
    finally:
        TASKS.remove(_Raises.name)
    assert capsys.readouterr().err == f"error: {_code(_Raises, 'sample')} raised RuntimeError: boom in sample\n"


# A plugin task's other hooks (reward, final_answer, free_span, warm_start_problems, use_settings), called where
# the trainer and the warm start need them: one that raises or returns the wrong type was a traceback from deep in
# vexact (or a span past the target, silently cut short); now one ValueError naming the task and the method.
def _broken(method: str, behaviour):
    """A DigitsTask whose ``method`` does ``behaviour()`` (raise or return something) instead of its work."""
    return type(f"Bad_{method}", (DigitsTask,), {method: lambda self, *args: behaviour(), "__module__": __name__})


def _boom():
    raise ZeroDivisionError("boom")


def _refuse():
    raise ValueError("needs min_len >= 5")


_HOOK_CASES = [
    ("reward", _boom, "raised ZeroDivisionError: boom"),
    ("reward", lambda: "1.0", "returned '1.0', not a number (float)"),
    ("reward", lambda: None, "returned None, not a number (float)"),
    ("reward", lambda: [1.0, 0.0], "returned [1.0, 0.0], not a number (float)"),
    ("reward", lambda: True, "returned True, not a number (float)"),
    ("final_answer", _boom, "raised ZeroDivisionError: boom"),
    ("final_answer", lambda: None, "returned None, not a str"),
    ("free_span", _boom, "raised ZeroDivisionError: boom"),
    ("free_span", lambda: "ab", "returned 'ab' for the target"),
    ("free_span", lambda: (0, 99), "returned (0, 99) for the target"),
    ("free_span", lambda: (2, 1), "returned (2, 1) for the target"),
    ("warm_start_problems", _boom, "raised ZeroDivisionError: boom"),
    ("warm_start_problems", lambda: None, "returned None: expected a list of 4 Problems"),
    ("warm_start_problems", lambda: [Problem("#:1=", "1")], "returned [Problem(prompt='#:1=', answer='1', "
                                                           "worked=None)]: expected a list of 4 Problems"),
    ("warm_start_problems", lambda: [("#:1=", "1")] * 4, "returned ('#:1=', '1'), not a Problem of strings"),
    ("use_settings", _boom, "raised ZeroDivisionError: boom"),
]
_HOOK_IDS = [f"{m}-{p.split(',')[0].split(':')[0].replace(' ', '_')}" for m, _, p in _HOOK_CASES]


def _call_hook(task: Task, method: str) -> object:
    """The hook called as vexact calls it (the checked helper of the trainer and the warm start)."""
    from vexact.rl.tasks import _call_task, task_free_span, task_reward, task_warm_start_problems

    problems = sample_problems(task, 4, seed=0)
    if method in ("reward", "final_answer"):
        return task_reward(task, problems[0], ids("12"))
    if method == "free_span":
        return task_free_span(task, problems[0], len(encode_target(task.tokenizer, problems[0])))
    if method == "warm_start_problems":
        return task_warm_start_problems(task, problems, None, 0, 4)
    return _call_task(task, method, None)


@pytest.mark.parametrize("method, behaviour, problem", _HOOK_CASES, ids=_HOOK_IDS)
def test_a_tasks_bad_hook_is_one_error_naming_the_task_and_method(method, behaviour, problem):
    cls = _broken(method, behaviour)
    with pytest.raises(ValueError) as e:
        _call_hook(cls(2, 3), method)
    assert str(e.value).startswith(f"{_code(cls, method)} {problem}"), str(e.value)
    if "raised" in problem:  # chained: a debugger or a traceback still reaches the plugin's own line
        assert isinstance(e.value.__cause__, ZeroDivisionError)
    _call_hook(DigitsTask(2, 3), method)  # counter-case: the same call on the task done right


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0.5, 2, -1.0])
def test_a_tasks_reward_may_be_any_real_number_nan_included(value):
    """Not a type error: a non-finite reward is the task's verdict, which a run records (it stops at a non-finite
    loss, see the CLI test below); the value passes as a float, bit for bit."""
    from vexact.rl.tasks import task_reward

    cls = _broken("reward", lambda: value)
    got = task_reward(cls(2, 3), sample_problems(cls(2, 3), 1, seed=0)[0], ids("12"))
    assert type(got) is float and (got == value or (got != got and value != value))


def _run_config(tmp_path, name: str, **warm_start) -> str:
    import yaml

    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "steps": 1, "threads": 1, "output_dir": str(tmp_path / name),
        "model": {"preset": "tiny", "max_seq_len": 24},
        "task": {"name": DigitsTask.name, "min_len": 2, "max_len": 3, "eval_prompts": 4, "partial_credit": True},
        "warm_start": {"steps": 0, "cache_dir": str(tmp_path / "cache"), **warm_start},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
        "distributed": {"leaves": 1}, "logging": {"live": False}}))
    return str(config)


@pytest.mark.parametrize("method, behaviour, problem", [
    ("reward", lambda: None, "returned None, not a number (float)"),
    ("final_answer", _boom, "raised ZeroDivisionError: boom"),
    ("free_span", lambda: (0, 99), "returned (0, 99) for the target"),
    ("warm_start_problems", _boom, "raised ZeroDivisionError: boom"),
    ("use_settings", _boom, "raised ZeroDivisionError: boom"),
    ("__init__", _boom, "raised ZeroDivisionError: boom"),
    ("__init__", _refuse, "raised ValueError: needs min_len >= 5"),  # its own error: was passed on unnamed
], ids=["reward", "final_answer", "free_span", "warm_start_problems", "use_settings", "init", "init_value_error"])
def test_the_cli_prints_a_bad_hook_as_one_error_line(tmp_path, capsys, method, behaviour, problem):
    """What a user sees from ``vexact run``: exit code 2 and one error line naming the plugin's class and method
    (a traceback from collect, warmstart or torch.tensor before)."""
    from vexact.cli import main

    cls = _broken(method, behaviour)
    warm = {"steps": 2, "batch_size": 2} if method in ("free_span", "warm_start_problems") else {}
    if method == "free_span":
        warm["free_weight"] = 0.5  # the warm start reads free spans only where it weights them
    TASKS.add(cls.name, cls)
    try:
        assert main(["run", _run_config(tmp_path, "bad_hook", **warm)]) == 2
    finally:
        TASKS.remove(cls.name)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{_code(cls, method)} {problem}" in err, err
    if method in ("use_settings", "__init__"):  # run when the config is loaded: a config error at the task
        assert err.startswith("error: config error at 'task': ")


def test_make_task_names_a_constructors_own_value_error_and_the_configs_lengths_by_key():
    """A task constructor's ValueError was passed on bare (the config error at 'task' named neither the task nor its
    class, as its other errors do); the config's lengths are still refused as before, by their key, unwrapped."""
    from vexact.registry import PluginCodeError

    cls = _broken("__init__", _refuse)
    TASKS.add(cls.name, cls)
    try:
        with pytest.raises(PluginCodeError) as e:
            make_task(cls.name, 2, 3)
        assert str(e.value) == f"{_code(cls, '__init__')} raised ValueError: needs min_len >= 5"
        assert isinstance(e.value.__cause__, ValueError)
        for lengths, says in [((0, 3), "min_len must be >= 1, got 0"),
                              ((3, 2), "max_len must be >= min_len (3), got 2"),
                              ((1.5, 3), "min_len must be an int, got 1.5")]:
            with pytest.raises(ValueError) as e:
                make_task(cls.name, *lengths)
            assert type(e.value) is ValueError and str(e.value) == says
    finally:
        TASKS.remove(cls.name)


def test_a_nan_reward_still_stops_the_run_at_a_non_finite_loss(tmp_path):
    """The behaviour before the reward was checked, kept: a NaN reward is recorded, and the run stops (exit 1)."""
    import json

    from vexact.cli import main

    cls = _broken("reward", lambda: float("nan"))
    TASKS.add(cls.name, cls)
    try:
        assert main(["run", _run_config(tmp_path, "nan_reward")]) == 1
    finally:
        TASKS.remove(cls.name)
    assert json.loads((tmp_path / "nan_reward" / "summary.json").read_text())["reason"] == "non-finite loss (nan)"


class _WellBehaved(DigitsTask):
    """Every optional hook overridden, each doing its work: a trace of the answer, a free span over the trace, the
    warm start's problems reversed, a setting read."""

    def sample(self, rng):
        digits = self.digits(rng)
        return Problem(self._prompt(digits), digits, f"{digits[::-1]}={digits}")

    def max_answer_len(self):
        return 2 * self.max_len + 1

    def final_answer(self, text):
        return text.rpartition("=")[2]

    def free_span(self, problem):
        return 0, problem.target.index("=")

    def warm_start_problems(self, problems, warm_start, first_index, total):
        return problems[::-1]

    def use_settings(self, section):
        self.seen = section.min_len

    def reward(self, problem, response_ids):
        return 0.25 + super().reward(problem, response_ids) / 2


def test_checked_hooks_train_the_same_bits_as_the_hooks_called_directly(tmp_path, monkeypatch):
    """The checks only read what a working task returns: a run (warm start with free spans, RL steps, evaluation)
    on a task with every hook overridden gives the same weights and metrics as with the hooks called unchecked."""
    from rich.console import Console

    from vexact.records.runlog import read_metrics
    from vexact.rl import collect, tasks, warmstart
    from vexact.rl.config import config_from_dict
    from vexact.rl.trainer import Trainer

    def run(name: str):
        cfg = config_from_dict({
            "name": name, "seed": 0, "steps": 2, "threads": 1, "output_dir": str(tmp_path / name),
            "model": {"preset": "tiny", "max_seq_len": 24},
            "task": {"name": DigitsTask.name, "min_len": 2, "max_len": 3, "eval_prompts": 4,
                     "partial_credit": True},
            "warm_start": {"steps": 2, "batch_size": 4, "free_weight": 0.5, "cache_dir": str(tmp_path / f"c{name}")},
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 8},
            "distributed": {"leaves": 1}, "logging": {"live": False, "eval_every": 1}})
        trainer = Trainer(cfg, Console(quiet=True))
        assert trainer.run()["status"] == "completed"
        rows = [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))}
                for r in read_metrics(tmp_path / name / "metrics.jsonl")]
        return trainer.master.state_dict(), rows

    TASKS.add(_WellBehaved.name, _WellBehaved)
    try:
        checked = run("checked")
        monkeypatch.setattr(tasks, "_call_task", lambda task, method, *args: getattr(task, method)(*args))
        monkeypatch.setattr(collect, "task_reward", lambda task, p, r: task.reward(p, r))
        monkeypatch.setattr(warmstart, "task_free_span", lambda task, p, n: task.free_span(p))
        monkeypatch.setattr(warmstart, "task_warm_start_problems",
                            lambda task, *args: task.warm_start_problems(*args))
        direct = run("direct")
    finally:
        TASKS.remove(_WellBehaved.name)
    assert checked[0].keys() == direct[0].keys()
    assert all(torch.equal(checked[0][k], direct[0][k]) for k in checked[0])
    assert checked[1] == direct[1] and len(checked[1]) == 2
    assert any(r["reward/mean"] > 0.25 for r in checked[1])  # partial credit: final_answer was read
