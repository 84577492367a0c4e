"""The RL loop on top of the engine, in the order one step runs:

``config`` (YAML -> RunConfig; + ``config_schema``, ``config_spellings``) -> ``inject`` (the step's RolloutPlan:
which ops, dtype and logits hook the rollout path uses) -> ``collect`` (prompts from ``tasks``, generate, rewards)
-> ``scoring`` (the training path's log-probs before the update: the PPO anchors, ...) -> ``advantages`` ->
``objective`` (``corrections``, PPO loss) -> update (in ``trainer``) -> ``step_metrics`` (the step's line, from
``metrics``) -> the run log (``vexact.records.runlog``: metrics.jsonl, checkpoints; ``log_backends``: its live
views); ``schedules`` (LR) and ``collapse`` watch the logged metrics; ``warmstart`` makes the starting policy.
Imports only ``vexact.engine``, ``vexact.records`` and ``vexact_kernels``.
"""

# The built-in tasks, modes, schedules, ... register themselves when imported, as a plugin's extensions do; the
# package imports them, so the config schema imports none of them. In this order: a registry lists its entries in
# the order they registered (the reference's tables, the choices an error names). A higher layer's built-ins
# (rollout.engine: vllm) are entry points of the vexact.plugins group instead (vexact.rl.plugins).
# isort: off
from . import tasks, horizon_task, surge_task, inject_modes, corrections, schedules, advantages, objective
from . import log_backends, rollout_engines
# isort: on

BUILTINS: tuple[str, ...] = tuple(module.__name__ for module in (
    tasks, horizon_task, surge_task, inject_modes, corrections, schedules, advantages, objective, log_backends,
    rollout_engines))
"""The modules that register the built-in tasks, injection modes, correction methods, LR schedules, advantage
estimators, loss aggregations and bypass losses, log backends and rollout engines (``vexact.rl.registries``)."""
