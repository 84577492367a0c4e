"""Which curve of the map a run is on: its correction, named from vexact, verl or TRL spellings, and its mismatch
source.

**Corrections.** Every run belongs to one correction, named by ``correction_name(old_logprobs, correction)`` from
its ``algorithm.old_logprobs`` and ``correction`` section: ``bypass`` (old log-probs from the rollout, no
correction), ``recompute`` (recomputed by the trainer, no correction), a method of the registry
``vexact.rl.corrections.CORRECTION_METHODS`` (``token_tis``, ``seq_tis``, ``token_mis``, ...: recompute with that
correction, verl's decoupled mode) or ``bypass_`` + that method. verl's own keys (``preset``, ``rollout_is``, ...)
name the method whose plan they spell. ``correction_names()`` lists them; TRL's
``vllm_importance_sampling_mode`` values (``TRL_MODES``) are read as the method each one is.

**Sources.** ``source_name(config)``: the injected mismatch a run had (the inject mode and its own settings). A map
never merges runs of two corrections or two sources into one curve.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..rl.config_schema import AlgorithmSection, CorrectionSection, RunConfig, knob_key
from ..rl.config_spellings import RENAMED_KEYS, move_renamed_keys
from ..rl.corrections import CORRECTION_METHODS, VERL_KEYS, CorrectionPlan, plan_for
from ..rl.inject_modes import INJECT_MODES
from ..rl.plugins import load_entry_points
from ..rl.validate import parse_yaml, yaml_problem

BYPASS, RECOMPUTE = "bypass", "recompute"
DEFAULT_CORRECTION = BYPASS  # assumed, and said so, when the user names none: the map's best-measured curve
BYPASS_PREFIX = "bypass_"  # a registry method run with old log-probs from the rollout
OLD_LOGPROBS = typing.get_args(typing.get_type_hints(AlgorithmSection)["old_logprobs"])  # ("rollout", "recompute")
TRL_MODES = {"token_truncate": "token_tis", "token_mask": "token_mis", "sequence_truncate": "seq_tis",
             "sequence_mask": "seq_mis"}
"""TRL's ``vllm_importance_sampling_mode`` (GRPOConfig) -> the registry method it is. TRL recomputes the old
log-probs with the trainer, so each is the decoupled (recompute) form; ``token_mask`` with a lower bound
``vllm_importance_sampling_clip_min`` zeroes the ratios outside [C_min, C_max]: ``TRL_BAND_METHOD``."""
TRL_BAND_METHOD = "icepop"
TRL_DEFAULTS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask"}
"""TRL 1.16's GRPOConfig defaults for the keys read here."""
TRL_PREFIX = "vllm_importance_sampling_"
TRL_USE_VLLM = "use_vllm"
"""TRL 1.16 applies its importance-sampling correction only with ``use_vllm=True`` (``_generate_and_score_completions``:
``self.use_vllm and self.vllm_importance_sampling_correction``); a GRPOConfig with ``use_vllm=False`` (TRL's default:
its transformers ``generate`` path, or a ``rollout_func``) is ``recompute`` whatever its ``vllm_importance_sampling_*``
keys say. A mapping without the key names the correction by those keys alone."""
VERL_MODE_KEY = "bypass_mode"  # verl's algorithm.old_logprobs: true = rollout (bypass), false/null = decoupled
VERL_BLOCK_KEYS = ("preset", *VERL_KEYS, VERL_MODE_KEY)  # the keys of verl's rollout_correction that decide it
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _methods() -> list[str]:
    """The registry's corrections: every method that expands into verl's keys (``none`` expands into nothing)."""
    return [name for name, method in CORRECTION_METHODS.items() if method.to_verl is not None]


def correction_names() -> tuple[str, ...]:
    """Every correction name a curve can carry, read from ``CORRECTION_METHODS`` now (a method registered later is
    in the next call's answer): bypass, recompute, each method (recompute with it) and ``bypass_`` + each method."""
    methods = _methods()
    return (BYPASS, RECOMPUTE, *methods, *(BYPASS_PREFIX + m for m in methods))


def _signature(plan: CorrectionPlan) -> tuple[Any, ...]:
    """What kind of correction a plan is (its thresholds aside): the IS level, whether it has a band, the RS options."""
    return plan.rollout_is, plan.is_lower is not None, tuple(sorted(option.name for option in plan.reject))


