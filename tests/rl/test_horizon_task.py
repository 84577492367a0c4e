"""The horizon task ``horizon``: the horizon is a knob, the answer stays the same problem."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from vexact.rl.horizon_task import SCRATCH_ALPHABET, SCRATCH_PROBS, horizon_overrides, scratch_entropy
from vexact.rl.tasks import (
    EOS_ID,
    TASKS,
    encode_prompt,
    encode_target,
    make_task,
    max_answer_tokens,
    max_prompt_tokens,
    training_problems,
)


def test_registered_and_configurable():
    assert "horizon" in TASKS
    from vexact.rl.config import config_from_dict

    cfg = config_from_dict({"task": {"name": "horizon", "min_len": 32, "max_len": 32}},
                           [f"{k}={v}" for k, v in horizon_overrides(32).items()])
    assert cfg.task.name == "horizon" and cfg.rollout.max_new_tokens == 40


@pytest.mark.parametrize("length", [8, 128])
def test_horizon_is_set_and_answer_unchanged(length):
    task = make_task("horizon", length, length)
    problems = training_problems(task, 200, run_seed=0, step=0)
    for p in problems:
        answer, _, scratch = p.worked.partition(":")
        assert len(scratch) == length and set(scratch) <= set(SCRATCH_ALPHABET)
        digits = p.prompt[2:-1]
        assert len(digits) == 3 and answer == p.answer == str(sum(map(int, digits)))
        assert task.reward(p, encode_target(task.tokenizer, p)) == 1.0
        assert len(encode_target(task.tokenizer, p)) <= max_answer_tokens(task)
        assert len(encode_prompt(task.tokenizer, p)) <= max_prompt_tokens(task)
        assert len(encode_prompt(task.tokenizer, p)) + length + 8 <= horizon_overrides(length)["model.max_seq_len"]


def test_scratchpad_tokens_carry_entropy():
    """Random draws from the stated distribution, not deterministic filler."""
    task = make_task("horizon", 64, 64)
    counts = Counter("".join(p.worked.partition(":")[2] for p in training_problems(task, 300, 1, 0)))
    total = sum(counts.values())
    for ch, prob in zip(SCRATCH_ALPHABET, SCRATCH_PROBS):
        assert counts[ch] / total == pytest.approx(prob, abs=0.01)
    assert scratch_entropy() == pytest.approx(-sum(p * math.log(p) for p in SCRATCH_PROBS))
    assert 0.5 < scratch_entropy() < math.log(3)


def test_reward_reads_only_the_answer():
    task = make_task("horizon", 8, 8)
    p = task.problem("314", "aaaaaaab")
    ids = task.tokenizer.encode
    assert task.reward(p, ids("8:cc") + [EOS_ID]) == 1.0  # any scratchpad, any length
    assert task.reward(p, ids("8:") + [EOS_ID]) == 1.0
    assert task.reward(p, ids("9:aaaaaaab") + [EOS_ID]) == 0.0
    assert task.reward(p, ids("8:aaaaaaab")) == 0.0  # no EOS: rambling past the limit loses the reward
    assert task.reward(p, ids("8") + [EOS_ID]) == 0.0  # no ':'


def test_bad_problems_refused():
    task = make_task("horizon", 8, 8)
    with pytest.raises(ValueError, match="3 digits"):
        task.problem("12", "aaa")
    with pytest.raises(ValueError, match="scratchpad tokens"):
        task.problem("123", "a:b")
    with pytest.raises(ValueError, match="positive integer"):
        horizon_overrides(0)


def test_deterministic_stream():
    task = make_task("horizon", 16, 16)
    assert training_problems(task, 5, 3, 7) == training_problems(task, 5, 3, 7)
    random.seed(123)  # global RNG state is not used
    assert training_problems(task, 5, 3, 7) == training_problems(make_task("horizon", 16, 16), 5, 3, 7)


def test_free_span_is_the_scratchpad_and_the_warm_start_weighs_it_as_one_token():
    from vexact.rl.tasks import task_has_free_span
    from vexact.rl.warmstart import free_token_weights

    task = make_task("horizon", 16, 16)
    problem = training_problems(task, 1, run_seed=0, step=0)[0]
    target = encode_target(task.tokenizer, problem)
    start, end = task.free_span(problem)
    assert task.tokenizer.decode(target[start:end]) == problem.target.partition(":")[2]
    assert end - start == 16 and target[end] == EOS_ID
    weights = free_token_weights(task, problem, len(target), 1.0)
    assert float(weights[start:end].sum()) == pytest.approx(1.0)
    assert torch.equal(weights[:start], torch.ones(start)) and float(weights[end]) == 1.0
    assert task_has_free_span("horizon") and not task_has_free_span("sum") and not task_has_free_span("nope")


def test_free_weight_is_checked_and_leaves_old_warm_start_keys_alone():
    from vexact.rl.config import ConfigError, config_from_dict
    from vexact.rl.warmstart import warm_start_key

    with pytest.raises(ConfigError, match="warm_start.free_weight.*needs a task with a free span"):
        config_from_dict({"task": {"name": "sum"}, "warm_start": {"free_weight": 1.0}})
    with pytest.raises(ConfigError, match="free_weight"):
        config_from_dict({"task": {"name": "horizon"}, "warm_start": {"free_weight": -1.0}})
    plain = config_from_dict({"task": {"name": "horizon"}})
    weighted = config_from_dict({"task": {"name": "horizon"}, "warm_start": {"free_weight": 1.0}})
    assert warm_start_key(plain) != warm_start_key(weighted)
    plain_dict = plain.to_dict()
    plain_dict["warm_start"].pop("free_weight")  # a config written before the knob existed
    assert warm_start_key(config_from_dict(plain_dict)) == warm_start_key(plain)


def test_hold_length_pays_only_a_full_scratchpad():
    """``task.hold_length``: the reward also asks for min_len scratchpad tokens, so RL cannot shorten T."""
    from vexact.rl.config import config_from_dict
    from vexact.rl.tasks import task_of

    held = task_of(config_from_dict({"task": {"name": "horizon", "min_len": 8, "max_len": 8, "hold_length": True}},
                                    [f"{k}={v}" for k, v in horizon_overrides(8).items()]))
    free = task_of(config_from_dict({"task": {"name": "horizon", "min_len": 8, "max_len": 8}},
                                    [f"{k}={v}" for k, v in horizon_overrides(8).items()]))
    p = held.problem("314", "aaaaaaab")
    ids = held.tokenizer.encode
    for short in ("8:", "8:cc", "8:aaaaaab"):  # 0, 2 and 7 scratchpad tokens: cut short
        assert held.reward(p, ids(short) + [EOS_ID]) == 0.0
        assert free.reward(p, ids(short) + [EOS_ID]) == 1.0
    assert held.reward(p, ids("8:aaaaaaab") + [EOS_ID]) == 1.0
    assert held.reward(p, ids("8:aaaaaaabcc") + [EOS_ID]) == 1.0  # longer is fine
    assert held.reward(p, ids("9:aaaaaaab") + [EOS_ID]) == 0.0


def test_hold_length_needs_the_horizon_task_and_leaves_the_warm_start_alone():
    from vexact.rl.config import ConfigError, config_from_dict
    from vexact.rl.warmstart import warm_start_key

    with pytest.raises(ConfigError, match="hold_length.*task.name: horizon"):
        config_from_dict({"task": {"name": "sum", "hold_length": True}})
    plain = config_from_dict({"task": {"name": "horizon"}})
    held = config_from_dict({"task": {"name": "horizon", "hold_length": True}})
    assert held.task.hold_length and not plain.task.hold_length
    assert warm_start_key(held) == warm_start_key(plain)  # reward-only: one cached warm start serves both
