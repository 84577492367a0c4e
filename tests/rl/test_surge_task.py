"""The surge task: the reward reads only the final answer, the direct and the worked forms both earn
it, and the warm start's mixture is exactly the fraction asked for."""

from __future__ import annotations

import pytest

from vexact.rl.config import ConfigError, config_from_dict
from vexact.rl.surge_task import SurgeTask, direct_problem, is_trace, mixed_targets
from vexact.rl.tasks import (
    EOS_ID,
    TASKS,
    CharTokenizer,
    encode_target,
    make_task,
    max_answer_tokens,
    sample_problems,
)


def _ids(text: str, eos: bool = True) -> list[int]:
    return CharTokenizer().encode(text) + ([EOS_ID] if eos else [])


def test_registered_and_reachable_from_a_config() -> None:
    assert "surge" in TASKS
    assert isinstance(make_task("surge", 4, 12), SurgeTask)
    cfg = config_from_dict({"task": {"name": "surge"}, "warm_start": {"trace_fraction": 0.1}})
    assert cfg.warm_start.trace_fraction == 0.1
    with pytest.raises(ConfigError, match="trace_fraction"):
        config_from_dict({"warm_start": {"trace_fraction": 1.5}})
    with pytest.raises(ConfigError, match="warm_start.trace_fraction.*needs task.name: surge"):
        config_from_dict({"task": {"name": "sum"}, "warm_start": {"trace_fraction": 0.1}})


def test_reward_reads_only_the_final_answer() -> None:
    task = make_task("surge", 5, 5)
    p = task.problem("10110")
    assert p.prompt == "c:10110=" and p.answer == "1" and p.worked == "11011=1"  # running parities
    assert task.reward(p, _ids("11011=1")) == 1.0  # the worked trace
    assert task.reward(p, _ids("=1")) == 1.0  # the direct answer: the same reward
    assert task.reward(p, _ids("00000=1")) == 1.0  # a wrong trace with the right answer: the trace is free
    assert task.reward(p, _ids("11011=0")) == 0.0  # wrong answer
    assert task.reward(p, _ids("=1", eos=False)) == 0.0  # no EOS
    assert task.reward(p, _ids("1")) == 0.0  # no '=': no answer given
    assert task.reward(p, _ids("=1") + _ids("77")) == 1.0  # after EOS: ignored
    assert task.problem("11").worked == "10=0" and task.problem("0").worked == "0=0"
    with pytest.raises(ValueError, match="expected digits"):
        task.problem("12")
    assert all(set(q.prompt[2:-1]) <= {"0", "1"} for q in sample_problems(task, 50, seed=0))


def test_direct_target_is_short_and_the_trace_long() -> None:
    task = make_task("surge", 20, 20)
    p = sample_problems(task, 1, seed=3)[0]
    tok = task.tokenizer
    direct = encode_target(tok, direct_problem(p))
    worked = encode_target(tok, p)
    assert len(direct) == 3 and len(worked) == 23  # '=' + answer + EOS vs one token per digit + '=' + answer + EOS
    assert max_answer_tokens(task) == 23
    assert task.reward(p, direct) == 1.0 and task.reward(p, worked) == 1.0


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.1, 1 / 3, 1.0])
def test_mixture_fraction_is_exact(fraction: float) -> None:
    n = 600
    traces = sum(is_trace(i, fraction) for i in range(n))
    assert traces == round(n * fraction)
    task = make_task("surge", 6, 6)
    problems = sample_problems(task, 64, seed=1)
    mixed = mixed_targets(task, problems, fraction, first_index=128)
    assert [m.worked == p.worked for m, p in zip(mixed, problems)] == [is_trace(128 + i, fraction)
                                                                       for i in range(64)]
    assert all(m.worked == f"={m.answer}" for m, p in zip(mixed, problems) if m.worked != p.worked)


def test_first_half_of_the_warm_start_is_all_traces() -> None:
    total = 400
    flags = [is_trace(i, 0.1, total) for i in range(total)]
    assert all(flags[:200])  # the skill: every example a trace
    assert sum(flags[200:]) == 20  # the choice: 10% traces
    assert [is_trace(i, 0.1) for i in range(200, 400)] == flags[200:]


def test_mixture_refuses_a_task_without_a_direct_form() -> None:
    with pytest.raises(ValueError, match="trace_fraction needs task.name: surge"):
        mixed_targets(make_task("sum", 2, 5), sample_problems(make_task("sum", 2, 5), 2, seed=0), 0.1, 0)
