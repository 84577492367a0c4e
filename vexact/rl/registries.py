"""The RL loop's extension points: one registry per kind of extension, and the checks extensions add to a config.

Each registry maps a config value to its entry (``vexact.registry.Registry``): the config schema
(``vexact.rl.config``) types its key with the registry's ``name_type`` and validates against whatever is registered
when a config is loaded, and entries bring their own settings (mounted into the config section of the registry's
key). The registries live here, apart from their built-in entries, so that the schema imports no extension: the
built-ins register themselves when their modules are imported (``vexact.rl.BUILTINS``, imported with the
``vexact.rl`` package), exactly as a plugin's do.

A check that needs an extension's own code (does every problem of the task fit the model? do the correction keys
expand to a valid plan?) is registered here by the module that has that code (``register_run_check``) and runs
when a ``RunConfig`` is validated, after the sections' own checks.

This module imports only ``vexact.registry`` and the validator's error type (not the config schema, which imports
it: a run check receives the ``RunConfig`` untyped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..registry import Registry, mounts, settings_of, type_hints
from .validate import ConfigError, build, show_value, unsupported_hint

__all__ = ["ADVANTAGE_ESTIMATORS", "BYPASS_LOSSES", "CORRECTION_METHODS", "INJECT_MODES", "LOG_BACKENDS",
           "LOSS_AGGREGATIONS", "LR_SCHEDULES", "REGISTRIES", "ROLLOUT_ENGINES", "TASKS", "check_run",
           "check_settings", "register_run_check"]

class _CheckedRegistry(Registry):
    """A ``Registry`` whose entries' settings are held to the config validator when they register (``registry``
    imports nothing of vexact, so the check lives here): a type hint the validator cannot check, or a default it
    would refuse (a saved config.yaml with it could not be loaded again), is one ValueError naming the entry and the
    key, and the entry is not registered."""

    def add(self, name: str, entry: Any, replace: bool = False) -> Any:
        settings = settings_of(entry)
        if settings is not None:
            check_settings(self.owner(name), self.settings_section(settings), settings)
        return super().add(name, entry, replace=replace)


def check_settings(owner: str, section: str, settings: type) -> None:
    """Each field of settings dataclass ``settings`` (of ``owner``, mounted into ``section``) has a type hint the
    config validator checks, and its default passes that check and the class's own ``check()``; else ValueError."""
    hints = type_hints(settings)
    defaults = {}
    for f in dataclasses.fields(settings):
        bad = unsupported_hint(hints[f.name])
        if bad is not None:
            raise ValueError(f"{owner} declares the setting '{section}.{f.name}' as {hints[f.name]!r}, but a config "
                             f"value cannot be checked as {bad!r}: use bool, int, float, str, a Literal, a list, tuple "
                             "or dict of them, or X | None")
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = _default(f)
    try:
        build(settings, defaults, section)
    except ConfigError as e:
        raise ValueError(f"{owner} declares the setting '{e.key}' with a default the config refuses: {e.problem} "
                         f"(a run would save it to config.yaml, which could not be loaded again)") from None


TASKS: Registry = _CheckedRegistry("task", "task.name", "vexact.register_task")
"""``task.name`` -> its ``Task`` class (``vexact.rl.tasks``)."""
INJECT_MODES: Registry = _CheckedRegistry("injection mode", "inject.mode", "vexact.register_inject_mode")
"""``inject.mode`` -> its ``InjectMode`` (``vexact.rl.inject_modes``)."""
CORRECTION_METHODS: Registry = _CheckedRegistry("correction method", "correction.method",
                                        "vexact.register_correction_method")
"""``correction.method`` -> its ``CorrectionMethod`` (``vexact.rl.corrections``)."""
BYPASS_LOSSES: Registry = _CheckedRegistry("bypass loss", "correction.loss_type",
                                           "vexact.rl.objective.register_bypass_loss")
