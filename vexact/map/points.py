"""A sweep's runs as points of the map: each run's horizon, correction, source, policy lag and the keys that split
a sweep into curves.

**Horizon.** A point's horizon group is its ``task.max_len`` (the scratchpad length L of ``horizon``, or the input
length of another task), set in the sweep's grid or in its variant's bundle; its horizon T is measured: the run
mean of ``response_length/mean`` (tokens per response) over the steps before collapse, the window of the dose. A
sweep that sets no ``task.max_len`` has no horizon axis. The curves of a sweep are split by correction (never one
fit over runs with different corrections) and by its other non-seed keys (``curve_keys``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import yaml

from ..metric_keys import RESPONSE_LENGTH_MEAN
from ..records import CONFIG_FILE
from ..rl.validate import parse_yaml
from ..sweeps.sweep_data import SEED_KEY, PointData, SweepData
from .naming import correction_from_config, correction_from_vexact, flat_config, source_name

HORIZON_KEY = "task.max_len"
HORIZON_METRIC = RESPONSE_LENGTH_MEAN
POLICY_LAG_KEY = "rollout.policy_lag"  # a curve's policy lag: its runs' rollout.policy_lag (0: on-policy, every curve
# from before the key existed)


def sweep_variants(data: SweepData) -> dict[str, dict[str, Any]]:
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
    values = [m[HORIZON_METRIC] for m in point.metrics if finite(m.get(HORIZON_METRIC))
              and (end is None or not finite(m.get("step")) or m["step"] < end)]
    return sum(values) / len(values) if values else None


CORRECTION_KEYS = ("algorithm.old_logprobs", "correction.method")  # what the correction name says already


def point_setup(point: PointData, variants: dict[str, dict[str, Any]], defaults: Mapping[str, Any]
                ) -> tuple[str, str]:
    """The point's correction name and source (``source_name``), from the config the run saved (``config.yaml``,
    read once), else from its overrides and its variant's bundle (a point that never started). The correction is
    "unknown (...)" when the saved config cannot be read or names none; ``defaults``: ``default_config()``."""
    path = point.dir / CONFIG_FILE
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
    return _correction_or_unknown(lambda: correction_from_vexact(nested, point.name)), source_name(dotted, defaults)


def point_policy_lag(point: PointData, variants: dict[str, dict[str, Any]]) -> int:
    """The point's ``rollout.policy_lag``: from the config the run saved, else its overrides and its variant's bundle;
    0 where none sets it (on-policy, as every run before the key existed)."""
    path = point.dir / CONFIG_FILE
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


def curve_keys(data: SweepData, variants: dict[str, dict[str, Any]]) -> list[str]:
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


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive(v: Any) -> bool:
    return finite(v) and v > 0


def interval_text(lo: float | None, hi: float | None) -> str:
    """A threshold's 95% interval as every printed line quotes it, with a leading space, an open end said so
    (both open: "[open below, open above]"): an interval left out where an end is open would make the bare point
    read as precise."""
    if positive(lo) and positive(hi):
        return f" [{lo:.2g}, {hi:.2g}]"
    if positive(hi):
        return f" [open below, {hi:.2g}]"
    return f" [{lo:.2g}, open above]" if positive(lo) else " [open below, open above]"
