"""Advantage estimators (``algorithm.advantage``): one class each, registered in ``ADVANTAGE_ESTIMATORS``.

An estimator turns a step's rewards (float64, each prompt's ``group_size`` samples adjacent) into one advantage per
sequence. The built-ins differ only in their baseline:

- ``grpo``: r - group mean, divided by (group std + eps) if ``algorithm.std_normalize``;
- ``rloo``: r - mean of the *other* samples of the group (leave-one-out baseline);
- ``reinforce``: r - batch mean (one baseline for the whole batch).

``std_normalize`` divides by the std of the same scope (group, or batch for reinforce); std is the unbiased sample
std, as in verl's GRPO. A new estimator is one class (``register_advantage_estimator(MyEstimator())``), with its own
settings as ``algorithm.*`` keys if it has any (a dataclass in ``settings``; it reads them from the ``algorithm``
section passed as ``alg``), and ``signal_problem`` if some rollout sizes give it nothing to learn from.
``compute_advantages`` is the one caller (a step's advantages stage; ``vexact.rl.objective`` re-exports it).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..registry import PluginCodeError, call_entry, entry_code
from .registries import ADVANTAGE_ESTIMATORS
from .validate import show_repr

__all__ = ["ADVANTAGE_EPS", "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "compute_advantages",
           "register_advantage_estimator"]

ADVANTAGE_EPS = 1e-6


def compute_advantages(rewards: Tensor, group_size: int, kind: str, std_normalize: bool = True,
                       alg: Any = None) -> Tensor:
    """One advantage per sequence; ``rewards`` [N] with each prompt's ``group_size`` samples adjacent, by the
    estimator ``kind`` (a name in ``ADVANTAGE_ESTIMATORS``: ``grpo``, ``rloo``, ``reinforce``). ``alg``: the
    ``algorithm`` section, for an estimator with settings of its own."""
    rewards = rewards.double()
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if kind not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage kind {kind!r}")
    estimator = ADVANTAGE_ESTIMATORS[kind]
    out = call_entry(ADVANTAGE_ESTIMATORS.what, kind, "advantages", estimator.advantages, rewards, group_size,
                     std_normalize, alg)
    # one value per group, [N, 1] or 2N values would fail deep in the loss, or be read in part without a word
    if not isinstance(out, Tensor) or not out.is_floating_point() or out.shape != rewards.shape:
        got = (f"a {out.dtype} tensor of shape {list(out.shape)}" if isinstance(out, Tensor)
               else f"{show_repr(out)} (a {type(out).__name__})")
        raise PluginCodeError(f"{entry_code(ADVANTAGE_ESTIMATORS.what, kind, 'advantages')} returned {got}: expected "
                              f"a floating-point tensor of the rewards' shape {list(rewards.shape)} (one advantage "
                              "per sequence)")
    # NaN/Inf from non-finite rewards is a run's outcome (recorded); from finite ones it is the estimator's defect.
    # A built-in's stays an outcome: its only way there is float64 overflow of extreme rewards, no defect of its code
    if type(estimator) not in _BUILT_IN and not bool(torch.isfinite(out).all()) and bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(out)).nonzero().flatten()
        raise PluginCodeError(f"{entry_code(ADVANTAGE_ESTIMATORS.what, kind, 'advantages')} returned {bad.numel()} "
                              f"non-finite advantage(s) of {out.numel()} (the first, {out[bad[0]].item()}, at index "
                              f"{bad[0].item()}) from finite rewards: expected finite advantages")
    return out.float()



class AdvantageEstimator:
    """One ``algorithm.advantage``: ``advantages(rewards, group_size, std_normalize, alg)`` -> one advantage per
    sequence (a floating-point tensor of ``rewards``' shape, float64 like them, finite where the rewards are; anything
    else is a ``PluginCodeError`` naming the estimator); ``alg`` is the ``algorithm`` section (its settings), or None.
    ``settings``: a dataclass of the estimator's own options, mounted as ``algorithm.<field>`` keys."""

    name: ClassVar[str] = ""
    settings: ClassVar[type | None] = None

    def advantages(self, rewards: Tensor, group_size: int, std_normalize: bool, alg: Any) -> Tensor:
        raise NotImplementedError

    def signal_problem(self, group_size: int, prompts_per_step: int) -> tuple[str, str] | None:
        """Why every advantage is 0 at every step for rollouts of ``prompts_per_step`` prompts x ``group_size``
        samples, so nothing is learned: (the problem, the config key to change), two non-empty strings, which the
        config reports when it is loaded; None when the estimator can learn from them. Anything else is refused,
        naming the estimator."""
        return None