def _method_name(section: CorrectionSection) -> str | None:
    """The registry method a correction section is (None: no correction). verl's keys name the method whose plan
    they spell; a combination no method spells gets a name built from its plan (``verl[...]``)."""
    if CORRECTION_METHODS[section.method].to_verl is not None:
        return section.method
    plan = plan_for(section)
    if not plan.active:
        return None
    for name in _methods():
        if _signature(plan_for(CorrectionSection(method=name))) == _signature(plan):
            return name
    parts = ([f"rollout_is={plan.rollout_is}" + ("_band" if plan.is_lower is not None else "")]
             if plan.rollout_is else []) + [f"rollout_rs={option.name}" for option in plan.reject]
    return "verl[" + ",".join(parts) + "]"


def correction_name(old_logprobs: str, correction: CorrectionSection | None = None) -> str:
    """The one name of a run's correction: from ``algorithm.old_logprobs`` and its ``correction`` section (module
    docstring). ``vexact report`` labels curves with it; ``compare --map`` and ``vexact.live`` choose curves by it."""
    if old_logprobs not in OLD_LOGPROBS:
        raise ValueError(f"algorithm.old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, got {old_logprobs!r}")
    method = _method_name(correction) if correction is not None else None
    bypass = old_logprobs == "rollout"
    if method is None:
        return BYPASS if bypass else RECOMPUTE
    return BYPASS_PREFIX + method if bypass else method


OLD_LOGPROB_WORDS = {BYPASS: "old log-probs from the rollout", RECOMPUTE: "old log-probs recomputed by the trainer"}


def correction_words(name: str) -> str:
    """A correction name as what the user runs, the old log-probs' source and the correction both:
    ``token_tis`` is "recompute + token_tis" (verl's decoupled mode), ``bypass_token_tis`` "bypass + token_tis" (the
    same correction on the rollout's own log-probs: verl's bypass mode with ``rollout_is: token``)."""
    if name in OLD_LOGPROB_WORDS:
        return f"{name}: {OLD_LOGPROB_WORDS[name]}, no correction"
    bypass = name.startswith(BYPASS_PREFIX) and name[len(BYPASS_PREFIX):] in CORRECTION_METHODS
    method = name[len(BYPASS_PREFIX):] if bypass else name
    if method not in CORRECTION_METHODS:
        return name
    old = BYPASS if bypass else RECOMPUTE
    return f"{old} + {method}: {OLD_LOGPROB_WORDS[old]}, corrected by {CORRECTION_METHODS[method].effect}"