"""``correction.loss_type`` -> the bypass-mode loss it names (``vexact.rl.objective``)."""
LR_SCHEDULES: Registry = _CheckedRegistry("LR schedule", "lr_schedule.kind", "vexact.register_lr_schedule")
"""``lr_schedule.kind`` -> its ``ScheduleKind`` (``vexact.rl.schedules``)."""
ADVANTAGE_ESTIMATORS: Registry = _CheckedRegistry("advantage estimator", "algorithm.advantage",
                                          "vexact.register_advantage_estimator")
"""``algorithm.advantage`` -> its ``AdvantageEstimator`` (``vexact.rl.advantages``)."""
LOSS_AGGREGATIONS: Registry = _CheckedRegistry("loss aggregation", "algorithm.loss_agg",
                                       "vexact.rl.objective.register_loss_aggregation")
"""``algorithm.loss_agg`` -> how a per-token loss is reduced (``vexact.rl.objective``)."""
LOG_BACKENDS: Registry = _CheckedRegistry("log backend", "logging.backends", "vexact.register_log_backend")
"""``logging.backends`` -> its ``LogBackendKind`` (``vexact.rl.log_backends``)."""
ROLLOUT_ENGINES: Registry = _CheckedRegistry("rollout engine", "rollout.engine", "vexact.register_rollout_engine")
"""``rollout.engine`` -> its ``RolloutEngine`` (``vexact.rl.rollout_engines``): who samples the rollout batch."""

REGISTRIES: tuple[Registry, ...] = (TASKS, INJECT_MODES, CORRECTION_METHODS, BYPASS_LOSSES, LR_SCHEDULES,
                                    ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, LOG_BACKENDS, ROLLOUT_ENGINES)
"""Every extension point, in the order the documentation lists them."""

RunCheck = Callable[[Any], None]
"""A run check: called with the ``vexact.rl.config.RunConfig`` being validated. Typed ``Any`` because the config
schema imports this module: naming its class here, even for types only, would close an import cycle."""

_RUN_CHECKS: list[RunCheck] = []


def register_run_check(check: RunCheck) -> RunCheck:
    """Run ``check(cfg)`` whenever a ``RunConfig`` is validated (after its sections' own checks); it raises
    ``ConfigError(problem, full.dotted.key)``. Registering the same function twice is a no-op."""
    if check not in _RUN_CHECKS:
        _RUN_CHECKS.append(check)
    return check


def check_run(cfg: Any) -> None:
    """The checks extensions add to a run's config: settings that need their entry selected, then each registered
    run check, in registration order."""
    for registry in REGISTRIES:
        _check_owners(cfg, registry)
    for check in _RUN_CHECKS:
        check(cfg)


def _value_at(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_owners(cfg: Any, registry: Registry) -> None:
    """A key of a settings class that says ``requires_owner`` keeps its default unless an entry that declares the
    key is the one the config selects (``registry.key``; for a list of names, one of them)."""
    chosen = _value_at(cfg, registry.key)
    chosen = set(chosen) if isinstance(chosen, (list, tuple)) else {chosen}
    declared = [getattr(entry, "settings", None) for _, entry in registry.items()]
    strict = {settings for settings in declared if getattr(settings, "requires_owner", False)}
    for section_name in dict.fromkeys(registry.settings_section(s) for s in strict):
        section = _value_at(cfg, section_name)
        for key, mount in mounts(type(section)).items():
            if not strict & {s for _, s in mount.owners}:
                continue
            owners = [n for n in registry.names() if registry.owner(n) in mount.owner_names]
            value, default = getattr(section, key), _default(mount.field)
            if value != default and not chosen & set(owners):
                raise ConfigError(f"{show_value(value)} is a setting of {registry.what} {' or '.join(owners)} only: "
                                  f"it needs {registry.key}: {' or '.join(owners)}, got {registry.key} "
                                  f"{show_value(_value_at(cfg, registry.key))} (leave {key} at {show_value(default)})",
                                  f"{section_name}.{key}")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
