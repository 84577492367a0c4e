"""Refuse, or warn about, a run whose Triton kernels would run in the Triton interpreter.

Why: the trainer computes on the CPU, and on a CPU ``backend: triton`` runs every kernel through the Triton
interpreter (numpy, one program instance at a time; see ``kernels/triton_exact.py``): correct and exact, but
measured here at about 33 ms per token per decoder layer for the default policy, so the default config's warm
start alone (180 steps x 64 sequences) takes hours, with nothing on screen. So a run estimates its interpreted
work before it creates its run directory: above ``REFUSE_ABOVE_S`` it is refused unless the environment sets
``VEXACT_ALLOW_SLOW_TRITON=1``; otherwise (or with that override) it starts with a warning giving the estimate.
``backend: exact`` gives the same bitwise guarantee on a CPU with compiled C++ kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console

from vexact_kernels import TRITON_PIP, triton_installed

from .inject_modes import INJECT_MODES
from .tasks import Task, max_answer_tokens, max_prompt_tokens
from .warmstart import warm_start_cache_path

if TYPE_CHECKING:
    from .config_schema import RunConfig

ALLOW_ENV = "VEXACT_ALLOW_SLOW_TRITON"
REFUSE_ABOVE_S = 600.0  # ten minutes of interpreted kernels: more needs ALLOW_ENV
# Seconds per token per decoder layer of an interpreted forward, a + b x hidden_size, fitted to forwards of 64 x 30
# tokens at hidden 32, 64 and 128 (0.030, 0.033, 0.054 s) on a 2-core CPU (torch 2.13, Triton's interpreter).
SECONDS_PER_TOKEN_LAYER = (0.012, 3.3e-4)
DECODE_FACTOR = 3.5  # a decode-step token costs this many prefill tokens (measured: 16 sequences, 8 new tokens)


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter on this machine: no CUDA device, or TRITON_INTERPRET=1 (the
    rule ``kernels/triton_common.py`` applies). The trainer's tensors are CPU tensors either way."""
    import torch

    return not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class InterpreterEstimate:
    """Rough seconds of interpreted Triton kernels in a run: the warm start (0 when cached) and the RL steps."""

    warm_start: float
    rl: float

    @property
    def total(self) -> float:
        return self.warm_start + self.rl


def estimate(cfg: RunConfig, task: Task) -> InterpreterEstimate:
    """Token-forwards on Triton paths x the measured cost per token: upper bounds on lengths (every response runs
    to ``max_new_tokens``), backward passes free (they run on native ops). An order of magnitude, not a forecast."""
    a, b = SECONDS_PER_TOKEN_LAYER
    per_token = (a + b * cfg.model.hidden_size) * cfg.model.num_layers
    prompt, new = max_prompt_tokens(task), cfg.rollout.max_new_tokens
    training = cfg.backend == "triton"
    rollout = (cfg.rollout.backend or cfg.backend) == "triton" or "triton" in _inject_backends(cfg)
    warm = 0.0
    if training and cfg.warm_start.steps and not warm_start_cache_path(cfg).exists():
        warm = cfg.warm_start.steps * cfg.warm_start.batch_size * (prompt + max_answer_tokens(task)) * per_token
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    generated = prompt + DECODE_FACTOR * new  # token-forward equivalents of one generated sequence
    tokens = sequences * generated if rollout else 0.0
    if training:
        passes = cfg.algorithm.ppo_epochs + 1 + (cfg.algorithm.kl_coef > 0)  # updates, the scoring pass, reference
        tokens += sequences * (prompt + new) * passes
        tokens += cfg.task.eval_prompts * 2 * generated / cfg.logging.eval_every  # sampled + greedy evaluation
    return InterpreterEstimate(warm, cfg.steps * tokens * per_token)


def _inject_backends(cfg: RunConfig) -> tuple[str, ...]:
    """The backends the injection mode runs the rollout on (``kernel`` mode: ``inject.kernel_backend``)."""
    return INJECT_MODES[cfg.inject.mode].backends(cfg.inject)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_interpreted_triton(cfg: RunConfig, task: Task, console: Console | None = None) -> InterpreterEstimate | None:
    """Before a run starts: None when no Triton kernel of the run is interpreted; else the estimate, after a warning
    on ``console``. Raises ValueError (before anything is written) when the estimate exceeds ``REFUSE_ABOVE_S`` and
    ``VEXACT_ALLOW_SLOW_TRITON=1`` is not set."""
    uses_triton = "triton" in (cfg.backend, cfg.rollout.backend, *_inject_backends(cfg))
    key = "backend" if cfg.backend == "triton" else "rollout.backend" if cfg.rollout.backend == "triton" else \
        "inject.kernel_backend"  # the key that asks for Triton, which the errors name
    if uses_triton and not triton_installed():  # before any estimate: without the package nothing runs at all
        raise ValueError(f"config error at '{key}': triton asks for the Triton kernels, which need the triton "
                         f"package, not installed here: {TRITON_PIP} (or backend: exact, the same bitwise guarantee "
                         "on a CPU)")
    if not uses_triton or not interpreting():
        return None
    cost = estimate(cfg, task)
    parts = f"warm start {_duration(cost.warm_start)}, {cfg.steps} RL step{'s' * (cfg.steps != 1)} {_duration(cost.rl)}"
    if cost.total > REFUSE_ABOVE_S and os.environ.get(ALLOW_ENV) != "1":
        raise ValueError(f"config error at '{key}': triton without a CUDA device runs every kernel in the Triton "
                         f"interpreter; this run would take roughly {_duration(cost.total)} ({parts}; at about "
                         f"{SECONDS_PER_TOKEN_LAYER[0] + SECONDS_PER_TOKEN_LAYER[1] * cfg.model.hidden_size:.2g} s "
                         f"per token per layer, measured on 2 CPU cores). Use {key}: exact (the same bitwise "
                         f"guarantee on a CPU, compiled kernels), shrink the run, or set {ALLOW_ENV}=1 to run it "
                         "anyway")
    if console is not None:
        console.print(f"[yellow]warning:[/] Triton kernels run in the Triton interpreter here (no CUDA device): "
                      f"roughly {_duration(cost.total)} of interpreted kernels ({parts}); backend exact is the "
                      "fast exact path on a CPU", soft_wrap=True)
    return cost
