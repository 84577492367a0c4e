"""The rollout stage of a step: task problems -> prompts -> the rollout path (``generate`` on the plan's
ops and weights) -> rewards. Also the clean evaluation, which samples the same way on the training path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.generation import generate
from ..engine.model import Transformer
from ..metric_keys import (
    EVAL_ACCURACY,
    EVAL_GREEDY_ACCURACY,
    EVAL_GREEDY_REWARD_MEAN,
    EVAL_RESPONSE_LENGTH_MEAN,
    EVAL_REWARD_MEAN,
)
from .config_schema import RolloutSection
from .inject import RolloutPlan
from .tasks import EOS_ID, CharTokenizer, Problem, Task, encode_prompt, task_reward, training_problems
from .vocab_tail import tail_metrics, tail_probe


@dataclass
class RolloutBatch:
    """``samples_per_prompt`` responses per problem, adjacent (the GRPO groups)."""

    problems: list[Problem]
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[Tensor]  # as recorded by the rollout path
    finished: list[bool]  # True where EOS was produced
    rewards: Tensor  # [N] float32
    tail_mass: list[Tensor] | None = None  # per token: the rollout's probability of the distractors (vocab_tail)
    # MoE models: per sequence, the experts the rollout's MoE layers used (GenerateOutput.routing); None when dense
    routing: list[Tensor] | None = None
    # seconds of the engine's own stages (``timing/*`` keys: an outside engine's weight sync); step metrics
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]

    def tail_metrics(self) -> dict[str, float]:
        """The ``tail/*`` metrics of the batch (``vocab_tail.tail_metrics``); none without a vocabulary tail."""
        return {} if self.tail_mass is None else tail_metrics(self.tail_mass, self.responses)

    def subset(self, idx: list[int] | range) -> RolloutBatch:
        """The sequences ``idx`` (in that order) as a batch of their own."""
        return RolloutBatch([self.problems[i] for i in idx], [self.prompts[i] for i in idx],
                            [self.responses[i] for i in idx], [self.logprobs[i] for i in idx],
                            [self.finished[i] for i in idx], self.rewards[list(idx)],
                            None if self.tail_mass is None else [self.tail_mass[i] for i in idx],
                            None if self.routing is None else [self.routing[i] for i in idx])

    @classmethod
    def concat(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """The batches one after another (data-parallel shards, in rank order)."""
        return cls([x for b in parts for x in b.problems], [x for b in parts for x in b.prompts],
                   [x for b in parts for x in b.responses], [x for b in parts for x in b.logprobs],
                   [x for b in parts for x in b.finished], torch.cat([b.rewards for b in parts]),
                   None if any(b.tail_mass is None for b in parts) else [x for b in parts for x in b.tail_mass],
                   None if any(b.routing is None for b in parts) else [x for b in parts for x in b.routing])


def step_problems(task: Task, settings: RolloutSection, run_seed: int, step: int) -> list[Problem]:
    """The ``settings.prompts_per_step`` training problems of ``step`` (keyed by (run seed, step))."""
    return training_problems(task, settings.prompts_per_step, run_seed, step)


def collect_rollouts(model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                     problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                     ) -> RolloutBatch:
    """Sample ``settings.samples_per_prompt`` responses per problem on the rollout path of ``plan``.

    ``model`` holds the policy weights in ``plan.dtype``; its own backend is not used (the plan's ops are).
    ``first_problem``: the step's index of ``problems[0]`` when this is one rank's share; sampling is keyed by the
    global sequence index, so the shares together are the one-process batch."""
    problems = [p for p in problems for _ in range(settings.samples_per_prompt)]
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    first = first_problem * settings.samples_per_prompt
    hook, probe = tail_probe(tokenizer, plan.logits_hook, len(prompts), settings.max_new_tokens, first)
    out = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                   seed=seed, batch_size=settings.batch_size, eos_token_id=EOS_ID, logits_hook=hook,
                   ops=plan.ops, first_index=first, routing_hook=plan.routing_hook, cuda_graphs=settings.cuda_graphs)
    rewards = torch.tensor([task_reward(task, p, r) for p, r in zip(problems, out.tokens)], dtype=torch.float32)
    return RolloutBatch(problems, prompts, out.tokens, out.logprobs, out.finished, rewards,
                        None if probe is None else probe.per_sequence(out.tokens), out.routing)


@dataclass
class EvalRecord:
    """One held-out problem's clean evaluation: sampled and greedy reward, sampled response length, and whether
    every log-prob either generation recorded was finite (non-finite logits still sample some token, so the rewards
    alone would pass a broken policy off as a poor one)."""

    sampled_reward: float
    greedy_reward: float
    sampled_length: int
    finite: bool = True


@torch.no_grad()
def eval_records(model: Transformer, task: Task, tokenizer: CharTokenizer, problems: list[Problem],
                 settings: RolloutSection, seed: int, first_index: int = 0) -> list[EvalRecord]:
    """Per-problem evaluation of ``problems`` (``first_index``: the index of ``problems[0]`` among all of them)."""
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    sampled = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                       seed=seed, batch_size=settings.batch_size, eos_token_id=EOS_ID, first_index=first_index,
                       cuda_graphs=settings.cuda_graphs)
    greedy = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=0.0,
                      batch_size=settings.batch_size, eos_token_id=EOS_ID, first_index=first_index,
                      cuda_graphs=settings.cuda_graphs)
    return [EvalRecord(task_reward(task, p, s), task_reward(task, p, g), len(s),
                       bool(torch.isfinite(s_lp).all() and torch.isfinite(g_lp).all()))
            for p, s, g, s_lp, g_lp in zip(problems, sampled.tokens, greedy.tokens, sampled.logprobs, greedy.logprobs)]


def eval_metrics(records: list[EvalRecord]) -> dict[str, float]:
    """``eval/*`` means over all problems' records (in problem order)."""
    sampled_r = [r.sampled_reward for r in records]
    greedy_r = [r.greedy_reward for r in records]
    return {
        EVAL_REWARD_MEAN: sum(sampled_r) / len(sampled_r),
        EVAL_ACCURACY: sum(r == 1.0 for r in sampled_r) / len(sampled_r),
        EVAL_GREEDY_REWARD_MEAN: sum(greedy_r) / len(greedy_r),
        EVAL_GREEDY_ACCURACY: sum(r == 1.0 for r in greedy_r) / len(greedy_r),
        EVAL_RESPONSE_LENGTH_MEAN: sum(r.sampled_length for r in records) / len(records),
    }
