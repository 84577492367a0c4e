"""The RL loop on top of the engine, in the order one step runs:

``config`` (YAML -> RunConfig) -> ``inject`` (the step's RolloutPlan: which ops, dtype and logits hook the
rollout path uses) -> ``rollouts`` (prompts from ``tasks``, generate, rewards) -> ``objective`` (anchor
log-probs, advantages, ``corrections``, PPO loss) -> update (in ``trainer``) -> ``metrics`` -> the run log
(``vexact.records.runlog``: metrics.jsonl, checkpoints; ``log_backends``: its live views); ``schedules`` (LR) and
``collapse`` watch the logged metrics; ``warmstart`` makes the starting policy. Imports only ``vexact.engine``,
``vexact.records`` and ``vexact_kernels``.
"""

from .plugins import load_builtins

load_builtins()  # the built-in tasks, modes, schedules, ... register themselves, as a plugin's extensions do
