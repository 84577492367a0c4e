"""Collapse scaling: how the 50% collapse threshold moves with the response horizon T, per correction, and where a
user sits.

``scaling(data)`` turns a loaded sweep over (horizon, mismatch) into ``scaling.json`` (a contract)::

    {"metric": "rollout_corr/k3_kl", "horizon_key": "task.max_len", "horizon_metric": "response_length/mean",
     "curve": ..., "correction": ..., "status": ..., "note": "...", "alpha": .., "alpha_ci_low": ..,
     "alpha_ci_high": .., "log10_prefactor": .., "horizon_range": [T_min, T_max], "replicates": [[log10 A, alpha], ...],
     "horizons": [{"horizon_value", "horizon", "threshold_50", "ci_low", "ci_high", "status", ...}, ...],
     "shape": {...}, "curves": [ ... the same for every curve, each with its "correction" ... ]}

The top level is the primary curve (the ``bypass`` one when the sweep has it). A map is such a file: ``compare
--map`` and ``vexact.live`` read the curve of the user's correction from ``curves``.

**Corrections.** Every run belongs to one correction, named by ``correction_name(old_logprobs, correction)`` from
its ``algorithm.old_logprobs`` and ``correction`` section: ``bypass`` (old log-probs from the rollout, no
correction), ``recompute`` (recomputed by the trainer, no correction), a method of the registry
``vexact.rl.corrections.CORRECTION_METHODS`` (``token_tis``, ``seq_tis``, ``token_mis``, ...: recompute with that
correction, verl's decoupled mode) or ``bypass_`` + that method. verl's own keys (``preset``, ``rollout_is``, ...)
name the method whose plan they spell. ``correction_names()`` lists them; TRL's
``vllm_importance_sampling_mode`` values (``TRL_MODES``) are read as the method each one is. The curves of a sweep
are split by correction (never one fit over runs with different corrections) and by its other non-seed keys.

**Horizon.** A point's horizon group is its ``task.max_len`` (the scratchpad length L of ``horizon``, or the input
length of another task), set in the sweep's grid or in its variant's bundle; its horizon T is measured: the run
mean of ``response_length/mean`` (tokens per response) over the steps before collapse, the window of the dose. A
sweep that sets no ``task.max_len`` has no horizon axis.

**Threshold per horizon.** ``dose_response.fit_threshold`` over that horizon's runs (dose = realised k3 before
collapse, collapse or not, seed): ``threshold_50`` with its seed-bootstrap interval, or a bound
(``above_range``: the 50% point lies above ``lower_bound``, the largest dose tested; ``below_range``: below
``upper_bound``, the smallest).

**The law.** log10 threshold = log10 A − α·log10 T, least squares over the horizons with a fitted threshold
(``status: fitted`` needs two or more). Interval of α (``alpha_ci_method``: ``ALPHA_CI_METHOD``): a regression
interval by residual bootstrap, ``BOOTSTRAP`` refits to the fitted values plus resampled residuals plus each
horizon's own threshold noise (a normal whose 95% range is its interval), so the scatter of the horizons about the
line widens it (a horizon with an open interval end leaves α's interval open: None). The replicates give the law's
95% band at any T (``law_band``); ``band_misses`` lists the fitted horizons whose threshold lies outside it, and
``alpha_leave_one_out`` α without each horizon (how much the law leans on one). A horizon whose dose levels each
hold one run (``runs_per_dose``, ``single_run_per_dose``: no seed scatter behind its interval) is named in
``single_run_horizons`` and in every verdict from the law. Horizons with only a bound never enter as numbers: the
fit lists them and says whether the line respects them; with fewer than two fitted horizons, pairs of (threshold or
bound) give bounds on α (``alpha_lower_bound``/``alpha_upper_bound``), ``status: bounds_only``. Other statuses:
``no_horizon``, ``single_horizon``, ``insufficient`` (points without the metrics), each with one sentence in
``note``. **The shape** (``compare_shapes``): the power law against a saturating threshold F + B/T, both fitted in
log10 on the fitted horizons, compared by AIC and leave-one-out error (three fitted horizons or more).

**Placing a user.** ``place_on_map(map_data, k3, horizon, correction)`` takes that correction's curve (None:
``bypass``, and the verdict says it was assumed; a correction the map has no curve for gets one sentence saying so,
never another curve): the law at the user's T (its interval from the replicates), the ratio k3 / threshold, a
verdict in words and how far T lies outside the measured horizons. Beyond them the verdict weighs the range the
law's interval and the saturating shape allow there (``range_low`` .. ``range_high``): "near" wherever that range
spans the k3. A bound (no collapse up to X, or every run collapsed from X) speaks within 1.5x of its own horizon
only: the threshold is not monotone in T. On a curve of bounds only, "no collapse measured up to k3 X at T Y". Every
verdict ends by naming the curve as the user runs it (``correction_words``: ``token_tis`` is recompute + token-level
TIS, ``bypass_token_tis`` the same on the rollout's log-probs). ``load_map(None)`` is the map shipped with vexact
(``default_map.json``, made by ``python -m vexact.lab.scaling build-map``; a single-curve file from before
corrections were recorded loads as a ``bypass`` curve).

**Assembling a map** (``build_map``): from sweep directories, whose runs of one (correction, horizon) are merged
into one dose-response fit when their resolved configs agree (``RUN_KEYS`` and ``BOOKKEEPING_KEYS`` aside), and from
``scaling.json`` files, whose curves join horizon by horizon; α is refitted per correction over all its horizons.
Each horizon fitted from runs carries what its collapses were (``failure_kinds``, ``vexact.lab.failure``: length lost,
limit overrun, reward lost at intact length) and whether a length surge came first. **The detector's sensitivity**
(``sensitivity``, ``python -m vexact.lab.scaling sensitivity INPUT...``): the map rebuilt with every run of the sweep
directories judged again from its logged metrics under other recovery windows (``patience``) and drop fractions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..metric_keys import K3_KL, RESPONSE_LENGTH_MEAN
from ..rl.collapse import detect_collapse
from ..rl.config import MEMORY_KEYS, AlgorithmSection, CollapseSection, CorrectionSection, RunConfig
from ..rl.corrections import CORRECTION_METHODS, VERL_KEYS, CorrectionPlan, plan_for
from ..rl.horizon_task import horizon_overrides
from ..rl.inject_modes import INJECT_MODES
from ..rl.validate import parse_yaml, yaml_problem
from ..rl.vocab_tail import tokenizer_for
from .dose_response import METRIC, fit_threshold, run_dose
from .failure import horizon_failure_words, horizon_failures
from .sweep_data import SEED_KEY, PointData, SweepData, read_sweep_results

__all__ = ["BOOTSTRAP", "BYPASS", "DEFAULT_MAP", "DEFAULT_TAIL_MAP", "HORIZON_KEY", "RECOMPUTE", "TRL_MODES",
           "build_map", "choose_correction", "compare_shapes", "correction_from_config", "correction_name",
           "correction_names", "curve_for", "fit_law", "load_map", "map_curves", "map_vocab", "place_on_map",
           "placement", "plot_scaling", "resolve_correction", "scaling", "shipped_map_for", "source_name",
           "write_scaling"]

HORIZON_KEY = "task.max_len"
HORIZON_METRIC = RESPONSE_LENGTH_MEAN
BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
ALPHA_CI_METHOD = ("regression interval by residual bootstrap: the line's fitted values plus the residuals resampled "
                   "with replacement (scaled by sqrt(n/(n-2))) plus each horizon's threshold redrawn within its own "
                   "95% interval")
"""How α's interval (and the replicates a verdict's interval at a new T comes from) is made: ``alpha_ci_method``
in a curve. It carries the scatter of the horizons about the line, which redrawing each threshold within its own
interval alone (the method before) left out."""
REPLICATES_KEPT = BOOTSTRAP  # replicates stored in scaling.json: the law's band at a new T (a verdict, a plot)
DEFAULT_MAP = Path(__file__).with_name("default_map.json")
DEFAULT_TAIL_MAP = Path(__file__).with_name("default_tail_map.json")
SHIPPED_MAPS = {DEFAULT_MAP: "the map shipped with vexact (vexact/lab/default_map.json)",
                DEFAULT_TAIL_MAP: "the tail map shipped with vexact (vexact/lab/default_tail_map.json)"}
"""The maps vexact ships, one per testbed vocabulary (``map_vocab``): the main map, on the task's characters, and the
tail map, the same testbed with a tail of distractor tokens. ``shipped_map_for(vocab)`` picks one for a user."""
MAP_KEYS = ("horizon", "k3", "threshold_50", "ci_low", "ci_high", "ratio", "verdict", "extrapolation_factor",
            "correction", "source", "vocab", "range_low", "range_high", "policy_lag")
"""``range_low`` / ``range_high``: beyond a fitted curve's measured horizons, the range the power law's interval and
the saturating shape allow there (None inside them, or without a law)."""
POLICY_LAG_KEY = "rollout.policy_lag"  # a curve's policy lag: its runs' rollout.policy_lag (0: on-policy, every curve
# from before the key existed)
ASSUMPTIONS = (
    "beyond the measured horizons the threshold lies where the fitted power law threshold ∝ T^(−alpha) (within its "
    "interval) or the saturating shape F + B/T puts it: the data do not tell the two apart",
    "the map's testbed (a 0.5M-parameter decoder on CPU, on-policy GRPO, the curve's correction and run length) "
    "stands for your stack; model size, mini-batches and run length are not on the map, and the vocabulary only as "
    "the testbed's (vocab: 22 characters, or 1,024 with the tail map)",
    "k3 is the token mean of exp(r) − r − 1 over your dump (rollout_corr/k3_kl); the map's doses are run means of "
    "the same metric before collapse",
    "your horizon is your dump's mean response length (tokens per sequence)",
)
BOUND_ASSUMPTION = ("a no-collapse bound measured at a horizon holds within 1.5x of it, and is carried no further: "
                    "the threshold does not fall monotonically with T (on the map's bypass curve it rises from one "
                    "horizon to the next twice)")
COLLAPSE_BOUND_ASSUMPTION = ("a collapse measured at a horizon also happens within 1.5x of it, and is carried no "
                             "further: the threshold does not fall monotonically with T (on the map's bypass curve "
                             "it rises from one horizon to the next twice)")
SAME_HORIZON = 1.5  # a horizon's threshold or bound answers within this factor of it, and nowhere else
WIDEST_INTERVAL_DECADES = 3.0  # a law whose interval at the user's T spans more decades than this pins nothing there
SHAPE_MIN_HORIZONS = 3  # two 2-parameter shapes: three points leave one degree of freedom each


# ----------------------------------------------------------------------------- corrections: which curve a run is on

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
VERL_BLOCK_KEYS = ("preset", *VERL_KEYS)  # the keys of verl's algorithm.rollout_correction that decide the correction
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
    section = _section(block, VERL_BLOCK_KEYS, where)
    return correction_name("rollout" if plan_for(section).bypass_mode else "recompute", section)  # verl: decoupled


def _from_trl(config: Mapping, where: str) -> str:
    values = {**TRL_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if not values["vllm_importance_sampling_correction"]:
        return RECOMPUTE
    mode = values["vllm_importance_sampling_mode"]
    if mode not in TRL_MODES:
        raise ValueError(f"{where}: vllm_importance_sampling_mode {mode!r} is none of TRL's {', '.join(TRL_MODES)}")
    if mode == "token_mask" and values.get(TRL_PREFIX + "clip_min") is not None:
        return TRL_BAND_METHOD
    return TRL_MODES[mode]


def _from_vexact(config: Mapping, where: str) -> str:
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
        return _from_vexact(config, where)
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


def resolve_correction(spec: Any, map_data: dict[str, Any] | None = None) -> str | None:
    """The user's correction as a curve name: None stays None (the caller assumes ``bypass`` and says so); a name
    (one of ``correction_names()``, a curve of ``map_data``, or TRL's mode name); a config file (.yaml, .yml,
    .json) or a config mapping (``correction_from_config``); or a config object with ``to_dict`` (TRL's
    GRPOConfig). An unknown name is one ValueError listing the known ones."""
    if spec is None:
        return None
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.lower().endswith(CONFIG_SUFFIXES)):
        return correction_from_file(spec)
    if isinstance(spec, Mapping):
        return correction_from_config(spec, "the correction config")
    if isinstance(spec, str):
        name = TRL_MODES.get(spec, spec)
        mapped = [c["correction"] for c in map_curves(map_data)] if map_data is not None else []
        if name not in correction_names() and name not in mapped:
            raise ValueError(f"unknown correction {spec!r}: expected one of {', '.join(correction_names())} (TRL's "
                             f"{', '.join(TRL_MODES)} name {', '.join(dict.fromkeys(TRL_MODES.values()))}), or a "
                             f"verl / TRL / vexact config file ({', '.join(CONFIG_SUFFIXES)})")
        return name
    to_dict = getattr(spec, "to_dict", None)
    if callable(to_dict) and isinstance(to_dict(), Mapping):
        return correction_from_config(to_dict(), type(spec).__name__)
    raise ValueError(f"correction must be a name, a config file or a config mapping, got {type(spec).__name__}")


# ----------------------------------------------------------------------------- sources: which mismatch a run had

SOURCE_SEPARATOR = ":"


def source_name(config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """The mismatch source a run injected, from its flat config (dotted keys; a key it lacks counts as its
    default): ``inject.mode``, then the values of that mode's own settings (its ``settings`` dataclass in the
    registry ``INJECT_MODES``), joined by ``SOURCE_SEPARATOR``: ``logit_scale``, ``routing_flip:near_tie``. A map
    never merges runs of two sources into one curve: one correction's threshold differs between them (a flattened
    rollout against flipped MoE routing). ``defaults``: ``_default_config()``, computed once by a caller that names
    many runs' sources (None: computed here)."""
    defaults = _default_config() if defaults is None else defaults
    mode = config.get("inject.mode", defaults.get("inject.mode"))
    settings = INJECT_MODES[mode].settings if mode in INJECT_MODES else None
    values = []
    for f in dataclasses.fields(settings) if settings is not None else ():
        value = config.get(f"inject.{f.name}", defaults.get(f"inject.{f.name}"))
        values.append("+".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
    return SOURCE_SEPARATOR.join([str(mode), *values])


# ----------------------------------------------------------------------------- reading a sweep


def _variants(data: SweepData) -> dict[str, dict[str, Any]]:
    try:
        spec = json.loads((data.path / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    variants = spec.get("variants") if isinstance(spec, dict) else None
    return variants if isinstance(variants, dict) else {}


def horizon_value(point: PointData, variants: dict[str, dict[str, Any]]) -> Any:
    """The point's ``task.max_len``: from its overrides, else from its variant's bundle; None when neither sets it."""
    if HORIZON_KEY in point.overrides:
        return point.overrides[HORIZON_KEY]
    return _bundle(point, variants).get(HORIZON_KEY)


def measured_horizon(point: PointData) -> float | None:
    """The run mean of ``response_length/mean`` over the steps before collapse (the whole run without collapse;
    None without the metric): the window of the run's dose, so the horizon is the one its mismatch acted over, not
    the collapsed policy's shorter (or longer) answers after it."""
    end = point.collapse_step
    values = [m[HORIZON_METRIC] for m in point.metrics if _number(m.get(HORIZON_METRIC))
              and (end is None or not _number(m.get("step")) or m["step"] < end)]
    return sum(values) / len(values) if values else None


CORRECTION_KEYS = ("algorithm.old_logprobs", "correction.method")  # what the correction name says already


def point_setup(point: PointData, variants: dict[str, dict[str, Any]], defaults: Mapping[str, Any]
                ) -> tuple[str, str]:
    """The point's correction name and source (``source_name``), from the config the run saved (``config.yaml``,
    read once), else from its overrides and its variant's bundle (a point that never started). The correction is
    "unknown (...)" when the saved config cannot be read or names none; ``defaults``: ``_default_config()``."""
    path = point.dir / "config.yaml"
    dotted = {**_bundle(point, variants), **point.overrides}
    try:
        config = parse_yaml(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        return _unknown(err), source_name(dotted, defaults)
    if isinstance(config, Mapping):
        return _correction_or_unknown(lambda: correction_from_config(config, str(path))), source_name(
            flat_config(config), defaults)
    nested: dict[str, dict[str, Any]] = {}
    for key, value in dotted.items():
        section, _, name = str(key).partition(".")
        if section in ("algorithm", "correction") and name and "." not in name:
            nested.setdefault(section, {})[name] = value
    return _correction_or_unknown(lambda: _from_vexact(nested, point.name)), source_name(dotted, defaults)


def point_policy_lag(point: PointData, variants: dict[str, dict[str, Any]]) -> int:
    """The point's ``rollout.policy_lag``: from the config the run saved, else its overrides and its variant's bundle;
    0 where none sets it (on-policy, as every run before the key existed)."""
    path = point.dir / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        config = None
    if isinstance(config, Mapping):
        lag = flat_config(config).get(POLICY_LAG_KEY)
    else:
        lag = {**_bundle(point, variants), **point.overrides}.get(POLICY_LAG_KEY)
    return int(lag) if isinstance(lag, int) and not isinstance(lag, bool) else 0


def _correction_or_unknown(resolve: Any) -> str:
    try:
        return resolve()
    except ValueError as err:
        return _unknown(err)


def _unknown(err: Exception) -> str:
    """A correction that cannot be named: "unknown (" + the error's first line + ")"."""
    return f"unknown ({str(err).splitlines()[0] if str(err) else type(err).__name__})"


def _bundle(point: PointData, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bundle = variants.get(str(point.overrides.get("variant")), {})
    return bundle if isinstance(bundle, dict) else {}


def _curve_keys(data: SweepData, variants: dict[str, dict[str, Any]]) -> list[str]:
    """Keys that split curves besides the correction: every non-seed group key outside ``inject.*``, the horizon key,
    ``CORRECTION_KEYS`` and ``variant`` when the variants carry the horizon (or inject settings)."""
    keys = []
    for k in data.group_keys:
        if k in (SEED_KEY, HORIZON_KEY, *CORRECTION_KEYS) or k.startswith("inject."):
            continue
        if k == "variant" and variants and any(HORIZON_KEY in b or any(x.startswith("inject.") for x in b)
                                               for b in variants.values() if isinstance(b, dict)):
            continue
        keys.append(k)
    return keys


# ----------------------------------------------------------------------------- the fit


def scaling(data: SweepData) -> dict[str, Any]:
    """The ``scaling.json`` object of a loaded sweep (module docstring)."""
    variants = _variants(data)
    base = {"metric": METRIC, "horizon_key": HORIZON_KEY, "horizon_metric": HORIZON_METRIC, "alpha": None,
            "alpha_ci_low": None, "alpha_ci_high": None, "horizons": [], "curves": []}
    with_h = [p for p in data.points if horizon_value(p, variants) is not None]
    if not with_h:
        return {**base, "status": "no_horizon",
                "note": f"the sweep sets no horizon key ({HORIZON_KEY} in its grid or its variants), so it has no "
                        "horizon axis: no scaling law"}
    keys = _curve_keys(data, variants)
    defaults = _default_config()
    setups = [point_setup(p, variants, defaults) for p in with_h]  # (correction, source) of each point
    several = len({source for _, source in setups}) > 1
    started: dict[tuple[str, str, str, int], list[PointData]] = {}
    pending: dict[tuple[str, str, str, int], list[PointData]] = {}
    for p, (correction, source) in zip(with_h, setups):  # one curve per correction, source and lag (and other
        # curve key): never one fit over several
        label = ", ".join([f"correction={correction}", *([f"source={source}"] if several else []),
                           *(f"{k}={p.overrides.get(k)}" for k in keys)])
        # a point never started is named from its overrides alone (sweep.json keeps no `set:` block), which may
        # name the wrong correction: it joins a curve of started runs, never starts one
        group = started if p.has_result or (p.dir / "config.yaml").is_file() else pending
        group.setdefault((label, correction, source, point_policy_lag(p, variants)), []).append(p)
    curves = {key: points + pending.get(key, []) for key, points in started.items()} or pending
    results = [{**_curve(label, correction, _by_horizon(points, variants)), "source": source, "policy_lag": lag}
               for (label, correction, source, lag), points in curves.items()]
    primary = next((c for c in results if c["correction"] == DEFAULT_CORRECTION), results[0])
    return {**base, **primary, "curves": results}


def _by_horizon(points: list[PointData], variants: dict[str, dict[str, Any]]) -> dict[Any, list[PointData]]:
    by_h: dict[Any, list[PointData]] = {}
    for p in points:
        by_h.setdefault(horizon_value(p, variants), []).append(p)
    return by_h


def _horizon_order(value: Any) -> tuple[bool, Any]:
    return not _number(value), value if _number(value) else str(value)


def _curve(label: str, correction: str, by_h: dict[Any, list[PointData]]) -> dict[str, Any]:
    """One curve from its runs grouped by horizon value: a threshold (or bound) per horizon, the law, the shape."""
    horizons, missing = [], 0
    for value in sorted(by_h, key=_horizon_order):
        done = [p for p in by_h[value] if p.has_result]
        runs, lengths, levels = [], [], {}
        for p in done:
            dose, t = run_dose(p), measured_horizon(p)
            if dose is None or t is None:
                missing += 1
                continue
            lengths.append(t)
            if dose > 0:
                runs.append((dose, p.collapse.get("collapsed") is True, p.overrides.get(SEED_KEY)))
                levels[_dose_level(p)] = levels.get(_dose_level(p), 0) + 1
        threshold = fit_threshold(runs)
        per_dose = [levels[k] for k in sorted(levels, key=str)]
        horizons.append({"horizon_value": value, "horizon": sum(lengths) / len(lengths) if lengths else None,
                         "runs_total": len(by_h[value]), "runs_with_result": len(done), **threshold,
                         "runs_per_dose": per_dose, "single_run_per_dose": bool(per_dose) and max(per_dose) == 1,
                         **horizon_failures(done),
                         # not collapses in the fit, and not clean survivals: a bound over them says so
                         "dropped_unconfirmed": sum(p.dropped_unconfirmed for p in done)})
    law = fit_law(horizons)
    if missing:
        law["note"] += f"; {missing} run(s) without a realised {METRIC} or {HORIZON_METRIC} are left out"
    return {"curve": label, "correction": correction, **law, "horizons": horizons, "shape": compare_shapes(horizons)}


def _dose_level(point: PointData) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The dose level a run belongs to: its sweep and its overrides but the seed (the seeds of one level are its
    replicates; a horizon whose levels each hold one run has no seed scatter to bootstrap)."""
    return str(point.dir.parent.parent), tuple(sorted((str(k), str(v)) for k, v in point.overrides.items()
                                                      if k != SEED_KEY))


def fit_law(horizons: list[dict[str, Any]]) -> dict[str, Any]:
    """α of threshold ∝ T^(−α) over per-horizon threshold dicts (``horizon`` = measured T; the threshold fields of
    ``dose_response.fit_threshold``), with its interval, or bounds on α, or why neither (module docstring)."""
    out: dict[str, Any] = {"metric": METRIC, "alpha": None, "alpha_ci_low": None, "alpha_ci_high": None,
                           "log10_prefactor": None, "replicates": [], "horizon_range": None, "band_misses": []}
    usable = [h for h in horizons if _positive(h.get("horizon"))]
    if not usable:
        return {**out, "status": "insufficient",
                "note": f"no horizon has runs with a realised {METRIC} and {HORIZON_METRIC}: nothing to fit"}
    # the measured horizons: a horizon whose runs give neither a threshold nor a bound (too few runs) measured
    # nothing, so it does not stretch the range a verdict counts as measured
    said = [h for h in usable if h.get("status") in ("fitted", "above_range", "below_range")]
    ts = [h["horizon"] for h in said or usable]
    out["horizon_range"] = [min(ts), max(ts)]
    if len(usable) < 2:
        h = usable[0]
        found = (f"; its 50% threshold: k3 {h['threshold_50']:.2g}" + (f" [{h['ci_low']:.2g}, {h['ci_high']:.2g}]" if
                 _positive(h.get("ci_low")) and _positive(h.get("ci_high")) else "")
                 if h.get("status") == "fitted" and _positive(h.get("threshold_50")) else "")
        return {**out, "status": "single_horizon",
                "note": f"one horizon (T = {ts[0]:.1f}): a law in T needs at least two{found}"}
    fitted = [h for h in usable if h.get("status") == "fitted"]
    bounded = [h for h in usable if h.get("status") in ("above_range", "below_range")]
    if len(fitted) < 2:
        return {**out, **_alpha_bounds(fitted, bounded), "horizon_range": [min(ts), max(ts)]}
    xs = [math.log10(h["horizon"]) for h in fitted]
    ys = [math.log10(h["threshold_50"]) for h in fitted]
    slope, intercept = _line(xs, ys)
    out.update(alpha=-slope, log10_prefactor=intercept)
    sds = []
    for h in fitted:
        lo, hi = h.get("ci_low"), h.get("ci_high")
        sds.append((math.log10(hi) - math.log10(lo)) / 3.92 if _positive(lo) and _positive(hi) else None)
    open_ends = [h["horizon_value"] for h, sd in zip(fitted, sds) if sd is None]
    out["alpha_ci_method"] = ALPHA_CI_METHOD
    if not open_ends:
        reps = _residual_bootstrap(xs, ys, [sd or 0.0 for sd in sds])
        alphas = sorted(a for _, a in reps)
        out["alpha_ci_low"], out["alpha_ci_high"] = _percentile(alphas, 0.025), _percentile(alphas, 0.975)
        out["replicates"] = [[round(c, 6), round(a, 6)] for c, a in reps[:REPLICATES_KEPT]]
        out["band_misses"] = band_misses(fitted, reps)
    violated = [h["horizon_value"] for h in bounded if not _respects(h, intercept, slope)]
    note = (f"threshold ∝ T^(−{-slope:.2f})" + (f" [α in {out['alpha_ci_low']:.2f} .. {out['alpha_ci_high']:.2f}, "
                                               "a regression interval]" if not open_ends else
                                               f" (no interval: horizon(s) {open_ends} have an open threshold "
                                               "interval)")
            + f" over {len(fitted)} horizons with a fitted threshold (T = {min(ts):.0f} .. {max(ts):.0f})")
    out["alpha_leave_one_out"] = leave_one_out_alphas(fitted)
    if out["alpha_leave_one_out"]:
        loo = out["alpha_leave_one_out"]
        low_key, high_key = min(loo, key=loo.__getitem__), max(loo, key=loo.__getitem__)
        note += (f"; α without one horizon: {loo[low_key]:.2f} (without {HORIZON_KEY} = {low_key}) .. "
                 f"{loo[high_key]:.2f} (without {high_key})")
    if out.get("band_misses"):
        note += (f"; the law's 95% band misses the threshold of {len(out['band_misses'])} of {len(fitted)} "
                 f"({HORIZON_KEY} = {', '.join(map(str, out['band_misses']))})")
    single = [h["horizon_value"] for h in fitted if h.get("single_run_per_dose")]
    if single:
        out["single_run_horizons"] = single
        note += f"; fitted from one run per dose: {HORIZON_KEY} = {', '.join(map(str, single))}"
    if bounded:
        note += (f"; {len(bounded)} horizon(s) give only a bound and are not in the fit"
                 + (f" (the line violates the bound at {violated})" if violated else " (the line respects them)"))
    return {**out, "status": "fitted", "note": note, "bounds_violated": violated}


def _residual_bootstrap(xs: list[float], ys: list[float], sds: list[float]) -> list[tuple[float, float]]:
    """``BOOTSTRAP`` replicate lines (log10 A, α) of the law (``ALPHA_CI_METHOD``): a regression interval by
    bootstrap. Each replicate refits the line to its fitted values plus the residuals resampled with replacement
    (scaled by √(n/(n−2)): the line took two degrees of freedom) plus each horizon's own threshold noise (a normal
    whose 95% range is its interval). The residuals carry the horizons' scatter about the line into α's interval;
    on points that lie on the line it is their own intervals' alone. Deterministic (``BOOTSTRAP_SEED``)."""
    slope, intercept = _line(xs, ys)
    n = len(xs)
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    inflate = math.sqrt(n / (n - 2)) if n > 2 else 1.0  # two points: the line passes through both, no residual
    rng = random.Random(BOOTSTRAP_SEED)
    reps = []
    for _ in range(BOOTSTRAP):
        drawn = [intercept + slope * x + inflate * rng.choice(residuals) + rng.gauss(0.0, sd) for x, sd in zip(xs, sds)]
        s, c = _line(xs, drawn)
        reps.append((c, -s))
    return reps


def leave_one_out_alphas(fitted: list[dict[str, Any]]) -> dict[str, float]:
    """α refitted without each fitted horizon ({horizon value as text: α}; three fitted horizons or more): how much
    the law leans on any one of them."""
    if len(fitted) < 3:
        return {}
    out = {}
    for i, h in enumerate(fitted):
        rest = fitted[:i] + fitted[i + 1:]
        out[str(h["horizon_value"])] = -_line([math.log10(r["horizon"]) for r in rest],
                                              [math.log10(r["threshold_50"]) for r in rest])[0]
    return out


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (the lower neighbour, as every interval here)."""
    return values[int(q * (len(values) - 1))]


def law_band(replicates: list[Any], horizon: float) -> tuple[float, float] | None:
    """The law's 95% band at ``horizon``: the 2.5/97.5 percentiles of the replicate lines' thresholds there (None
    without replicates)."""
    lt = math.log10(horizon)
    values = sorted(10 ** (c - a * lt) for c, a in replicates or [])
    return (_percentile(values, 0.025), _percentile(values, 0.975)) if values else None


def band_misses(fitted: list[dict[str, Any]], replicates: list[Any]) -> list[Any]:
    """The horizon values of the fitted horizons whose threshold lies outside the law's 95% band at their T."""
    misses = []
    for h in fitted:
        band = law_band(replicates, h["horizon"])
        if band is not None and not band[0] <= h["threshold_50"] <= band[1]:
            misses.append(h["horizon_value"])
    return misses


def _alpha_bounds(fitted: list[dict[str, Any]], bounded: list[dict[str, Any]]) -> dict[str, Any]:
    """With fewer than two thresholds: bounds on α from pairs where one is a threshold or bound below and the other
    a threshold or bound above. thr(T2)/thr(T1) = (T2/T1)^(−α) for T2 > T1."""
    lower, upper = [], []
    items = [(h["horizon"], h) for h in fitted + bounded]
    for t1, a in items:
        for t2, b in items:
            if t2 <= t1:
                continue
            span = math.log10(t2 / t1)
            a_hi = _value(a, "upper")  # thr(T1) <= a_hi
            a_lo = _value(a, "lower")  # thr(T1) >= a_lo
            b_hi, b_lo = _value(b, "upper"), _value(b, "lower")
            if a_lo is not None and b_hi is not None:  # α = log(thr1/thr2)/span >= log(a_lo/b_hi)/span
                lower.append(math.log10(a_lo / b_hi) / span)
            if a_hi is not None and b_lo is not None:
                upper.append(math.log10(a_hi / b_lo) / span)
    lo, hi = (max(lower) if lower else None), (min(upper) if upper else None)
    parts = [f"{len(fitted)} horizon(s) with a fitted threshold, {len(bounded)} with only a bound: no exponent "
             "can be fitted"]
    if lo is not None or hi is not None:
        parts.append("the measurements bound it: " + " and ".join(
            x for x in (f"α ≥ {lo:.2f}" if lo is not None else "", f"α ≤ {hi:.2f}" if hi is not None else "") if x))
    else:
        parts.append("and they bound it on neither side")
    return {"status": "bounds_only", "alpha_lower_bound": lo, "alpha_upper_bound": hi, "note": "; ".join(parts)}


def _value(h: dict[str, Any], side: str) -> float | None:
    """A bound on a horizon's threshold: a fitted threshold bounds it by its interval's ends (an open end: none),
    never by its point value, which between two tested doses the data cannot place."""
    if h.get("status") == "fitted":
        return h.get("ci_low") if side == "lower" else h.get("ci_high")
    if side == "lower" and h.get("status") == "above_range":
        return h.get("lower_bound")
    if side == "upper" and h.get("status") == "below_range":
        return h.get("upper_bound")
    return None


def _respects(h: dict[str, Any], intercept: float, slope: float) -> bool:
    return _respects_value(h, 10 ** (intercept + slope * math.log10(h["horizon"])))


def _respects_value(h: dict[str, Any], predicted: float) -> bool:
    """Does a threshold ``predicted`` at a bounded horizon agree with its bound (above a lower bound, below an
    upper one)?"""
    if h["status"] == "above_range":
        return predicted >= h["lower_bound"]
    return predicted <= h["upper_bound"]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


# ----------------------------------------------------------------------------- the law's shape

GOLDEN = (math.sqrt(5) - 1) / 2
SATURATING_GRID = 100  # floor values tried before the golden-section refinement


def compare_shapes(horizons: list[dict[str, Any]]) -> dict[str, Any]:
    """Is the threshold still falling as a power of T, or levelling off? Over the horizons with a fitted threshold,
    fit both in log10 by least squares -- the power law log10 A − α·log10 T and the saturating floor F + B/T
    (F, B >= 0; F = 0 is the power law with α = 1) -- and compare them by AIC (n·ln(RSS/n) + 2k, k = 2 each) and
    by leave-one-out error (each horizon predicted from a fit to the others). ΔAIC = AIC(power) − AIC(saturating):
    above 2 the data prefer the floor, below −2 the power law, between them neither. The horizons with only a bound
    (no collapse up to X, or collapse from the smallest dose) stay out of both fits and test them: each shape lists
    the bounds its curve violates (``bounds_violated``, horizon values), and the note names them."""
    pts = sorted((h["horizon"], h["threshold_50"]) for h in horizons if h.get("status") == "fitted"
                 and _positive(h.get("horizon")) and _positive(h.get("threshold_50")))
    n = len(pts)
    if n < SHAPE_MIN_HORIZONS:
        return {"status": "too_few", "horizons": n,
                "note": f"{n} horizon(s) with a fitted threshold: comparing a power law with a saturating threshold "
                        f"(two parameters each) needs at least {SHAPE_MIN_HORIZONS}"}
    ts, ys = [t for t, _ in pts], [math.log10(v) for _, v in pts]
    bounded = [h for h in horizons if _positive(h.get("horizon")) and (
        (h.get("status") == "above_range" and _positive(h.get("lower_bound")))
        or (h.get("status") == "below_range" and _positive(h.get("upper_bound"))))]
    fits = {"power": _fit_power, "saturating": _fit_saturating}
    out: dict[str, Any] = {"status": "compared", "horizons": n, "horizon_range": [ts[0], ts[-1]]}
    for name, fit in fits.items():
        params, predict = fit(ts, ys)
        rss = sum((predict(t) - y) ** 2 for t, y in zip(ts, ys))
        loo = []
        for i in range(n):
            _, predict_i = fit(ts[:i] + ts[i + 1:], ys[:i] + ys[i + 1:])
            loo.append(predict_i(ts[i]) - ys[i])
        out[name] = {**params, "rss": rss, "aic": n * math.log(max(rss, 1e-12) / n) + 2 * 2,
                     "loo_rmse": math.sqrt(sum(e * e for e in loo) / n)}
        out[name]["bounds_violated"] = [h["horizon_value"] for h in bounded if not _respects_value(
            h, 10 ** predict(h["horizon"]))]
    delta = out["power"]["aic"] - out["saturating"]["aic"]
    out["delta_aic"] = delta
    out["preferred"] = "saturating" if delta > 2 else "power" if delta < -2 else None
    p, f = out["power"], out["saturating"]
    verdict = {"saturating": "the data prefer the saturating shape", "power": "the data prefer the power law",
               None: "the two shapes cannot be told apart (|ΔAIC| < 2)"}[out["preferred"]]
    out["note"] = (f"shape over {n} fitted horizons (T = {ts[0]:.0f} .. {ts[-1]:.0f}): power law α = {p['alpha']:.2f}, "
                   f"RSS {p['rss']:.2g} dex², leave-one-out RMSE {p['loo_rmse']:.2g} dex; saturating "
                   f"{f['floor']:.2g} + {f['scale']:.2g}/T, RSS {f['rss']:.2g} dex², leave-one-out RMSE "
                   f"{f['loo_rmse']:.2g} dex; ΔAIC (power − saturating) = {delta:+.2f}: {verdict}"
                   + (f" ({n} points for 2 parameters each: a weak test)" if n <= SHAPE_MIN_HORIZONS else "")
                   + _bounds_against_shapes(bounded, out))
    return out


def _bounds_against_shapes(bounded: list[dict[str, Any]], shapes: dict[str, Any]) -> str:
    """One clause per bound: which shapes it rules out (their curve crosses it), or that both respect it."""
    clauses = []
    for h in bounded:
        side = (f"above k3 {h['lower_bound']:.2g}" if h["status"] == "above_range"
                else f"below k3 {h['upper_bound']:.2g}")
        against = [name for name in ("power", "saturating") if h["horizon_value"] in shapes[name]["bounds_violated"]]
        verdict = ("both shapes respect it" if not against else "both shapes violate it" if len(against) == 2
                   else f"it rules out the {'power law' if against == ['power'] else 'saturating shape'}")
        clauses.append(f"the bound at T {h['horizon']:.0f} (threshold {side}): {verdict}")
    return ("; " + "; ".join(clauses)) if clauses else ""


def _fit_power(ts: list[float], ys: list[float]) -> tuple[dict[str, float], Any]:
    slope, intercept = _line([math.log10(t) for t in ts], ys)
    return {"alpha": -slope, "log10_prefactor": intercept}, lambda t: intercept + slope * math.log10(t)


def _fit_saturating(ts: list[float], ys: list[float]) -> tuple[dict[str, float], Any]:
    """F + B/T (F, B >= 0) by least squares in log10: for each floor F the best B (golden section in log10 B), over
    F a grid on [0, max threshold] refined by golden section. Deterministic."""
    top = max(10 ** y for y in ys)
    u_lo = math.log10(min(10 ** y * t for t, y in zip(ts, ys))) - 4  # B/T spans the thresholds with room
    u_hi = math.log10(max(10 ** y * t for t, y in zip(ts, ys))) + 4

    def rss(floor: float, u: float) -> float:
        return sum((math.log10(floor + 10 ** u / t) - y) ** 2 for t, y in zip(ts, ys))

    def best_u(floor: float) -> float:
        return _golden(lambda u: rss(floor, u), u_lo, u_hi)

    def cost(floor: float) -> float:
        return rss(floor, best_u(floor))

    grid = [top * k / SATURATING_GRID for k in range(SATURATING_GRID + 1)]
    costs = [cost(f) for f in grid]
    k = min(range(len(grid)), key=costs.__getitem__)
    floor = _golden(cost, grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)])
    if cost(floor) > costs[k]:
        floor = grid[k]
    u = best_u(floor)
    scale = 10 ** u
    return {"floor": floor, "scale": scale}, lambda t: math.log10(floor + scale / t)


def _golden(f: Any, lo: float, hi: float, steps: int = 60) -> float:
    """The minimiser of a unimodal ``f`` on [lo, hi] by golden-section search."""
    a, b = lo, hi
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


# ----------------------------------------------------------------------------- report output


def write_scaling(data: SweepData, out: Path) -> tuple[list[Path], str]:
    """``scaling.json`` and ``scaling.png`` in ``out`` (the report directory) and the lines the report prints (per
    curve: its law and its shape).

    A sweep without a horizon axis (most sweeps) writes no file: the line says why there is no law."""
    from ..records.runlog import json_safe

    result = scaling(data)
    meter_path = data.path / "meter.json"
    if meter_path.is_file() and result["status"] != "no_horizon":
        result["meter"] = against_meter(result, json.loads(meter_path.read_text()))
    if result["status"] == "no_horizon":
        return [], f"scaling: {result['note']}"
    line = "\n".join(f"scaling ({c['curve']}): {c['status']}: {c['note']}; {c['shape']['note']}"
                     + "".join(f"\n  failure: {f}" for f in failure_lines(c)) for c in result["curves"])
    path = out / "scaling.json"
    path.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    files = [path]
    try:
        files.append(plot_scaling(result, out / "scaling.png", data.name))
    except ImportError:
        pass
    return files, line


def against_meter(result: dict[str, Any], meter: dict[str, Any]) -> dict[str, Any]:
    """The meter's bias ratio at each horizon's threshold: does collapse happen at a common bias ratio?

    ``meter``: a ``vexact meter`` result whose cells' ``horizon`` is the sweep's ``task.max_len`` (copy meter.json
    into the sweep directory). At each horizon with a fitted threshold, the bias ratio is interpolated in log-log
    over that horizon's cells (every source) by realised k3; outside their k3 range it is not extrapolated."""
    rows = []
    for h in result["horizons"]:
        cells = sorted((c["k3_kl"], c["bias_ratio"]) for c in meter.get("cells", [])
                       if c.get("horizon") == h["horizon_value"] and _positive(c.get("k3_kl"))
                       and _positive(c.get("bias_ratio")))
        ratio = None
        if h.get("status") == "fitted" and len(cells) >= 2 and cells[0][0] <= h["threshold_50"] <= cells[-1][0]:
            x = math.log10(h["threshold_50"])
            for (k0, b0), (k1, b1) in zip(cells, cells[1:]):
                if k0 <= h["threshold_50"] <= k1:
                    w = 0.0 if k1 == k0 else (x - math.log10(k0)) / (math.log10(k1) - math.log10(k0))
                    ratio = 10 ** (math.log10(b0) + w * (math.log10(b1) - math.log10(b0)))
                    break
        rows.append({"horizon_value": h["horizon_value"], "horizon": h.get("horizon"),
                     "threshold_50": h.get("threshold_50"), "bias_ratio_at_threshold": ratio})
    found = [r["bias_ratio_at_threshold"] for r in rows if r["bias_ratio_at_threshold"] is not None]
    if len(found) < 2:
        note = (f"{len(found)} horizon(s) have both a fitted threshold and meter cells bracketing it: no comparison "
                "across horizons")
    else:
        note = (f"bias ratio at the threshold: {', '.join(f'{v:.2g}' for v in found)} across {len(found)} horizons "
                f"(spread {max(found) / min(found):.2g}x)")
    return {"horizons": rows, "note": note}


def plot_scaling(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Threshold (with interval) against T, log-log, one colour per curve; bounds as arrows; the fitted law with its
    95% band (the legend names the points the band misses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("tab10")
    any_point = False
    ys: list[float] = []
    for i, curve in enumerate(result["curves"]):
        colour = cmap(i % 10)
        for h in curve["horizons"]:
            if not _positive(h.get("horizon")):
                continue
            if h["status"] == "fitted":
                lo, hi = h.get("ci_low") or h["threshold_50"], h.get("ci_high") or h["threshold_50"]
                ax.errorbar([h["horizon"]], [h["threshold_50"]], yerr=[[h["threshold_50"] - lo],
                            [hi - h["threshold_50"]]], color=colour, marker="o", capsize=3)
                any_point = True
                ys += [lo, hi]
            elif h["status"] in ("above_range", "below_range"):
                up = h["status"] == "above_range"
                y = h["lower_bound"] if up else h["upper_bound"]
                ax.scatter([h["horizon"]], [y], color=colour, marker="^" if up else "v", s=70)
                any_point = True
                ys.append(y)
        label = f"{curve['curve']}: {curve['status']}"
        if curve["status"] == "fitted" and curve["horizon_range"]:
            t0, t1 = curve["horizon_range"]
            xs = [t0 * (t1 / t0) ** (k / 50) for k in range(51)]
            ax.plot(xs, [10 ** (curve["log10_prefactor"] - curve["alpha"] * math.log10(x)) for x in xs],
                    color=colour, lw=1.2)
            bands = [law_band(curve.get("replicates") or [], x) for x in xs]
            if all(b is not None for b in bands):  # the law's 95% band, drawn with the points it should hold
                ax.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands], color=colour, alpha=0.12, lw=0)
            label += f", α = {curve['alpha']:.2f}"
            if curve.get("band_misses"):
                label += f" (band misses {HORIZON_KEY} = {', '.join(map(str, curve['band_misses']))})"
        ax.plot([], [], color=colour, label=label)
    if any_point:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(min(ys) / 5, max(ys) * 5)  # at least a decade: bounds alone would zoom into noise
    ax.set_xlabel("horizon T (mean response length, tokens)")
    ax.set_ylabel(f"50% collapse threshold ({METRIC})")
    ax.set_title((f"{title}\n" if title else "") + "collapse threshold vs horizon (▲ lower bound, ▼ upper bound)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the map


def load_map(path: str | Path | None = None, vocab: int | None = None) -> dict[str, Any]:
    """A map (a ``scaling.json``, or one made by ``build-map``); None = the map shipped with vexact for ``vocab``
    (``shipped_map_for``: the main map without one; a named file is read whatever ``vocab`` says). Its ``curves``
    come back each with its ``correction`` (``map_curves``). One clear error on a bad file."""
    path = Path(path) if path is not None else shipped_map_for(vocab)
    if not path.is_file():
        raise ValueError(f"map file not found: '{path}'")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"map file '{path}' is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"map file '{path}' is not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict) or "status" not in data or "horizon_range" not in data:
        raise ValueError(f"map file '{path}' is not a scaling.json (no 'status' / 'horizon_range'); make one with "
                         "vexact report on a sweep over task.max_len")
    data["curves"] = map_curves(data, f"map file '{path}'")
    data["origin"] = SHIPPED_MAPS.get(path, str(path))
    return data


def map_vocab(map_data: dict[str, Any]) -> int | None:
    """The vocabulary size of a map's testbed: the task's characters plus its ``task.distractors`` (the vocabulary
    tail, ``vexact.rl.vocab_tail``); None for a map without a testbed."""
    testbed = map_data.get("testbed")
    if not isinstance(testbed, dict):
        return None
    return tokenizer_for(int(testbed.get("task.distractors") or 0)).vocab_size


def shipped_map_for(vocab: int | None, maps: Mapping[Path, str] | None = None) -> Path:
    """The shipped map (``SHIPPED_MAPS``, or ``maps``) whose testbed vocabulary is nearest ``vocab`` on a log scale;
    None: the main map. The main map's 22 characters and the tail map's 1,024 tokens meet at ~150, so every real
    LLM vocabulary (32k to 256k) gets the tail map: k3 over a vocabulary with a tail is not k3 over 22 tokens (the
    same flattening gives ~4x the k3 with the tail)."""
    candidates = [Path(p) for p in (maps or SHIPPED_MAPS)]
    if vocab is None:
        return candidates[0]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise ValueError(f"a vocabulary size must be an integer >= 2, got {vocab!r}")
    sizes = {path: map_vocab(load_map(path)) for path in candidates if path.is_file()}
    sizes = {path: size for path, size in sizes.items() if size}
    if not sizes:
        return candidates[0]
    return min(sizes, key=lambda path: (abs(math.log(sizes[path] / vocab)), candidates.index(path)))


def map_curves(map_data: dict[str, Any] | None, where: str = "the map") -> list[dict[str, Any]]:
    """The map's curves, each with its ``correction`` and ``source`` (the injected mismatch its runs had:
    ``source_name``; a curve saved without one takes it from its testbed, else None). A file from before corrections
    were recorded is one curve, its top level: ``bypass`` (``recompute`` when its label says
    ``algorithm.old_logprobs=recompute``). Two curves for one (correction, source) are an error: a map answers with
    one curve per correction and source."""
    if not map_data:
        return []
    curves = map_data.get("curves")
    if isinstance(curves, list) and curves and all(isinstance(c, dict) and "correction" in c for c in curves):
        seen: dict[tuple[str, Any, Any], str] = {}
        out = []
        for c in curves:
            c = c if "source" in c else {**c, "source": _curve_source(c)}
            c = c if "policy_lag" in c else {**c, "policy_lag": 0}  # a curve from before the lag axis: on-policy
            key = (c["correction"], c["source"], c["policy_lag"])
            if key in seen:
                raise ValueError(f"{where} has two curves for correction {key[0]!r} and source {key[1]!r} at policy "
                                 f"lag {key[2]} ({seen[key]!r} and {c.get('curve')!r}): a map holds one curve per "
                                 "correction, source and policy lag")
            seen[key] = str(c.get("curve"))
            out.append(c)
        return out
    label = str(map_data.get("curve", ""))
    legacy = RECOMPUTE if "algorithm.old_logprobs=recompute" in label else BYPASS
    legacy_curve = {k: v for k, v in map_data.items() if k not in ("curves", "origin")}
    return [{**legacy_curve, "correction": legacy, "source": _curve_source(legacy_curve),
             "policy_lag": legacy_curve.get("policy_lag", 0)}]


def _curve_source(curve: dict[str, Any]) -> str | None:
    """A curve's source: its own ``source``, else the one its ``testbed`` (flat config) injected, else None."""
    if curve.get("source") is not None:
        return str(curve["source"])
    testbed = curve.get("testbed")
    return source_name(testbed) if isinstance(testbed, dict) and "inject.mode" in testbed else None


def default_source(map_data: dict[str, Any]) -> str | None:
    """The source a placement uses when the user names none: the map's primary curve's (its top level: the
    ``bypass`` curve of the map's main source)."""
    curves = map_curves(map_data)
    top = _curve_source(map_data) if "testbed" in map_data or "source" in map_data else None
    return top if top is not None or not curves else curves[0]["source"]


def map_sources(map_data: dict[str, Any]) -> list[str]:
    """The sources the map has curves for, the default first."""
    first = default_source(map_data)
    rest = [c["source"] for c in map_curves(map_data) if c["source"] is not None and c["source"] != first]
    return [s for s in dict.fromkeys([first, *rest]) if s is not None]


def curve_for(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
              ) -> dict[str, Any]:
    """The map's curve for ``correction`` and ``source`` (None: ``default_source``) at ``policy_lag`` (the user's
    ``rollout.policy_lag``: 0 on-policy); a correction, source or lag it has no curve for is one ValueError naming it
    and the curves there are (never another correction's, source's or lag's curve in its place)."""
    curve = find_curve(map_data, correction, source, policy_lag)  # a lag or source it has none at: its error
    if curve is not None:
        return curve
    curves = _curves_at_lag(map_data, policy_lag)
    where = _map_where(map_data)
    wanted = default_source(map_data) if source is None else source
    names = ", ".join(c["correction"] for c in curves if c["source"] == wanted) or "none"
    elsewhere = [c["source"] for c in curves if c["correction"] == correction and c["source"] != wanted]
    hint = (f" (source {wanted!r}; the map has {correction} for source(s) {', '.join(map(repr, elsewhere))}: name "
            "one with --source / source=)") if elsewhere else ""
    raise ValueError(f"{where} has no curve for correction {correction!r}: it has {names}{hint}; another correction's "
                     "threshold would not answer for yours")


def find_curve(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
               ) -> dict[str, Any] | None:
    """The map's curve for ``correction`` and ``source`` (None: ``default_source``) at ``policy_lag``, or None when
    it has none for that correction; a source or a lag the map has no curves for at all is one ValueError naming what
    it has (a bad input, not a gap)."""
    curves = _curves_at_lag(map_data, policy_lag)
    wanted = default_source(map_data) if source is None else source
    if source is not None and not any(c["source"] == wanted for c in curves):
        raise ValueError(f"{_map_where(map_data)} has no curves for source {source!r}: its sources are "
                         f"{', '.join(map(repr, map_sources(map_data))) or 'none'}")
    return next((c for c in curves if c["correction"] == correction and c["source"] == wanted), None)


def _curves_at_lag(map_data: dict[str, Any], policy_lag: int) -> list[dict[str, Any]]:
    """The map's curves measured at ``policy_lag``; a lag it has no curve at is one ValueError naming its lags."""
    if isinstance(policy_lag, bool) or not isinstance(policy_lag, int) or policy_lag < 0:
        raise ValueError(f"a policy lag is a number of optimizer steps, an integer >= 0, got {policy_lag!r}")
    curves = map_curves(map_data)
    lags = sorted({c["policy_lag"] for c in curves})
    if policy_lag not in lags:
        raise ValueError(f"{_map_where(map_data)} has no curve at policy lag {policy_lag} (its curves are at lag "
                         f"{', '.join(map(str, lags)) or 'none'}): another lag's threshold would not answer for "
                         f"rollouts {policy_lag} optimizer step(s) behind the trained policy")
    return [c for c in curves if c["policy_lag"] == policy_lag]


def _map_where(map_data: dict[str, Any]) -> str:
    origin = str(map_data.get("origin", "the map"))
    return origin if origin in (*SHIPPED_MAPS.values(), "the map") else f"the map '{origin}'"


def no_curve_sentence(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
                      ) -> str:
    """One sentence: the map has no curve for this correction (and source, at this lag), so no verdict; never
    another correction's or another source's curve in its place."""
    wanted = default_source(map_data) if source is None else source
    there = [c["correction"] for c in _curves_at_lag(map_data, policy_lag) if c["source"] == wanted]
    lag = f" at policy lag {policy_lag}" if policy_lag else ""
    return (f"no verdict: {_map_where(map_data)} has no curve for your correction ({correction_words(correction)}) "
            f"on source {wanted}{lag} (its curves there: {', '.join(there) or 'none'}), "
            "and another correction's threshold would not answer for yours")


def _no_curve_placement(map_data: dict[str, Any], k3: float, horizon: float, name: str, source: str | None,
                        assumed: bool, policy_lag: int) -> dict[str, Any]:
    return {"horizon": float(horizon), "k3": float(k3), "threshold_50": None, "ci_low": None, "ci_high": None,
            "ratio": None, "verdict": no_curve_sentence(map_data, name, source, policy_lag),
            "extrapolation_factor": 1.0, "correction": name,
            "source": default_source(map_data) if source is None else source, "vocab": map_vocab(map_data),
            "range_low": None, "range_high": None, "policy_lag": policy_lag, "correction_assumed": assumed,
            "bound_assumption": None, "no_curve": True}


def saturating_at(shape: dict[str, Any], horizon: float) -> float | None:
    """The saturating shape's threshold F + B/T at ``horizon`` (None: the curve's shapes were not compared)."""
    fit = shape.get("saturating") if shape.get("status") == "compared" else None
    if not isinstance(fit, dict) or not _number(fit.get("floor")) or not _number(fit.get("scale")):
        return None
    value = fit["floor"] + fit["scale"] / horizon
    return value if value > 0 else None


def choose_correction(map_data: dict[str, Any], spec: Any, source: str | None = None, policy_lag: int = 0
                      ) -> str | None:
    """``resolve_correction(spec)`` checked against the map: a known name (or config), a source the map has (None:
    the map's default) and a policy lag it has curves at, for callers that check once before placing many points. A
    correction the map has no curve for is no error: its verdict is one sentence saying so (``no_curve_sentence``)."""
    name = resolve_correction(spec, map_data)
    find_curve(map_data, DEFAULT_CORRECTION if name is None else name, source, policy_lag)
    return name


def place_on_map(map_data: dict[str, Any], k3: float, horizon: float, correction: str | None = None,
                 source: str | None = None, policy_lag: int = 0) -> dict[str, Any]:
    """The curve of ``correction`` (None: ``bypass``, assumed and said so in the verdict) and ``source`` (None: the
    map's default source, ``default_source``) at ``horizon``, as the ``MAP_KEYS``: the law's threshold (with its
    interval), ``ratio`` = k3 / threshold, a ``verdict`` in words, ``extrapolation_factor`` (how many times outside
    the curve's measured horizons T lies; 1.0 inside them), ``correction`` and ``source``; on a curve without a law,
    the verdict says what its threshold at its one horizon or its bounds say. ``policy_lag``: the user's lag; the
    curve measured at it, or one ValueError saying the map has none (``curve_for``)."""
    placed = placement(map_data, k3, horizon, correction, source, policy_lag)
    return {k: placed[k] for k in MAP_KEYS}


def placement(map_data: dict[str, Any], k3: float, horizon: float, correction: str | None,
              source: str | None = None, policy_lag: int = 0) -> dict[str, Any]:
    """``place_on_map``'s keys and what the printed lines add: ``correction_assumed``, ``bound_assumption`` (the
    assumption a verdict from a measured bound rests on, or None) and ``outside_every_curve`` (the sentence when T is
    outside every curve's measured horizons)."""
    if not _number(k3) or k3 < 0:
        raise ValueError(f"k3 must be a finite number >= 0, got {k3!r}")
    if not _positive(horizon):
        raise ValueError(f"the horizon (mean response length) must be a positive number, got {horizon!r}: the dump "
                         "has no response lengths to place on the map")
    name = resolve_correction(correction, map_data)
    assumed = name is None
    name = DEFAULT_CORRECTION if assumed else name
    curve = find_curve(map_data, name, source, policy_lag)
    if curve is None:
        return _no_curve_placement(map_data, k3, horizon, name, source, assumed, policy_lag)
    t_range = curve.get("horizon_range")
    if not (isinstance(t_range, list) and len(t_range) == 2 and all(_positive(t) for t in t_range)):
        raise ValueError(f"the map's {name} curve has no measured horizons (horizon_range): it cannot place a horizon")
    t0, t1 = t_range
    factor = horizon / t1 if horizon > t1 else t0 / horizon if horizon < t0 else 1.0
    out: dict[str, Any] = {"horizon": float(horizon), "k3": float(k3), "threshold_50": None, "ci_low": None,
                           "ci_high": None, "ratio": None, "verdict": None, "extrapolation_factor": factor,
                           "correction": name, "source": curve["source"], "vocab": map_vocab(map_data),
                           "range_low": None, "range_high": None, "policy_lag": curve["policy_lag"],
                           "correction_assumed": assumed,
                           "bound_assumption": None}
    if curve.get("status") == "fitted":
        thr = 10 ** (curve["log10_prefactor"] - curve["alpha"] * math.log10(horizon))
        band = law_band(curve.get("replicates") or [], horizon)
        lo, hi = band if band is not None else (None, None)
        out.update(threshold_50=thr, ci_low=lo, ci_high=hi, ratio=k3 / thr)
        low, high = lo or thr, hi or thr
        shape = None
        if factor > 1:  # beyond the measured horizons: the range both shapes and the law's interval allow
            shape = saturating_at(curve.get("shape") or {}, horizon)
            if shape is not None:
                low, high = min(low, shape), max(high, shape)
            out.update(range_low=low, range_high=high)
        if math.log10(high / low) > WIDEST_INTERVAL_DECADES:
            what = ("the law's 95% interval" if shape is None else
                    "the range the law's interval and the saturating shape allow")
            verdict = (f"no verdict: {what} at this T spans k3 {low:.2g} .. {high:.2g} "
                       f"({math.log10(high / low):.0f} decades), so the {name} curve's horizons do not pin the "
                       "threshold here")
        elif k3 < low / 10:
            verdict = "far below the measured collapse range"
        elif k3 < high:
            verdict = "near the measured collapse range"
        else:
            verdict = "above the measured collapse range"
        measured = _measured_over_law(curve, name, k3, horizon, thr, verdict)
        if measured is not None:
            verdict, out["bound_assumption"] = measured
        if factor > 1:
            verdict += (f"; extrapolated: T = {_t(horizon)} lies {factor:.3g}x outside the {name} curve's measured "
                        f"horizons (T = {_t(t0)} .. {_t(t1)}), where the threshold may lie anywhere in k3 "
                        f"{low:.2g} .. {high:.2g} (the power law's 95% interval"
                        + (f" [{lo:.2g}, {hi:.2g}]" if lo is not None else " (none)")
                        + (f" and the saturating shape's {shape:.2g}" if shape is not None else "") + ")")
        single = curve.get("single_run_horizons") or []
        if single:
            verdict += (f"; the law rests on horizon(s) fitted from one run per dose ({HORIZON_KEY} = "
                        f"{', '.join(map(str, single))})")
    else:
        verdict = _bound_verdict(curve, name, k3, horizon, (t0, t1))
        if verdict.startswith("below every level tested"):
            out["bound_assumption"] = BOUND_ASSUMPTION
    if assumed:
        verdict += f"; correction assumed: {name} (none given: name the one you run)"
    out["verdict"] = verdict + f"; curve: {correction_words(name)}"
    ranges = [(c["correction"], c.get("horizon_range")) for c in map_curves(map_data) if c["source"] == curve["source"]]
    ranges = [(c, r) for c, r in ranges if isinstance(r, list) and len(r) == 2 and all(_positive(t) for t in r)]
    if ranges and all(not r[0] <= horizon <= r[1] for _, r in ranges):
        out["outside_every_curve"] = (
            f"T = {_t(horizon)} lies outside every curve's measured horizons ("
            + "; ".join(f"{c}: T = {_t(r[0])} .. {_t(r[1])}" for c, r in ranges)
            + "): every threshold the map gives at this T is an extrapolation")
    return out


def _t(horizon: float) -> str:
    """A horizon in words: whole tokens from 20 on, one decimal below."""
    return f"{horizon:.0f}" if horizon >= 20 else f"{horizon:.1f}"


def _measured_over_law(curve: dict[str, Any], name: str, k3: float, horizon: float, thr: float, verdict: str
                       ) -> tuple[str, str] | None:
    """Where a horizon with only a bound speaks for the user's T, the measurement wins over the law (which was not
    fitted to it, and may cross it): (the verdict, the assumption it rests on), or None to keep the law's verdict.

    Only a horizon within 1.5x of the user's T speaks (``SAME_HORIZON``): the threshold is not monotone in T.

    - Every run collapsed, from k3 D, at T_b: k3 >= D is above a measured collapse; k3 < D where the law's threshold
      lies above D: the law is wrong there, and the map can only say "below D, where runs collapsed".
    - Nothing collapsed up to k3 D at T_b: k3 <= D where the law says near or above is below every level tested
      there; k3 > D where the law's threshold lies below D is not placed (the law is wrong there, and
      nothing was measured above D)."""
    for h in curve.get("horizons") or []:
        t_b = h.get("horizon")
        if not _positive(t_b):
            continue
        at = f"T {_t(t_b)} ({name})"
        if not horizon / SAME_HORIZON <= t_b <= horizon * SAME_HORIZON:
            continue  # a bound speaks for its own horizon only: the threshold is not monotone in T
        if h.get("status") == "below_range" and _positive(h.get("upper_bound")):
            dose = h["upper_bound"]
            fact = f"every run collapsed from k3 {dose:.2g} at {at}" + _one_run(h)
            if k3 >= dose:
                return f"above the measured collapse range: {fact}", COLLAPSE_BOUND_ASSUMPTION
            if thr > dose:
                times = f" ({dose / k3:.3g}x)" if k3 > 0 else ""
                return (f"below k3 {dose:.2g}{times}, where runs collapsed: {fact}; the law's threshold at this T "
                        f"(k3 {thr:.2g}) lies above that measured collapse, so the map cannot say how far below the "
                        "threshold you are", COLLAPSE_BOUND_ASSUMPTION)
        if h.get("status") == "above_range" and not h.get("collapsed") and _positive(h.get("lower_bound")):
            dose = h["lower_bound"]
            fact = _no_collapse_fact(h, at)
            if k3 <= dose and not verdict.startswith("far below"):
                return (f"below every level tested: {fact}; the law's threshold at this T (k3 {thr:.2g}) lies below "
                        "that measured survival", BOUND_ASSUMPTION)
            if k3 > dose and thr < dose:
                return (f"not placed: your k3 is above the largest level tested without collapse ({fact}), and the "
                        f"law's threshold at this T (k3 {thr:.2g}) lies below that measured survival: the map does "
                        "not know where this collapses", BOUND_ASSUMPTION)
    return None


def _bound_verdict(curve: dict[str, Any], name: str, k3: float, horizon: float, t_range: tuple[float, float]
                   ) -> str:
    """A curve without a law: what its no-collapse bounds say. A bound measured within 1.5x of the user's T speaks
    for it (``BOUND_ASSUMPTION``); none is carried further, up or down (the threshold is not monotone in T)."""
    safe = [h for h in curve.get("horizons", []) if h.get("status") == "above_range" and not h.get("collapsed")
            and _positive(h.get("lower_bound")) and _positive(h.get("horizon"))]  # nothing collapsed up to the bound
    carried = [h for h in safe if horizon / SAME_HORIZON <= h["horizon"] <= horizon * SAME_HORIZON]
    if carried:
        best = max(carried, key=lambda h: h["lower_bound"])
        fact = _no_collapse_fact(best, f"T {_t(best['horizon'])} ({name})")
        if k3 < best["lower_bound"]:
            return f"below every level tested: {fact}; the curve has no threshold to compare with"
        return (f"not placed: your k3 is at or above the largest level tested without collapse ({fact}); the {name} "
                "curve does not say where this correction collapses")
    measured = [h for h in curve.get("horizons", []) if h.get("status") == "fitted" and _positive(h.get("horizon"))
                and _positive(h.get("threshold_50"))]
    if len(measured) == 1:  # one horizon with a threshold: an answer at that T only, no law to carry it
        h = measured[0]
        lo, hi = h.get("ci_low"), h.get("ci_high")
        fact = (f"50% collapse threshold k3 {h['threshold_50']:.2g}" + (f" [{lo:.2g}, {hi:.2g}]" if _positive(lo)
                and _positive(hi) else "") + f" measured at T {_t(h['horizon'])} only ({name})")
        if not h["horizon"] / SAME_HORIZON <= horizon <= h["horizon"] * SAME_HORIZON:
            if not safe:
                return (f"no verdict at this horizon: the {name} curve has one horizon ({fact}) and no law to carry "
                        f"it to T = {_t(horizon)}")
        else:
            low, high = (lo, hi) if _positive(lo) and _positive(hi) else (h["threshold_50"], h["threshold_50"])
            where = ("far below" if k3 < low / 10 else "near" if k3 < high else "above")
            return f"{where} the measured collapse range: {fact}"
    if safe:
        nearest = min(safe, key=lambda h: abs(math.log(h["horizon"] / horizon)))
        at = f"T {_t(nearest['horizon'])} ({name})"
        where = (f"lies {'beyond' if horizon > t_range[1] else 'below'} the {name} curve's measured horizons "
                 f"(T = {_t(t_range[0])} .. {_t(t_range[1])})" if not t_range[0] <= horizon <= t_range[1] else
                 f"is more than {SAME_HORIZON}x from every horizon of the {name} curve")
        return (f"no verdict at this horizon: T = {_t(horizon)} {where}: the nearest bound, "
                f"{_no_collapse_fact(nearest, at)}, is not carried to another T (the threshold is not monotone in T) "
                "and the curve has no law")
    return f"unknown: the {name} curve has no fitted law ({curve.get('status')}): {curve.get('note')}"


def map_lines(placed: dict[str, Any], map_data: dict[str, Any]) -> list[str]:
    """The placement as printed lines, assumptions included."""
    p = placed
    given = " (assumed: none given)" if p.get("correction_assumed") else ""
    lines = [f"map ({map_data.get('origin', 'map')}), correction {p['correction']}{given}: k3 = {p['k3']:.3g} at "
             f"T = {p['horizon']:.1f} tokens", f"  your correction: {correction_words(p['correction'])}"]
    if p.get("no_curve"):
        return [*lines, f"  verdict: {p['verdict']}"]
    curve = curve_for(map_data, p["correction"], p.get("source"), p.get("policy_lag", 0))
    if p["threshold_50"] is not None:
        ci = (f" [{p['ci_low']:.2g}, {p['ci_high']:.2g}]" if p["ci_low"] is not None else " [no interval]")
        alpha_ci = (f" [{curve['alpha_ci_low']:.2f}, {curve['alpha_ci_high']:.2f}]"
                    if _number(curve.get("alpha_ci_low")) and _number(curve.get("alpha_ci_high")) else "")
        lines.append(f"  the law's 50% collapse threshold at this T: k3 = {p['threshold_50']:.2g}{ci} "
                     f"(α = {curve['alpha']:.2f}{alpha_ci}); ratio k3 / threshold = {p['ratio']:.2g}")
        if p.get("range_low") is not None:
            lines.append(f"  beyond the measured horizons: the threshold may lie anywhere in k3 "
                         f"{p['range_low']:.2g} .. {p['range_high']:.2g} (the power law's interval and the "
                         "saturating shape)")
    lines.append(f"  verdict: {p['verdict']}")
    t0, t1 = curve["horizon_range"]
    lines.append(f"  extrapolation: T is {p['extrapolation_factor']:.3g}x outside the {p['correction']} curve's "
                 f"measured horizons (T = {t0:.0f} .. {t1:.0f})" if p["extrapolation_factor"] > 1 else
                 f"  T lies within the {p['correction']} curve's measured horizons (T = {t0:.0f} .. {t1:.0f})")
    if p.get("outside_every_curve"):
        lines.append(f"  outside the map: {p['outside_every_curve']}")
    bounds = bound_lines(curve)
    if bounds:
        lines.append(f"  the {p['correction']} curve's bounds (measured, not in its fit): " + "; ".join(bounds))
    assumptions = ASSUMPTIONS + ((p["bound_assumption"],) if p.get("bound_assumption") else ())
    lines.append("  assumptions: " + "; ".join(assumptions))
    what = (curve.get("provenance") or map_data.get("provenance") or {}).get("what")
    if what:
        lines.append(f"  the curve: {what}")
    others = [s for s in map_sources(map_data) if s != p.get("source")]
    if others:
        lines.append(f"  source: {p.get('source')} (the mismatch the curve's runs injected); the map's other sources "
                     f"(--source): {', '.join(others)}")
    return lines


def compare_map(summary: dict[str, Any], map_path: str | Path | dict[str, Any] | None, correction: Any = None,
                source: str | None = None, vocab: int | None = None, policy_lag: int = 0
                ) -> tuple[dict[str, Any], list[str]]:
    """``vexact compare --map [--correction] [--source] [--vocab]``: place a compare summary (its k3 and mean response
    length) on the curve of ``correction`` (a name or a config: ``resolve_correction``; None: bypass, assumed) and
    ``source`` (None: the map's default) of a map (a path, "default"/None for the shipped one, or a loaded map);
    ``vocab``, the user's vocabulary size, picks the shipped map for it (``shipped_map_for``: the tail map for any
    real vocabulary) when no map file is named. Returns the ``map`` JSON object (``MAP_KEYS`` exactly) and the lines
    to print."""
    map_data = map_path if isinstance(map_path, dict) else load_map(
        None if map_path in (None, "default", DEFAULT_MAP) else map_path, vocab)
    name = choose_correction(map_data, correction, source, policy_lag)
    sequences, tokens = summary.get("sequences") or 0, summary.get("tokens") or 0
    if not sequences or not tokens:
        raise ValueError("the dump has no response lengths (no tokens): nothing to place on the map")
    k3, horizon = summary["metrics"][K3_KL], tokens / sequences
    placed = placement(map_data, k3, horizon, name, source, policy_lag)
    lines = map_lines(placed, map_data) + vocab_lines(placed, map_data, vocab)
    if placed["verdict"].startswith("no verdict") and map_data.get("origin") == SHIPPED_MAPS[DEFAULT_TAIL_MAP]:
        lines += _main_map_reference(k3, horizon, name, placed["source"])
    return {k: placed[k] for k in MAP_KEYS}, lines


def vocab_lines(placed: dict[str, Any], map_data: dict[str, Any], vocab: int | None) -> list[str]:
    """What the verdict's vocabulary is: the map's testbed's, against the user's (``--vocab``) when given."""
    theirs = placed.get("vocab")
    if theirs is None:
        return []
    if vocab is None:
        return [f"  vocabulary: the map's testbed has {theirs:,} tokens; yours was not given (--vocab N picks the "
                "shipped map nearest it: the tail map for any real LLM vocabulary)"]
    return [f"  vocabulary: yours {vocab:,} tokens; the map's testbed {theirs:,} (the shipped map nearest yours on a "
            "log scale)" if map_data.get("origin") in SHIPPED_MAPS.values() else
            f"  vocabulary: yours {vocab:,} tokens; this map's testbed {theirs:,}"]


def _main_map_reference(k3: float, horizon: float, correction: str, source: str | None) -> list[str]:
    """The main map's verdict for the same point, printed (never returned as the verdict) when a shipped map with
    another vocabulary has none at this horizon."""
    main = load_map(DEFAULT_MAP)
    try:
        other = placement(main, k3, horizon, correction, source)
    except ValueError as err:
        return [f"  the main map (22 tokens) cannot place it either: {err}"]
    return [f"  for reference, the main map (its testbed's {other['vocab']} tokens, no tail): {other['verdict']}; a "
            "tail moves the k3 threshold (docs/results/vocab_tail.md), so this is no verdict for your vocabulary"]


# ----------------------------------------------------------------------------- assembling a map


RUN_KEYS = ("name", "output_dir", SEED_KEY, "inject.value")
"""Config keys that differ between the runs of one dose-response by design: the run's name and directory, its seed
and the injected magnitude."""
BOOKKEEPING_KEYS = ("threads", "warm_start.cache_dir", "logging.checkpoint_every", "logging.live",
                    "logging.backends", "logging.wandb_project", "logging.wandb_mode", *MEMORY_KEYS)
"""Config keys that say where a run writes, what it shows while running, how many threads it uses and whether it
recomputes activations to save memory; a run's bits do not depend on them (the last:
``test_activation_checkpointing_changes_no_bit``)."""
HORIZON_SETTINGS = (*horizon_overrides(1), "task.hold_length")
"""The keys that set a horizon of the horizon testbed (the scratchpad length, the room to write it, and whether the
reward holds that length: a free scratchpad shortens under RL, so the longest horizons hold it to keep T near L):
they differ between the horizons of one curve, and nowhere else."""


@dataclasses.dataclass
class _Run:
    """One point of a sweep directory given to build-map, with its resolved config (dotted keys)."""

    sweep: str
    point: PointData
    config: dict[str, Any]


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


def _default_config() -> dict[str, Any]:
    """The defaults of every run config key: what a config saved before a key existed ran with (tuples as lists, as
    a saved config.yaml holds them)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flat_config(dataclasses.asdict(RunConfig())).items()}


CurveKey = tuple[str, str, int]  # (correction, source, policy lag): one curve of a map


def parse_only(items: list[str] | None) -> dict[str, list[Any]]:
    """``KEY=VALUE[,VALUE...]`` items (build-map's ``--only``) as {config key: allowed values}, each value read as
    YAML (``1002``, ``true``, ``recompute``); a key that is no run config key is one error naming it."""
    defaults = _default_config()
    wanted: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--only {item!r}: expected KEY=VALUE[,VALUE...], e.g. --only task.distractors=1002")
        if key not in defaults:
            raise ValueError(f"--only {item!r}: {key!r} is not a run config key")
        wanted.setdefault(key, []).extend(parse_yaml(v.strip()) for v in values.split(","))
    return wanted


def _sweep_runs(path: Path, only: dict[str, list[Any]] | None = None, detector: dict[str, Any] | None = None
                ) -> tuple[dict[CurveKey, dict[Any, list[_Run]]], int]:
    """The finished points of one sweep directory as {(correction, source): {horizon value: runs}}, and how many runs
    with router replay were left out; a finished point without its config.yaml, or a sweep without finished runs, is
    one error naming it.

    A point's horizon value is its ``task.max_len`` from the sweep's grid or variant, else from its saved config (a
    sweep that does not vary the horizon gives a curve of one horizon). Runs with ``algorithm.router_replay`` are
    left out: replay removes the routing mismatch, so their realised k3 is another source's (the rest of the
    rollout's mismatch), not the swept one. ``only`` ({config key: values}, ``parse_only``) keeps the runs whose
    saved config holds one of the values at every key: one testbed out of a sweep that varies it (the tail sweep's
    two vocabularies). ``detector`` ({collapse setting: value}, e.g. patience and drop) judges every run again from
    its logged metrics with its own saved ``collapse`` settings so changed (``redetect``)."""
    data = read_sweep_results(path)
    variants = _variants(data)
    defaults = _default_config()
    out: dict[CurveKey, dict[Any, list[_Run]]] = {}
    replayed = 0
    for p in data.points:
        saved = p.dir / "config.yaml"
        if not p.has_result:
            continue  # not finished (never started, running or failed): no dose or outcome to fit
        try:
            loaded = parse_yaml(saved.read_text()) if saved.is_file() else None
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
            raise ValueError(f"'{saved}' cannot be read ({str(err).splitlines()[0]}): build-map compares the "
                             "configs of the runs it merges") from None
        if not isinstance(loaded, Mapping):
            raise ValueError(f"point '{p.name}' of sweep '{path}' has a result but no config.yaml (a mapping) in "
                             f"'{p.dir}': build-map compares the configs of the runs it merges")
        config = flat_config(loaded)
        if only and any(config.get(key, defaults.get(key)) not in values for key, values in only.items()):
            continue
        if config.get("algorithm.router_replay"):
            replayed += 1
            continue
        if detector:
            redetect(p, loaded, detector)
        value = horizon_value(p, variants)
        value = config.get(HORIZON_KEY) if value is None else value
        if value is None:
            continue
        key = (correction_from_config(loaded, str(saved)), source_name(config, defaults),
               int(config.get(POLICY_LAG_KEY) or 0))
        out.setdefault(key, {}).setdefault(value, []).append(_Run(str(path), p, config))
    if not out:
        kept = f" with {' and '.join(f'{k} in {v}' for k, v in only.items())}" if only else ""
        raise ValueError(f"sweep '{path}' has no finished runs{kept} with a horizon ({HORIZON_KEY}) outside router "
                         "replay: it has no points for a map")
    return out, replayed


def redetect(point: PointData, config: Mapping, settings: dict[str, Any]) -> None:
    """Judge a finished run again from its logged metrics: its saved ``collapse`` section with ``settings`` (say
    ``patience`` and ``drop``) changed; the run's collapse summary (its verdict, collapse step and dose) is replaced
    in memory, never on disk."""
    saved = config.get("collapse") if isinstance(config.get("collapse"), Mapping) else {}
    known = {f.name for f in dataclasses.fields(CollapseSection)}
    section = CollapseSection(**{k: v for k, v in {**saved, **settings}.items() if k in known})
    summary = point.summary or {}
    point.summary = {**summary, "collapse": detect_collapse(point.metrics, section, summary.get("reason"),
                                                            summary.get("stopped_at_step"))}


def _config_difference(a: dict[str, Any], b: dict[str, Any], exempt: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every non-exempt key where the two configs differ; a key one of them lacks
    (saved before it existed) counts as its default."""
    defaults = _default_config()
    missing = object()
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in exempt or any(key.startswith(e + ".") for e in exempt):
            continue
        va, vb = a.get(key, defaults.get(key, missing)), b.get(key, defaults.get(key, missing))
        if va != vb:
            diffs.append((key, "(absent)" if va is missing else va, "(absent)" if vb is missing else vb))
    return diffs


def _run_label(run: _Run) -> str:
    return f"'{run.sweep}' point '{run.point.name}'"


def _check_testbed(reference: _Run, run: _Run, exempt: tuple[str, ...], what: str) -> None:
    """One error naming the first key where ``run``'s config leaves ``reference``'s testbed (and how many more)."""
    diffs = _config_difference(reference.config, run.config, exempt)
    if diffs:
        key, a, b = diffs[0]
        more = (f" (and {len(diffs) - 1} more key(s): {', '.join(k for k, _, _ in diffs[1:4])})"
                if len(diffs) > 1 else "")
        raise ValueError(f"{what}: {_run_label(reference)} and {_run_label(run)} differ in {key} ({a!r} vs {b!r})"
                         f"{more}: their runs are not one testbed, so they cannot share one dose-response fit")


def _sweep_curve(key: CurveKey, by_h: dict[Any, list[_Run]]) -> dict[str, Any]:
    """One correction's curve from the runs of several sweeps: the runs of one horizon (task.max_len) merged into one
    dose-response fit when their configs agree apart from ``RUN_KEYS`` and ``BOOKKEEPING_KEYS``; the horizons of the
    curve agree apart from ``HORIZON_SETTINGS`` too."""
    correction, source, lag = key
    per_run = RUN_KEYS + BOOKKEEPING_KEYS
    curve_reference: tuple[Any, _Run] | None = None  # (its horizon value, the run)
    for value in sorted(by_h, key=_horizon_order):
        configured = by_h[value]
        for run in configured[1:]:
            _check_testbed(configured[0], run, per_run, f"correction {correction!r} at {HORIZON_KEY} = {value}")
        if configured and curve_reference is None:
            curve_reference = value, configured[0]
        elif configured and curve_reference is not None:
            _check_testbed(curve_reference[1], configured[0], per_run + HORIZON_SETTINGS,
                           f"correction {correction!r}, horizons {HORIZON_KEY} = {curve_reference[0]} and {value}")
    curve = _curve(_label(key), correction, {v: [r.point for r in runs] for v, runs in by_h.items()})
    curve["source"], curve["policy_lag"] = source, lag
    for h in curve["horizons"]:
        counts: dict[str, int] = {}
        for run in by_h[h["horizon_value"]]:
            counts[run.sweep] = counts.get(run.sweep, 0) + 1
        h["sweeps"] = counts
    curve["provenance"] = {"what": f"{RUNS_OF}{', '.join(sorted({r.sweep for rs in by_h.values() for r in rs}))} "
                                   f"({HORIZON_KEY} = {', '.join(str(v) for v in sorted(by_h, key=_horizon_order))})"}
    if curve_reference is not None:
        curve["testbed"] = {k: v for k, v in sorted(curve_reference[1].config.items())
                            if k not in per_run + HORIZON_SETTINGS and not any(k.startswith(e + ".") for e in per_run)}
    return curve


def _label(key: CurveKey) -> str:
    return f"correction={key[0]}, source={key[1]}" + (f", policy_lag={key[2]}" if key[2] else "")


def _no_collapse_fact(h: dict[str, Any], at: str) -> str:
    """"no collapse measured up to k3 X at ``at``", and how many of those runs dropped below half their peak too late
    for the detector to confirm it (they are not collapses, and not clean survivals either)."""
    dropped = h.get("dropped_unconfirmed") or 0
    return (f"no collapse measured up to k3 {h['lower_bound']:.2g} at {at}"
            + (f" ({dropped} of {h.get('runs')} runs dropped below half their peak, unconfirmed by the run's end)"
               if dropped else "") + _one_run(h))


def _one_run(h: dict[str, Any]) -> str:
    """" (one run per dose)" for a horizon whose dose levels hold one run each (no seed scatter behind it)."""
    return " (one run per dose)" if h.get("single_run_per_dose") else ""


def bound_lines(curve: dict[str, Any]) -> list[str]:
    """The curve's horizons that give only a bound, in words: "no collapse measured up to k3 X at T Y" where no run
    collapsed; the side of a 50% point the data could not place otherwise. Bounds never enter the law's fit."""
    lines = []
    for h in curve.get("horizons") or []:
        status, t = h.get("status"), h.get("horizon")
        at = f"T {_t(t)}" if _positive(t) else f"{HORIZON_KEY} = {h.get('horizon_value')}"
        if status == "above_range" and _positive(h.get("lower_bound")):
            if not h.get("collapsed"):
                lines.append(_no_collapse_fact(h, at))
            else:
                lines.append(f"threshold above k3 {h['lower_bound']:.2g} at {at} ({h['collapsed']} of "
                             f"{h.get('runs')} runs collapsed, the fitted 50% point lies above every dose tested)"
                             + _one_run(h))
        elif status == "below_range" and _positive(h.get("upper_bound")):
            lines.append(f"threshold below k3 {h['upper_bound']:.2g} at {at} (every run collapsed, from the "
                         f"smallest dose tested){_one_run(h)}")
    return lines


MERGED = "Merged, horizon by horizon: "
RUNS_OF = "the runs of "


def _what_parts(what: str) -> list[str]:
    """A curve's provenance sentence as its inputs' sentences: a merged one ("Merged, horizon by horizon: [a] + [b]",
    nested when a map was rebuilt from itself) flattened into [a, b, ...], anything else as itself."""
    if not (what.startswith(MERGED + "[") and what.endswith("]")):
        return [what]
    inner, parts, depth, start = what[len(MERGED):], [], 0, 0
    for i, char in enumerate(inner):  # split on " + " between top-level brackets
        depth += (char == "[") - (char == "]")
        if depth == 0 and char == "]":
            parts.extend(_what_parts(inner[start + 1:i]))
            start = i + 4  # past "] + ["'s "] + "
    return parts


def _runs_of(part: str) -> list[str]:
    """The sweep directories a "the runs of A, B (task.max_len = ...)" sentence names (none for other sentences)."""
    if not part.startswith(RUNS_OF) or " (" not in part:
        return []
    return [d.strip() for d in part[len(RUNS_OF):part.index(" (")].split(",")]


def _merge_sources(curve_key: CurveKey, file_curves: list[tuple[dict[str, Any], str]], swept: dict[str, Any] | None,
                   given_dirs: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One (correction, source)'s curve from the curves of map files and (``swept``) the curve fitted to sweep
    directories' runs. A single input stays as it is; several are merged horizon by horizon (one horizon in two
    inputs is an error: a file holds thresholds, not runs) and the law refitted over all of them. A file's horizon
    that was fitted from sweep directories given again (``given_dirs``: its ``sweeps`` name only those) is superseded
    by their runs, which now hold more points: a map grows by rebuilding it from itself and the same directories."""
    name = curve_key[0]
    swept_values = {h.get("horizon_value") for h in (swept or {}).get("horizons") or []}
    file_curves = [({**curve, "horizons": [h for h in curve.get("horizons") or []
                                           if not (h.get("horizon_value") in swept_values and h.get("sweeps")
                                                   and set(h["sweeps"]) <= given_dirs)]}, where)
                   for curve, where in file_curves]
    sources: list[tuple[dict[str, Any], str]] = list(file_curves) + ([(swept, "sweep directories")] if swept else [])
    if len(sources) == 1:
        return dict(sources[0][0])
    seen: dict[Any, str] = {}
    horizons = []
    for curve, where in sources:
        for h in curve.get("horizons") or []:
            key = h.get("horizon_value")
            if key in seen:
                raise ValueError(f"two sources hold correction {name!r} at {HORIZON_KEY} = {key}: {seen[key]} and "
                                 f"{where}: a scaling.json holds thresholds, not runs, so only sweep directories "
                                 "can be merged at one horizon (give that sweep's directory instead of its file)")
            seen[key] = f"'{where}'" if where != "sweep directories" else "the sweep directories"
            horizons.append({**h, "sweeps": h.get("sweeps") or {where: h.get("runs_total")}})
    testbeds = [(c["testbed"], w) for c, w in sources if isinstance(c.get("testbed"), dict)]
    for (a, wa), (b, wb) in zip(testbeds, testbeds[1:]):
        diffs = _config_difference(a, b, HORIZON_SETTINGS)
        if diffs:
            key, va, vb = diffs[0]
            raise ValueError(f"correction {name!r}: the curves of '{wa}' and '{wb}' come from different testbeds: "
                             f"{key} is {va!r} vs {vb!r}")
    unchecked = [w for c, w in sources if not isinstance(c.get("testbed"), dict)]
    horizons.sort(key=lambda h: _horizon_order(h.get("horizon_value")))
    law = fit_law(horizons)
    parts: list[str] = []
    for c, w in sources:
        for part in _what_parts(str((c.get("provenance") or {}).get("what") or f"the curve of '{w}'")):
            superseded = w != "sweep directories" and set(_runs_of(part)) <= given_dirs and _runs_of(part)
            if not superseded and part not in parts:  # a directory given again speaks for itself, once
                parts.append(part)
    merged = {"curve": _label(curve_key), "correction": name, "source": curve_key[1], "policy_lag": curve_key[2],
              **law, "horizons": horizons,
              "shape": compare_shapes(horizons),
              "provenance": {"what": parts[0] if len(parts) == 1 else MERGED + " + ".join(f"[{p}]" for p in parts),
                             "testbed_unchecked": [w for w in unchecked if w != "sweep directories"]}}
    if testbeds:
        merged["testbed"] = testbeds[0][0]
    return merged


def build_map(paths: list[str | Path], made_by: str | None = None, only: dict[str, list[Any]] | None = None,
              detector: dict[str, Any] | None = None) -> dict[str, Any]:
    """One map from sweep directories (their runs) and ``scaling.json`` files or maps (their curves), one curve per
    correction, ordered as ``correction_names()``.

    The runs of one (correction, horizon) from several sweep directories are merged into one dose-response fit when
    their resolved configs agree apart from ``RUN_KEYS`` and ``BOOKKEEPING_KEYS`` (else one error naming the key
    that differs); a curve's horizons must agree apart from ``HORIZON_SETTINGS`` too. A file's curve joins them
    horizon by horizon (its configs are unknown: the curve's provenance lists it under ``testbed_unchecked``). α is
    refitted over every horizon of a correction; a horizon where nothing collapsed is a bound, kept in the curve,
    never a threshold in the fit. Each curve gets its shape comparison. The top level is the ``bypass`` curve (else
    the first) so that readers of the single-curve format read it; ``provenance`` names the command and inputs.
    ``only`` (``parse_only``) keeps the runs of the sweep directories whose saved config holds those values;
    ``detector`` judges their runs again under other collapse settings (``redetect``; ``sensitivity``)."""
    if not paths:
        raise ValueError("build-map needs at least one sweep directory or scaling.json")
    file_curves: dict[CurveKey, list[tuple[dict[str, Any], str]]] = {}
    swept: dict[CurveKey, dict[Any, list[_Run]]] = {}
    given_dirs = frozenset(str(Path(p)) for p in paths if Path(p).is_dir())
    head: dict[str, Any] = {}
    replayed = 0
    for path in paths:
        path = Path(path)
        if path.is_dir():
            if not (path / "sweep.json").is_file():
                raise ValueError(f"'{path}' is a directory without sweep.json: give a sweep directory or a "
                                 "scaling.json file")
            runs_of, left_out = _sweep_runs(path, only, detector)
            replayed += left_out
            for key, by_h in runs_of.items():
                for value, runs in by_h.items():
                    swept.setdefault(key, {}).setdefault(value, []).extend(runs)
            data = {"metric": METRIC, "horizon_key": HORIZON_KEY, "horizon_metric": HORIZON_METRIC}
            curves: list[dict[str, Any]] = []
        else:
            data = load_map(path)
            curves = data["curves"]
        for key in ("metric", "horizon_key", "horizon_metric"):
            if key in head and data.get(key) != head[key]:
                raise ValueError(f"'{path}' has {key} {data.get(key)!r} but an earlier input has {head[key]!r}: one "
                                 "map holds curves of one metric over one horizon")
            head.setdefault(key, data.get(key))
        for curve in curves:
            curve = dict(curve)
            if "provenance" not in curve and isinstance(data.get("provenance"), dict):
                curve["provenance"] = data["provenance"]
            if "meter" not in curve and isinstance(data.get("meter"), dict) and curve.get("curve") == data.get("curve"):
                curve["meter"] = data["meter"]  # the file's meter comparison belongs to its primary curve
            file_curves.setdefault((curve["correction"], curve["source"], curve["policy_lag"]), []).append(
                (curve, str(path)))
    built = []
    for key in dict.fromkeys([*file_curves, *swept]):
        curve = _merge_sources(key, file_curves.get(key, []),
                               _sweep_curve(key, swept[key]) if key in swept else None, given_dirs)
        curve["shape"] = compare_shapes(curve.get("horizons") or [])
        built.append(curve)
    # the first input's sources first (a map rebuilt from itself keeps its default source), then corrections in
    # registry order
    sources = list(dict.fromkeys(c["source"] for c in built))
    order = {name: i for i, name in enumerate(correction_names())}
    ordered = sorted(built, key=lambda c: (sources.index(c["source"]), c["policy_lag"],
                                           order.get(c["correction"], len(order))))
    primary = next((c for c in ordered if c["correction"] == DEFAULT_CORRECTION), ordered[0])
    provenance = {"made_by": made_by or "vexact.lab.scaling.build_map", "sources": [str(p) for p in paths],
                  "curves": {c["curve"]: (c.get("provenance") or {}).get("what") for c in ordered},
                  "router_replay_runs_left_out": replayed, **({"only": only} if only else {})}
    return {**head, **{k: v for k, v in primary.items() if k != "provenance"}, "curves": ordered,
            "provenance": provenance}


SENSITIVITY_PATIENCE = (10, 20, 30)  # steps the reward must stay down: the runs' own 20 and either side
SENSITIVITY_DROP = (0.4, 0.5, 0.6)  # fraction of the peak lost: the runs' own 0.5 and either side


def sensitivity(paths: list[str | Path], patiences: tuple[int, ...] = SENSITIVITY_PATIENCE,
                drops: tuple[float, ...] = SENSITIVITY_DROP, correction: str = DEFAULT_CORRECTION,
                source: str | None = None, only: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """The collapse detector's sensitivity: the map rebuilt (``build_map``) with every run of the sweep directories
    judged again from its logged metrics under each (``patience``, ``drop``) (``redetect``), one row each: α with
    its interval and each horizon of the curve of ``correction`` and ``source`` (None: the map's default). Horizons
    a map file brings (no runs behind them) keep their thresholds: ``from_runs`` says which horizons were judged
    again."""
    rows = []
    for patience in patiences:
        for drop in drops:
            built = build_map(paths, only=only, detector={"patience": patience, "drop": drop})
            curve = curve_for(built, correction, source)
            rows.append({"patience": patience, "drop": drop, "status": curve.get("status"),
                         "alpha": curve.get("alpha"), "alpha_ci_low": curve.get("alpha_ci_low"),
                         "alpha_ci_high": curve.get("alpha_ci_high"),
                         "horizons": [{k: h.get(k) for k in ("horizon_value", "horizon", "status", "threshold_50",
                                                             "ci_low", "ci_high", "lower_bound", "upper_bound",
                                                             "collapsed", "runs")}
                                      for h in curve.get("horizons") or []],
                         "from_runs": [h.get("horizon_value") for h in curve.get("horizons") or []
                                       if any(Path(s).is_dir() for s in (h.get("sweeps") or {}))]})
    return rows


def _horizon_cell(h: dict[str, Any]) -> str:
    """One horizon's threshold or bound in a sensitivity line, with its collapse count."""
    count = f" ({h.get('collapsed')}/{h.get('runs')})"
    if h.get("status") == "fitted" and _positive(h.get("threshold_50")):
        ci = (f" [{h['ci_low']:.2g}, {h['ci_high']:.2g}]" if _positive(h.get("ci_low")) and _positive(h.get("ci_high"))
              else "")
        return f"{h['threshold_50']:.2g}{ci}{count}"
    if h.get("status") == "above_range" and _positive(h.get("lower_bound")):
        return f"above {h['lower_bound']:.2g}{count}"
    if h.get("status") == "below_range" and _positive(h.get("upper_bound")):
        return f"below {h['upper_bound']:.2g}{count}"
    return f"{h.get('status')}{count}"


def sensitivity_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The sensitivity rows as printed lines: per (patience, drop), α and the horizons judged again."""
    lines = []
    for r in rows:
        alpha = (f"α {r['alpha']:.2f}" + (f" [{r['alpha_ci_low']:.2f}, {r['alpha_ci_high']:.2f}]"
                                          if _number(r.get("alpha_ci_low")) else
                                          " (no interval: a horizon's threshold interval is open)")
                 if _number(r.get("alpha")) else f"no α ({r['status']})")
        cells = [f"L = {h['horizon_value']}: {_horizon_cell(h)}" for h in r["horizons"]
                 if h["horizon_value"] in r["from_runs"]]
        lines.append(f"patience {r['patience']}, drop {r['drop']}: {alpha}; " + "; ".join(cells))
    return lines


def _curve_name(curve: dict[str, Any], curves: list[dict[str, Any]]) -> str:
    """A curve in printed lines: its correction, and its source where the map has several."""
    several = len({c.get("source") for c in curves}) > 1
    return f"{curve['correction']} / {curve.get('source')}" if several else curve["correction"]


def failure_lines(curve: dict[str, Any]) -> list[str]:
    """Per horizon of a curve, which failure its collapses are (``vexact.lab.failure``), so which failure its
    threshold or bound measures, and whether a length surge came first; horizons without the record say so."""
    lines = []
    for h in curve.get("horizons") or []:
        t = f" (T {_t(h['horizon'])})" if _positive(h.get("horizon")) else ""
        words = horizon_failure_words(h)
        if not h.get("collapsed") and not h.get("collapsed_classified"):
            continue  # nothing collapsed: no failure to name
        lines.append(f"{HORIZON_KEY} = {h.get('horizon_value')}{t}: its collapses, what its threshold or bound "
                     "measures: " + (words or "not classified (the horizon came from a file without its runs)"))
    return lines


def band_lines(curve: dict[str, Any]) -> list[str]:
    """Each fitted horizon of a fitted curve against the law's 95% band at its T: inside, or which side it misses."""
    lines = []
    for h in curve.get("horizons") or []:
        band = law_band(curve.get("replicates") or [], h["horizon"]) if _positive(h.get("horizon")) else None
        if h.get("status") != "fitted" or band is None:
            continue
        ci = (f" [{h['ci_low']:.2g}, {h['ci_high']:.2g}]" if _positive(h.get("ci_low")) and _positive(h.get("ci_high"))
              else "")
        where = ("inside" if band[0] <= h["threshold_50"] <= band[1] else
                 "MISSED (above)" if h["threshold_50"] > band[1] else "MISSED (below)")
        lines.append(f"{HORIZON_KEY} = {h['horizon_value']} (T {_t(h['horizon'])}): threshold {h['threshold_50']:.2g}"
                     f"{ci}{_one_run(h)}; the law's 95% band {band[0]:.2g} .. {band[1]:.2g}: {where}")
    return lines


def build_lines(built: dict[str, Any]) -> list[str]:
    """What build-map prints per curve: its law (or why none), its shape comparison, and its bounds."""
    lines = []
    for c in built["curves"]:
        lines.append(f"{_curve_name(c, built['curves'])} ({c['status']}, {len(c.get('horizons') or [])} horizons): "
                     f"{c['note']}")
        lines.append(f"  shape: {c['shape']['note']}")
        lines += [f"  band: {b}" for b in band_lines(c)]
        lines += [f"  failure: {b}" for b in failure_lines(c)]
        lines += [f"  bound (not in the fit): {b}" for b in bound_lines(c)]
    return lines


def _parse_list(text: str, kind: type, flag: str) -> list[Any]:
    """A comma-separated list of numbers of one kind; one error naming the flag otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated {kind.__name__} values") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def _main(argv: list[str] | None = None) -> int:
    from ..records.runlog import json_safe

    parser = argparse.ArgumentParser(prog="python -m vexact.lab.scaling", description=(
        "build-map: assemble one collapse map (one curve per correction) from sweep directories (their runs of one "
        "correction and horizon merged into one fit) and scaling.json files; "
        "shape: print the power-law / saturating comparison of each curve of a map."))
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-map", help="write OUT from the runs of sweep directories and the curves of "
                                             "scaling.json files")
    build.add_argument("out", type=Path, metavar="OUT")
    build.add_argument("inputs", type=Path, nargs="+", metavar="SWEEP_DIR_OR_SCALING_JSON")
    build.add_argument("--only", action="append", default=[], metavar="KEY=VALUE[,VALUE...]",
                       help="keep the sweep directories' runs whose saved config holds one of the values (repeat for "
                            "more keys), e.g. --only task.distractors=1002")
    sens = sub.add_parser("sensitivity", help="the collapse detector's sensitivity: α and each horizon's threshold "
                                               "with every run of the sweep directories judged again under each "
                                               "recovery window (patience) and drop fraction")
    sens.add_argument("inputs", type=Path, nargs="+", metavar="SWEEP_DIR_OR_SCALING_JSON")
    sens.add_argument("--patience", default=",".join(map(str, SENSITIVITY_PATIENCE)), metavar="STEPS[,STEPS...]",
                      help="recovery windows, in steps (default: %(default)s)")
    sens.add_argument("--drop", default=",".join(map(str, SENSITIVITY_DROP)), metavar="FRACTION[,FRACTION...]",
                      help="drop fractions of the peak (default: %(default)s)")
    sens.add_argument("--correction", default=DEFAULT_CORRECTION, help="the curve to show (default: %(default)s)")
    sens.add_argument("--source", default=None, help="its source (default: the map's first)")
    sens.add_argument("--only", action="append", default=[], metavar="KEY=VALUE[,VALUE...]",
                      help="as build-map's --only")
    shape = sub.add_parser("shape", help="print each curve's shape comparison and its fitted horizons against the "
                                         "law's 95%% band (default: the shipped map)")
    shape.add_argument("map", type=Path, nargs="?", default=None, metavar="MAP")
    args = parser.parse_args(argv)
    try:
        if args.command == "build-map":
            command = "python -m vexact.lab.scaling build-map " + " ".join(
                [str(p) for p in [args.out, *args.inputs]] + [f"--only {item}" for item in args.only])
            built = build_map(list(args.inputs), made_by=command, only=parse_only(args.only))
            if args.out.is_dir():
                raise ValueError(f"'{args.out}' is a directory: give the map's file name")
            args.out.write_text(json.dumps(json_safe(built), indent=1, ensure_ascii=False) + "\n")
            print(f"wrote {args.out}: " + "; ".join(f"{_curve_name(c, built['curves'])} ({c['status']}, "
                                                     f"{len(c.get('horizons') or [])} horizons)"
                                                     for c in built["curves"]))
            print("\n".join(build_lines(built)))
            return 0
        if args.command == "sensitivity":
            patiences = tuple(_parse_list(args.patience, int, "--patience"))
            drops = tuple(_parse_list(args.drop, float, "--drop"))
            if any(p < 0 for p in patiences) or any(not 0 < d < 1 for d in drops):
                raise ValueError("--patience takes steps >= 0 and --drop fractions strictly between 0 and 1")
            rows = sensitivity(list(args.inputs), patiences, drops, args.correction, args.source,
                               parse_only(args.only))
            print("\n".join(sensitivity_lines(rows)))
            return 0
        curves = load_map(args.map)["curves"]
        for curve in curves:
            print(f"{_curve_name(curve, curves)}: {compare_shapes(curve.get('horizons') or [])['note']}")
            if curve.get("status") == "fitted":
                print(f"  law: {curve['note']} ({curve.get('alpha_ci_method') or 'interval method not recorded'})")
            for line in band_lines(curve):
                print(f"  band: {line}")
            for line in failure_lines(curve):
                print(f"  failure: {line}")
        return 0
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main())