def _section(block: Any, keys: tuple[str, ...], where: str) -> CorrectionSection:
    """A ``CorrectionSection`` from the given keys of a config block (others are not about the correction)."""
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(block).__name__}")
    given = {k: (tuple(v) if k == "band" and isinstance(v, list) else v) for k, v in block.items()
             if k in keys and v is not None}
    try:
        section = CorrectionSection(**given)
        plan_for(section)  # the correction's own check: its keys expand to a plan
    except KeyError as err:  # the registry's message for an unknown name
        raise ValueError(f"{where}: {err.args[0]}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    return section


def _from_verl(block: Any, where: str) -> str:
    section = _section(block, ("preset", *VERL_KEYS), where)
    mode = block.get(VERL_MODE_KEY) if isinstance(block, Mapping) else None
    if mode is not None and not isinstance(mode, bool):
        raise ValueError(f"{where}: {VERL_MODE_KEY} must be true or false, got {mode!r}")
    bypass = plan_for(section, mode).bypass_mode  # the block's own, else its preset's; neither: verl's decoupled
    return correction_name("rollout" if bypass else "recompute", section)


def _from_trl(config: Mapping, where: str) -> str:
    values = {**TRL_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if not values["vllm_importance_sampling_correction"] or config.get(TRL_USE_VLLM) is False:
        return RECOMPUTE
    mode = values["vllm_importance_sampling_mode"]
    if mode not in TRL_MODES:
        raise ValueError(f"{where}: vllm_importance_sampling_mode {mode!r} is none of TRL's {', '.join(TRL_MODES)}")
    if mode == "token_mask" and values.get(TRL_PREFIX + "clip_min") is not None:
        return TRL_BAND_METHOD
    return TRL_MODES[mode]


def correction_from_vexact(config: Mapping, where: str) -> str:
    config = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    try:  # a deprecated spelling (verl's correction.bypass_mode) read as the config reads it
        move_renamed_keys(config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    algorithm = config.get("algorithm") or {}
    if not isinstance(algorithm, Mapping):
        raise ValueError(f"{where}: algorithm must be a mapping, got {type(algorithm).__name__}")
    old = algorithm.get("old_logprobs", AlgorithmSection.old_logprobs)
    keys = tuple(f.name for f in dataclasses.fields(CorrectionSection))
    return correction_name(old, _section(config.get("correction"), keys, f"{where}: correction"))


def correction_from_config(config: Mapping, where: str = "the config") -> str:
    """The correction a training config sets: verl's (``algorithm.rollout_correction``, or that block alone), a TRL
    ``GRPOConfig`` as a mapping (``vllm_importance_sampling_*``), or vexact's (``algorithm.old_logprobs`` and
    ``correction``). ``where`` names the config in errors."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{where} must be a mapping of config keys, got {type(config).__name__}")
    algorithm = config.get("algorithm")
    if isinstance(algorithm, Mapping) and "rollout_correction" in algorithm:
        return _from_verl(algorithm["rollout_correction"], f"{where}: algorithm.rollout_correction")
    if "rollout_correction" in config:
        return _from_verl(config["rollout_correction"], f"{where}: rollout_correction")
    if any(isinstance(k, str) and k.startswith(TRL_PREFIX) for k in config):
        return _from_trl(config, where)
    if (isinstance(algorithm, Mapping) and "old_logprobs" in algorithm) or "correction" in config:
        return correction_from_vexact(config, where)
    if any(k in config for k in VERL_BLOCK_KEYS):
        return _from_verl(config, where)
    raise ValueError(f"{where}: no correction setting found: expected verl's algorithm.rollout_correction, a TRL "
                     f"GRPOConfig's {TRL_PREFIX}* keys, or a vexact config's algorithm.old_logprobs / correction")


def correction_from_file(path: str | Path) -> str:
    """``correction_from_config`` of a YAML or JSON file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"correction config file not found: '{path}'")
    try:
        config = parse_yaml(path.read_text())  # JSON is read as YAML too
    except yaml.YAMLError as err:
        raise ValueError(f"correction config '{path}' is not valid YAML or JSON: {yaml_problem(err)}") from None
    except UnicodeDecodeError:
        raise ValueError(f"correction config '{path}' is not a UTF-8 text file") from None
    return correction_from_config(config, f"correction config '{path}'")


SOURCE_SEPARATOR = ":"


def source_name(config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """The mismatch source a run injected, from its flat config (dotted keys; a key it lacks counts as its
    default): ``inject.mode``, then the values of that mode's own settings (its ``settings`` dataclass in the
    registry ``INJECT_MODES``), joined by ``SOURCE_SEPARATOR``: ``logit_scale``, ``routing_flip:near_tie``. A map
    never merges runs of two sources into one curve: one correction's threshold differs between them (a flattened
    rollout against flipped MoE routing). ``defaults``: ``default_config()``, computed once by a caller that names
    many runs' sources (None: computed here)."""
    defaults = default_config() if defaults is None else defaults
    mode = config.get("inject.mode", defaults.get("inject.mode"))
    settings = INJECT_MODES[mode].settings if mode in INJECT_MODES else None
    values = []
    for f in dataclasses.fields(settings) if settings is not None else ():
        value = config.get(f"inject.{f.name}", defaults.get(f"inject.{f.name}"))
        values.append("+".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
    return SOURCE_SEPARATOR.join([str(mode), *values])


def knob_as_value(config: dict[str, Any]) -> dict[str, Any]:
    """A flat saved config with its injection knob under ``inject.value`` however the run saved it: runs saved
    before modes named their knobs hold ``inject.value``, later ones the mode's key (``inject.sigma``, ...); the map
    compares, exempts and filters one key."""
    mode = config.get("inject.mode")
    key = f"inject.{knob_key(mode)}" if isinstance(mode, str) else "inject.value"
    if key == "inject.value" or key not in config:
        return config
    return {("inject.value" if k == key else k): v for k, v in config.items()}


def flat_config(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested run config as dotted keys (``algorithm.old_logprobs``), lists kept as values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value
    return out


def default_config() -> dict[str, Any]:
    """The defaults of every run config key: what a config saved before a key existed ran with (tuples as lists, as
    a saved config.yaml holds them). The entry points' extensions are loaded first, so that their keys (``rollout.
    vllm_timeout_s`` of the vllm engine) have defaults too: a key added after older runs were saved is the same
    testbed at its default."""
    load_entry_points()
    # a renamed key whose null means "not given" (verl's correction.bypass_mode): configs saved before the rename
    # hold it at null, those saved after lack it; both are the same testbed
    retired = {old: None for old, renamed in RENAMED_KEYS.items() if renamed.values is not None}
    return {**retired, **{k: list(v) if isinstance(v, tuple) else v
                          for k, v in flat_config(dataclasses.asdict(RunConfig())).items()}}
