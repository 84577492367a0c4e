"""The rollout stage of a step: task problems -> prompts -> the rollout path (``generate`` on the plan's
ops and weights) -> rewards. Also the clean evaluation, which samples the same way on the training path."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.model import Transformer
from ..engine.rollout import generate
from .config import RolloutSection
from .inject import RolloutPlan
from .tasks import EOS_ID, CharTokenizer, Problem, Task, encode_prompt, training_problems


@dataclass
class RolloutBatch:
    """``samples_per_prompt`` responses per problem, adjacent (the GRPO groups)."""

    problems: list[Problem]
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[Tensor]  # as recorded by the rollout path
    finished: list[bool]  # True where EOS was produced
    rewards: Tensor  # [N] float32

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]


def step_problems(task: Task, settings: RolloutSection, run_seed: int, step: int) -> list[Problem]:
    """The ``settings.prompts_per_step`` training problems of ``step`` (keyed by (run seed, step))."""
    return training_problems(task, settings.prompts_per_step, run_seed, step)


def collect_rollouts(model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                     problems: list[Problem], settings: RolloutSection, seed: int) -> RolloutBatch:
    """Sample ``settings.samples_per_prompt`` responses per problem on the rollout path of ``plan``.

    ``model`` holds the policy weights in ``plan.dtype``; its own backend is not used (the plan's ops are)."""
    problems = [p for p in problems for _ in range(settings.samples_per_prompt)]
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    out = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                   seed=seed, batch_size=settings.batch_size, eos_token_id=EOS_ID, logits_hook=plan.logits_hook,
                   ops=plan.ops)
    rewards = torch.tensor([task.reward(p, r) for p, r in zip(problems, out.tokens)], dtype=torch.float32)
    return RolloutBatch(problems, prompts, out.tokens, out.logprobs, out.finished, rewards)


@torch.no_grad()
def evaluate_policy(model: Transformer, task: Task, tokenizer: CharTokenizer, problems: list[Problem],
                    settings: RolloutSection, seed: int) -> dict[str, float]:
    """``eval/*`` metrics: the policy itself on the training path (no injection), sampled and greedy."""
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    sampled = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                       seed=seed, batch_size=settings.batch_size, eos_token_id=EOS_ID)
    greedy = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=0.0,
                      batch_size=settings.batch_size, eos_token_id=EOS_ID)
    sampled_r = [task.reward(p, r) for p, r in zip(problems, sampled.tokens)]
    greedy_r = [task.reward(p, r) for p, r in zip(problems, greedy.tokens)]
    return {
        "eval/reward_mean": sum(sampled_r) / len(sampled_r),
        "eval/accuracy": sum(r == 1.0 for r in sampled_r) / len(sampled_r),
        "eval/greedy_reward_mean": sum(greedy_r) / len(greedy_r),
        "eval/greedy_accuracy": sum(r == 1.0 for r in greedy_r) / len(greedy_r),
        "eval/response_length_mean": sum(map(len, sampled.tokens)) / len(sampled.tokens),
    }