def register_advantage_estimator(estimator: AdvantageEstimator, replace: bool = False) -> AdvantageEstimator:
    """Register an advantage estimator (an ``AdvantageEstimator`` instance) under its ``name``:
    ``algorithm.advantage: NAME`` selects it. A name already taken is an error unless ``replace``."""
    if not isinstance(estimator, AdvantageEstimator):
        raise TypeError(f"register_advantage_estimator needs an AdvantageEstimator instance, got {estimator!r}")
    return ADVANTAGE_ESTIMATORS.add(estimator.name, estimator, replace=replace)


class _GroupBaseline(AdvantageEstimator):
    """A baseline per prompt group (``centred``), then the group's std if ``std_normalize``."""

    def centred(self, groups: Tensor, mean: Tensor, group_size: int) -> Tensor:
        raise NotImplementedError

    def signal_problem(self, group_size: int, prompts_per_step: int) -> tuple[str, str] | None:
        if group_size >= 2:
            return None
        return (f"algorithm.advantage {self.name!r} compares the samples of one prompt with each other: a group of "
                f"{group_size} sample has advantage 0 at every step, so nothing is learned; set "
                "rollout.samples_per_prompt >= 2 (or algorithm.advantage: reinforce)", "rollout.samples_per_prompt")

    def advantages(self, rewards: Tensor, group_size: int, std_normalize: bool, alg: Any) -> Tensor:
        groups = rewards.view(-1, group_size)
        mean = groups.mean(dim=1, keepdim=True)
        centred = self.centred(groups, mean, group_size)
        if std_normalize:
            std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
            centred = centred / (std + ADVANTAGE_EPS)
        return centred.reshape(-1)


class GRPO(_GroupBaseline):
    """``grpo``: r - group mean (GRPO)."""

    name = "grpo"

    def centred(self, groups: Tensor, mean: Tensor, group_size: int) -> Tensor:
        return groups - mean


class RLOO(_GroupBaseline):
    """``rloo``: r - the mean of the group's other samples (leave-one-out)."""

    name = "rloo"

    def centred(self, groups: Tensor, mean: Tensor, group_size: int) -> Tensor:
        if group_size < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        return (groups - mean) * group_size / (group_size - 1)


class Reinforce(AdvantageEstimator):
    """``reinforce``: r - batch mean (one baseline for the batch)."""

    name = "reinforce"

    def signal_problem(self, group_size: int, prompts_per_step: int) -> tuple[str, str] | None:
        if prompts_per_step * group_size >= 2:
            return None
        return (f"algorithm.advantage {self.name!r} centres each reward on the batch mean: a batch of 1 sample has "
                "advantage 0 at every step; set rollout.prompts_per_step or rollout.samples_per_prompt above 1",
                "rollout.prompts_per_step")

    def advantages(self, rewards: Tensor, group_size: int, std_normalize: bool, alg: Any) -> Tensor:
        centred = rewards - rewards.mean()
        scale = rewards.std() if rewards.numel() > 1 else rewards.new_tensor(0.0)
        return centred / (scale + ADVANTAGE_EPS) if std_normalize else centred


_BUILT_IN = (GRPO, RLOO, Reinforce)
for _kind in _BUILT_IN:
    register_advantage_estimator(_kind())
